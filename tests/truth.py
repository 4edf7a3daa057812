"""Float64 numpy ground truth for sparse decode, independent of the package's code."""

from __future__ import annotations

import ml_dtypes
import numpy as np

LATENT = 512


def make_inputs(rng, batch, heads, cache_rows, width, *, scale=1.0):
    """Random FP8 q [B, H, 576] and kv [N, 576] (numpy, float8_e4m3fn), rows [B, K] int32."""
    fp8 = ml_dtypes.float8_e4m3fn
    q = (rng.standard_normal((batch, heads, 576)) * scale).astype(fp8)
    kv = (rng.standard_normal((cache_rows, 576)) * scale).astype(fp8)
    rows = rng.integers(0, cache_rows, (batch, width)).astype(np.int32)
    return q, kv, rows


def live_rows(rows, valid, b: int, cache_rows: int) -> list[int]:
    """Row b's keys that a decode reads: the first valid[b] (clamped to [0, K]) slots whose
    row is inside [0, cache_rows), duplicates kept."""
    slots = rows[b, : max(0, min(int(valid[b]), rows.shape[1]))]
    return [int(r) for r in slots if 0 <= r < cache_rows]


def truth_decode(q, kv, rows, valid, *, softmax_scale, q_scale=1.0, kv_scale=1.0):
    """Exact softmax attention in float64 over each row's live keys.

    Returns latent [B, H, 512], lse [B, H] (natural log; -inf for empty rows), and an error
    bound [B, H, 512] for an implementation that rounds P to F16 at 448 of any running max not
    above the row max (|dP| <= max(P 2**-11, 2**-25) in those units: half an F16 ulp, or of the
    subnormal spacing), may round its normalised partials to F16 before merging them (another
    2**-11 of sum P |V| / sum P, so dP <= max(P 2**-10, 2**-25) covers both, and half F16's
    subnormal spacing, 2**-25 |kv_scale|, where the partial's cancellation leaves it below
    F16's normal range), and rounds the output to BF16.
    """
    q = np.asarray(q).astype(np.float64)
    kv = np.asarray(kv).astype(np.float64).reshape(-1, 576)
    rows, valid = np.asarray(rows), np.asarray(valid)
    batch, heads, _ = q.shape
    cache_rows = kv.shape[0]
    scale = softmax_scale * q_scale * kv_scale
    latent = np.zeros((batch, heads, LATENT))
    lse = np.full((batch, heads), -np.inf)
    bound = np.zeros((batch, heads, LATENT))
    for b in range(batch):
        live = live_rows(rows, valid, b, cache_rows)
        if not live:
            continue
        keys = kv[live]  # [n, 576]
        logits = q[b] @ keys.T * scale  # [H, n]
        top = logits.max(axis=1, keepdims=True)
        p = np.exp(logits - top) * 448.0  # P in the kernel's units (448 at the max)
        total = p.sum(axis=1, keepdims=True)
        values = keys[:, :LATENT]
        latent[b] = p @ values / total * kv_scale
        lse[b] = top[:, 0] + np.log(total[:, 0] / 448.0)
        dp = np.maximum(p * 2.0**-10, 2.0**-25)
        bound[b] = dp @ np.abs(values) / total * abs(kv_scale)
    bound += 2.0**-8 * np.abs(latent) + 2.0**-25 * abs(kv_scale) + 1e-6 * (np.abs(latent) + 1e-3)
    return latent, lse, bound


def logit_magnitude(q, kv, rows, valid, *, softmax_scale, q_scale=1.0, kv_scale=1.0):
    """[B, H]: the largest scale * sum_i |q_i k_i| over each row's live keys (0 for empty
    rows): the size of the FP32 partial sums of a logit, which cancellation hides from it."""
    q = np.abs(np.asarray(q).astype(np.float64))
    kv = np.abs(np.asarray(kv).astype(np.float64).reshape(-1, 576))
    rows, valid = np.asarray(rows), np.asarray(valid)
    scale = abs(softmax_scale * q_scale * kv_scale)
    magnitude = np.zeros(q.shape[:2])
    for b in range(q.shape[0]):
        live = live_rows(rows, valid, b, kv.shape[0])
        if live:
            magnitude[b] = (q[b] @ kv[live].T).max(axis=1) * scale
    return magnitude


def lse_tolerance(lse, magnitude=0.0):
    """LSE from FP32 sums of unquantized P: a few FP32 ulps of the logits' scale, i.e. of
    |LSE| or, where large terms cancel, of their size (``magnitude``, logit_magnitude's):
    8 ulps (2**-21) of it, the rounding of a few of the 576 FP32 partial sums."""
    finite = np.where(np.isfinite(lse), np.abs(lse), 0.0)
    return 2e-5 + np.maximum(4e-6 * finite, 2.0**-21 * np.asarray(magnitude))
