"""The CUDA lowering, checked on a CPU machine: the custom call, its cubin attribute, export.

A fake cubin holding every byte value (NULs included) stands in for the kernel where the test
is about the plumbing; one test uses the real kernel when it can be compiled or is cached.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib import xla_client
from jax._src.lib.mlir import ir

import jax_sparse_mla
from jax_sparse_mla import cuda_lowering, index_lowering
from jax_sparse_mla.kernel import compile as kernel_compile
from jax_sparse_mla.kernel import dispatch
from jax_sparse_mla.kernel.config import (
    PAIR_SPLITS,
    PARAMS,
    KernelConfig,
    KernelUnavailableError,
)

B, H, K, N = 5, 20, 64, 1000  # H pads to 32 heads
HP = 32
FAKE_CUBIN = b"\x7fELF\x00\x00\x00" + bytes(range(256)) * 3 + b"\x00"


def _fake_kernel(config: KernelConfig) -> kernel_compile.CompiledKernel:
    meta = {
        "kernel_name": "fake_entry",
        "head_tile": config.head_tile,
        "block": list(config.block),
        "cluster": list(config.cluster),
        "smem_bytes": 123456,
        "params": list(PARAMS),
        "config": {"variant": config.variant, "split": config.split},
    }
    return kernel_compile.CompiledKernel(FAKE_CUBIN, meta)


def _args(batch=B, heads=H, width=K, cache_rows=N, row_bytes=576):
    return (
        jax.ShapeDtypeStruct((batch, heads, 576), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((cache_rows, row_bytes), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((batch, width), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )


def _decode(implementation, kernel_config=None, **options):
    def fn(q, kv, rows, valid):
        return jax_sparse_mla.decode(
            q,
            kv,
            rows,
            valid,
            softmax_scale=0.1,
            kv_scale=0.5,
            implementation=implementation,
            kernel_config=kernel_config,
            **options,
        )

    return jax.jit(fn)


def _cuda_text(implementation, args=None, kernel_config=None, **options) -> str:
    args = _args() if args is None else args
    lowered = _decode(implementation, kernel_config, **options).trace(*args)
    return lowered.lower(lowering_platforms=("cuda",)).as_text()


def _custom_call_attributes(module_text: str) -> list[dict[str, object]]:
    """The attributes of every custom call to our target, decoded from the MLIR text."""
    found = []
    with jax_mlir.make_ir_context():
        module = ir.Module.parse(module_text)

        def visit(op):
            attrs = op.operation.attributes
            if (
                op.operation.name == "stablehlo.custom_call"
                and ir.StringAttr(attrs["call_target_name"]).value == cuda_lowering.FFI_TARGET
            ):
                config = ir.DictAttr(attrs["mhlo.backend_config"])
                found.append(
                    {
                        "cubin": np.asarray(ir.DenseElementsAttr(config["cubin"])),
                        "kernel_name": ir.StringAttr(config["kernel_name"]).value,
                        "head_tile": ir.IntegerAttr(config["head_tile"]).value,
                        "block": list(np.asarray(ir.DenseElementsAttr(config["block"]))),
                        "cluster": list(np.asarray(ir.DenseElementsAttr(config["cluster"]))),
                        "smem_bytes": ir.IntegerAttr(config["smem_bytes"]).value,
                        "smem_type": str(ir.IntegerAttr(config["smem_bytes"]).type),
                    }
                )
            return ir.WalkResult.ADVANCE

        module.operation.walk(visit)
    return found


@pytest.fixture(autouse=True)
def _fresh_lowering(monkeypatch):
    """Every test lowers anew, sees a Hopper-less CPU process and a fresh warning log."""
    jax.clear_caches()
    cuda_lowering._warn_fallback.cache_clear()
    monkeypatch.setattr(cuda_lowering, "_local_cuda_capabilities", lambda: None)
    yield
    jax.clear_caches()


@pytest.fixture
def fake_kernel(monkeypatch):
    monkeypatch.setattr(kernel_compile, "get_kernel", _fake_kernel)


def test_lowering_emits_custom_call_with_cubin(fake_kernel):
    text = _cuda_text("cute", kernel_config=KernelConfig(split=1))
    (attrs,) = _custom_call_attributes(text)
    assert attrs["cubin"].dtype == np.uint8
    assert attrs["cubin"].tobytes() == FAKE_CUBIN
    assert attrs["kernel_name"] == "fake_entry"
    assert attrs["head_tile"] == 16  # the handler's grid: (32 / 16 * 1, B, 1)
    assert attrs["block"] == [512, 1, 1]
    assert attrs["cluster"] == [1, 1, 1]  # split 1: no cluster
    assert (attrs["smem_bytes"], attrs["smem_type"]) == (123456, "i64")
    # The operands are the padded primitive's: q [B, 32, 576], results [B, 32, 512] / [B, 32].
    assert f"tensor<{B}x{HP}x576xf8E4M3FN>" in text
    assert f"-> (tensor<{B}x{HP}x512xbf16>, tensor<{B}x{HP}xf32>)" in text


@pytest.mark.parametrize(
    "batch, heads, width, config",
    [
        (5, 96, 256, KernelConfig(split=4)),  # latency-h96: 5.8 us (split 2 7.2)
        (5, 128, 256, KernelConfig(split=2)),  # 7.2 us (split 4: 20 clusters of 8, 2 waves, 11.0)
        (5, 96, 1024, KernelConfig(split=4)),  # 10.9 us (wgmma split 8 12.2; session 26)
        (5, 96, 2048, KernelConfig("wgmma", 8)),  # 16.2 us (split 4 19.5; session 26)
        (5, 128, 512, KernelConfig(split=2)),  # 9.5 us (wgmma split 8 10.5; session 28)
        (8, 128, 256, KernelConfig("wgmma", 4)),  # 9.3 us (split 1 12.2; session 26)
        (64, 64, 64, KernelConfig("wgmma", 1)),  # 8.6 us (split 1 12.6; session 26)
        (5, 128, 2048, KernelConfig("wgmma", 8)),  # rank-full: 16.6 us (split 8 35.2)
        (16, 128, 2048, KernelConfig("wgmma", 2)),  # 39.7 us (cluster-mma split 1 70.8)
        (32, 128, 2048, KernelConfig("wgmma", 2)),  # 53.7 us (wgmma split 1 101.3; session 7)
        (64, 128, 2048, KernelConfig("wgmma", 1)),  # throughput: 77.8 us (split 2 87.2)
        (1, 128, 128, KernelConfig(split=4)),  # 5.2 us (split 8 5.5, split 2 5.7; session 26)
        (5, 128, 128, KernelConfig(split=2)),  # 5.9 us (split 1 8.1, wgmma split 2 8.8)
        (16, 128, 128, KernelConfig(split=1)),  # 9.1 us (wgmma split 2 9.5, split 2 16.3)
        (64, 128, 128, KernelConfig("wgmma", 1)),  # 12.2 us (cluster-mma split 1 31.2)
        (256, 128, 128, KernelConfig("wgmma", 1)),  # 63.5 us (split 1 128.9; session 7)
        (5, 96, 128, KernelConfig(split=4)),  # 4.9 us (split 2 5.3, split 1 7.6; session 28)
        (1, 16, 8, KernelConfig(split=1)),  # 4.36 us (split 2 4.94; session 31)
        (5, 96, 64, KernelConfig(split=2)),  # 4.91 us (split 1 6.30; session 26)
        (1, 128, 2048, KernelConfig(split=8)),  # 8 clusters of 8: 11.7 us (split 4 19.3)
        (1, 128, 256, KernelConfig(split=8)),  # 5.2 us (split 4, one wave too, 5.6)
        (2, 64, 1024, KernelConfig(split=8)),
        (8, 64, 129, KernelConfig(split=2)),  # 32 clusters of 4 would take 2 waves
    ],
    ids=str,
)
def test_lowering_follows_the_dispatch_rule(fake_kernel, batch, heads, width, config):
    """Without a GPU the rule assumes the H200's 132 SMs; the comments give the H200's
    measured times (BENCHMARKS.md, session 25 unless noted) behind each pick."""
    args = _args(batch=batch, heads=heads, width=width)
    (attrs,) = _custom_call_attributes(_cuda_text("cute", args))
    assert attrs["cluster"] == list(config.cluster)
    assert attrs["head_tile"] == config.head_tile and attrs["block"] == list(config.block)
    padded = -(-heads // 16) * 16
    assert dispatch.choose_config(batch, padded, width) == config


@pytest.mark.parametrize(
    "valid_hint, config",
    [
        (None, KernelConfig("wgmma", 8)),  # the rule sees K = 2048: rank-full's pick
        (2048, KernelConfig("wgmma", 8)),
        (4096, KernelConfig("wgmma", 8)),  # a hint above K changes nothing
        (256, KernelConfig(split=2)),  # latency-h128: 7.8 us (wgmma split 8: 10.0)
        (100, KernelConfig(split=2)),  # B=5, H=128, 128 keys: 6.9 us (split 1 8.1)
    ],
)
def test_valid_hint_steers_the_dispatch(fake_kernel, valid_hint, config):
    args = _args(batch=5, heads=128, width=2048)
    (attrs,) = _custom_call_attributes(_cuda_text("cute", args, valid_hint=valid_hint))
    assert attrs["cluster"] == list(config.cluster)
    assert attrs["head_tile"] == config.head_tile


def test_valid_hint_yields_to_a_forced_config(fake_kernel):
    forced = KernelConfig("wgmma", 2)
    text = _cuda_text("cute", _args(batch=5, heads=128, width=2048), forced, valid_hint=64)
    (attrs,) = _custom_call_attributes(text)
    assert attrs["cluster"] == [2, 1, 1] and attrs["head_tile"] == forced.head_tile


def test_active_clusters_match_the_h200():
    # cuOccupancyMaxActiveClusters of every shipped cubin on the H200 (one CTA per SM).
    assert [dispatch.active_clusters(s, 132) for s in (1, 2, 4, 8, 16)] == [132, 66, 30, 15, 7]


def test_dispatch_rule_uses_the_sm_count():
    # rank-full: 10 clusters of 8 fit one wave of 132 SMs, not of 66 (then split 4: one wave).
    assert dispatch.choose_config(5, 128, 2048, sm_count=132) == KernelConfig("wgmma", 8)
    assert dispatch.choose_config(5, 128, 2048, sm_count=66) == KernelConfig("wgmma", 4)
    # B = 64: 128 CTAs of split 1 fill one wave of 132 SMs; on 66, split 1 takes 2 waves.
    assert dispatch.choose_config(64, 128, 2048, sm_count=132) == KernelConfig("wgmma", 1)
    assert dispatch.choose_config(64, 128, 2048, sm_count=66).variant == "wgmma"


def test_dispatch_keeps_small_heads_off_wgmma():
    # 133 x 16 heads: a 64-head wgmma tile would be three quarters padding.
    assert dispatch.choose_config(133, 16, 2048).variant == "cluster-mma"
    assert dispatch.choose_config(133, 64, 2048).variant == "wgmma"


def test_predicted_times_follow_the_measured_order():
    """The fitted costs rank the configs as the H200 did at the benchmark's shapes."""

    def us(config, batch, heads, width):
        return dispatch.predicted_us(config, batch, heads, width, 132)

    wgmma = [KernelConfig("wgmma", s) for s in (1, 2, 4, 8)]
    # rank-full: 76.6, 40.7, 24.1, 16.9 us.
    times = [us(c, 5, 128, 2048) for c in wgmma]
    assert times == sorted(times, reverse=True)
    # throughput: split 1 (one wave) 88.1 before split 2 (two waves) 96.2.
    assert us(wgmma[0], 64, 128, 2048) < us(wgmma[1], 64, 128, 2048)


