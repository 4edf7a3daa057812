"""dcp_decode(exchange="push") on CPU virtual devices: the API, its errors, and its CUDA lowering.

On CPU the push exchange runs as the collectives (no setup), so its results must equal the
collectives' bit for bit. The CUDA lowering (lowered here without a GPU) must hold the push
exchange's one custom call (the pushing decode, whose handler launches the merge behind it),
side-effecting, and no all-to-all.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from test_dcp import (
    AXIS,
    SOFTMAX_SCALE,
    fp8,
    make_tokens,
    mesh_of,
    run_dcp,
    shard_flat_cache,
    shard_paged_cache,
)

import jax_sparse_mla
from jax_sparse_mla import cuda_lowering, push_exchange
from jax_sparse_mla.dcp import _as_tokens, dcp_decode, local_rows


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize(("dcp", "heads_own"), [(2, 16), (8, 5)])
def test_push_equals_collectives_on_cpu(dcp, heads_own, paged):
    rng = np.random.default_rng(7 + dcp)
    batch, width, n_local = 5, 40, 48
    n_global = dcp * n_local
    q = fp8(rng, (batch, dcp * heads_own, 576))
    kv_global = fp8(rng, (n_global, 576))
    tokens = make_tokens(rng, batch, width, dcp, n_global)
    if paged:
        block_size = 16
        kv, table = shard_paged_cache(rng, fp8(rng, (batch, n_global, 576)), dcp, block_size)
    else:
        block_size, kv, table = None, shard_flat_cache(kv_global, dcp), None
    args = (mesh_of(dcp), q, kv, tokens, table)
    kwargs = dict(block_size=block_size, q_scale=0.5, kv_scale=2.0)
    expected = run_dcp(*args, **kwargs)
    for step in (0, 1, 2**31 - 1):
        got = run_dcp(*args, **kwargs, exchange="push", step=step)
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


def test_push_in_a_scan_with_traced_step():
    """A decode loop: the scan counter is the step (traced inside the loop)."""
    dcp, heads_own, batch, width, n_local, steps = 4, 8, 5, 24, 32, 5
    rng = np.random.default_rng(3)
    q = fp8(rng, (batch, dcp * heads_own, 576))
    kv = shard_flat_cache(fp8(rng, (dcp * n_local, 576)), dcp)
    tokens = jnp.asarray(make_tokens(rng, batch, width, dcp, dcp * n_local))

    def body(q, kv, tokens, exchange):
        rows, valid = local_rows(tokens, rank=lax.axis_index(AXIS), dcp_size=dcp)

        def one_step(carry, step):
            q_t = (q.astype(jnp.float32) * (1.0 + step.astype(jnp.float32) / 8)).astype(q.dtype)
            out = dcp_decode(
                q_t,
                kv,
                rows,
                valid,
                axis_name=AXIS,
                softmax_scale=SOFTMAX_SCALE,
                exchange=exchange,
                step=step,
            )
            return carry, out

        return lax.scan(one_step, 0, jnp.arange(steps, dtype=jnp.int32))[1]

    def run(exchange):
        fn = jax.shard_map(
            lambda q, kv, tokens: body(q, kv, tokens, exchange),
            mesh=mesh_of(dcp),
            in_specs=(P(None, AXIS), P(AXIS), P()),
            out_specs=(P(None, None, AXIS), P(None, None, AXIS)),
        )
        return jax.jit(fn)(q, kv, tokens)

    pushed, collected = run("push"), run("collectives")
    assert pushed[0].shape == (steps, batch, dcp * heads_own, 512)
    assert not np.array_equal(np.asarray(pushed[1][0]), np.asarray(pushed[1][1]))  # steps differ
    for g, e in zip(pushed, collected, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


def test_exchange_argument_errors():
    dcp = 2
    mesh = mesh_of(dcp)
    rng = np.random.default_rng(0)
    q = fp8(rng, (2, dcp * 4, 576))
    kv = fp8(rng, (dcp * 8, 576))
    rows = jnp.zeros((2, 4), jnp.int32)
    valid = jnp.full((2,), 4, jnp.int32)

    def call(**options):
        fn = jax.shard_map(
            lambda q, kv, rows, valid: dcp_decode(
                q, kv, rows, valid, axis_name=AXIS, softmax_scale=1.0, **options
            ),
            mesh=mesh,
            in_specs=(P(None, AXIS), P(AXIS), P(), P()),
            out_specs=(P(None, AXIS), P(None, AXIS)),
        )
        return jax.jit(fn)(q, kv, rows, valid)

    with pytest.raises(ValueError, match="exchange must be one of"):
        call(exchange="nccl")
    with pytest.raises(ValueError, match="needs step="):
        call(exchange="push")
    with pytest.raises(TypeError, match="step must be an integer scalar"):
        call(exchange="push", step=1.5)
    with pytest.raises(TypeError, match="step must be an integer scalar"):
        call(exchange="push", step=jnp.zeros((2,), jnp.int32))
    call(exchange="collectives", step=3)  # step is accepted and unused


def test_setup_on_cpu_is_a_no_op():
    mesh = mesh_of(2)
    assert jax_sparse_mla.dcp_setup(mesh, AXIS) is False
    jax_sparse_mla.dcp_check()  # nothing set up, nothing failed
    with pytest.raises(ValueError, match="not in the mesh"):
        jax_sparse_mla.dcp_setup(mesh, "model")
    with pytest.raises(ValueError, match="capacity_bytes"):
        jax_sparse_mla.dcp_setup(mesh, AXIS, capacity_bytes=100)
    with pytest.raises(ValueError, match="timeout_s"):
        jax_sparse_mla.dcp_setup(mesh, AXIS, timeout_s=0)


def test_groups_follow_axis_index():
    """dcp_setup's rank order per group is lax.axis_index's, also for a 2-D mesh and for a
    tuple of axes."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    mesh = Mesh(devices, ("data", "dcp"))
    for axis_name in ("dcp", "data", ("data", "dcp"), ("dcp", "data")):
        fn = jax.jit(
            jax.shard_map(
                lambda x, axis_name=axis_name: (lax.axis_index(axis_name) + 0 * x).astype(
                    jnp.int32
                ),
                mesh=mesh,
                in_specs=P(("data", "dcp")),
                out_specs=P(("data", "dcp")),
            )
        )
        ids = fn(jnp.zeros(8, jnp.int32))
        rank_of = {shard.device: int(np.asarray(shard.data)[0]) for shard in ids.addressable_shards}
        groups = push_exchange._groups(mesh, axis_name)
        size = len(groups[0])
        assert len(groups) * size == 8
        for group in groups:
            assert [rank_of[d] for d in group] == list(range(size)), (axis_name, group)


