"""index_topk's CUDA lowering, checked on a CPU machine: the one custom call with both cubins
and the scores' span, the fallbacks to the reference, jax.export, and the span rule."""

from __future__ import annotations

import itertools
import logging
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir

import jax_sparse_mla
from jax_sparse_mla import cuda_lowering, index_lowering, index_primitive
from jax_sparse_mla.kernel import compile as kernel_compile
from jax_sparse_mla.kernel.config import PARAMS, KernelConfig, KernelUnavailableError
from jax_sparse_mla.kernel.dispatch import active_clusters
from jax_sparse_mla.kernel.index import compile as index_compile
from jax_sparse_mla.kernel.index import config
from jax_sparse_mla.kernel.index.config import (
    HEADS,
    INDEX_KERNELS,
    MAX_QUERY_TILES,
    SCORE_SMEM_FIXED,
    SCORE_SMEM_PER_QUERY_TILE,
    TOKENS,
    TOPK_CLUSTERS,
    IndexKernel,
)

B, T, HI, N, TOP_K = 3, 2, 40, 1000, 64  # Hi pads to one tile of 64 heads
STAGES = ("scores", "topk")
ELF = b"\x7fELF"


def _args(batch=B, steps=T, heads=HI, cache=(N,), table_blocks=None):
    """index_topk's arguments: a flat cache [N, 128], or paged [num_blocks, block_size, 128]
    with a [B, table_blocks] table."""
    args = [
        jax.ShapeDtypeStruct((batch, steps, heads, 128), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((batch, steps, heads), jnp.float32),
        jax.ShapeDtypeStruct((*cache, 128), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct(cache, jnp.float32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    ]
    if table_blocks is not None:
        args.append(jax.ShapeDtypeStruct((batch, table_blocks), jnp.int32))
    return tuple(args)


def _index_topk(implementation):
    def fn(q, weights, keys, scales, lengths, block_table=None):
        return jax_sparse_mla.index_topk(
            q,
            weights,
            keys,
            scales,
            lengths,
            top_k=TOP_K,
            block_table=block_table,
            implementation=implementation,
        )

    return jax.jit(fn)


def _lower(fn, args, platform="cuda") -> str:
    return fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _custom_calls(module_text: str) -> list[tuple[str, dict[str, object]]]:
    """(target, attributes) of every custom call, index_topk's attributes decoded."""
    found = []
    with jax_mlir.make_ir_context():
        module = ir.Module.parse(module_text)

        def visit(op):
            if op.operation.name != "stablehlo.custom_call":
                return ir.WalkResult.ADVANCE
            attrs = op.operation.attributes
            target = ir.StringAttr(attrs["call_target_name"]).value
            decoded = {}
            if target == index_lowering.FFI_TARGET:
                config = ir.DictAttr(attrs["mhlo.backend_config"])
                for stage in STAGES:
                    cubin = np.asarray(ir.DenseElementsAttr(config[f"{stage}_cubin"]))
                    decoded[f"{stage}_cubin"] = cubin
                    decoded[f"{stage}_kernel"] = ir.StringAttr(config[f"{stage}_kernel"]).value
                decoded["span"] = ir.IntegerAttr(config["span"]).value
                decoded["topk_cluster"] = ir.IntegerAttr(config["topk_cluster"]).value
                decoded["dcp_size"] = ir.IntegerAttr(config["dcp_size"]).value
                decoded["operands"] = [str(operand.type) for operand in op.operation.operands]
                decoded["span_type"] = str(ir.IntegerAttr(config["span"]).type)
                decoded["results"] = [str(result.type) for result in op.operation.results]
            found.append((target, decoded))
            return ir.WalkResult.ADVANCE

        module.operation.walk(visit)
    return found


def _index_call(module_text: str) -> dict[str, object]:
    """The attributes of the module's one custom call, which must be index_topk's."""
    ((target, attrs),) = _custom_calls(module_text)
    assert target == index_lowering.FFI_TARGET
    return attrs


@pytest.fixture(autouse=True)
def _fresh_lowering(monkeypatch):
    """Every test lowers anew, sees a GPU-less process and a fresh warning log."""
    jax.clear_caches()
    index_lowering._warn_fallback.cache_clear()
    monkeypatch.setattr(cuda_lowering, "_local_cuda_capabilities", lambda: None)
    yield
    jax.clear_caches()


@pytest.fixture
def handler():
    """The FFI handler library (the installed package's or $JAX_SPARSE_MLA_FFI_LIBRARY):
    without it the lowering falls back, so the custom call's tests are skipped."""
    try:
        index_lowering.register_ffi_target()
    except (FileNotFoundError, OSError) as err:
        pytest.skip(f"handler library not installed: {err}")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """The cubins the lowering reads: shipped or cached, else compiled (into a disk cache of
    the test's own when it compiles). Skips where none can be had."""
    cache = tmp_path_factory.mktemp("index-cubins")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAX_SPARSE_MLA_CACHE_DIR", str(cache))
        try:
            return {kernel.slug: index_compile.get_kernel(kernel) for kernel in INDEX_KERNELS}
        except (KernelUnavailableError, ImportError) as err:
            pytest.skip(f"no index cubins on this machine: {err}")


@pytest.fixture
def same_kernels(kernels, monkeypatch):
    """The lowering reads exactly ``kernels`` (a concurrent edit of the kernel sources
    cannot swap them between the fixture and the lowering)."""
    monkeypatch.setattr(index_compile, "get_kernel", lambda kernel: kernels[kernel.slug])
    return kernels


def _lowered_kernels(batch, steps, capacity):
    """The IndexKernel of each stage that the lowering picks for B x T verify rows."""
    cluster = index_lowering.topk_cluster(batch * steps, capacity, cuda_lowering.sm_count())
    return {"scores": IndexKernel("scores"), "topk": IndexKernel("topk", cluster)}


def _check_kernel_call(attrs, kernels, batch=B, steps=T, heads=HI, capacity=N):
    lowered = _lowered_kernels(batch, steps, capacity)
    for stage in STAGES:
        cubin = attrs[f"{stage}_cubin"]
        assert cubin.dtype == np.uint8 and cubin.tobytes()[:4] == ELF
        assert cubin.tobytes() == kernels[lowered[stage].slug].cubin
        assert attrs[f"{stage}_kernel"] == kernels[lowered[stage].slug].meta["kernel_name"]
    assert attrs["topk_cluster"] == lowered["topk"].cluster
    assert attrs["dcp_size"] == 1
    assert attrs["operands"][5:] == [f"tensor<{batch}xi32>", "tensor<1xi32>"]  # lengths, rank
    assert attrs["scores_cubin"].tobytes() != attrs["topk_cubin"].tobytes()
    assert attrs["span_type"] == "i64"
    head_tiles = -(-heads // HEADS)
    span = _span(batch, steps, head_tiles, capacity, cuda_lowering.sm_count())
    assert attrs["span"] == span >= 1
    pitch = index_lowering.pitch(capacity)
    assert pitch % TOKENS == 0 and capacity <= pitch < capacity + TOKENS
    # tokens, scores, then the scratch order keys [B, T, pitch] (not returned)
    assert attrs["results"] == [
        f"tensor<{batch}x{steps}x{TOP_K}xi32>",
        f"tensor<{batch}x{steps}x{TOP_K}xf32>",
        f"tensor<{batch}x{steps}x{pitch}xi32>",
    ]


@pytest.mark.parametrize("implementation", ["cute", None])
def test_lowers_to_one_custom_call_with_both_cubins(handler, same_kernels, implementation):
    text = _lower(_index_topk(implementation), _args())
    _check_kernel_call(_index_call(text), same_kernels)
    # The operands are the normalized ones: heads padded to 64, the flat cache as one block;
    # the lengths go in as given (the kernels clamp them: no XLA op computes row limits).
    assert f"tensor<{B}x{T}x{HEADS}x128xf8E4M3FN>" in text
    assert f"tensor<1x{N}x128xf8E4M3FN>" in text
    assert not any(op in text for op in ("clamp", "minimum", "maximum", "iota"))


def test_paged_cache_lowers_to_the_kernel(handler, same_kernels):
    blocks, block_size, table_blocks, batch, steps = 40, 64, 7, 5, 4
    args = _args(batch, steps, 128, (blocks, block_size), table_blocks)
    attrs = _index_call(_lower(_index_topk("cute"), args))
    _check_kernel_call(attrs, same_kernels, batch, steps, 128, table_blocks * block_size)


def test_the_real_lookup_feeds_the_lowering(handler, kernels):
    """Without the test's stand-in for get_kernel: the cubins the package's own lookup
    finds (this process's, else shipped, cached or compiled) are the ones lowered."""
    attrs = _index_call(_lower(_index_topk("cute"), _args()))
    for stage, kernel in _lowered_kernels(B, T, N).items():
        cubin = attrs[f"{stage}_cubin"].tobytes()
        assert cubin[:4] == ELF
        assert cubin == index_compile.get_kernel(kernel).cubin


@pytest.mark.parametrize(
    "steps, heads",
    [
        (MAX_QUERY_TILES + 1, 1),  # one head tile per verify row, one row too many
        (1, MAX_QUERY_TILES * HEADS + 1),  # one verify row, one head too many
        (2, (MAX_QUERY_TILES // 2) * HEADS + 1),  # T * ceil(Hi / 64) just above the limit
    ],
)
def test_too_many_query_tiles(steps, heads, caplog):
    """T * ceil(Hi / 64) above MAX_QUERY_TILES: "cute" raises naming the limit; None lowers
    to the reference (the same module as on CPU) after one warning."""
    args = _args(steps=steps, heads=heads)
    with pytest.raises(NotImplementedError, match=rf"at most {MAX_QUERY_TILES} tiles"):
        _lower(_index_topk("cute"), args)
    jax.clear_caches()
    with caplog.at_level(logging.WARNING, logger="jax_sparse_mla"):
        text = _lower(_index_topk(None), args)
        jax.clear_caches()
        _lower(_index_topk(None), args)  # warned once per reason
    assert _custom_calls(text) == []
    assert text == _lower(_index_topk(None), args, platform="cpu")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "using the reference on CUDA" in warnings[0]
    assert f"at most {MAX_QUERY_TILES} tiles" in warnings[0]


@pytest.mark.parametrize(
    "steps, heads",
    [(MAX_QUERY_TILES, HEADS), (1, MAX_QUERY_TILES * HEADS), (MAX_QUERY_TILES, 1)],
)
def test_query_tiles_at_the_limit_use_the_kernel(handler, same_kernels, steps, heads):
    capacity = 2048 * TOKENS  # spans of many tiles: the query tiles' shared memory counts
    args = _args(steps=steps, heads=heads, cache=(capacity,))
    attrs = _index_call(_lower(_index_topk("cute"), args))
    _check_kernel_call(attrs, same_kernels, steps=steps, heads=heads, capacity=capacity)
    assert attrs["span"] > 1


def test_empty_batch_lowers_to_the_reference_without_a_warning(caplog):
    """B = 0: nothing to score, so even "cute" lowers to the reference (empty results)."""
    args = _args(batch=0)
    with caplog.at_level(logging.WARNING, logger="jax_sparse_mla"):
        for implementation in ("cute", None):
            text = _lower(_index_topk(implementation), args)
            assert _custom_calls(text) == []
            assert f"tensor<0x{T}x{TOP_K}xi32>" in text
            jax.clear_caches()
    assert not caplog.records


def test_empty_cache():
    """An empty cache is refused by the argument checks; the primitive bound directly with
    one (the normalized form a caller cannot produce) lowers to the reference, whose rows
    are all -1."""
    with pytest.raises(ValueError, match="index_keys must hold at least one key"):
        _lower(_index_topk("cute"), _args(cache=(0,)))
    operands = (
        jnp.zeros((B, T, HEADS, 128), jnp.float8_e4m3fn),
        jnp.ones((B, T, HEADS), jnp.float32),
        jnp.zeros((1, 0, 128), jnp.float8_e4m3fn),
        jnp.zeros((1, 0), jnp.float32),
        jnp.zeros((B, 1), jnp.int32),
        jnp.zeros((B,), jnp.int32),
        jnp.zeros((1,), jnp.int32),
    )

    def bound(require_kernel):
        def fn(*operands):
            return index_primitive.index_topk_p.bind(
                *operands, top_k=TOP_K, dcp_size=1, require_kernel=require_kernel
            )

        return jax.jit(fn)

    text = _lower(bound(True), operands)
    assert _custom_calls(text) == []
    assert text == _lower(bound(False), operands, platform="cpu")  # the reference
    tokens, scores = bound(False)(*operands)  # that same module, run on CPU
    assert np.all(np.asarray(tokens) == -1) and np.all(np.asarray(scores) == -np.inf)


def test_no_cubin(handler, monkeypatch, caplog):
    def unavailable(kernel):
        raise KernelUnavailableError(f"no cubin for {kernel.slug} (test)")

    monkeypatch.setattr(index_compile, "get_kernel", unavailable)
    with pytest.raises(NotImplementedError, match=r"no cubin for index-scores \(test\)"):
        _lower(_index_topk("cute"), _args())
    jax.clear_caches()
    with caplog.at_level(logging.WARNING, logger="jax_sparse_mla"):
        assert _custom_calls(_lower(_index_topk(None), _args())) == []
    assert any("no cubin for index-scores" in r.getMessage() for r in caplog.records)


def test_no_handler_library(monkeypatch, caplog):
    def missing():
        raise FileNotFoundError("libsparse_mla_ffi.so is not installed (test)")

    monkeypatch.setattr(index_lowering, "register_ffi_target", missing)
    with pytest.raises(NotImplementedError, match=r"libsparse_mla_ffi\.so is not installed"):
        _lower(_index_topk("cute"), _args())
    jax.clear_caches()
    with caplog.at_level(logging.WARNING, logger="jax_sparse_mla"):
        assert _custom_calls(_lower(_index_topk(None), _args())) == []
    assert any("not installed (test)" in r.getMessage() for r in caplog.records)


def test_non_hopper_gpu(monkeypatch):
    monkeypatch.setattr(cuda_lowering, "_local_cuda_capabilities", lambda: ("8.0",))
    with pytest.raises(NotImplementedError, match="Hopper"):
        _lower(_index_topk("cute"), _args())


def test_reference_and_cpu_never_use_the_kernel():
    assert _custom_calls(_lower(_index_topk("reference"), _args())) == []
    with pytest.raises(NotImplementedError, match="Hopper"):  # "cute" on CPU
        _lower(_index_topk("cute"), _args(), platform="cpu")
    assert _custom_calls(_lower(_index_topk(None), _args(), platform="cpu")) == []


# ---------------------------------------------------------------------------------------
# jax.export


def test_export_roundtrips_both_cubins(handler, same_kernels):
    fn = _index_topk("cute")
    with pytest.raises(ValueError, match=index_lowering.FFI_TARGET):
        jax.export.export(fn, platforms=("cuda",))(*_args())
    checks = index_lowering.export_disabled_checks()
    exported = jax.export.export(fn, platforms=("cuda",), disabled_checks=checks)(*_args())
    restored = jax.export.deserialize(exported.serialize())
    assert restored.platforms == ("cuda",)
    assert [a.shape for a in restored.out_avals] == [(B, T, TOP_K)]
    text = restored.mlir_module()
    assert f"stablehlo.custom_call @{index_lowering.FFI_TARGET}(" in text
    attrs = _index_call(text)
    _check_kernel_call(attrs, same_kernels)
    for stage in STAGES:  # the NUL bytes survive serialization
        kernel = same_kernels[_lowered_kernels(B, T, N)[stage].slug]
        assert attrs[f"{stage}_cubin"].tobytes().count(0) == kernel.cubin.count(0)


def _fake_decode_kernel(config: KernelConfig) -> kernel_compile.CompiledKernel:
    meta = {
        "kernel_name": "fake_decode_entry",
        "head_tile": config.head_tile,
        "block": list(config.block),
        "cluster": list(config.cluster),
        "smem_bytes": 1024,
        "params": list(PARAMS),
    }
    return kernel_compile.CompiledKernel(ELF + bytes(64), meta)


def test_export_a_model_step_with_the_library_checks(handler, same_kernels, monkeypatch):
    """index_topk -> token_rows -> decode: one program, two of the library's custom calls;
    each lowering's own checks are not enough, the package's union is."""
    monkeypatch.setattr(kernel_compile, "get_kernel", _fake_decode_kernel)

    @jax.jit
    def step(q, kv, q_index, weights, keys, scales, lengths):
        tokens = jax_sparse_mla.index_topk(
            q_index, weights, keys, scales, lengths, top_k=TOP_K, implementation="cute"
        )
        rows, valid = jax_sparse_mla.token_rows(tokens)
        return jax_sparse_mla.decode(q, kv, rows, valid, softmax_scale=0.1, implementation="cute")

    args = (
        jax.ShapeDtypeStruct((B, 16, 576), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((N, 576), jnp.float8_e4m3fn),
        *_args(steps=1),
    )
    for partial in (cuda_lowering, index_lowering):
        with pytest.raises(ValueError, match="custom call"):
            jax.export.export(
                step, platforms=("cuda",), disabled_checks=partial.export_disabled_checks()
            )(*args)
    checks = jax_sparse_mla.export_disabled_checks()
    assert set(checks) >= {
        *cuda_lowering.export_disabled_checks(),
        *index_lowering.export_disabled_checks(),
    }
    exported = jax.export.export(step, platforms=("cuda",), disabled_checks=checks)(*args)
    text = jax.export.deserialize(exported.serialize()).mlir_module()
    targets = [target for target, _ in _custom_calls(text)]
    assert targets == [index_lowering.FFI_TARGET, cuda_lowering.FFI_TARGET]
    _check_kernel_call(_index_call_of(text), same_kernels, steps=1)


def _index_call_of(module_text: str) -> dict[str, object]:
    (attrs,) = (a for t, a in _custom_calls(module_text) if t == index_lowering.FFI_TARGET)
    return attrs


# ---------------------------------------------------------------------------------------
# The span rule


def _span(batch: int, steps: int, head_tiles: int, capacity: int, sm_count: int) -> int:
    return index_lowering.span(
        batch=batch, steps=steps, head_tiles=head_tiles, capacity=capacity, sm_count=sm_count
    )


def _resident_ctas(query_tiles: int, sm_count: int) -> int:
    """Scores CTAs the GPU holds at once: per SM, as many as its shared memory takes (each
    CTA's dynamic shared memory plus the driver's share), within the register cap, >= 1."""
    smem = SCORE_SMEM_FIXED + query_tiles * SCORE_SMEM_PER_QUERY_TILE
    per_sm = 1
    while (
        per_sm < index_lowering.MAX_CTAS_PER_SM
        and (per_sm + 1) * (smem + index_lowering.CTA_RESERVED_BYTES)
        <= index_lowering.SM_SHARED_BYTES
    ):
        per_sm += 1
    return per_sm * sm_count


def _grid(batch: int, capacity: int, span: int) -> int:
    """The handler's scores grid, (ceil(tiles / span), B), in CTAs."""
    tiles = index_lowering.pitch(capacity) // TOKENS
    return -(-tiles // span) * batch


SHAPES = list(
    itertools.product(
        [1, 2, 3, 5, 16, 64, 90, 131, 200, 1000, 5000],  # B
        [(1, 1), (1, 2), (4, 1), (5, 3), (MAX_QUERY_TILES, 1)],  # (T, head tiles)
        [1, TOKENS - 1, TOKENS, 5 * TOKENS, 1000, 2048, 32768, 131072],  # capacity
        [1, 66, 78, 132],  # SMs
    )
)


def test_span_fills_one_wave():
    """The docstring's rule: each request gets as many CTAs as fit B times into the resident
    slots (one wave), at least one: the grid fits the wave whenever B does, one tile fewer
    per CTA would overflow it, and B beyond the slots gets one CTA (all tiles) per request."""
    for batch, (steps, head_tiles), capacity, sms in SHAPES:
        case = (batch, steps, head_tiles, capacity, sms)
        span = _span(*case)
        tiles = index_lowering.pitch(capacity) // TOKENS
        slots = _resident_ctas(steps * head_tiles, sms)
        assert isinstance(span, int) and 1 <= span <= tiles, (case, span)
        if batch <= slots:
            assert _grid(batch, capacity, span) <= slots, (case, span)
        else:
            assert span == tiles, (case, span)
        if span > 1:
            assert _grid(batch, capacity, span - 1) > slots, (case, span)


def test_span_grows_with_the_work_and_shrinks_with_the_gpu():
    """More requests, keys or staged query tiles never give a CTA fewer tiles; more SMs
    never give it more."""
    for batch, (steps, head_tiles), capacity, sms in SHAPES:
        span = _span(batch, steps, head_tiles, capacity, sms)
        assert _span(batch + 1, steps, head_tiles, capacity, sms) >= span
        assert _span(batch, steps, head_tiles, capacity + TOKENS, sms) >= span
        assert _span(batch, steps + 1, head_tiles, capacity, sms) >= span
        assert _span(batch, steps, head_tiles, capacity, sms + 1) <= span


@pytest.mark.parametrize(
    ("rows", "cluster"),
    [(1, 16), (7, 16), (8, 8), (15, 8), (16, 4), (30, 4), (31, 2), (66, 2), (67, 1), (5000, 1)],
)
def test_topk_cluster_is_the_largest_resident_in_one_wave(rows, cluster):
    """On 132 SMs, with slices long enough for any size: ``rows`` clusters of the chosen
    size are resident at once (the H200's measured GPC limits: 7 of 16, 15 of 8, 30 of 4,
    66 of 2), the next larger size is not, and more rows than fit in pairs run one CTA each."""
    assert index_lowering.topk_cluster(rows, 131072, 132) == cluster
    assert cluster == 1 or rows <= active_clusters(cluster, 132)
    larger = [c for c in TOPK_CLUSTERS if c > cluster]
    assert not larger or rows > active_clusters(larger[0], 132)


@pytest.mark.parametrize(
    ("capacity", "cluster"),
    [(1, 1), (4096, 1), (8192, 1), (8193, 2), (16384, 4), (32768, 8), (32784, 8), (65536, 16)],
)
def test_topk_cluster_leaves_each_cta_a_long_slice(capacity, cluster):
    """One row: a single CTA up to 8192 token slots, then the largest cluster whose CTAs keep
    at least 4096 slots each (the H200's fastest sizes per context, session 14's sweep)."""
    assert index_lowering.topk_cluster(1, capacity, 132) == cluster


def test_ffi_mirrors_the_kernels_static_sizes():
    """ffi/index_topk_ffi.cc restates the launch sizes of config.py (the cubins carry none):
    a layout change on one side only would launch with the wrong shared memory."""
    source = pathlib.Path(__file__).parents[1] / "ffi" / "index_topk_ffi.cc"
    constants = {
        name: eval(" ".join(expr.split()), {"__builtins__": {}})  # sums / products of literals
        for name, expr in re.findall(
            r"constexpr \w+(?: \w+)? (k\w+) =\s*([\d\s*+]+);", source.read_text()
        )
    }
    assert constants == {
        "kDim": config.DIM,
        "kTokens": config.TOKENS,
        "kHeads": config.HEADS,
        "kScoreThreads": config.SCORE_THREADS,
        "kScoreSmemFixed": config.SCORE_SMEM_FIXED,
        "kScoreSmemPerQueryTile": config.SCORE_SMEM_PER_QUERY_TILE,
        "kMaxQueryTiles": config.MAX_QUERY_TILES,
        "kTopkThreads": config.TOPK_THREADS,
        "kTopkSmem": config.TOPK_SMEM,
        "kMaxGridY": 65535,  # CUDA's grid limit, not a kernel size
    }
