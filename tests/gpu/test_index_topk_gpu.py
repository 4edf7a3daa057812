"""The indexer's kernels (scores on FP8 wgmma + radix top-k) on a GPU vs a float64 oracle.

    python -m pytest -s -m gpu tests/gpu/test_index_topk_gpu.py

Two kinds of check:
- Exact: inputs whose scores every implementation computes without rounding (small-integer
  FP8 values, power-of-two weights and scales, so every product and sum is exact in FP32 and
  in the wgmma's reduced-precision accumulation): the kernel's tokens equal the reference's
  bit for bit, ties (many, by construction) included.
- Random inputs: FP8 wgmma adds each k32 step's products with reduced precision, so the
  kernel's scores differ from the float64 truth by at most TOLERANCE of the magnitude
  sum_h |w_h| sum_d |q_hd k_nd| |scale|. The kernel's selection must be a top-k under such
  scores: every selected token's true score at least the k-th largest minus twice the bound,
  every unselected candidate's at most the k-th plus twice the bound; its returned scores
  within the bound of the truth.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_sparse_mla
from jax_sparse_mla import index_lowering, index_validation
from jax_sparse_mla.kernel.index.config import TOPK_CLUSTERS

pytestmark = pytest.mark.gpu

FP8 = ml_dtypes.float8_e4m3fn
TOLERANCE = 2.0**-14  # of the magnitude; measured on the H200: max 1.5e-5, median 1.3e-6


def _inputs(rng, batch, steps, heads, capacity, *, paged, block_size=64, integer=False):
    """q [B, T, Hi, 128], weights, the cache (flat or paged with shuffled tables and a few
    out-of-range entries) as numpy arrays, and the lengths."""
    if integer:
        q = rng.integers(-2, 3, (batch, steps, heads, 128)).astype(FP8)
        weights = (2.0 ** rng.integers(-3, 3, (batch, steps, heads))).astype(np.float32)
        weights *= rng.choice([-1.0, 1.0], weights.shape).astype(np.float32)
    else:
        q = rng.standard_normal((batch, steps, heads, 128)).astype(FP8)
        weights = rng.standard_normal((batch, steps, heads)).astype(np.float32)
    if not paged:
        keys_shape, scales_shape, table = (capacity, 128), (capacity,), None
    else:
        max_blocks = -(-capacity // block_size)
        num_blocks = batch * max_blocks + 3
        table = np.stack([rng.permutation(num_blocks)[:max_blocks] for _ in range(batch)])
        table = table.astype(np.int32)
        table[0, -1] = num_blocks + 7  # never read: those tokens are no candidates
        keys_shape, scales_shape = (num_blocks, block_size, 128), (num_blocks, block_size)
    if integer:
        keys = rng.integers(-2, 3, keys_shape).astype(FP8)
        scales = (2.0 ** rng.integers(-2, 2, scales_shape)).astype(np.float32)
    else:
        keys = rng.standard_normal(keys_shape).astype(FP8)
        scales = rng.uniform(0.5, 2.0, scales_shape).astype(np.float32)
    return q, weights, keys, scales, table


def _truth(q, weights, keys, scales, table, lengths):
    """float64 scores [B, T, C], the magnitude bound's base [B, T, C], candidates [B, T, C]."""
    batch, steps = q.shape[:2]
    if table is None:
        flat_keys = np.broadcast_to(keys.astype(np.float64), (batch, *keys.shape))
        flat_scales = np.broadcast_to(scales.astype(np.float64), (batch, *scales.shape))
        in_cache = np.ones(flat_scales.shape, bool)
    else:
        inside = (table >= 0) & (table < keys.shape[0])
        safe = np.where(inside, table, 0)
        flat_keys = keys.astype(np.float64)[safe].reshape(batch, -1, 128)
        flat_scales = scales.astype(np.float64)[safe].reshape(batch, -1)
        in_cache = np.repeat(inside, keys.shape[1], axis=1)
    q64 = q.astype(np.float64)
    dots = np.einsum("bthd,bnd->bthn", q64, flat_keys)
    size = np.einsum("bthd,bnd->bthn", np.abs(q64), np.abs(flat_keys))
    w = weights.astype(np.float64)[..., None]
    scores = np.sum(w * np.maximum(dots, 0.0), axis=2) * flat_scales[:, None, :]
    magnitude = np.sum(np.abs(w) * size, axis=2) * np.abs(flat_scales[:, None, :])
    capacity = flat_scales.shape[1]
    ends = np.clip(lengths, 0, capacity)[:, None] - steps + np.arange(steps)[None, :] + 1
    live = (np.arange(capacity)[None, None, :] < np.clip(ends, 0, capacity)[..., None]) & in_cache[
        :, None, :
    ]
    return scores, magnitude, live