def _push_program(dcp, heads_own, batch, api="rows"):
    """A jitted shard_map of local_rows + dcp_decode(exchange="push") (``api`` "rows"), of
    dcp_decode_tokens(exchange="push") ("tokens") or of that on a paged cache with a block
    table [B, 4] per rank ("paged"), and its arguments."""
    rng = np.random.default_rng(1)
    q = fp8(rng, (batch, dcp * heads_own, 576))
    kv = fp8(rng, (dcp * 64, 576))
    tokens = jnp.asarray(make_tokens(rng, batch, 32, dcp, dcp * 64))
    tables = jnp.asarray(rng.integers(0, 4, (dcp * batch, 4)), jnp.int32)

    def body(q, kv, tokens, tables, step):
        options = dict(axis_name=AXIS, softmax_scale=1.0, exchange="push", step=step)
        if api == "paged":
            return jax_sparse_mla.dcp_decode_tokens(
                q, kv.reshape(4, 16, 576), tokens, block_table=tables, block_size=16, **options
            )
        if api == "tokens":
            return jax_sparse_mla.dcp_decode_tokens(q, kv, tokens, **options)
        rows, valid = local_rows(tokens, rank=lax.axis_index(AXIS), dcp_size=dcp)
        return dcp_decode(q, kv, rows, valid, **options)

    fn = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh_of(dcp),
            in_specs=(P(None, AXIS), P(AXIS), P(), P(AXIS), P()),
            out_specs=(P(None, AXIS), P(None, AXIS)),
        )
    )
    return fn, (q, kv, tokens, tables, jnp.int32(0))


def _lower_push_for_cuda(dcp=2, heads_own=16, batch=5, api="rows"):
    fn, args = _push_program(dcp, heads_own, batch, api)
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_cuda_lowering_needs_setup(monkeypatch):
    monkeypatch.setattr(push_exchange, "_ready_ordinals", set())
    try:
        push_exchange._load_library()
    except (FileNotFoundError, OSError) as err:
        pytest.skip(f"handler library not installed: {err}")
    with pytest.raises(RuntimeError, match=r"jax_sparse_mla\.dcp_setup\(mesh, axis_name\)"):
        _lower_push_for_cuda()