@pytest.mark.parametrize("split", [1, 2, 4, 8])
def test_kernel_config_forces_a_config(fake_kernel, split):
    args = _args(batch=64, heads=128, width=8)  # the rule would take split 1
    config = KernelConfig(split=split)
    (attrs,) = _custom_call_attributes(_cuda_text("cute", args, kernel_config=config))
    # s2 and s4 clusters pair two head tiles (multicast gathers): 2 x split CTAs per cluster
    assert attrs["cluster"] == [split * (2 if split in PAIR_SPLITS else 1), 1, 1]
    assert attrs["head_tile"] == (32 if split in PAIR_SPLITS else 16)


def test_fingerprint_covers_the_kernel_but_not_the_dispatch_rule(tmp_path, monkeypatch):
    sources = tmp_path / "kernel"
    sources.mkdir()
    (sources / "exchange").mkdir()
    for path in kernel_compile._KERNEL_DIR.glob("**/*.py"):
        relative = path.relative_to(kernel_compile._KERNEL_DIR)
        (sources / relative).parent.mkdir(exist_ok=True)
        (sources / relative).write_bytes(path.read_bytes())
    monkeypatch.setattr(kernel_compile, "_KERNEL_DIR", sources)
    before = kernel_compile.source_fingerprint()
    with open(sources / "dispatch.py", "a") as f:
        f.write("# a retuned rule\n")
    assert kernel_compile.source_fingerprint() == before
    for edited in ("sparse_decode.py", "exchange/ptx.py"):  # the decodes use the exchange's PTX
        with open(sources / edited, "a") as f:
            f.write("# an edited kernel\n")
        assert kernel_compile.source_fingerprint() != before
        before = kernel_compile.source_fingerprint()


