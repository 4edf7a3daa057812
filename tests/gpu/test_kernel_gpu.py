"""The sparse decode cubin on a GPU vs the float64 truth (tests/truth.py).

One cubin per config (shipped in the installed package, cached, or compiled by
nvidia-cutlass-dsl) serves every shape: B, padded H, K, the cache size and its row pitch W
arrive at run time. Every config (cluster-mma and wgmma at split 1, 2, 4, 8) runs every shape.

    python -m pytest -s -m gpu tests/gpu/test_kernel_gpu.py

Counts cover 0, 1, 31, 32, 33, 63, 64, 65, CHUNK - 1, CHUNK, CHUNK + 1, 256, K, negative and
above K; rows hold duplicates, out-of-range indices (skipped), and past each count garbage:
in-range rows (wrong if read) and a NaN cache row (poisons the output if read).
"""

from __future__ import annotations

import math
import pathlib
import sys

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/truth.py

from truth import lse_tolerance, make_inputs, truth_decode

from jax_sparse_mla.kernel import KernelConfig, get_kernel
from jax_sparse_mla.kernel.config import ALL_CONFIGS, CHUNK

WIDTH = 2048
CACHE_ROWS = 8192
COUNTS = [0, 1, 31, 32, 33, 63, 64, 65, CHUNK - 1, CHUNK, CHUNK + 1, 256, 2048, -7, 5000]
WILD = [-1, -(2**31), CACHE_ROWS, CACHE_ROWS + 12345, 2**31 - 1]
SOFTMAX_SCALE, Q_SCALE, KV_SCALE = 576**-0.5, 0.8, 1.25
# (batch, padded heads, width, cache row bytes W): every H at K = 2048 for B in 1, 5, 64, then
# odd widths, batches and padded rows (rows padded to W with NaN bytes, never read).
SHAPES = [(b, h, WIDTH, 576) for b in (1, 5, 16, 64) for h in (16, 64, 96, 128)] + [
    (1, 16, 256, 576),
    (3, 32, 40, 576),
    (7, 48, 333, 640),
    (5, 112, 2048, 640),
    (2, 16, 1, 592),
    (256, 16, 65, 640),
]

_CONTEXT = None
_KERNELS = {}


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        from cubin_launch import Context

        _CONTEXT = Context()
    return _CONTEXT


def _kernel(config: KernelConfig):
    from cubin_launch import CubinKernel

    if config not in _KERNELS:
        compiled = get_kernel(config)
        _KERNELS[config] = CubinKernel(compiled.cubin, compiled.meta)
    return _KERNELS[config]


def _pad_rows(kv, row_bytes: int):
    """kv [N, 576] padded to [N, row_bytes] with NaN bytes (poison if ever read)."""
    pad = np.full((kv.shape[0], row_bytes - 576), 0x7F, np.uint8).view(kv.dtype)
    return np.concatenate([kv, pad], axis=1)


def make_case(rng, batch, heads, width, counts):
    """Inputs with duplicates, out-of-range rows and garbage (in range and NaN) past counts."""
    q, kv, rows = make_inputs(rng, batch, heads, CACHE_ROWS, width)
    nan_row = CACHE_ROWS - 1
    kv[nan_row] = np.uint8(0x7F).view(ml_dtypes.float8_e4m3fn)  # E4M3 NaN
    rows[rows == nan_row] = 0
    valid = np.asarray(counts, np.int32)
    for b in range(batch):
        live = max(0, min(int(valid[b]), width))
        if live > 8:
            rows[b, 3:live:7] = rows[b, 0]  # duplicates
        if b % 2 == 0 and live > 4:
            rows[b, 2:live:9] = rng.choice(WILD, len(range(2, live, 9)))  # skipped keys
        garbage = rng.choice([0, 1, 2], width - live)
        tail = rows[b, live:]
        tail[garbage == 1] = nan_row
        tail[garbage == 2] = rng.choice(WILD, int((garbage == 2).sum()))
    return q, kv, rows, valid


def run_case(shape, counts, seed: int, config: KernelConfig):
    """Kernel vs truth for one launch; returns (max |err|, max |err| / bound, max LSE err)."""
    from cubin_launch import run_decode

    batch, heads, width, row_bytes = shape
    rng = np.random.default_rng(seed)
    q, kv, rows, valid = make_case(rng, batch, heads, width, counts)
    scale_log2 = SOFTMAX_SCALE * Q_SCALE * KV_SCALE * math.log2(math.e)
    scales = np.array([scale_log2, KV_SCALE], np.float32)
    cache = _pad_rows(kv, row_bytes)
    bits, lse = run_decode(_context(), _kernel(config), q, cache, rows, valid, scales)
    latent = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    want, want_lse, bound = truth_decode(
        q, kv, rows, valid, softmax_scale=SOFTMAX_SCALE, q_scale=Q_SCALE, kv_scale=KV_SCALE
    )
    assert np.isfinite(latent).all(), "NaN/Inf (unwritten or poisoned) latent"
    err = np.abs(latent - want)
    assert (err <= bound).all(), f"latent error {err.max():.3g} above bound at {err.argmax()}"
    empty = np.isneginf(want_lse)
    assert (latent[empty] == 0).all()
    assert np.array_equal(np.isneginf(lse), empty), "LSE -inf exactly for empty rows"
    lse_err = np.abs(np.where(empty, 0.0, lse) - np.where(empty, 0.0, want_lse))
    assert (lse_err <= lse_tolerance(want_lse)).all(), f"LSE error {lse_err.max():.3g}"
    return float(err.max()), float((err / bound).max()), float(lse_err.max())


def _launches(batch: int):
    """Count vectors so that every count of COUNTS appears at least once."""
    per = -(-len(COUNTS) // batch)
    return [[COUNTS[(i * batch + b) % len(COUNTS)] for b in range(batch)] for i in range(per)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda c: c.slug)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-h{}-k{}-w{}".format(*s))
def test_kernel_matches_truth(shape, config):
    worst = (0.0, 0.0, 0.0)
    for i, counts in enumerate(_launches(shape[0])):
        result = run_case(shape, counts, seed=sum(shape) % 1000 + i, config=config)
        worst = tuple(max(a, b) for a, b in zip(worst, result, strict=True))
    print(
        "\n{} b{}-h{}-k{}-w{}".format(config.slug, *shape)
        + f": max|err| {worst[0]:.3e}  max err/bound {worst[1]:.3f}  max|lse err| {worst[2]:.3e}"
    )
