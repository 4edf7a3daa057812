"""index_topk (public op and reference) against the float64 oracle of index_truth.py, its
argument checks and transformations, and token_rows feeding decode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from index_truth import (
    FP8,
    check_near_ties,
    exact_inputs,
    random_inputs,
    select,
    truth_index_topk,
    truth_scores,
)
from truth import make_inputs

import jax_sparse_mla
from jax_sparse_mla.dcp_indexer import merge_candidates

IMPLEMENTATIONS = [None, "reference"]


def index_topk(*args, implementation=None, **kwargs):
    return np.asarray(jax_sparse_mla.index_topk(*args, implementation=implementation, **kwargs))


def paged_layout(rng, keys, scales, batch, block_size, *, extra_blocks=3, holes=0):
    """A flat cache [N, ...] (N a multiple of block_size) as a paged cache whose blocks are
    shuffled among ``extra_blocks`` unused ones, with a table per request; ``holes`` table
    entries per request point outside the cache (negative or >= num_blocks)."""
    blocks = keys.shape[0] // block_size
    num_blocks = blocks + extra_blocks
    physical = rng.permutation(num_blocks)[:blocks]
    paged_keys = np.zeros((num_blocks, block_size, keys.shape[1]), keys.dtype)
    paged_scales = np.zeros((num_blocks, block_size), np.float32)
    paged_keys[physical] = keys.reshape(blocks, block_size, -1)
    paged_scales[physical] = scales.reshape(blocks, block_size)
    table = np.tile(physical, (batch, 1)).astype(np.int32)
    for b in range(batch):
        for j in rng.choice(blocks, holes, replace=False):
            table[b, j] = rng.choice([-1, -7, num_blocks, num_blocks + 5])
    return paged_keys, paged_scales, table


# ---------------------------------------------------------------------------------------
# Values against the oracle


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("steps", [1, 5])
def test_lengths(implementation, steps):
    """Lengths 0, 1, < top_k, = top_k, > top_k, > capacity and negative, flat cache."""
    top_k, capacity = 16, 40
    rng = np.random.default_rng(steps)
    lengths = np.array([0, 1, 5, top_k, top_k + 7, capacity + 10, -3, 2**31 - 1], np.int32)
    q, w, keys, scales = exact_inputs(rng, len(lengths), steps, 3, (capacity,))
    got = index_topk(q, w, keys, scales, lengths, top_k=top_k, implementation=implementation)
    want = truth_index_topk(q, w, keys, scales, lengths, top_k)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int32 and got.shape == (len(lengths), steps, top_k)
    # The rows that see at most top_k positions select all of them.
    assert np.all(got[0] == -1) and np.all(got[6] == -1)
    np.testing.assert_array_equal(got[3, -1], np.arange(top_k))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("heads", [1, 3, 64, 65])
def test_heads_not_a_multiple_of_the_tile(implementation, heads):
    rng = np.random.default_rng(heads)
    q, w, keys, scales = exact_inputs(rng, 3, 2, heads, (70,), weight_range=2)
    lengths = np.array([70, 33, 9], np.int32)
    got = index_topk(q, w, keys, scales, lengths, top_k=24, implementation=implementation)
    np.testing.assert_array_equal(got, truth_index_topk(q, w, keys, scales, lengths, 24))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_all_zero_scores_go_to_the_smaller_positions(implementation):
    """Every dot product <= 0: every score is +-0.0 (negative weights give -0.0), one tie
    cluster, so the selection is the first top_k positions of each row."""
    rng = np.random.default_rng(1)
    q = rng.integers(0, 3, (2, 5, 4, 128)).astype(np.float32).astype(FP8)
    keys = (-rng.integers(0, 3, (50, 128))).astype(np.float32).astype(FP8)
    w = np.array([1.0, -2.0, 0.5, -1.0], np.float32) * np.ones((2, 5, 1), np.float32)
    scales = np.ones(50, np.float32)
    lengths = np.array([50, 12], np.int32)
    got = index_topk(q, w, keys, scales, lengths, top_k=10, implementation=implementation)
    np.testing.assert_array_equal(got, truth_index_topk(q, w, keys, scales, lengths, 10))
    np.testing.assert_array_equal(got[0], np.tile(np.arange(10), (5, 1)))
    limits = 12 - 5 + np.arange(5) + 1  # 8 .. 12 positions
    for t, limit in enumerate(limits):
        np.testing.assert_array_equal(got[1, t, : min(limit, 10)], np.arange(min(limit, 10)))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_negative_weights_and_duplicate_keys(implementation):
    """Negative scores rank below zero scores; duplicate keys tie and go to the smaller
    position."""
    rng = np.random.default_rng(2)
    q, w, keys, scales = exact_inputs(rng, 3, 5, 6, (16,))
    w = -np.abs(w) - 1.0  # every score <= 0
    keys = np.concatenate([keys] * 4)  # position n and n + 16k hold the same key
    scales = np.concatenate([scales] * 4)
    lengths = np.array([64, 40, 17], np.int32)
    got = index_topk(q, w, keys, scales, lengths, top_k=20, implementation=implementation)
    np.testing.assert_array_equal(got, truth_index_topk(q, w, keys, scales, lengths, 20))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_nan_scores_rank_below_every_number(implementation):
    rng = np.random.default_rng(3)
    q, w, keys, scales = exact_inputs(rng, 2, 1, 2, (30,))
    keys[[3, 11, 20]] = np.nan  # their dot products, hence scores, are NaN
    scales[5] = -np.inf  # score -inf, +inf or NaN (0 * inf), by the sign of its head sum
    scales[6] = np.inf
    lengths = np.array([30, 30], np.int32)
    scores, _, _ = truth_scores(q, w, keys, scales, lengths)
    for top_k in (5, 28, 29, 30):
        got = index_topk(q, w, keys, scales, lengths, top_k=top_k, implementation=implementation)
        np.testing.assert_array_equal(got, truth_index_topk(q, w, keys, scales, lengths, top_k))
    for b in range(2):
        nans = np.flatnonzero(np.isnan(scores[b, 0]))
        numbers = 30 - len(nans)
        got = index_topk(q, w, keys, scales, lengths, top_k=numbers, implementation=implementation)
        assert not np.isin(nans, got[b]).any()
        got = index_topk(
            q, w, keys, scales, lengths, top_k=numbers + 1, implementation=implementation
        )
        assert np.isin(nans, got[b]).tolist() == [True] + [False] * (len(nans) - 1)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("steps", [1, 5])
def test_paged_shuffled_tables_with_holes(implementation, steps):
    rng = np.random.default_rng(10 + steps)
    batch, block_size = 4, 8
    q, w, keys, scales = exact_inputs(rng, batch, steps, 5, (96,))
    paged_keys, paged_scales, table = paged_layout(rng, keys, scales, batch, block_size, holes=3)
    for b in range(batch):  # each request its own order of the blocks
        table[b] = table[b, rng.permutation(table.shape[1])]
    lengths = np.array([96, 50, 7, 200], np.int32)
    got = index_topk(
        q,
        w,
        paged_keys,
        paged_scales,
        lengths,
        top_k=32,
        block_table=table,
        implementation=implementation,
    )
    want = truth_index_topk(q, w, paged_keys, paged_scales, lengths, 32, table)
    np.testing.assert_array_equal(got, want)
    # Tokens of the blocks outside the cache are never selected.
    for b in range(batch):
        hole_blocks = np.flatnonzero((table[b] < 0) | (table[b] >= paged_keys.shape[0]))
        assert not np.isin(got[b][got[b] >= 0] // block_size, hole_blocks).any()


def test_flat_cache_equals_its_paged_form():
    rng = np.random.default_rng(4)
    q, w, keys, scales = exact_inputs(rng, 3, 2, 4, (64,))
    lengths = np.array([64, 20, 3], np.int32)
    paged_keys, paged_scales, table = paged_layout(rng, keys, scales, 3, 16)
    flat = index_topk(q, w, keys, scales, lengths, top_k=12)
    paged = index_topk(q, w, paged_keys, paged_scales, lengths, top_k=12, block_table=table)
    np.testing.assert_array_equal(flat, paged)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_top_k_above_capacity(implementation):
    rng = np.random.default_rng(5)
    q, w, keys, scales = exact_inputs(rng, 2, 3, 2, (10,))
    lengths = np.array([10, 6], np.int32)
    got = index_topk(q, w, keys, scales, lengths, top_k=25, implementation=implementation)
    np.testing.assert_array_equal(got, truth_index_topk(q, w, keys, scales, lengths, 25))
    np.testing.assert_array_equal(got[0, 2, :10], np.arange(10))
    assert np.all(got[:, :, 10:] == -1)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("paged", [False, True])
def test_random_inputs_within_fp32_error(implementation, paged):
    """Rounded FP32 scores: any difference from the float64 truth is a near tie at the k-th
    score (within the FP32 error bound of both scores)."""
    rng = np.random.default_rng(6)
    batch, steps = 3, 5
    q, w, keys, scales = random_inputs(rng, batch, steps, 64, (256,))
    lengths = np.array([256, 180, 40], np.int32)
    table = None
    if paged:
        keys, scales, table = paged_layout(rng, keys, scales, batch, 32, holes=1)
    got = index_topk(
        q, w, keys, scales, lengths, top_k=64, block_table=table, implementation=implementation
    )
    check_near_ties(got, q, w, keys, scales, lengths, 64, table)


def test_reference_and_default_agree_bit_for_bit():
    rng = np.random.default_rng(7)
    q, w, keys, scales = random_inputs(rng, 4, 5, 65, (300,))
    lengths = np.array([300, 299, 64, 1], np.int32)
    args = (q, w, keys, scales, lengths)
    default = index_topk(*args, top_k=100)
    np.testing.assert_array_equal(default, index_topk(*args, top_k=100, implementation="reference"))
    np.testing.assert_array_equal(
        default, np.asarray(jax_sparse_mla.reference.index_topk(*args, top_k=100))
    )


def test_under_jit():
    rng = np.random.default_rng(8)
    q, w, keys, scales = exact_inputs(rng, 2, 5, 3, (4, 16))
    table = np.array([[3, 0, 1, 2], [2, 9, 0, -1]], np.int32)
    lengths = np.array([60, 64], np.int32)
    jitted = jax.jit(jax_sparse_mla.index_topk, static_argnames=("top_k", "implementation"))
    got = np.asarray(jitted(q, w, keys, scales, lengths, top_k=20, block_table=table))
    np.testing.assert_array_equal(got, truth_index_topk(q, w, keys, scales, lengths, 20, table))
    eager = index_topk(q, w, keys, scales, lengths, top_k=20, block_table=table)
    np.testing.assert_array_equal(got, eager)


def test_grad_raises():
    rng = np.random.default_rng(9)
    q, w, keys, scales = exact_inputs(rng, 1, 1, 2, (8,))
    lengths = np.array([8], np.int32)

    def loss(weights):
        tokens = jax_sparse_mla.index_topk(q, weights, keys, scales, lengths, top_k=4)
        return jnp.sum(tokens).astype(jnp.float32) * weights.sum()

    with pytest.raises(NotImplementedError, match="no gradient"):
        jax.grad(loss)(jnp.asarray(w))


def test_is_not_a_kernel_on_cpu():
    rng = np.random.default_rng(10)
    q, w, keys, scales = exact_inputs(rng, 1, 1, 2, (8,))
    with pytest.raises(NotImplementedError, match="Hopper"):
        jax_sparse_mla.index_topk(
            q, w, keys, scales, np.array([8], np.int32), top_k=4, implementation="cute"
        )


# ---------------------------------------------------------------------------------------
# merge_candidates (the DCP merge) against the oracle's selection


def test_merge_candidates_matches_the_tie_rule():
    rng = np.random.default_rng(11)
    rows, width = 40, 24
    scores = rng.integers(-3, 4, (rows, width)).astype(np.float32)
    scores[rng.random((rows, width)) < 0.1] = np.nan
    scores[rng.random((rows, width)) < 0.2] *= -0.0  # -0.0 among the zeros
    positions = np.stack([rng.choice(1000, width, replace=False) for _ in range(rows)])
    positions[rng.random((rows, width)) < 0.3] = -1
    positions = positions.astype(np.int32)
    for top_k in (1, 7, 24, 30):
        got = np.asarray(merge_candidates(jnp.asarray(scores), jnp.asarray(positions), top_k))
        full = np.full((rows, 1000), 0.0, np.float32)
        live = np.zeros((rows, 1000), bool)
        for r in range(rows):
            mine = positions[r] >= 0
            full[r, positions[r, mine]] = scores[r, mine]
            live[r, positions[r, mine]] = True
        np.testing.assert_array_equal(got, select(full, live, top_k))


# ---------------------------------------------------------------------------------------
# Argument checks


def _args(batch=2, steps=3, heads=4, n=20):
    q, w, keys, scales = exact_inputs(np.random.default_rng(0), batch, steps, heads, (n,))
    return q, w, keys, scales, np.full((batch,), n, np.int32)


def _paged_args(batch=2, steps=3, heads=4):
    q, w, keys, scales = exact_inputs(np.random.default_rng(0), batch, steps, heads, (5, 4))
    table = np.tile(np.arange(5, dtype=np.int32), (batch, 1))
    return q, w, keys, scales, np.full((batch,), 20, np.int32), table


BAD_FLAT = [
    (lambda q, w, k, s, n: (q.astype(np.float32), w, k, s, n), TypeError, "q_index must be float8"),
    (
        lambda q, w, k, s, n: (q, w.astype(np.float16), k, s, n),
        TypeError,
        "weights must be float32",
    ),
    (
        lambda q, w, k, s, n: (q, w, k.astype(np.float32), s, n),
        TypeError,
        "index_keys must be float8",
    ),
    (
        lambda q, w, k, s, n: (q, w, k, s.astype(np.float64), n),
        TypeError,
        "index_scales must be float32",
    ),
    (lambda q, w, k, s, n: (q, w, k, s, n.astype(np.int64)), TypeError, "lengths must be int32"),
    (
        lambda q, w, k, s, n: (q[..., :64], w, k, s, n),
        ValueError,
        r"q_index must be \[B, T, Hi, 128\]",
    ),
    (lambda q, w, k, s, n: (q[0], w, k, s, n), ValueError, r"q_index must be \[B, T, Hi, 128\]"),
    (lambda q, w, k, s, n: (q[:, :0], w[:, :0], k, s, n), ValueError, r"q_index .* \(T >= 1\)"),
    (
        lambda q, w, k, s, n: (q[:, :, :0], w[:, :, :0], k, s, n),
        ValueError,
        r"q_index .* \(Hi >= 1\)",
    ),
    (lambda q, w, k, s, n: (q, w[:, :, :3], k, s, n), ValueError, r"weights must be \[B, T, Hi\]"),
    (lambda q, w, k, s, n: (q, w[:1], k, s, n), ValueError, r"weights must be \[B, T, Hi\]"),
    (lambda q, w, k, s, n: (q, w, k, s, n[:1]), ValueError, r"lengths must be \[B\]"),
    (lambda q, w, k, s, n: (q, w, k, s, n[:, None]), ValueError, r"lengths must be \[B\]"),
    (lambda q, w, k, s, n: (q, w, k[:, :127], s, n), ValueError, r"index_keys must be \[N, 128\]"),
    (lambda q, w, k, s, n: (q, w, k[None, None], s, n), ValueError, "index_keys must be"),
    (lambda q, w, k, s, n: (q, w, k, s[:-1], n), ValueError, "index_scales must be"),
    (lambda q, w, k, s, n: (q, w, k[:0], s[:0], n), ValueError, "index_keys must hold at least"),
]


@pytest.mark.parametrize(
    "function", [jax_sparse_mla.index_topk, jax_sparse_mla.reference.index_topk]
)
@pytest.mark.parametrize(("mutate", "error", "message"), BAD_FLAT)
def test_bad_arguments_are_named(function, mutate, error, message):
    with pytest.raises(error, match=message):
        function(*mutate(*_args()), top_k=4)


def test_block_table_goes_with_a_paged_cache():
    q, w, keys, scales, lengths, table = _paged_args()
    with pytest.raises(ValueError, match="needs block_table"):
        jax_sparse_mla.index_topk(q, w, keys, scales, lengths, top_k=4)
    flat = _args()
    with pytest.raises(ValueError, match="block_table goes with a paged cache"):
        jax_sparse_mla.index_topk(*flat, top_k=4, block_table=table)
    with pytest.raises(TypeError, match="block_table must be int32"):
        jax_sparse_mla.index_topk(*_paged_args()[:5], top_k=4, block_table=table.astype(np.int64))
    for bad in (table[:1], table[0], table[:, :0]):
        with pytest.raises(ValueError, match=r"block_table must be \[B, max_blocks\]"):
            jax_sparse_mla.index_topk(q, w, keys, scales, lengths, top_k=4, block_table=bad)
    with pytest.raises(ValueError, match="index_scales must be"):
        jax_sparse_mla.index_topk(q, w, keys, scales[:, :3], lengths, top_k=4, block_table=table)


def test_int32_positions():
    q, w, keys, scales, lengths, _ = _paged_args()
    huge = np.zeros((2, 2**29), np.int32)  # 2**29 blocks of 4 positions
    with pytest.raises(ValueError, match=r"int32 positions .* 2\*\*31"):
        jax_sparse_mla.index_topk(q, w, keys, scales, lengths, top_k=4, block_table=huge)


@pytest.mark.parametrize(
    ("top_k", "error", "message"),
    [
        (0, ValueError, "top_k must be in"),
        (-3, ValueError, "top_k must be in"),
        (2**31, ValueError, "top_k must be in"),
        (4.0, TypeError, "top_k must be a static Python int"),
        (True, TypeError, "top_k must be a static Python int"),
        (jnp.int32(4), TypeError, "top_k must be a static Python int"),
        (None, TypeError, "top_k must be a static Python int"),
    ],
)
def test_bad_top_k(top_k, error, message):
    with pytest.raises(error, match=message):
        jax_sparse_mla.index_topk(*_args(), top_k=top_k)


def test_traced_top_k_is_refused():
    args = _args()
    with pytest.raises(TypeError, match="top_k must be a static Python int"):
        jax.jit(lambda k: jax_sparse_mla.index_topk(*args, top_k=k))(4)


def test_bad_implementation():
    with pytest.raises(ValueError, match="implementation must be one of"):
        jax_sparse_mla.index_topk(*_args(), top_k=4, implementation="triton")
    with pytest.raises(ValueError, match="runs the reference only"):
        jax_sparse_mla.reference.index_topk(*_args(), top_k=4, implementation="cute")


# ---------------------------------------------------------------------------------------
# token_rows: index_topk's tokens -> decode's rows and valid


def token_rows_numpy(tokens, table=None, block_size=None):
    """The obvious loop, rows flattened to [B * T, K]."""
    batch, steps, width = tokens.shape
    rows = np.full((batch * steps, width), -1, np.int32)
    valid = np.zeros(batch * steps, np.int32)
    for b in range(batch):
        for t in range(steps):
            r = b * steps + t
            for i, n in enumerate(tokens[b, t]):
                if n < 0:
                    continue
                valid[r] = i + 1  # one past the last token
                if table is None:
                    rows[r, i] = n
                    continue
                line = table[b if table.shape[0] > 1 else 0]
                j = n // block_size
                rows[r, i] = (
                    -1 if j >= len(line) or line[j] < 0 else line[j] * block_size + n % block_size
                )
    return rows, valid


@pytest.mark.parametrize("paged", [False, True])
def test_token_rows_feed_decode(paged):
    """index_topk -> token_rows -> decode equals a decode over rows built by hand."""
    rng = np.random.default_rng(12)
    batch, steps, top_k, block_size = 3, 5, 24, 16
    capacity = 64
    q_index, w, keys, scales = exact_inputs(rng, batch, steps, 4, (capacity,))
    lengths = np.array([64, 30, 3], np.int32)
    _, kv, _ = make_inputs(rng, 1, 1, capacity, 1)  # the decode's cache [64, 576]
    q, _, _ = make_inputs(rng, batch * steps, 8, 1, 1)
    table, kv_table, block_args = None, None, {}
    if paged:
        keys, scales, table = paged_layout(rng, keys, scales, batch, block_size, holes=1)
        # The decode's cache is paged like the index cache: same table, same block size.
        kv_paged = np.zeros((keys.shape[0], block_size, 576), kv.dtype)
        for j, block in enumerate(table.T):  # logical block j: one physical block (or a hole)
            for physical in block[(block >= 0) & (block < keys.shape[0])]:
                kv_paged[physical] = kv[j * block_size : (j + 1) * block_size]
        kv, kv_table = kv_paged, table
        block_args = dict(block_table=jnp.asarray(table), block_size=block_size)
    tokens = jax_sparse_mla.index_topk(
        q_index, w, keys, scales, lengths, top_k=top_k, block_table=table
    )
    rows, valid = jax_sparse_mla.token_rows(tokens, **block_args)
    want_rows, want_valid = token_rows_numpy(np.asarray(tokens), kv_table, block_size)
    np.testing.assert_array_equal(np.asarray(rows), want_rows)
    np.testing.assert_array_equal(np.asarray(valid), want_valid)
    assert rows.dtype == jnp.int32 and valid.dtype == jnp.int32

    # By hand: each verify row attends its visible tokens with the top-k largest scores.
    want_tokens = truth_index_topk(q_index, w, keys, scales, lengths, top_k, table)
    hand_rows = np.full((batch * steps, top_k), -1, np.int32)
    hand_valid = np.zeros(batch * steps, np.int32)
    for b in range(batch):
        for t in range(steps):
            chosen = [int(n) for n in want_tokens[b, t] if n >= 0]
            if paged:
                chosen = [table[b, n // block_size] * block_size + n % block_size for n in chosen]
            hand_rows[b * steps + t, : len(chosen)] = chosen
            hand_valid[b * steps + t] = len(chosen)
    latent, lse = jax_sparse_mla.decode(q, kv, rows, valid, softmax_scale=0.1)
    want_latent, want_lse = jax_sparse_mla.decode(q, kv, hand_rows, hand_valid, softmax_scale=0.1)
    np.testing.assert_array_equal(np.asarray(latent), np.asarray(want_latent))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    assert np.all(np.isinf(np.asarray(lse)[2 * steps : 2 * steps + 2]))  # rows with no token


def test_token_rows_shapes_and_table_edges():
    tokens = jnp.array([[0, 5, 9, 17, -1], [2, 3, 20, -1, -1]], jnp.int32)
    rows, valid = jax_sparse_mla.token_rows(tokens)
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(tokens))
    np.testing.assert_array_equal(np.asarray(valid), [4, 3])
    table = np.array([[4, -1, 7]], np.int32)  # shared by both requests; block 3 is past it
    rows, valid = jax_sparse_mla.token_rows(tokens, block_table=jnp.asarray(table), block_size=6)
    want_rows, want_valid = token_rows_numpy(np.asarray(tokens)[:, None], table, 6)
    np.testing.assert_array_equal(np.asarray(rows), want_rows)
    np.testing.assert_array_equal(np.asarray(valid), want_valid)
    np.testing.assert_array_equal(np.asarray(rows), [[24, 29, -1, 47, -1], [26, 27, -1, -1, -1]])
    jitted = jax.jit(jax_sparse_mla.token_rows, static_argnames="block_size")
    np.testing.assert_array_equal(
        np.asarray(jitted(tokens, block_table=jnp.asarray(table), block_size=6)[0]), want_rows
    )


def test_token_rows_keep_slots():
    """Tokens keep their slots (no compaction): a -1 between tokens stays a hole inside
    valid, which decode skips, so decode sees the same keys as over the packed rows."""
    tokens = jnp.array([[3, -1, 7, -1], [-1, -1, -1, -1], [-1, 2, -1, -1]], jnp.int32)
    rows, valid = jax_sparse_mla.token_rows(tokens)
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(tokens))
    np.testing.assert_array_equal(np.asarray(valid), [3, 0, 2])
    rng = np.random.default_rng(3)
    q, kv, _ = make_inputs(rng, 3, 8, 16, 1)
    packed = np.array([[3, 7, -1, -1], [-1, -1, -1, -1], [2, -1, -1, -1]], np.int32)
    latent, lse = jax_sparse_mla.decode(q, kv, rows, valid, softmax_scale=0.1)
    want_latent, want_lse = jax_sparse_mla.decode(
        q, kv, jnp.asarray(packed), jnp.array([2, 0, 1], jnp.int32), softmax_scale=0.1
    )
    np.testing.assert_array_equal(np.asarray(latent), np.asarray(want_latent))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    empty_rows, empty_valid = jax_sparse_mla.token_rows(jnp.zeros((2, 3, 0), jnp.int32))
    assert empty_rows.shape == (6, 0) and np.asarray(empty_valid).tolist() == [0] * 6  # K = 0


def test_token_rows_errors():
    tokens = jnp.zeros((2, 3, 4), jnp.int32)
    with pytest.raises(ValueError, match="tokens must be"):
        jax_sparse_mla.token_rows(tokens[0, 0])
    with pytest.raises(TypeError, match="tokens must be an integer"):
        jax_sparse_mla.token_rows(tokens.astype(jnp.float32))
    with pytest.raises(ValueError, match="block_table and block_size go together"):
        jax_sparse_mla.token_rows(tokens, block_size=4)
    with pytest.raises(ValueError, match="block_table and block_size go together"):
        jax_sparse_mla.token_rows(tokens, block_table=jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="block_size must be"):
        jax_sparse_mla.token_rows(tokens, block_table=jnp.zeros((2, 3), jnp.int32), block_size=0)
    with pytest.raises(ValueError, match="block_table must be"):
        jax_sparse_mla.token_rows(tokens, block_table=jnp.zeros((3, 3), jnp.int32), block_size=4)
