"""dcp_decode(exchange="push") on two GPUs: vs the collectives, float64 truth, faults.

Needs two Hopper GPUs (the device tool's nvidia-h200-x2); skipped with fewer. Every program
computes both exchanges in one step from the same kernel config (the push decode writes its
partials into the owners' mailboxes, the plain one into buffers: the same bits), so the push
merge is checked against the collectives' merge. They differ only by the GPU's exp2 / lg2
approximations (relative error about 2^-22 per weight) against XLA's exp / log and the push
merge's reciprocal of the weights' sum (one more f32 rounding), so a merged
element may differ by one bf16 rounding (2^-7 of its value) plus 2^-19 of the largest |V|
(the partials are convex combinations of V rows; this covers cancellation between partials),
and LSEs by 1e-5 relative. A slot read before its push completed, or a stale slot (the query
changes every step), would miss these bounds by orders of magnitude.

    python -m pytest -s -m gpu tests/gpu/test_dcp_push_gpu.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from test_dcp import (
    AXIS,
    SOFTMAX_SCALE,
    check_against_truth,
    fp8,
    make_tokens,
    shard_flat_cache,
    shard_paged_cache,
    truth,
)

import jax_sparse_mla
from jax_sparse_mla import push_exchange
from jax_sparse_mla.dcp import dcp_decode, local_rows
from jax_sparse_mla.kernel.config import ALL_CONFIGS

pytestmark = pytest.mark.gpu
DCP = 2
BF16_STEP = 2.0**-7  # one bf16 ulp is at most this fraction of the value
APPROX = 2.0**-19  # times max |V|: the exp2 / lg2 approximations' share
LSE_RTOL = 1e-5


@pytest.fixture(autouse=True)
def fresh_exchange(mesh):
    """Every test starts from zeroed mailboxes (so its step counter may start anywhere)."""
    _reset(mesh)


def both_exchanges(mesh, *, paged=False, block_size=None, kernel_config=None):
    """One jitted step: (push latent, push lse, collectives latent, collectives lse)."""

    def body(q, kv, tokens, table, step):
        extra = dict(block_table=table, block_size=block_size) if paged else {}
        rows, valid = local_rows(tokens, rank=lax.axis_index(AXIS), dcp_size=DCP, **extra)
        common = dict(
            axis_name=AXIS,
            softmax_scale=SOFTMAX_SCALE,
            implementation="cute",
            kernel_config=kernel_config,
        )
        pushed = dcp_decode(q, kv, rows, valid, exchange="push", step=step, **common)
        collected = dcp_decode(q, kv, rows, valid, exchange="collectives", **common)
        return (*pushed, *collected)

    table_spec = P(AXIS) if paged else P()
    out = (P(None, AXIS), P(None, AXIS))
    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(None, AXIS), P(AXIS), P(), table_spec, P()),
            out_specs=out + out,
        )
    )


def v_max(kv) -> float:
    return float(jnp.max(jnp.abs(kv.astype(jnp.float32))))


def mismatches(push_latent, push_lse, latent, lse, v_max):
    """(latent elements beyond the bound of the module docstring, LSEs beyond LSE_RTOL);
    non-finite values must agree exactly."""
    p, c = (np.asarray(x.astype(jnp.float32)) for x in (push_latent, latent))
    pl, cl = np.asarray(push_lse), np.asarray(lse)
    finite = np.isfinite(c)
    tolerance = BF16_STEP * np.abs(c[finite]) + APPROX * v_max
    bad_latent = int(np.sum(~(np.abs(p[finite] - c[finite]) <= tolerance)))
    bad_latent += int(np.sum(np.isfinite(p[~finite])))
    same_inf = (pl == cl) | (np.isnan(pl) & np.isnan(cl))
    with np.errstate(invalid="ignore"):  # inf - inf: decided by same_inf
        close = np.abs(pl - cl) <= LSE_RTOL * np.maximum(1.0, np.abs(cl))
    bad_lse = int(np.sum(~(same_inf | close)))
    return bad_latent, bad_lse


def latency_inputs(seed=1):
    rng = np.random.default_rng(seed)
    batch, heads, width, n_global = 5, 96, 256, DCP * 4096
    q = fp8(rng, (batch, heads, 576))
    kv_global = fp8(rng, (n_global, 576))
    tokens = make_tokens(rng, batch, width, DCP, n_global)
    return q, kv_global, tokens


def test_push_matches_collectives_and_truth(mesh):
    q, kv_global, tokens = latency_inputs()
    table = jnp.zeros((1, 1), jnp.int32)
    step_fn = both_exchanges(mesh)
    args = (q, shard_flat_cache(kv_global, DCP), jnp.asarray(tokens), table)
    hlo = step_fn.lower(*args, jnp.int32(0)).as_text()
    assert "jax_sparse_mla_decode_push" in hlo and "jax_sparse_mla_dcp_merge" not in hlo
    assert "jax_sparse_mla_decode" in hlo
    push_latent, push_lse, latent, lse = step_fn(*args, jnp.int32(0))
    jax_sparse_mla.dcp_check()
    assert mismatches(push_latent, push_lse, latent, lse, v_max(kv_global)) == (0, 0)
    keys = np.asarray(kv_global.astype(jnp.float32), np.float64)
    t = truth(q, lambda b: keys[tokens[b][tokens[b] >= 0]], SOFTMAX_SCALE, 1, 1)
    check_against_truth(push_latent, push_lse, t)
    again = step_fn(*args, jnp.int32(1))
    for a, b in zip((push_latent, push_lse), again[:2], strict=True):  # bit-identical repeats
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda c: c.slug)
def test_push_from_every_kernel_config(mesh, config):
    """Each kernel config pushes its own way (cluster merges, wgmma's bulk row copies): 40
    heads per rank, so a 16- or 64-head tile holds heads of both owners; make_tokens' rows:
    ~300 keys per rank (several chunks, a partial last one), keys on rank 0 only, none, one,
    a sparse row."""
    rng = np.random.default_rng(11)
    batch, heads, width, n_global = 5, 80, 600, DCP * 2048
    q = fp8(rng, (batch, heads, 576))
    kv_global = fp8(rng, (n_global, 576))
    tokens = make_tokens(rng, batch, width, DCP, n_global)
    table = jnp.zeros((1, 1), jnp.int32)
    step_fn = both_exchanges(mesh, kernel_config=config)
    args = (q, shard_flat_cache(kv_global, DCP), jnp.asarray(tokens), table)
    for step in (0, 1):
        push_latent, push_lse, latent, lse = step_fn(*args, jnp.int32(step))
        jax_sparse_mla.dcp_check()
        assert mismatches(push_latent, push_lse, latent, lse, v_max(kv_global)) == (0, 0)
    keys = np.asarray(kv_global.astype(jnp.float32), np.float64)
    t = truth(q, lambda b: keys[tokens[b][tokens[b] >= 0]], SOFTMAX_SCALE, 1, 1)
    check_against_truth(push_latent, push_lse, t)


@pytest.mark.parametrize("shared_table", [False, True])
def test_push_paged(mesh, shared_table):
    rng = np.random.default_rng(2 + shared_table)
    batch, heads, width, n_global, block_size = 6, 40, 128, DCP * 512, 64
    n_seqs = 1 if shared_table else batch
    q = fp8(rng, (batch, heads, 576))
    seqs = fp8(rng, (n_seqs, n_global, 576))
    tokens = make_tokens(rng, batch, width, DCP, n_global)
    pools, tables = shard_paged_cache(rng, seqs, DCP, block_size)
    step_fn = both_exchanges(mesh, paged=True, block_size=block_size)
    push_latent, push_lse, latent, lse = step_fn(q, pools, jnp.asarray(tokens), tables, 2)
    jax_sparse_mla.dcp_check()
    assert mismatches(push_latent, push_lse, latent, lse, v_max(seqs)) == (0, 0)
    keys = np.asarray(seqs.astype(jnp.float32), np.float64)
    t = truth(q, lambda b: keys[b % n_seqs][tokens[b][tokens[b] >= 0]], SOFTMAX_SCALE, 1, 1)
    check_against_truth(push_latent, push_lse, t)


def soak(mesh, first_step: int, steps: int):
    """One jitted scan of `steps` decode steps with the step counter starting at first_step
    (int32, wrapping): per step, both exchanges from the same partials. Returns the counts of
    latent and LSE mismatches and of non-finite push elements over all steps, and the largest
    latent difference."""
    q, kv_global, tokens = latency_inputs(seed=5)
    approx = APPROX * v_max(kv_global)
    kv = shard_flat_cache(kv_global, DCP)
    table = jnp.zeros((1, 1), jnp.int32)
    step_fn = both_exchanges(mesh)

    def loop(q, kv, tokens, first):
        def body(carry, i):
            counts, largest = carry
            step = first + i  # int32 arithmetic: wraps at 2**31
            scale = 1.0 + (i % 8).astype(jnp.float32) * 2.0**-3
            q_t = (q.astype(jnp.float32) * scale).astype(q.dtype)
            pl, pe, cl, ce = step_fn(q_t, kv, tokens, table, step)
            p, c = pl.astype(jnp.float32), cl.astype(jnp.float32)
            difference = jnp.abs(p - c)
            bad = ~(difference <= BF16_STEP * jnp.abs(c) + approx)  # NaN counts as bad
            close = jnp.abs(pe - ce) <= LSE_RTOL * jnp.maximum(1.0, jnp.abs(ce))
            bad_lse = ~(close | (pe == ce))
            counts = counts + jnp.stack([bad.sum(), bad_lse.sum(), (~jnp.isfinite(p)).sum()])
            largest = jnp.maximum(largest, jnp.max(difference))
            return (counts, largest), None

        start = (jnp.zeros(3, jnp.int32), jnp.float32(0))
        return lax.scan(body, start, jnp.arange(steps, dtype=jnp.int32))[0]

    counts, largest = jax.jit(loop)(q, kv, jnp.asarray(tokens), jnp.int32(first_step))
    jax_sparse_mla.dcp_check()
    print(f"soak of {steps} steps from {first_step}: mismatches {counts}, largest {largest}")
    return (*np.asarray(counts).tolist(), float(largest))


def test_soak_10000_steps(mesh):
    bad_latent, bad_lse, nonfinite, _ = soak(mesh, first_step=100, steps=10_000)
    assert (bad_latent, bad_lse, nonfinite) == (0, 0, 0)


def test_step_wraps_around_int32(mesh):
    bad_latent, bad_lse, nonfinite, _ = soak(mesh, first_step=2**31 - 4, steps=8)
    assert (bad_latent, bad_lse, nonfinite) == (0, 0, 0)


def test_compiled_program_survives_a_new_setup(mesh):
    """dcp_setup again (here with another capacity, so the data regions move) while a compiled
    program, possibly captured into a CUDA graph, keeps its kernel parameters: they point at
    the permanent headers, which the new setup rewrote."""
    q, kv_global, tokens = latency_inputs(seed=7)
    table = jnp.zeros((1, 1), jnp.int32)
    step_fn = both_exchanges(mesh)
    args = (q, shard_flat_cache(kv_global, DCP), jnp.asarray(tokens), table)
    for step in range(4):  # warm: XLA may capture the exchange into a command buffer
        assert mismatches(*step_fn(*args, jnp.int32(step)), v_max(kv_global)) == (0, 0)
    assert jax_sparse_mla.dcp_setup(mesh, AXIS, capacity_bytes=16 << 20)
    for step in range(4):
        assert mismatches(*step_fn(*args, jnp.int32(step)), v_max(kv_global)) == (0, 0)
    jax_sparse_mla.dcp_check()


def test_scan_stacking_the_rows(mesh):
    """A scan that stacks each step's rows (as a decode loop collecting outputs does): XLA must
    not fold the stacking into a second copy of the exchange (it did before the barriers in
    push_exchange.decode_and_exchange: the duplicated merge timed out)."""
    q, kv_global, tokens = latency_inputs(seed=6)
    kv = shard_flat_cache(kv_global, DCP)
    table = jnp.zeros((1, 1), jnp.int32)
    step_fn = both_exchanges(mesh)
    steps = 16

    def loop(q, kv, tokens):
        def body(carry, i):
            q_t = (q.astype(jnp.float32) * (1.0 + (i % 8).astype(jnp.float32) / 8)).astype(q.dtype)
            return carry, step_fn(q_t, kv, tokens, table, i)

        return lax.scan(body, 0, jnp.arange(steps, dtype=jnp.int32))[1]

    stacked = jax.jit(loop)(q, kv, jnp.asarray(tokens))
    jax_sparse_mla.dcp_check()
    for s in range(steps):
        assert mismatches(*(x[s] for x in stacked), v_max(kv_global)) == (0, 0), s


def expect_failure(results, cause: str) -> None:
    """A failed exchange surfaces either when its results are used (a later exchange's
    execute saw the error record in time) or as NaN rows that dcp_check then reports."""
    try:
        values = [np.asarray(x.astype(jnp.float32)) for x in results]
    except Exception as error:  # XLA's runtime error type differs between jax versions
        assert cause in str(error) and "dcp_setup again" in str(error), error
        return
    assert all(np.isnan(v).all() for v in values)
    with pytest.raises(RuntimeError, match=cause):
        jax_sparse_mla.dcp_check()


def _reset(mesh):
    assert jax_sparse_mla.dcp_setup(mesh, AXIS) is True


def test_missing_push_times_out_with_nan_and_error(mesh):
    """Rank r passes step + 2 r: each owner waits for a push of its own step that never comes
    (the peer pushed another step). Bounded wait, NaN rows, an error naming the timeout."""
    assert jax_sparse_mla.dcp_setup(mesh, AXIS, timeout_s=0.2)
    q, kv_global, tokens = latency_inputs()
    table = jnp.zeros((1, 1), jnp.int32)

    def body(q, kv, tokens, table, step):
        rank = lax.axis_index(AXIS)
        rows, valid = local_rows(tokens, rank=rank, dcp_size=DCP)
        return dcp_decode(
            q,
            kv,
            rows,
            valid,
            axis_name=AXIS,
            softmax_scale=SOFTMAX_SCALE,
            implementation="cute",
            exchange="push",
            step=step + 2 * rank,
        )

    fn = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(None, AXIS), P(AXIS), P(), P(), P()),
            out_specs=(P(None, AXIS), P(None, AXIS)),
        )
    )
    try:
        results = fn(q, shard_flat_cache(kv_global, DCP), jnp.asarray(tokens), table, 0)
        expect_failure(results, "timed out waiting for")
        with pytest.raises(Exception, match="dcp_setup again"):  # the next call refuses
            jax.block_until_ready(
                fn(q, shard_flat_cache(kv_global, DCP), jnp.asarray(tokens), table, 1)
            )
    finally:
        _reset(mesh)
    test_push_matches_collectives_and_truth(mesh)  # the reset exchange works again


def test_repeated_parity_is_refused(mesh):
    """The same step twice in a row would overwrite a slot the owner may still read: the push
    decode refuses to push, the owners time out with NaN rows, and dcp_check names the
    parity."""
    assert jax_sparse_mla.dcp_setup(mesh, AXIS, timeout_s=0.2)
    q, kv_global, tokens = latency_inputs()
    table = jnp.zeros((1, 1), jnp.int32)
    step_fn = both_exchanges(mesh)
    args = (q, shard_flat_cache(kv_global, DCP), jnp.asarray(tokens), table)
    try:
        first = step_fn(*args, jnp.int32(6))
        assert mismatches(*first, v_max(kv_global)) == (0, 0)
        expect_failure(step_fn(*args, jnp.int32(8))[:2], "previous exchange's parity")
    finally:
        _reset(mesh)


def test_push_without_setup_names_dcp_setup(mesh):
    """A fresh process that skips dcp_setup gets an error naming it (not a hang, not NaN)."""
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, PartitionSpec as P
        import jax_sparse_mla
        mesh = Mesh(np.array(jax.devices()[:2]), ("dcp",))
        def body(q, kv, rows, valid):
            return jax_sparse_mla.dcp_decode(q, kv, rows, valid, axis_name="dcp",
                softmax_scale=1.0, exchange="push", step=0)
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "dcp"), P("dcp"), P(), P()),
                                   out_specs=(P(None, "dcp"), P(None, "dcp"))))
        q = jnp.zeros((2, 32, 576), jnp.float8_e4m3fn)
        kv = jnp.zeros((64, 576), jnp.float8_e4m3fn)
        try:
            fn(q, kv, jnp.zeros((2, 4), jnp.int32), jnp.ones((2,), jnp.int32))
        except RuntimeError as err:
            print("ERROR:", err)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd="/tmp"
    )
    assert "ERROR:" in result.stdout and "jax_sparse_mla.dcp_setup" in result.stdout, (
        result.stdout + result.stderr
    )


def test_capacity_error_names_the_setting(mesh):
    assert jax_sparse_mla.dcp_setup(mesh, AXIS, capacity_bytes=8192)
    q, kv_global, tokens = latency_inputs()
    step_fn = both_exchanges(mesh)
    args = (q, shard_flat_cache(kv_global, DCP), jnp.asarray(tokens), jnp.zeros((1, 1), jnp.int32))
    try:
        with pytest.raises(Exception, match="raise capacity_bytes"):
            jax.block_until_ready(step_fn(*args, jnp.int32(0)))
    finally:
        _reset(mesh)
    assert push_exchange.DEFAULT_CAPACITY_BYTES >= 4 * DCP * 5 * 48 * 1028