def _run(q, weights, keys, scales, table, lengths, top_k, implementation):
    args = [jnp.asarray(x) for x in (q, weights, keys, scales, lengths)]
    table = None if table is None else jnp.asarray(table)
    fn = jax.jit(
        lambda *a: jax_sparse_mla.index_topk(
            *a, top_k=top_k, block_table=table, implementation=implementation
        )
    )
    return np.asarray(fn(*args))


def _check_selection(tokens, scores, magnitude, live, top_k):
    for b in range(tokens.shape[0]):
        for t in range(tokens.shape[1]):
            row = tokens[b, t]
            candidates = np.flatnonzero(live[b, t])
            taken = row[row >= 0]
            expected = min(top_k, candidates.size)
            assert taken.size == expected, (b, t, taken.size, expected)
            assert np.all(row[expected:] == -1) and np.all(np.diff(taken) > 0), (b, t)
            assert np.all(live[b, t, taken]), (b, t, "took a non-candidate")
            if expected == 0 or expected == candidates.size:
                continue
            truth = scores[b, t, candidates]
            kth = np.sort(truth)[::-1][expected - 1]
            slack = 2 * TOLERANCE * magnitude[b, t, candidates].max()
            assert scores[b, t, taken].min() >= kth - slack, (b, t)
            rest = np.setdiff1d(candidates, taken)
            assert scores[b, t, rest].max() <= kth + slack, (b, t)


EXACT_CASES = [
    # (B, T, Hi, capacity, top_k, paged, lengths)
    (1, 1, 64, 4096, 2048, False, [4096]),
    (2, 5, 64, 3000, 512, False, [3000, 700]),
    (3, 1, 1, 2000, 100, False, [0, 1, 2000]),
    (2, 2, 65, 1000, 600, True, [600, 1000]),
    (1, 5, 128, 5000, 2048, True, [5000]),
    (4, 1, 64, 9000, 2048, True, [2048, 2049, 2047, 99999]),
    (1, 3, 3, 700, 700, False, [-5]),
]


@pytest.mark.parametrize("case", EXACT_CASES, ids=str)
def test_exact_inputs_equal_the_reference(case):
    batch, steps, heads, capacity, top_k, paged, lengths = case
    rng = np.random.default_rng(sum(case[:5]))
    q, weights, keys, scales, table = _inputs(
        rng, batch, steps, heads, capacity, paged=paged, integer=True
    )
    lengths = np.asarray(lengths, np.int32)
    kernel = _run(q, weights, keys, scales, table, lengths, top_k, "cute")
    reference = _run(q, weights, keys, scales, table, lengths, top_k, "reference")
    np.testing.assert_array_equal(kernel, reference)


@pytest.mark.parametrize("cluster", TOPK_CLUSTERS)
def test_every_top_k_cluster_size_equals_the_reference(cluster, monkeypatch):
    """Each top-k cubin, whatever the row count would pick: slices of one and of several
    steps of keys, rows shorter and longer than top_k, ties across the slices."""
    monkeypatch.setattr(index_lowering, "topk_cluster", lambda rows, capacity, sm_count: cluster)
    for batch, steps, capacity, top_k, lengths in (
        (2, 2, 40000, 2048, [40000, 17000]),
        (3, 1, 3000, 512, [3000, 400, 1]),
    ):
        rng = np.random.default_rng(capacity + cluster)
        q, weights, keys, scales, table = _inputs(
            rng, batch, steps, 64, capacity, paged=True, integer=True
        )
        lengths = np.asarray(lengths, np.int32)
        kernel = _run(q, weights, keys, scales, table, lengths, top_k, "cute")
        reference = _run(q, weights, keys, scales, table, lengths, top_k, "reference")
        np.testing.assert_array_equal(kernel, reference)


