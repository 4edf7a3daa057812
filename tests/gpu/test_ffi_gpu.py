"""The FFI custom call on a Hopper GPU: handler plumbing, kernel vs reference, loops, export.

Run on the H200 with the package installed from a wheel (handler and shipped cubins; no DSL
needed): ``python -m pytest -m gpu tests/gpu/test_ffi_gpu.py``.

The probe test launches a small nvcc-built cubin with the kernel's parameter ABI through the
handler and checks its exactly predictable output, which pins the pointers, the four sizes
(n_rows, width, heads, row_bytes), the grid the handler computes from the buffer shapes, the
cluster and the dynamic shared memory independently of the real kernel's numerics.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # truth.py

from truth import lse_tolerance, truth_decode

import jax_sparse_mla
from jax_sparse_mla import cuda_lowering
from jax_sparse_mla.kernel import compile as kernel_compile
from jax_sparse_mla.kernel.config import CHUNK, PARAMS, KernelConfig, KernelUnavailableError

pytestmark = pytest.mark.gpu

SOFTMAX_SCALE = 192**-0.5
COUNTS = (0, 1, 31, 32, 33, CHUNK - 1, CHUNK + 1, 256, 2048, -3, 4096)

PROBE_SOURCE = r"""
#include <cstdint>
#include <cuda_bf16.h>
// latent[b, h, c] = (q[b, h, c] % 64) * scales[1] + cluster size;
// lse[b, h] = sum over the row's readable keys of (kv[row, (h + 600) % row_bytes] + 1).
extern "C" __global__ void __launch_bounds__(512) probe(
    const uint8_t* q, const uint8_t* kv, const int32_t* rows, const int32_t* valid,
    const float* scales, __nv_bfloat16* latent, float* lse, int32_t n_rows, int32_t width,
    int32_t heads, int32_t row_bytes) {
  extern __shared__ uint8_t smem[];
  asm volatile("griddepcontrol.wait;" ::: "memory");
  unsigned cluster;
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(cluster));
  smem[threadIdx.x] = 1;  // both ends of the dynamic shared memory must exist
  smem[SMEM - 1 - threadIdx.x] = 2;
  __syncthreads();
  const int b = blockIdx.y, group = blockIdx.x / cluster, part = blockIdx.x % cluster;
  if (gridDim.x != heads / 16 * cluster || heads % 16 != 0) __trap();
  const int cols = 512 / cluster;
  for (int i = threadIdx.x; i < 16 * cols; i += blockDim.x) {
    const int h = group * 16 + i / cols, c = part * cols + i % cols;
    const float x = float(q[(size_t(b) * heads + h) * 576 + c] % 64) * scales[1] + cluster;
    latent[(size_t(b) * heads + h) * 512 + c] =
        __float2bfloat16(x + smem[threadIdx.x] - 1 + smem[SMEM - 1 - threadIdx.x] - 2);
  }
  if (part == 0 && threadIdx.x < 16) {
    const int h = group * 16 + threadIdx.x;
    const int count = min(max(valid[b], 0), width);
    float sum = 0.f;
    for (int j = 0; j < count; ++j) {
      const int row = rows[size_t(b) * width + j];
      if (row >= 0 && row < n_rows) {
        sum += float(kv[size_t(row) * row_bytes + (h + 600) % row_bytes]) + 1.f;
      }
    }
    lse[size_t(b) * heads + h] = sum;
  }
}
"""


def _inputs(seed, batch, heads, width, n_rows, counts=COUNTS, row_bytes=576):
    rng = np.random.default_rng(seed)
    q = rng.uniform(-2, 2, (batch, heads, 576)).astype(jnp.float8_e4m3fn)
    kv = rng.uniform(-2, 2, (n_rows, row_bytes)).astype(jnp.float8_e4m3fn)
    # Out-of-range rows (negative and >= N) and duplicates (small N, repeated picks).
    rows = rng.integers(-8, n_rows + 8, (batch, width)).astype(np.int32)
    rows[:, 1::7] = rows[:, 0:1]
    valid = np.array([counts[(b * 7 + heads) % len(counts)] for b in range(batch)], np.int32)
    if batch >= len(counts):
        valid[: len(counts)] = counts
    return jnp.asarray(q), jnp.asarray(kv), jnp.asarray(rows), jnp.asarray(valid)


def _decode(implementation, **scales):
    def fn(q, kv, rows, valid):
        return jax_sparse_mla.decode(
            q,
            kv,
            rows,
            valid,
            softmax_scale=SOFTMAX_SCALE,
            implementation=implementation,
            **scales,
        )

    return jax.jit(fn)


def _kernel_or_skip():
    try:
        return kernel_compile.get_kernel(KernelConfig())
    except KernelUnavailableError as err:
        pytest.skip(f"no cubin: {err}")


@pytest.fixture(scope="module", autouse=True)
def _hopper_and_handler():
    if jax.devices()[0].platform != "gpu" or jax.devices()[0].compute_capability != "9.0":
        pytest.skip("needs a Hopper GPU")
    cuda_lowering.register_ffi_target()


def test_probe_cubin_through_handler(tmp_path, monkeypatch):
    """The handler launches any cubin with the ABI correctly (pointers, n_rows, grid, ...)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is needed to build the probe cubin")
    batch, heads, width, n_rows, smem, row_bytes = 5, 40, 64, 300, 200 * 1024, 640
    source = tmp_path / "probe.cu"
    source.write_text(PROBE_SOURCE)
    cubin = tmp_path / "probe.cubin"
    subprocess.run(
        [nvcc, "-cubin", "-gencode=arch=compute_90a,code=sm_90a", f"-DSMEM={smem}", "-o",
         str(cubin), str(source)],
        check=True,
    )  # fmt: skip

    # A config of one 16-head tile per cluster of split CTAs, the probe's geometry (the
    # dispatch's pick at this shape pairs two tiles, cluster 2 x split, since K <= 64 went
    # to split 2 in session 26).
    forced = KernelConfig("cluster-mma", 8)

    def probe_kernel(config):
        assert config == forced, config
        meta = {
            "kernel_name": "probe",
            "head_tile": config.head_tile,
            "block": list(config.block),
            "cluster": list(config.cluster),
            "smem_bytes": smem,
            "params": list(PARAMS),
        }
        return kernel_compile.CompiledKernel(cubin.read_bytes(), meta)

    monkeypatch.setattr(kernel_compile, "get_kernel", probe_kernel)
    jax.clear_caches()
    q, kv, rows, valid = _inputs(
        0, batch, heads, width, n_rows, counts=(0, 1, 33, 64, 99), row_bytes=row_bytes
    )
    latent, lse = _decode("cute", kv_scale=0.5, kernel_config=forced)(q, kv, rows, valid)
    jax.clear_caches()

    q8, kv8 = np.asarray(q).view(np.uint8), np.asarray(kv).view(np.uint8)
    cluster = forced.split  # the probe adds its cluster size
    want_latent = (q8[..., :512] % 64) * 0.5 + cluster
    np.testing.assert_array_equal(np.asarray(latent, np.float32), want_latent)
    rows_np, valid_np = np.asarray(rows), np.asarray(valid)
    want_lse = np.zeros((batch, heads), np.float32)
    for b in range(batch):
        for row in rows_np[b, : min(max(valid_np[b], 0), width)]:
            if 0 <= row < n_rows:
                want_lse[b] += kv8[row, 600 : 600 + heads].astype(np.float32) + 1
    np.testing.assert_array_equal(np.asarray(lse), want_lse)


