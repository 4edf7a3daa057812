"""Float64 numpy ground truth for the DSA indexer's top-k, independent of the package's code.

score(b, t, n) = scale[n] * sum_h w[b, t, h] * relu(q[b, t, h] . k[n]) in float64; verify row
t of a request with context L = clamp(length, 0, capacity) scores positions
[0, clamp(L - T + t + 1, 0, capacity)) whose block is in the cache; the top_k by (higher
score, then smaller position; -0.0 == +0.0; NaN below every number), ascending, then -1.

The package computes scores in FP32. ``exact_inputs`` builds inputs whose FP32 scores are
exact (small integers times powers of two), so the selection must match bit for bit; for
other inputs ``score_bounds`` bounds the FP32 error and ``check_near_ties`` allows
differences only among candidates whose true score is that close to the k-th score.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

DIM = 128
FP8 = ml_dtypes.float8_e4m3fn


def exact_inputs(rng, batch, steps, heads, key_shape, *, value_range=2, weight_range=3):
    """q [B, T, H, 128] and keys [*key_shape, 128] of small integers (exact in FP8), integer
    weights [B, T, H] (some negative) and power-of-two scales [*key_shape]: every FP32 dot
    product, head sum and scaled score is an exact small integer times a power of two."""
    q = rng.integers(-value_range, value_range + 1, (batch, steps, heads, DIM))
    keys = rng.integers(-value_range, value_range + 1, (*key_shape, DIM))
    weights = rng.integers(-weight_range, weight_range + 1, (batch, steps, heads))
    scales = 2.0 ** rng.integers(-3, 4, key_shape)
    return (
        q.astype(np.float32).astype(FP8),
        weights.astype(np.float32),
        keys.astype(np.float32).astype(FP8),
        scales.astype(np.float32),
    )


def random_inputs(rng, batch, steps, heads, key_shape):
    """Normal FP8 q and keys, normal weights, positive scales: FP32 scores are rounded."""
    q = rng.standard_normal((batch, steps, heads, DIM)).astype(FP8)
    keys = rng.standard_normal((*key_shape, DIM)).astype(FP8)
    weights = (rng.standard_normal((batch, steps, heads)) / heads).astype(np.float32)
    scales = rng.uniform(0.5, 2.0, key_shape).astype(np.float32)
    return q, weights, keys, scales


def _rows_of(keys, scales, block_table, b, capacity):
    """Request b's (key [capacity, 128], scale [capacity], readable [capacity]) per position."""
    keys = np.asarray(keys).astype(np.float64)
    scales = np.asarray(scales).astype(np.float64)
    if keys.ndim == 2:
        return keys, scales, np.ones(capacity, bool)
    num_blocks, block_size = scales.shape
    row_keys = np.zeros((capacity, DIM))
    row_scales = np.zeros(capacity)
    readable = np.zeros(capacity, bool)
    for n in range(capacity):
        block = int(block_table[b, n // block_size])
        if 0 <= block < num_blocks:
            row_keys[n] = keys[block, n % block_size]
            row_scales[n] = scales[block, n % block_size]
            readable[n] = True
    return row_keys, row_scales, readable


def capacity_of(keys, block_table) -> int:
    keys = np.asarray(keys)
    return keys.shape[0] if keys.ndim == 2 else np.shape(block_table)[1] * keys.shape[1]


def truth_scores(q, weights, keys, scales, lengths, block_table=None):
    """(scores [B, T, C] float64, bounds [B, T, C], candidate [B, T, C] bool).

    ``bounds`` bounds |FP32 score - true score| for FP32 sums of 128 exact products and of
    H head terms (each rounding at most 2^-24 relative of the running sum of magnitudes)."""
    q = np.asarray(q).astype(np.float64)
    weights = np.asarray(weights).astype(np.float64)
    lengths = np.asarray(lengths)
    batch, steps, heads, _ = q.shape
    capacity = capacity_of(keys, block_table)
    scores = np.zeros((batch, steps, capacity))
    bounds = np.zeros((batch, steps, capacity))
    candidate = np.zeros((batch, steps, capacity), bool)
    eps = 2.0**-24
    for b in range(batch):
        row_keys, row_scales, readable = _rows_of(keys, scales, block_table, b, capacity)
        context = min(max(int(lengths[b]), 0), capacity)
        for t in range(steps):
            limit = min(max(context - steps + t + 1, 0), capacity)
            dots = q[b, t] @ row_keys.T  # [H, C]
            with np.errstate(invalid="ignore"):
                scores[b, t] = row_scales * (weights[b, t] @ np.maximum(dots, 0.0))
                magnitude = np.abs(q[b, t]) @ np.abs(row_keys.T)  # [H, C]
                head_terms = np.abs(weights[b, t]) @ magnitude
            bounds[b, t] = row_scales * head_terms * ((DIM + heads + 2) * eps)
            candidate[b, t] = readable & (np.arange(capacity) < limit)
    return scores, bounds, candidate


def _rank_key(score: float, position: int):
    return (1, 0.0, position) if math.isnan(score) else (0, -score, position)


def select(scores, candidate, top_k):
    """The top_k of each row by the tie rule -> tokens [..., top_k] int32 (ascending, -1)."""
    lead = scores.shape[:-1]
    tokens = np.full((*lead, top_k), -1, np.int32)
    for index in np.ndindex(*lead):
        live = np.flatnonzero(candidate[index])
        ranked = sorted(live, key=lambda n: _rank_key(float(scores[index][n]), int(n)))
        chosen = sorted(int(n) for n in ranked[:top_k])
        tokens[index][: len(chosen)] = chosen
    return tokens


def truth_index_topk(q, weights, keys, scales, lengths, top_k, block_table=None):
    """Expected tokens [B, T, top_k] int32."""
    scores, _, candidate = truth_scores(q, weights, keys, scales, lengths, block_table)
    return select(scores, candidate, top_k)


def check_near_ties(got, q, weights, keys, scales, lengths, top_k, block_table=None):
    """Assert ``got`` is a valid top-k (ascending candidates, then -1, as many as expected)
    that differs from the float64 truth only by tokens whose true score lies within the
    FP32 error of the k-th score: |s - s_k| <= bound(s) + bound(s_k)."""
    got = np.asarray(got)
    scores, bounds, candidate = truth_scores(q, weights, keys, scales, lengths, block_table)
    want = select(scores, candidate, top_k)
    differing_rows = 0
    for index in np.ndindex(*got.shape[:-1]):
        row_got, row_want = got[index], want[index]
        count = int(np.sum(row_want >= 0))
        assert np.all(row_got[count:] == -1), (index, row_got)
        chosen = row_got[:count]
        assert np.all(np.diff(chosen) > 0), (index, row_got)
        assert np.all(candidate[index][chosen]), (index, row_got)
        if np.array_equal(row_got, row_want):
            continue
        differing_rows += 1
        kth = min(row_want[:count], key=lambda n: (scores[index][n], -n))
        for n in set(chosen.tolist()) ^ set(row_want[:count].tolist()):
            gap = abs(scores[index][n] - scores[index][kth])
            assert gap <= bounds[index][n] + bounds[index][kth], (index, n, gap)
    return differing_rows