def test_kernel_config_argument_errors():
    q, kv, rows, valid = (jnp.zeros(a.shape, a.dtype) for a in _args())
    with pytest.raises(TypeError, match="kernel_config"):
        jax_sparse_mla.decode(q, kv, rows, valid, softmax_scale=0.1, kernel_config=2)
    with pytest.raises(ValueError, match=r"kernel_config.*reference"):
        jax_sparse_mla.decode(
            q,
            kv,
            rows,
            valid,
            softmax_scale=0.1,
            implementation="reference",
            kernel_config=KernelConfig(split=2),
        )
    # The push exchange's own cubin is not a decode variant.
    with pytest.raises(ValueError, match=r"exchange=True.*plain config"):
        jax_sparse_mla.decode(
            q, kv, rows, valid, softmax_scale=0.1, kernel_config=KernelConfig(exchange=True)
        )


def test_kernel_config_is_ignored_off_cuda():
    """On CPU the primitive lowers to the reference whatever config a caller forces."""
    q, kv, rows, valid = (jnp.ones(a.shape, a.dtype) for a in _args(width=4, cache_rows=8))
    rows = jnp.zeros_like(rows)
    valid = jnp.full_like(valid, 4)
    kwargs = dict(softmax_scale=0.1, implementation=None)
    forced = jax_sparse_mla.decode(
        q, kv, rows, valid, kernel_config=KernelConfig(split=1), **kwargs
    )
    plain = jax_sparse_mla.decode(q, kv, rows, valid, **kwargs)
    for a, b in zip(forced, plain, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_default_implementation_uses_kernel_on_cuda(fake_kernel):
    assert len(_custom_call_attributes(_cuda_text(None))) == 1


def test_cpu_lowering_has_no_custom_call(fake_kernel):
    lowered = _decode(None).trace(*_args()).lower(lowering_platforms=("cpu",))
    assert cuda_lowering.FFI_TARGET not in lowered.as_text()


def test_export_roundtrips_cubin_bytes(fake_kernel):
    exported = jax.export.export(
        _decode("cute"), platforms=("cuda",), disabled_checks=cuda_lowering.export_disabled_checks()
    )(*_args())
    restored = jax.export.deserialize(exported.serialize())
    assert restored.platforms == ("cuda",)
    (attrs,) = _custom_call_attributes(restored.mlir_module())
    assert attrs["cubin"].tobytes() == FAKE_CUBIN
    assert attrs["cubin"].tobytes().count(0) == FAKE_CUBIN.count(0) > 3
    assert attrs["kernel_name"] == "fake_entry"


def test_export_without_disabled_check_is_refused(fake_kernel):
    with pytest.raises(ValueError, match=cuda_lowering.FFI_TARGET):
        jax.export.export(_decode("cute"), platforms=("cuda",))(*_args())


def test_export_real_kernel_roundtrips():
    try:
        kernel = kernel_compile.get_kernel(dispatch.choose_config(B, HP, K))
    except KernelUnavailableError as err:
        pytest.skip(f"no cubin on this machine: {err}")
    assert kernel.cubin[:4] == b"\x7fELF" and 0 in kernel.cubin
    exported = jax.export.export(
        _decode("cute"), platforms=("cuda",), disabled_checks=cuda_lowering.export_disabled_checks()
    )(*_args())
    (attrs,) = _custom_call_attributes(jax.export.deserialize(exported.serialize()).mlir_module())
    assert attrs["cubin"].tobytes() == kernel.cubin
    assert attrs["kernel_name"] == kernel.meta["kernel_name"]
    assert attrs["smem_bytes"] == kernel.meta["smem_bytes"]


@pytest.fixture
def without_dsl(monkeypatch, tmp_path):
    """No DSL (cutlass unimportable), an empty disk cache and no cubin in memory."""
    monkeypatch.setitem(sys.modules, "cutlass", None)
    monkeypatch.setattr(kernel_compile, "dsl_version", lambda: None)
    monkeypatch.setattr(kernel_compile, "_MEMORY", {})
    monkeypatch.setenv("JAX_SPARSE_MLA_CACHE_DIR", str(tmp_path / "empty-cache"))


def test_shipped_cubin_serves_shapes_never_compiled(without_dsl):
    shipped = kernel_compile.shipped_dir()
    assert shipped is not None, (
        "the installed jax_sparse_mla ships no cubins (jax_sparse_mla/_cubins): install it "
        "with `pip install .`, whose build compiles them"
    )
    shapes = [(7, 40, 333, 50_000, 640), (1, 1, 1, 3, 576), (300, 128, 2048, 10, 592)]
    for batch, heads, width, cache_rows, row_bytes in shapes:
        padded = -(-heads // 16) * 16
        config = dispatch.choose_config(batch, padded, width)
        (cubin_path,) = shipped.glob(f"{config.slug}-{kernel_compile.source_fingerprint()}-*.cubin")
        args = _args(batch, heads, width, cache_rows, row_bytes)
        text = _cuda_text("cute", args)
        (attrs,) = _custom_call_attributes(text)
        assert attrs["cubin"].tobytes() == cubin_path.read_bytes()
        assert attrs["cluster"] == list(config.cluster)
        assert f"tensor<{cache_rows}x{row_bytes}xf8E4M3FN>" in text  # padded rows, no copy
        assert f"tensor<{batch}x{padded}x576xf8E4M3FN>" in text
        jax.clear_caches()


def test_without_dsl_or_shipped_cubin_falls_back(without_dsl, monkeypatch):
    monkeypatch.setattr(kernel_compile, "shipped_dir", lambda: None)
    with pytest.raises(NotImplementedError, match="not installed to compile"):
        _cuda_text("cute")


def _unavailable(config):
    raise KernelUnavailableError(f"no cubin for {config.slug} (test)")


def test_no_cubin_falls_back_to_reference_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(kernel_compile, "get_kernel", _unavailable)
    with caplog.at_level(logging.WARNING, logger="jax_sparse_mla"):
        text = _cuda_text(None)
        jax.clear_caches()
        _cuda_text(None)
    assert cuda_lowering.FFI_TARGET not in text
    warnings = [r for r in caplog.records if "using the reference on CUDA" in r.getMessage()]
    assert len(warnings) == 1 and "no cubin" in warnings[0].getMessage()


def test_no_cubin_with_cute_raises(monkeypatch):
    monkeypatch.setattr(kernel_compile, "get_kernel", _unavailable)
    with pytest.raises(NotImplementedError, match="no cubin"):
        _cuda_text("cute")


def test_non_hopper_gpu(monkeypatch, fake_kernel, caplog):
    monkeypatch.setattr(cuda_lowering, "_local_cuda_capabilities", lambda: ("8.0",))
    with pytest.raises(NotImplementedError, match="Hopper"):
        _cuda_text("cute")
    jax.clear_caches()
    with caplog.at_level(logging.WARNING, logger="jax_sparse_mla"):
        assert cuda_lowering.FFI_TARGET not in _cuda_text(None)
    assert any("Hopper" in r.getMessage() for r in caplog.records)


def test_batch_beyond_the_grid_limit(fake_kernel, caplog):
    """B > 65535 (the grid's y extent): 'cute' raises, the default falls back loudly."""
    args = _args(batch=65536, heads=16, width=8, cache_rows=64)
    with pytest.raises(NotImplementedError, match="at most 65535"):
        _cuda_text("cute", args)
    jax.clear_caches()
    with caplog.at_level(logging.WARNING, logger="jax_sparse_mla"):
        assert cuda_lowering.FFI_TARGET not in _cuda_text(None, args)
    assert any("at most 65535" in r.getMessage() for r in caplog.records)
    jax.clear_caches()
    assert cuda_lowering.FFI_TARGET in _cuda_text("cute", _args(batch=65535, heads=16))


def test_reference_implementation_never_uses_kernel(fake_kernel):
    assert cuda_lowering.FFI_TARGET not in _cuda_text("reference")


def _has_cuda_backend() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def test_handler_library_loads_and_registers():
    path = cuda_lowering.register_ffi_target()
    library = ctypes.CDLL(str(path))
    for symbol in (
        "JaxSparseMlaDecodeInstantiate",
        "JaxSparseMlaDecodeExecute",
        "JaxSparseMlaDecodeStateTypeId",
        "JaxSparseMlaDecodeStateTypeInfo",
    ):
        assert getattr(library, symbol) is not None
    # Registered: with a CUDA backend, straight into XLA; without one, queued by jaxlib
    # for the CUDA plugin.
    index_lowering.register_ffi_target()  # the same library's index_topk handler
    pending = [name for name, *_ in xla_client._custom_callback.get("CUDA", [])]
    targets = (cuda_lowering.FFI_TARGET, cuda_lowering.PUSH_FFI_TARGET, index_lowering.FFI_TARGET)
    assert _has_cuda_backend() or set(targets) <= set(pending)
    assert cuda_lowering.register_ffi_target() == path  # idempotent