@pytest.mark.parametrize("heads", [16, 64, 96, 128])
@pytest.mark.parametrize("batch", [1, 5, 64])
def test_kernel_matches_reference(batch, heads):
    width, n_rows = 2048, 3000
    _kernel_or_skip()
    args = _inputs(batch * 1000 + heads, batch, heads, width, n_rows)
    scales = {"q_scale": 0.75, "kv_scale": 1.5}
    text = _decode("cute", **scales).trace(*args).lower().as_text()
    assert cuda_lowering.FFI_TARGET in text
    _assert_matches_reference(args, scales, _decode("cute", **scales)(*args))


def test_valid_hint_changes_the_config_not_the_results():
    """B=5, H=128, K=2048: wgmma split 8 by K alone, cluster-mma split 2 with a hint of 256
    valid keys per row; both against the reference, whatever the actual counts."""
    _kernel_or_skip()
    args = _inputs(7, 5, 128, 2048, 3000)
    scales = {"q_scale": 0.75, "kv_scale": 1.5}
    clusters = set()
    for hint in (None, 256):
        options = dict(scales, valid_hint=hint)
        text = _decode("cute", **options).trace(*args).lower().as_text()
        clusters.add(re.search(r"cluster = dense<\[([\d, ]+)\]>", text).group(1))
        _assert_matches_reference(args, scales, _decode("cute", **options)(*args))
    assert len(clusters) == 2, clusters


