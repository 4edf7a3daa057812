"""dcp_index_topk under jax.shard_map on 2, 4 and 8 virtual CPU devices: bit for bit the
single-device index_topk over the unsharded cache (and the float64 oracle where the scores
are exact), flat and paged shards, one and five verify rows, ties and short lengths."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from index_truth import exact_inputs, random_inputs, truth_index_topk
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_sparse_mla

AXIS = "dcp"


def mesh_of(dcp: int) -> Mesh:
    if len(jax.devices()) < dcp:
        pytest.skip(f"needs {dcp} devices, jax sees {len(jax.devices())}")
    return Mesh(np.array(jax.devices()[:dcp]), (AXIS,))


def flat_shards(keys, scales, dcp):
    """Global token t -> rank t % D, local row t // D: [D, N / D, ...] stacks."""
    return np.stack([keys[r::dcp] for r in range(dcp)]), np.stack(
        [scales[r::dcp] for r in range(dcp)]
    )


def paged_shards(rng, keys, scales, table, dcp):
    """A global paged cache [num_blocks, D * bs, 128] -> each rank its own paged cache of its
    local positions [num_blocks, bs, 128] (global block p's offsets i * D + r) with its own
    shuffled block order and its own table (the global table's holes stay holes)."""
    num_blocks = keys.shape[0]
    local_keys, local_scales, local_tables = [], [], []
    for r in range(dcp):
        order = rng.permutation(num_blocks)  # physical block p of the shard holds order[p]
        where = np.argsort(order)  # global block g lives at where[g]
        local_keys.append(keys[order][:, r::dcp])
        local_scales.append(scales[order][:, r::dcp])
        inside = (table >= 0) & (table < num_blocks)
        holes = np.where(table < 0, table, table + 3)  # still outside the shard
        local_tables.append(np.where(inside, where[table.clip(0, num_blocks - 1)], holes))
    return (
        np.stack(local_keys),
        np.stack(local_scales),
        np.stack(local_tables).astype(np.int32),
    )


def run_dcp(dcp, q, w, keys, scales, lengths, *, top_k, tables=None, implementation=None):
    """dcp_index_topk on per-rank stacks [D, ...]; returns every rank's tokens [D, B, T, K]."""
    paged = tables is not None

    def body(q, w, keys, scales, lengths, *table):
        tokens = jax_sparse_mla.dcp_index_topk(
            q,
            w,
            keys[0],
            scales[0],
            lengths,
            axis_name=AXIS,
            top_k=top_k,
            block_table=table[0][0] if paged else None,
            implementation=implementation,
        )
        return tokens[None]

    args = [q, w, keys, scales, lengths] + ([tables] if paged else [])
    in_specs = (P(), P(), P(AXIS), P(AXIS), P()) + ((P(AXIS),) if paged else ())
    fn = jax.jit(jax.shard_map(body, mesh=mesh_of(dcp), in_specs=in_specs, out_specs=P(AXIS)))
    return np.asarray(fn(*map(jnp.asarray, args)))


def assert_every_rank_equals(got, want):
    for rank_tokens in got:
        np.testing.assert_array_equal(rank_tokens, want)