@pytest.mark.parametrize("block_size", [16, 48, 128])
def test_block_sizes_equal_the_reference(block_size):
    """Blocks of part of a key tile, of a tile and a half (rows of a tile in two blocks),
    of two whole tiles (the scores kernel's one-entry-per-tile path)."""
    rng = np.random.default_rng(block_size)
    q, weights, keys, scales, table = _inputs(
        rng, 2, 3, 64, 5000, paged=True, block_size=block_size, integer=True
    )
    lengths = np.asarray([5000, 2100], np.int32)
    kernel = _run(q, weights, keys, scales, table, lengths, 1024, "cute")
    reference = _run(q, weights, keys, scales, table, lengths, 1024, "reference")
    np.testing.assert_array_equal(kernel, reference)


def test_all_zero_scores_tie_to_the_smallest_positions():
    rng = np.random.default_rng(7)
    q, weights, keys, scales, _ = _inputs(rng, 1, 2, 64, 10000, paged=False)
    q = -np.abs(q.astype(np.float32)).astype(FP8)  # every dot product <= 0 with keys >= 0
    keys = np.abs(keys.astype(np.float32)).astype(FP8)
    lengths = np.asarray([10000], np.int32)
    kernel = _run(q, weights, keys, scales, None, lengths, 2048, "cute")
    np.testing.assert_array_equal(kernel[0, 0], np.arange(2048))
    np.testing.assert_array_equal(kernel[0, 1], np.arange(2048))


RANDOM_CASES = [
    (1, 5, 64, 32768, 2048, False),
    (1, 1, 64, 131072, 2048, True),
    (64, 1, 64, 4096, 2048, True),
    (8, 1, 64, 65536, 2048, True),
    (2, 5, 100, 9000, 1000, True),
]