def _assert_matches_reference(args, scales, result):
    latent, lse = result
    width = args[2].shape[1]
    want_latent, want_lse = _decode("reference", **scales)(*args)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-4, atol=2e-3)
    got, want = np.asarray(latent, np.float32), np.asarray(want_latent, np.float32)
    # P is rounded to F16 in both (at other anchors): where the two round a P differently it
    # moves by at most one ulp (2**-10 of itself), so the output moves by at most
    # 2**-10 * max|V| * kv_scale, plus 2**-11 of that for the kernel's F16 partials (split >
    # 1), and one BF16 ulp (<= 2**-7 relative) where the two outputs round to neighbours.
    # Nearly all elements must agree much more tightly.
    v_max = float(np.max(np.abs(np.asarray(args[1], np.float32)[:, :512])))
    bound = 2.0**-9 * v_max * scales["kv_scale"] + 2.0**-7 * np.abs(want)
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want)))
    close = np.isclose(got, want, rtol=2e-2, atol=3e-2)
    assert close.mean() >= 0.99, f"{close.mean()=}"
    empty = np.clip(np.asarray(args[3]), 0, width) == 0
    assert np.all(np.asarray(lse)[empty] == -np.inf)
    assert np.all(np.asarray(latent, np.float32)[empty] == 0)


@pytest.fixture
def shipped_only(monkeypatch, tmp_path):
    """The shipped cubins are the only source: empty disk cache, DSL unimportable."""
    assert kernel_compile.shipped_dir() is not None, "the installed package ships no cubins"
    monkeypatch.setitem(sys.modules, "cutlass", None)
    monkeypatch.setattr(kernel_compile, "dsl_version", lambda: None)
    monkeypatch.setattr(kernel_compile, "_MEMORY", {})
    monkeypatch.setenv("JAX_SPARSE_MLA_CACHE_DIR", str(tmp_path / "empty"))
    jax.clear_caches()
    yield
    assert not list(tmp_path.glob("empty/*")), "nothing is compiled or cached"
    jax.clear_caches()


# (batch, heads, width, cache rows, row bytes W): shapes no cubin was ever compiled for.
ODD_SHAPES = [(7, 40, 333, 50_000, 640), (1, 1, 1, 10, 576), (300, 20, 70, 4000, 592),
              (3, 112, 2048, 9000, 640)]  # fmt: skip


@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: "b{}-h{}-k{}-n{}-w{}".format(*s))
def test_shipped_cubin_runs_odd_shapes(shipped_only, shape):
    batch, heads, width, n_rows, row_bytes = shape
    q, kv, rows, valid = _inputs(sum(shape), batch, heads, width, n_rows, row_bytes=row_bytes)
    kv = kv.at[:, 576:].set(jnp.nan)  # padding bytes: NaN, never read
    scales = {"q_scale": 0.75, "kv_scale": 1.5}
    fn = _decode("cute", **scales)
    assert cuda_lowering.FFI_TARGET in fn.trace(q, kv, rows, valid).lower().as_text()
    latent, lse = fn(q, kv, rows, valid)
    want, want_lse, bound = truth_decode(
        q, np.asarray(kv)[:, :576], rows, valid, softmax_scale=SOFTMAX_SCALE, **scales
    )
    got = np.asarray(latent, np.float64)
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) - bound))
    empty = np.isneginf(want_lse)
    lse = np.asarray(lse, np.float64)
    assert np.array_equal(np.isneginf(lse), empty) and np.all(got[empty] == 0)
    assert np.all(np.abs(lse[~empty] - want_lse[~empty]) <= lse_tolerance(want_lse[~empty]))