@pytest.mark.parametrize("dcp", [2, 4, 8])
@pytest.mark.parametrize("steps", [1, 5])
@pytest.mark.parametrize("implementation", [None, "reference"])
def test_flat_exact_scores(dcp, steps, implementation):
    """Small-integer inputs: many ties, exact scores; equal to index_topk and the oracle."""
    rng = np.random.default_rng(dcp * 10 + steps)
    local, top_k = 24, 16
    n = dcp * local
    lengths = np.array([0, 1, 7, top_k, n - 3, n, n + 9, -5], np.int32)
    q, w, keys, scales = exact_inputs(rng, len(lengths), steps, 3, (n,), value_range=1)
    keys[n // 2 :] = keys[: n - n // 2]  # duplicate keys: ties across ranks
    scales[n // 2 :] = scales[: n - n // 2]
    want = np.asarray(
        jax_sparse_mla.index_topk(
            q, w, keys, scales, lengths, top_k=top_k, implementation=implementation
        )
    )
    np.testing.assert_array_equal(want, truth_index_topk(q, w, keys, scales, lengths, top_k))
    shard_keys, shard_scales = flat_shards(keys, scales, dcp)
    got = run_dcp(
        dcp, q, w, shard_keys, shard_scales, lengths, top_k=top_k, implementation=implementation
    )
    assert_every_rank_equals(got, want)


@pytest.mark.parametrize("dcp", [2, 4, 8])
@pytest.mark.parametrize("steps", [1, 5])
def test_flat_random_scores(dcp, steps):
    """Rounded FP32 scores: still bit for bit (each rank computes each token's score as the
    single device does, and the scores travel exactly)."""
    rng = np.random.default_rng(dcp + steps)
    local, top_k = 64, 48
    n = dcp * local
    lengths = np.array([n, n - 1, n // 3, 40, 2], np.int32)
    q, w, keys, scales = random_inputs(rng, len(lengths), steps, 64, (n,))
    want = np.asarray(jax_sparse_mla.index_topk(q, w, keys, scales, lengths, top_k=top_k))
    got = run_dcp(dcp, q, w, *flat_shards(keys, scales, dcp), lengths, top_k=top_k)
    assert_every_rank_equals(got, want)


@pytest.mark.parametrize("dcp", [2, 4, 8])
@pytest.mark.parametrize("steps", [1, 5])
def test_paged(dcp, steps):
    rng = np.random.default_rng(100 + dcp * 10 + steps)
    batch, local_block, blocks, top_k = 4, 4, 6, 20
    block = dcp * local_block  # a global block of D * bs tokens: bs on each rank
    num_blocks = blocks + 2
    q, w, keys, scales = exact_inputs(rng, batch, steps, 5, (num_blocks, block))
    table = np.stack([rng.permutation(num_blocks)[:blocks] for _ in range(batch)]).astype(np.int32)
    table[1, 2] = -1  # holes: their tokens are no candidates on any rank
    table[2, 0] = num_blocks + 4
    capacity = blocks * block
    lengths = np.array([capacity, capacity // 2 + 3, 5, capacity + 100], np.int32)
    want = np.asarray(
        jax_sparse_mla.index_topk(q, w, keys, scales, lengths, top_k=top_k, block_table=table)
    )
    np.testing.assert_array_equal(want, truth_index_topk(q, w, keys, scales, lengths, top_k, table))
    shard_keys, shard_scales, shard_tables = paged_shards(rng, keys, scales, table, dcp)
    got = run_dcp(dcp, q, w, shard_keys, shard_scales, lengths, top_k=top_k, tables=shard_tables)
    assert_every_rank_equals(got, want)


@pytest.mark.parametrize("dcp", [2, 8])
def test_ties_and_short_lengths(dcp):
    """All scores zero (one tie cluster): the first top_k positions, spread over the ranks;
    top_k above the global capacity."""
    rng = np.random.default_rng(dcp)
    steps, n = 5, dcp * 6
    q = rng.integers(0, 3, (3, steps, 2, 128)).astype(np.float32).astype(jnp.float8_e4m3fn)
    keys = (-rng.integers(0, 3, (n, 128))).astype(np.float32).astype(jnp.float8_e4m3fn)
    w = np.array([[[1.0, -1.0]]], np.float32) * np.ones((3, steps, 1), np.float32)
    scales = np.ones(n, np.float32)
    lengths = np.array([n, 3, 7], np.int32)
    for top_k in (5, n + 4):
        want = np.asarray(jax_sparse_mla.index_topk(q, w, keys, scales, lengths, top_k=top_k))
        got = run_dcp(dcp, q, w, *flat_shards(keys, scales, dcp), lengths, top_k=top_k)
        assert_every_rank_equals(got, want)
    np.testing.assert_array_equal(want[0, -1, :n], np.arange(n))
    np.testing.assert_array_equal(want[1, :, 0], [-1, -1, 0, 0, 0])


@pytest.mark.parametrize("dcp", [1, 4])
def test_tokens_are_replicated(dcp):
    """The tokens are typed invariant over the axis: out_specs=P() needs no check_vma=False."""
    rng = np.random.default_rng(dcp)
    q, w, keys, scales = random_inputs(rng, 2, 3, 4, (dcp * 12,))
    lengths = np.array([dcp * 12, 7], np.int32)
    want = np.asarray(jax_sparse_mla.index_topk(q, w, keys, scales, lengths, top_k=10))

    def body(q, w, keys, scales, lengths):
        return jax_sparse_mla.dcp_index_topk(q, w, keys, scales, lengths, axis_name=AXIS, top_k=10)

    in_specs = (P(), P(), P(AXIS), P(AXIS), P())
    fn = jax.jit(jax.shard_map(body, mesh=mesh_of(dcp), in_specs=in_specs, out_specs=P()))
    by_rank = [np.asarray(keys[r::dcp]) for r in range(dcp)]  # rank-major rows for P(AXIS)
    shard_keys = np.concatenate(by_rank)
    shard_scales = np.concatenate([scales[r::dcp] for r in range(dcp)])
    got = fn(*map(jnp.asarray, (q, w, shard_keys, shard_scales, lengths)))
    np.testing.assert_array_equal(np.asarray(got), want)


def test_one_all_gather_of_the_candidates():
    """The only collective: one all-gather of the packed (score bits, position) candidates,
    [B, T, top_k, 2] int32 per rank; the index cache never moves."""
    dcp, batch, steps, top_k = 4, 2, 5, 8
    rng = np.random.default_rng(0)
    q, w, keys, scales = random_inputs(rng, batch, steps, 3, (dcp * 16,))
    lengths = np.array([dcp * 16, 9], np.int32)

    def body(q, w, keys, scales, lengths):
        return jax_sparse_mla.dcp_index_topk(
            q, w, keys, scales, lengths, axis_name=AXIS, top_k=top_k
        )

    in_specs = (P(), P(), P(AXIS), P(AXIS), P())
    fn = jax.jit(jax.shard_map(body, mesh=mesh_of(dcp), in_specs=in_specs, out_specs=P()))
    stablehlo = fn.lower(*map(jnp.asarray, (q, w, keys, scales, lengths))).as_text()
    collectives = re.findall(
        r"stablehlo\.(all_gather|all_to_all|all_reduce|collective_permute|reduce_scatter|"
        r"collective_broadcast)",
        stablehlo,
    )
    assert collectives == ["all_gather"], collectives
    gather = re.search(r"stablehlo\.all_gather.*", stablehlo).group(0)
    shape = f"{batch}x{steps}x{top_k}x2xi32"
    assert f"(tensor<1x{shape}>) -> tensor<{dcp}x{shape}>" in gather, gather


def test_one_rank_is_index_topk():
    rng = np.random.default_rng(0)
    q, w, keys, scales = random_inputs(rng, 2, 3, 4, (50,))
    lengths = np.array([50, 20], np.int32)
    want = np.asarray(jax_sparse_mla.index_topk(q, w, keys, scales, lengths, top_k=16))
    got = run_dcp(1, q, w, keys[None], scales[None], lengths, top_k=16)
    assert_every_rank_equals(got, want)


def test_errors():
    rng = np.random.default_rng(0)
    q, w, keys, scales = exact_inputs(rng, 2, 1, 4, (16,))
    lengths = np.array([16, 3], np.int32)
    with pytest.raises(ValueError, match=r"inside jax\.shard_map"):
        jax_sparse_mla.dcp_index_topk(q, w, keys, scales, lengths, axis_name=AXIS, top_k=4)
    with pytest.raises(TypeError, match="q_index must be float8"):
        run_dcp(2, q.astype(np.float32), w, *flat_shards(keys, scales, 2), lengths, top_k=4)
    with pytest.raises(ValueError, match="top_k must be in"):
        run_dcp(2, q, w, *flat_shards(keys, scales, 2), lengths, top_k=0)
    with pytest.raises(ValueError, match="implementation must be one of"):
        run_dcp(2, q, w, *flat_shards(keys, scales, 2), lengths, top_k=4, implementation="x")