@pytest.mark.parametrize("api", ["rows", "tokens", "paged"])
def test_cuda_lowering_is_one_custom_call_and_no_all_to_all(monkeypatch, api):
    monkeypatch.setattr(push_exchange, "_ready_ordinals", {0, 1})  # as after dcp_setup
    try:
        push_exchange._load_library()
    except (FileNotFoundError, OSError) as err:
        pytest.skip(f"handler library not installed: {err}")
    asked = []
    kernel_or_reason = cuda_lowering.kernel_or_reason

    def recording(avals, config, valid_hint):
        asked.append(config)
        return kernel_or_reason(avals, config, valid_hint)

    monkeypatch.setattr(cuda_lowering, "kernel_or_reason", recording)
    text = _lower_push_for_cuda(dcp=2, heads_own=16, batch=5, api=api)
    # The decode is the dispatched config's cubin that exchanges the query heads.
    assert len(asked) == 1 and asked[0].exchange, asked
    assert "all_to_all" not in text and "all_gather" not in text  # no collective at all
    # One custom call: the decode exchanges the query heads itself and its handler launches
    # the owners' merge behind it (no gather call, no merge call).
    assert re.findall(r"stablehlo\.custom_call @(\w+)", text) == ["jax_sparse_mla_decode_push"]
    push = re.search(r"stablehlo\.custom_call @jax_sparse_mla_decode_push\((.*)", text)
    assert push, text
    call = push.group(0)
    assert "has_side_effect = true" in call and "dcp_size = 2" in call, call
    # This rank's own q heads, the local cache and the global tokens [B, K] in (the kernel
    # compacts this rank's), the merged rows of its heads out and the kernel's scratch.
    assert "(tensor<5x16x576xf8E4M3FN>, tensor<" in call
    operands = "tensor<5x32xi32>, tensor<2xf32>, tensor<i32>, tensor<i32>)"
    results = r"-> \(tensor<5x16x512xbf16>, tensor<5x16xf32>, tensor<\d+xi32>\)"
    assert re.search(re.escape(operands) + " " + results, call), call
    assert "heads_own = 16" in call and 'kernel_name = "' in call and "split = " in call
    assert "jax_sparse_mla_decode(" not in text  # no plain decode
    # dcp_decode_tokens hands the tokens over without local_rows (its scatter); on a paged
    # cache it maps them through the table first (one gather, elementwise).
    assert ("stablehlo.scatter" in text) == (api == "rows")
    assert ("stablehlo.gather" in text) == (api == "paged")


def test_export_for_cuda_keeps_the_exchange(monkeypatch):
    """jax.export of a push program for CUDA (on a CPU machine): export_disabled_checks()
    admits the exchange's custom calls, and they survive serialization."""
    monkeypatch.setattr(push_exchange, "_ready_ordinals", {0, 1})  # as after dcp_setup
    try:
        push_exchange._load_library()
    except (FileNotFoundError, OSError) as err:
        pytest.skip(f"handler library not installed: {err}")
    fn, args = _push_program(2, 16, 5)
    with pytest.raises(ValueError, match="jax_sparse_mla_decode_push"):
        jax.export.export(fn, platforms=("cuda",))(*args)
    checks = jax_sparse_mla.export_disabled_checks()
    exported = jax.export.export(fn, platforms=("cuda",), disabled_checks=checks)(*args)
    text = jax.export.deserialize(exported.serialize()).mlir_module()
    assert "@jax_sparse_mla_decode_push" in text


def test_error_texts_come_from_the_library():
    """dcp_check words a failure with the library's text for its code (one source for the
    handlers' errors and dcp_check): one per code the kernels record, "failed" otherwise."""
    try:
        library = push_exchange._load_library()
    except (FileNotFoundError, OSError) as err:
        pytest.skip(f"handler library not installed: {err}")
    texts = [library.JaxSparseMlaDcpErrorText(code).decode() for code in (1, 2, 3, 4, 5, 99)]
    assert "partials" in texts[0] and "parity" in texts[1] and "rank" in texts[2]
    assert "query heads" in texts[3] and "does not advance" in texts[4] and texts[5] == "failed"
    assert len(set(texts)) == 6


@pytest.mark.parametrize("dcp", [1, 2, 8])
def test_rows_as_tokens_compact_back_to_the_same_keys(dcp):
    """dcp_decode's push path hands the kernel its rows and valid as global tokens: this
    rank's compaction of them (local_rows, which the kernel's mirrors) gives back valid and
    the rows in order, a row outside the cache as row N (skipped by the kernel as before)."""
    rng = np.random.default_rng(dcp)
    n_rows, batch, width = 50, 6, 12
    rows = rng.integers(-3, n_rows + 3, (batch, width)).astype(np.int32)
    valid = np.array([0, width, 5, -2, width + 4, 1], np.int32)
    for rank in range(dcp):
        keys = jnp.arange(width) < jnp.asarray(valid)[:, None]
        tokens = _as_tokens(jnp.asarray(rows), keys, n_rows=n_rows, rank=rank, dcp_size=dcp)
        back, count = local_rows(tokens, rank=rank, dcp_size=dcp)
        want = np.clip(valid, 0, width)
        np.testing.assert_array_equal(np.asarray(count), want)
        expected = np.where((rows >= 0) & (rows < n_rows), rows, n_rows)
        for b in range(batch):
            np.testing.assert_array_equal(np.asarray(back)[b, : want[b]], expected[b, : want[b]])
    with pytest.raises(ValueError, match="do not fit"):
        _as_tokens(jnp.asarray(rows), keys, n_rows=2**28, rank=0, dcp_size=8)