def test_exported_executable_runs():
    args = _inputs(7, 5, 96, 2048, 5000)
    _kernel_or_skip()
    jitted = _decode("cute")
    exported = jax.export.export(jitted, disabled_checks=cuda_lowering.export_disabled_checks())(
        *args
    )
    assert cuda_lowering.FFI_TARGET in exported.mlir_module()
    restored = jax.export.deserialize(exported.serialize())
    for got, want in zip(restored.call(*args), jitted(*args), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


LOOP_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import jax, jax.numpy as jnp, numpy as np
    # The package the test process imported (an installed wheel or the checkout), then the
    # checkout for the test module.
    sys.path[:0] = [sys.argv[2], sys.argv[1]]
    import jax_sparse_mla
    assert jax_sparse_mla.__file__ == sys.argv[3], (jax_sparse_mla.__file__, sys.argv[3])
    from tests.gpu.test_ffi_gpu import _decode, _inputs
    from jax_sparse_mla import cuda_lowering

    steps = 64
    q, kv, rows, valid = _inputs(3, 5, 96, 2048, 131072, counts=(256,))
    qs = jnp.stack([jnp.roll(q, t, axis=1) for t in range(steps)])
    single = _decode("cute")
    want = [jax.device_get(single(qs[t], kv, rows, valid)) for t in range(steps)]

    def scan_fn(qs, kv, rows, valid):
        return jax.lax.scan(lambda c, qt: (c, single(qt, kv, rows, valid)), 0, qs)[1]

    scan = jax.jit(scan_fn)
    hlo = scan.lower(qs, kv, rows, valid).compile().as_text()
    latent, lse = jax.device_get(scan(qs, kv, rows, valid))
    identical = all(
        np.array_equal(latent[t].view(np.uint16), want[t][0].view(np.uint16))
        and np.array_equal(lse[t], want[t][1]) for t in range(steps))

    def timed(impl, n):
        fn = _decode(impl)
        def body(i, acc):
            v = jnp.minimum(valid, 2048 - i % 2)  # loop-variant: not hoisted
            return acc + fn(q, kv, rows, v)[1][0, 0]
        run = jax.jit(lambda: jax.lax.fori_loop(0, n, body, jnp.float32(0)))
        run().block_until_ready()
        times = []
        for _ in range(5):
            t0 = time.perf_counter(); run().block_until_ready()
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    per_call = {}
    for impl in ("cute", "reference"):
        short, long = timed(impl, 10), timed(impl, 2010)
        per_call[impl] = (long - short) / 2000 * 1e6
    print(json.dumps({"identical": bool(identical),
                      "custom_call_in_hlo": cuda_lowering.FFI_TARGET in hlo,
                      "us_per_call_in_fori_loop": per_call}))
    """
)


def test_loops_with_command_buffers_are_identical():
    """A jitted scan of many calls (command buffers on) matches single calls bit for bit.

    Also prints the time per call inside a jitted fori_loop (kernel and reference). Whether
    XLA captured the loop into a CUDA graph is not asserted: recent XLA converts thunks to
    command buffers after HLO, so the compiled HLO text does not show it.
    """
    _kernel_or_skip()
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "")
        + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    package_parent = os.path.dirname(os.path.dirname(jax_sparse_mla.__file__))
    done = subprocess.run(
        [sys.executable, "-c", LOOP_SCRIPT, root, package_parent, jax_sparse_mla.__file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print("loop result:", result)
    assert result["identical"]
    assert result["custom_call_in_hlo"]
