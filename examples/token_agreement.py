"""Do two top-k selections of the DSA indexer agree, up to FP32 rounding at the boundary?

``jax_sparse_mla.index_topk`` scores every visible token in FP32: score[n] = k_scale[n] *
sum_h w[h] * relu(q[h] . k[n]) over FP8 q and k. Two correct implementations (the kernel, the
jnp reference) sum in different orders, so their scores differ by FP32 rounding; where two
tokens' scores at the selection boundary lie closer than that, either may be the k-th.
Everywhere else they must pick the same tokens. To tell the two apart, the scores of a row are
recomputed in float64 with a worst-case bound on each score's FP32 rounding error, and every
token that one selection holds and the other does not must lie within the bounds of the row's
k-th score. Used by examples/kimi_decode_step.py and benchmarks/bench_index_topk.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

UNIT_ROUNDOFF = 2.0**-24  # float32
# The kernel's FP8 warpgroup MMA adds each 32-product step with reduced precision: its scores
# are within this fraction of the magnitude of the exact ones (measured on an H200: at most
# 1.5e-5, median 1.3e-6; tests/gpu/test_index_topk_gpu.py holds it to this bound).
FP8_MMA_ERROR = 2.0**-14
RowScores = tuple[np.ndarray, np.ndarray]  # float64 scores [L], their FP32 error bounds [L]


def row_scores(q: np.ndarray, weights: np.ndarray, keys: np.ndarray, scales: np.ndarray):
    """float64 scores [L] of one verify row over its L visible keys, and a bound on how far an
    FP32 evaluation of each (any summation order) can be from it.

    q [H, D] and keys [L, D] hold FP8 values (any dtype that holds them exactly), weights [H]
    and scales [L] float32. The products of two E4M3 values are exact in FP32; the D-term dot
    products, the H-term head sum and the two scalings each round, which a first-order bound
    puts at (D + H + 2) * u times the score's magnitude k_scale * sum_h |w_h| sum_d |q_hd k_nd|;
    the kernel's FP8 MMA adds FP8_MMA_ERROR of the magnitude.
    """
    q, keys = np.asarray(q, np.float64), np.asarray(keys, np.float64)
    weights, scales = np.asarray(weights, np.float64), np.asarray(scales, np.float64)
    scores = scales * (weights @ np.maximum(q @ keys.T, 0.0))
    magnitude = scales * (np.abs(weights) @ (np.abs(q) @ np.abs(keys).T))
    terms = q.shape[1] + q.shape[0] + 2
    return scores, (terms * UNIT_ROUNDOFF + FP8_MMA_ERROR) * magnitude


def exact_selection(scores: np.ndarray, top_k: int) -> np.ndarray:
    """index_topk's selection on exact scores [L]: the top_k highest (ties to the smaller
    position) in ascending position order, then -1, as int32 [top_k]."""
    order = np.lexsort((np.arange(scores.size), -scores))[:top_k]
    tokens = np.full(top_k, -1, np.int32)
    tokens[: order.size] = np.sort(order)
    return tokens


@dataclasses.dataclass(frozen=True)
class Agreement:
    """How selection `got` compares with selection `want`, over all rows."""

    rows: int
    rows_differing: int
    differing: int  # tokens in one selection only (both directions), summed over rows
    unexplained: int  # of those: farther from the row's k-th score than FP32 rounding allows
    worst_ratio: float  # max |score - k-th score| / tolerance over differing tokens (0: none)
    malformed_rows: int  # rows of `got` not ascending unique in-range positions, then -1
    count_mismatch_rows: int  # rows whose selections hold different numbers of tokens

    @property
    def agrees(self) -> bool:
        return not (self.unexplained or self.malformed_rows or self.count_mismatch_rows)

    def summary(self) -> str:
        text = f"{self.differing} differing tokens in {self.rows_differing}/{self.rows} rows"
        if self.differing:
            text += (
                f", {self.unexplained} of them beyond FP32 rounding of the row's k-th score "
                f"(worst |score - k-th| / bound {self.worst_ratio:.3g})"
            )
        if self.malformed_rows or self.count_mismatch_rows:
            text += (
                f"; {self.malformed_rows} malformed rows, {self.count_mismatch_rows} rows with "
                f"a different token count"
            )
        return text


def well_formed(tokens: np.ndarray, visible: int) -> bool:
    """Ascending unique positions in [0, visible), then only -1."""
    count = int(np.sum(tokens >= 0))
    head, tail = tokens[:count], tokens[count:]
    return bool(
        np.all(tail == -1)
        and np.all(np.diff(head) > 0)
        and (count == 0 or (head[0] >= 0 and head[-1] < visible))
    )


def compare(
    got: np.ndarray, want: np.ndarray, scores_of_row: Callable[[int], RowScores]
) -> Agreement:
    """Compares two selections [R, top_k] (ascending positions, then -1) row by row;
    scores_of_row(r) gives row r's ``row_scores`` over its visible positions, and is called
    only for rows whose selections differ or look malformed."""
    got, want = np.asarray(got).reshape(-1, got.shape[-1]), np.asarray(want)
    want = want.reshape(got.shape)
    top_k = got.shape[-1]
    rows_differing = differing = unexplained = malformed = count_mismatch = 0
    worst = 0.0
    for r in range(got.shape[0]):
        if np.array_equal(got[r], want[r]):
            continue
        mine, theirs = got[r][got[r] >= 0], want[r][want[r] >= 0]
        scores, bounds = scores_of_row(r)
        if not well_formed(got[r], scores.size):
            malformed += 1
        if mine.size != theirs.size:
            count_mismatch += 1
        delta = np.setxor1d(mine, theirs)
        if delta.size == 0:
            continue
        rows_differing += 1
        differing += delta.size
        kept = min(top_k, scores.size)
        if kept == scores.size:  # every visible token belongs to the selection: no boundary
            unexplained += delta.size
            worst = np.inf
            continue
        kth = np.lexsort((np.arange(scores.size), -scores))[kept - 1]
        in_range = delta[(delta >= 0) & (delta < scores.size)]
        unexplained += delta.size - in_range.size
        tolerance = bounds[in_range] + bounds[kth]
        distance = np.abs(scores[in_range] - scores[kth])
        beyond = distance > tolerance
        unexplained += int(np.sum(beyond))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(distance == 0, 0.0, distance / tolerance)
        worst = max(worst, float(np.max(ratio, initial=0.0)))
        if in_range.size < delta.size:
            worst = np.inf
    return Agreement(
        got.shape[0], rows_differing, differing, unexplained, worst, malformed, count_mismatch
    )