@pytest.mark.parametrize("case", RANDOM_CASES, ids=str)
def test_random_inputs_select_a_top_k(case):
    batch, steps, heads, capacity, top_k, paged = case
    rng = np.random.default_rng(capacity + batch)
    q, weights, keys, scales, table = _inputs(rng, batch, steps, heads, capacity, paged=paged)
    lengths = rng.integers(capacity // 2, capacity + 1, batch).astype(np.int32)
    lengths[0] = capacity
    tokens = _run(q, weights, keys, scales, table, lengths, top_k, "cute")
    truth, magnitude, live = _truth(q, weights, keys, scales, table, lengths)
    _check_selection(tokens, truth, magnitude, live, top_k)


def test_returned_scores_and_repeatability():
    """The primitive's second result (the selected tokens' scores, used by the DCP merge)
    within the bound of the truth; repeated calls bit-identical."""
    from jax_sparse_mla.index_primitive import index_topk_p

    rng = np.random.default_rng(3)
    q, weights, keys, scales, table = _inputs(rng, 2, 5, 64, 20000, paged=True)
    lengths = np.asarray([20000, 15000], np.int32)
    _, operands = index_validation.index_operands(
        jnp.asarray(q), jnp.asarray(weights), jnp.asarray(keys), jnp.asarray(scales),
        jnp.asarray(lengths), jnp.asarray(table), head_tile=64,
    )  # fmt: skip
    fn = jax.jit(lambda *a: index_topk_p.bind(*a, top_k=2048, dcp_size=1, require_kernel=True))
    tokens, scores = (np.asarray(x) for x in fn(*operands))
    truth, magnitude, _ = _truth(q, weights, keys, scales, table, lengths)
    b, t, k = np.nonzero(tokens >= 0)
    picked = tokens[b, t, k]
    error = np.abs(scores[b, t, k] - truth[b, t, picked]) / magnitude[b, t, picked]
    print(f"score error / magnitude: max {error.max():.3g}, median {np.median(error):.3g}")
    assert np.all(error <= TOLERANCE)
    assert np.all(np.isneginf(scores[tokens < 0]))
    for _ in range(20):
        again_tokens, again_scores = (np.asarray(x) for x in fn(*operands))
        np.testing.assert_array_equal(again_tokens, tokens)
        np.testing.assert_array_equal(again_scores, scores)


def test_soak_is_bit_identical():
    """100,000 calls in one jitted loop, cycling 16 length patterns (0, 1, below, at and
    above top_k, the capacity, above it): every call's tokens equal the first call's for
    its pattern, bit for bit; the first calls are a top-k of the truth."""
    batch, steps, capacity, top_k, calls = 2, 5, 32768, 2048, 100_000
    rng = np.random.default_rng(12)
    q, weights, keys, scales, table = _inputs(rng, batch, steps, 64, capacity, paged=True)
    patterns = rng.integers(-2, capacity + 3, (16, batch)).astype(np.int32)
    patterns[:4] = [[capacity, 0], [1, top_k + steps - 1], [top_k - 1, top_k], [9999, 99999]]
    operands = [jnp.asarray(x) for x in (q, weights, keys, scales, table)]

    def select(q, weights, keys, scales, table, lengths):
        return jax_sparse_mla.index_topk(
            q, weights, keys, scales, lengths, top_k=top_k, block_table=table,
            implementation="cute",
        )  # fmt: skip

    once = jax.jit(select)
    first = jnp.stack([once(*operands, jnp.asarray(lengths)) for lengths in patterns])

    @jax.jit
    def soak(operands, patterns, first):
        def body(i, mismatches):
            k = i % patterns.shape[0]
            same = jnp.all(select(*operands, patterns[k]) == first[k])
            return mismatches + (~same).astype(jnp.int32)

        return jax.lax.fori_loop(0, calls, body, jnp.int32(0))

    assert int(soak(operands, jnp.asarray(patterns), first)) == 0
    for k in range(4):
        truth, magnitude, live = _truth(q, weights, keys, scales, table, patterns[k])
        _check_selection(np.asarray(first[k]), truth, magnitude, live, top_k)


def test_dcp_selection_equals_the_single_device_kernel():
    """dcp_index_topk's math on one GPU: the kernel on each of D token shards (the global
    lengths, the shard's rank: its limits computed in-kernel), the candidates merged, equals
    the kernel over the whole cache bit for bit (each token's score is computed the same way
    wherever its tile lies)."""
    from jax_sparse_mla.dcp_indexer import merge_candidates
    from jax_sparse_mla.index_primitive import index_topk_p

    dcp, batch, steps, capacity, top_k = 4, 2, 5, 16384, 2048
    rng = np.random.default_rng(11)
    q, weights, keys, scales, _ = _inputs(rng, batch, steps, 64, capacity, paged=False)
    lengths = np.asarray([capacity, 9999], np.int32)
    whole = _run(q, weights, keys, scales, None, lengths, top_k, "cute")
    scores, positions = [], []
    for rank in range(dcp):
        _, operands = index_validation.index_operands(
            jnp.asarray(q), jnp.asarray(weights), jnp.asarray(keys[rank::dcp]),
            jnp.asarray(scales[rank::dcp]), jnp.asarray(lengths), None, head_tile=64,
        )  # fmt: skip
        tokens, local_scores = index_topk_p.bind(
            *operands[:6],
            jnp.full((1,), rank, jnp.int32),
            top_k=top_k,
            dcp_size=dcp,
            require_kernel=True,
        )
        scores.append(local_scores)
        positions.append(jnp.where(tokens >= 0, tokens * dcp + rank, -1))
    merged = merge_candidates(jnp.concatenate(scores, -1), jnp.concatenate(positions, -1), top_k)
    np.testing.assert_array_equal(np.asarray(merged), whole)
