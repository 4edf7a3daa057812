"""Decode context parallelism: local_rows and dcp_decode under jax.shard_map on CPU devices.

dcp_decode over a token-sharded cache is compared with the single-device decode over the
whole cache and with an independent float64 numpy computation. Tolerances (derived in
``latent_bound`` / ``lse_bound``): every rank anchors its P at its own max; the bound allows
P rounded to E4M3 there (F16 in the reference and the kernels: 128x finer), so each
output element can move by up to 2^-4 (E4M3 half-ulp) of sum_i p_i |v_i| / sum_i p_i,
plus the bf16 rounding of the partials (2^-9 each, they travel in bf16) and of the result;
the LSE depends on no quantized value, only on FP32 logits and sums.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_sparse_mla
from jax_sparse_mla.dcp import FILL_ROW, dcp_decode, local_rows

AXIS = "dcp"
FP8 = jnp.float8_e4m3fn
SOFTMAX_SCALE = 1.0 / 24.0


def mesh_of(dcp: int) -> Mesh:
    if len(jax.devices()) < dcp:
        pytest.skip(f"needs {dcp} devices, jax sees {len(jax.devices())}")
    return Mesh(np.array(jax.devices()[:dcp]), (AXIS,))


# ---------------------------------------------------------------------------------------
# local_rows


def local_rows_numpy(tokens, rank, dcp, table=None, block_size=None):
    """The obvious loop: keep this rank's tokens in order, map them, pad with FILL_ROW."""
    batch, width = tokens.shape
    rows = np.full((batch, width), FILL_ROW, np.int32)
    valid = np.zeros(batch, np.int32)
    for b in range(batch):
        mine = [int(t) for t in tokens[b] if t >= 0 and t % dcp == rank]
        for i, t in enumerate(mine):
            p = t // dcp
            if table is not None:
                line = table[b if table.shape[0] > 1 else 0]
                j = p // block_size
                p = (
                    FILL_ROW
                    if j >= len(line) or line[j] < 0
                    else line[j] * block_size + p % block_size
                )
            rows[b, i] = p
        valid[b] = len(mine)
    return rows, valid


def random_tokens(rng, batch, width, n_tokens, empty_fraction=0.3):
    tokens = np.stack([rng.choice(n_tokens, width, replace=False) for _ in range(batch)])
    tokens[rng.random((batch, width)) < empty_fraction] = -1
    tokens[0, :] = -1  # a row with no tokens at all
    return tokens.astype(np.int32)


@pytest.mark.parametrize("dcp", [1, 2, 3, 4, 8])
def test_local_rows_flat(dcp):
    rng = np.random.default_rng(dcp)
    tokens = random_tokens(rng, 6, 37, 200)
    tokens[1, :] = np.where(tokens[1] >= 0, (tokens[1] // dcp) * dcp, -1)  # all on rank 0
    for rank in range(dcp):
        rows, valid = local_rows(jnp.asarray(tokens), rank=rank, dcp_size=dcp)
        want_rows, want_valid = local_rows_numpy(tokens, rank, dcp)
        np.testing.assert_array_equal(np.asarray(rows), want_rows)
        np.testing.assert_array_equal(np.asarray(valid), want_valid)
        assert rows.dtype == jnp.int32 and valid.dtype == jnp.int32


@pytest.mark.parametrize("shared_table", [False, True])
@pytest.mark.parametrize("dcp", [1, 4])
def test_local_rows_paged(dcp, shared_table):
    rng = np.random.default_rng(10 + dcp)
    batch, width, block_size, blocks = 5, 29, 4, 9
    # Local positions reach 200 // dcp, past the table's 36 slots for small dcp.
    tokens = random_tokens(rng, batch, width, 200)
    table = rng.permutation(64)[: (1 if shared_table else batch) * blocks].reshape(-1, blocks)
    table[-1, 2] = -1  # an unallocated block
    table = table.astype(np.int32)
    for rank in range(dcp):
        rows, valid = local_rows(
            jnp.asarray(tokens),
            rank=rank,
            dcp_size=dcp,
            block_table=jnp.asarray(table),
            block_size=block_size,
        )
        want_rows, want_valid = local_rows_numpy(tokens, rank, dcp, table, block_size)
        np.testing.assert_array_equal(np.asarray(rows), want_rows)
        np.testing.assert_array_equal(np.asarray(valid), want_valid)


def test_local_rows_traced_rank():
    """Under jit with a traced rank, and vmapped over the ranks (as under shard_map)."""
    dcp = 4
    tokens = random_tokens(np.random.default_rng(3), 4, 50, 300)
    table = np.random.default_rng(4).permutation(100)[:80].reshape(4, 20).astype(np.int32)

    def per_rank(rank):
        return local_rows(
            jnp.asarray(tokens), rank=rank, dcp_size=dcp, block_table=table, block_size=8
        )

    rows, valid = jax.jit(jax.vmap(per_rank))(jnp.arange(dcp, dtype=jnp.int32))
    for rank in range(dcp):
        want_rows, want_valid = local_rows_numpy(tokens, rank, dcp, table, 8)
        np.testing.assert_array_equal(np.asarray(rows[rank]), want_rows)
        np.testing.assert_array_equal(np.asarray(valid[rank]), want_valid)
    # Every token lands on exactly one rank.
    np.testing.assert_array_equal(np.asarray(valid).sum(0), (tokens >= 0).sum(1))


def test_local_rows_errors():
    tokens = jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(ValueError, match="dcp_size"):
        local_rows(tokens, rank=0, dcp_size=0)
    with pytest.raises(ValueError, match="rank"):
        local_rows(tokens, rank=4, dcp_size=4)
    with pytest.raises(ValueError, match=r"tokens must be \[B, K\]"):
        local_rows(jnp.zeros((8,), jnp.int32), rank=0, dcp_size=2)
    with pytest.raises(TypeError, match="tokens must be an integer"):
        local_rows(jnp.zeros((2, 8), jnp.float32), rank=0, dcp_size=2)
    with pytest.raises(ValueError, match="block_table and block_size"):
        local_rows(tokens, rank=0, dcp_size=2, block_table=jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match=r"block_table must be integer \[2 or 1, blocks\]"):
        local_rows(
            tokens, rank=0, dcp_size=2, block_table=jnp.zeros((3, 3), jnp.int32), block_size=4
        )


# ---------------------------------------------------------------------------------------
# dcp_decode: problem construction and float64 truth


def fp8(rng, shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, FP8)


def make_tokens(rng, batch, width, dcp, n_global):
    """Global top-k positions: a full row, a row whose tokens all sit on rank 0 (the other
    ranks have no local keys), a row with no tokens, a single token, a sparse row."""
    tokens = np.full((batch, width), -1, np.int32)
    tokens[0] = rng.choice(n_global, width, replace=False)
    on_rank0 = rng.choice(n_global // dcp, min(width, n_global // dcp), replace=False) * dcp
    slots = np.sort(rng.choice(width, len(on_rank0) // 2, replace=False))
    tokens[1, slots] = on_rank0[: len(slots)]
    # row 2 stays empty
    tokens[3, rng.integers(width)] = rng.integers(n_global)
    picked = rng.choice(n_global, width, replace=False)
    tokens[4] = np.where(rng.random(width) < 0.5, picked, -1)
    if batch > 5:
        tokens[5:] = np.stack([rng.choice(n_global, width, replace=False)] * (batch - 5))
    return tokens


def truth(q, keys_of_row, softmax_scale, q_scale, kv_scale):
    """float64 latent, lse and the quantities the error bounds need, row by row.

    q [B, H, 576] (FP8 values), keys_of_row(b) -> [n, 576] float64 keys of row b.
    """
    q = np.asarray(q.astype(jnp.float32), np.float64)
    batch, heads, _ = q.shape
    latent = np.zeros((batch, heads, 512))
    lse = np.full((batch, heads), -np.inf)
    mean_abs = np.zeros((batch, heads, 512))  # sum p |v| / sum p
    max_abs = np.zeros((batch, 512))
    n_keys = np.zeros(batch, int)
    logit_error = np.zeros(batch)  # bound on |FP32 logit - exact logit|
    scale = softmax_scale * q_scale * kv_scale
    for b in range(batch):
        keys = keys_of_row(b)
        n_keys[b] = len(keys)
        if not len(keys):
            continue
        logits = scale * q[b] @ keys.T  # [H, n]
        top = logits.max(-1, keepdims=True)
        p = np.exp(logits - top)
        v = keys[:, :512] * kv_scale
        latent[b] = p @ v / p.sum(-1, keepdims=True)
        mean_abs[b] = p @ np.abs(v) / p.sum(-1, keepdims=True)
        max_abs[b] = np.abs(v).max(0)
        lse[b] = top[:, 0] + np.log(p.sum(-1))
        gamma = 576 * 2.0**-24 / (1 - 576 * 2.0**-24)  # FP32 sum of 576 exact products
        logit_error[b] = gamma * scale * (np.abs(q[b]) @ np.abs(keys).T).max()
    return dict(
        latent=latent,
        lse=lse,
        mean_abs=mean_abs,
        max_abs=max_abs,
        n_keys=n_keys,
        logit_error=logit_error,
    )


def latent_bound(t):
    """Per-element bound on |latent - truth| for a DCP result (any split of the keys).

    Per partial, E4M3 P relative to that partial's anchor: <= 2^-4 relative (normal) or
    2^-10 / 448 absolute (subnormal) per key; the partials' weights sum to one, so the
    merged error is <= 2^-4 mean_abs + n 2^-10/448 max_abs. Logit errors d move each
    weight by <= e^2d - 1. bf16 partials and result: 2^-9 each, of |partial| <= ~mean_abs.
    """
    d = t["logit_error"][:, None, None]
    n = t["n_keys"][:, None, None]
    relative = 2.0**-4 + 2 * 2.0**-9 + np.expm1(2 * d) * 1.1
    subnormal = n * 2.0**-10 / 448 * t["max_abs"][:, None, :]
    return relative * t["mean_abs"] + subnormal + 2.0**-9 * np.abs(t["latent"]) + 1e-6


def lse_bound(t):
    """|lse - truth| <= logit error + FP32 rounding of the exp2 / sums / log / merge."""
    n = t["n_keys"][:, None]
    return t["logit_error"][:, None] + (n + 16) * 2.0**-23 + 2.0**-21 * np.abs(t["lse"])


def check_against_truth(latent, lse, t):
    latent = np.asarray(latent.astype(jnp.float32), np.float64)
    lse = np.asarray(lse, np.float64)
    empty = t["n_keys"] == 0
    assert np.all(latent[empty] == 0) and np.all(lse[empty] == -np.inf)
    err = np.abs(latent - t["latent"])
    bound = latent_bound(t)
    assert np.all(err <= bound), f"latent error {err.max()} (worst ratio {(err / bound).max()})"
    live = ~empty
    lse_err = np.abs(lse[live] - t["lse"][live])
    assert np.all(lse_err <= lse_bound(t)[live]), f"lse error {lse_err.max()}"
    return err


def shard_flat_cache(kv_global, dcp):
    """Rank r holds tokens r, r + D, ...: local row p is global token p * D + r."""
    return jnp.concatenate([kv_global[r::dcp] for r in range(dcp)])


def shard_paged_cache(rng, seqs, dcp, block_size, spare_blocks=2):
    """Per-rank paged pools and block tables for per-row sequences seqs [S, N, 576].

    Rank r stores local position p of sequence s in block table[r][s, p // block_size] at
    offset p % block_size; blocks are scattered randomly over a pool with spare (garbage)
    blocks. Returns pools [D * blocks, block_size, 576] and tables [D * S, per_seq].
    """
    n_seqs, n_global, _ = seqs.shape
    per_seq = -(-(n_global // dcp) // block_size)
    n_blocks = n_seqs * per_seq + spare_blocks
    pools, tables = [], []
    for r in range(dcp):
        pool = np.array(fp8(rng, (n_blocks, block_size, 576)).view(np.uint8))
        table = rng.permutation(n_blocks)[: n_seqs * per_seq].reshape(n_seqs, per_seq)
        local = np.asarray(seqs[:, r::dcp].view(np.uint8))  # [S, N_local, 576]
        for p in range(local.shape[1]):
            pool[table[:, p // block_size], p % block_size] = local[:, p]
        pools.append(pool)
        tables.append(table)
    pools = jnp.asarray(np.concatenate(pools)).view(FP8)
    return pools, jnp.asarray(np.concatenate(tables).astype(np.int32))


def dcp_program(
    mesh, *, block_size=None, implementation=None, exchange="collectives", valid_hint=None
):
    """jit(shard_map(local_rows + dcp_decode)) with the traced rank:
    fn(q, kv, tokens, table, q_scale, kv_scale, step). A paged cache (block_size given) takes
    its per-rank block tables; a flat one takes table=None."""
    dcp = mesh.shape[AXIS]
    paged = block_size is not None

    def body(q, kv, tokens, table, q_scale, kv_scale, step):
        extra = dict(block_table=table, block_size=block_size) if paged else {}
        rows, valid = local_rows(tokens, rank=lax.axis_index(AXIS), dcp_size=dcp, **extra)
        return dcp_decode(
            q,
            kv,
            rows,
            valid,
            axis_name=AXIS,
            softmax_scale=SOFTMAX_SCALE,
            q_scale=q_scale,
            kv_scale=kv_scale,
            implementation=implementation,
            exchange=exchange,
            step=step,
            valid_hint=valid_hint,
        )

    in_specs = (P(None, AXIS), P(AXIS), P(), P(AXIS) if paged else None, P(), P(), P())
    out_specs = (P(None, AXIS), P(None, AXIS))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def run_dcp(
    mesh, q, kv, tokens, table, *, block_size, q_scale, kv_scale, exchange="collectives", step=0
):
    """dcp_program called once (table None for a flat cache)."""
    fn = dcp_program(mesh, block_size=block_size, exchange=exchange)
    return fn(q, kv, jnp.asarray(tokens), table, q_scale, kv_scale, jnp.int32(step))


def test_dcp_decode_hands_valid_hint_to_the_decode():
    """Each rank's decode call carries the caller's per-rank hint (the CUDA lowering reads
    it: test_cuda_lowering.py)."""
    mesh = mesh_of(2)
    rng = np.random.default_rng(3)
    q, kv = fp8(rng, (5, 32, 576)), shard_flat_cache(fp8(rng, (128, 576)), 2)
    tokens = jnp.asarray(make_tokens(rng, 5, 16, 2, 128))
    fn = dcp_program(mesh, valid_hint=8)
    text = str(jax.make_jaxpr(fn)(q, kv, tokens, None, 1.0, 1.0, jnp.int32(0)))
    calls = re.findall(r"sparse_mla_decode\[[^\]]*\]", text)
    assert len(calls) == 1 and "valid_hint=8" in calls[0], calls


def test_dcp_decode_hints_its_share_of_the_keys_by_default():
    """Without a hint, each rank's decode is hinted ceil(K / D) valid keys: what a rank holds
    of a full row under the interleaved layout, so the dispatch rule picks for that."""
    rng = np.random.default_rng(4)
    for dcp_size, width in ((2, 16), (4, 18), (8, 7)):
        mesh = mesh_of(dcp_size)
        q = fp8(rng, (5, 16 * dcp_size, 576))
        kv = shard_flat_cache(fp8(rng, (16 * dcp_size, 576)), dcp_size)
        tokens = jnp.asarray(make_tokens(rng, 5, width, dcp_size, 16 * dcp_size))
        text = str(jax.make_jaxpr(dcp_program(mesh))(q, kv, tokens, None, 1.0, 1.0, 0))
        calls = re.findall(r"sparse_mla_decode\[[^\]]*\]", text)
        share = -(-width // dcp_size)
        assert len(calls) == 1 and f"valid_hint={share}" in calls[0], (dcp_size, calls)


def global_rows(tokens, seq_length=0, per_row_seq=False):
    """Single-device rows: the tokens compacted; with per-row sequences, row b's token t is
    row b * seq_length + t of the concatenated cache."""
    rows = np.full_like(tokens, -1)
    valid = np.zeros(len(tokens), np.int32)
    for b, line in enumerate(tokens):
        kept = line[line >= 0] + (b * seq_length if per_row_seq else 0)
        rows[b, : len(kept)] = kept
        valid[b] = len(kept)
    return jnp.asarray(rows), jnp.asarray(valid)


# ---------------------------------------------------------------------------------------
# dcp_decode vs single-device decode and float64


@pytest.mark.parametrize(
    ("dcp", "heads_own", "scales"),
    [(1, 5, (1.0, 1.0)), (2, 16, (0.5, 2.0)), (4, 5, (1.0, 1.0)), (8, 12, (1.5, 0.25))],
)
def test_dcp_decode_flat(dcp, heads_own, scales):
    rng = np.random.default_rng(100 + dcp)
    batch, width, n_local = 5, 48, 64
    n_global = dcp * n_local
    q = fp8(rng, (batch, dcp * heads_own, 576))
    kv_global = fp8(rng, (n_global, 576))
    tokens = make_tokens(rng, batch, width, dcp, n_global)
    q_scale, kv_scale = (jnp.float32(s) for s in scales)  # traced scales

    latent, lse = run_dcp(
        mesh_of(dcp),
        q,
        shard_flat_cache(kv_global, dcp),
        tokens,
        None,
        block_size=None,
        q_scale=q_scale,
        kv_scale=kv_scale,
    )
    assert latent.shape == (batch, dcp * heads_own, 512) and latent.dtype == jnp.bfloat16
    assert lse.shape == (batch, dcp * heads_own) and lse.dtype == jnp.float32

    keys = np.asarray(kv_global.astype(jnp.float32), np.float64)
    t = truth(q, lambda b: keys[tokens[b][tokens[b] >= 0]], SOFTMAX_SCALE, *scales)
    err = check_against_truth(latent, lse, t)

    rows, valid = global_rows(tokens)
    single_latent, single_lse = jax_sparse_mla.decode(
        q, kv_global, rows, valid, softmax_scale=SOFTMAX_SCALE, q_scale=q_scale, kv_scale=kv_scale
    )
    single_err = check_against_truth(single_latent, single_lse, t)
    compare_with_single(latent, lse, single_latent, single_lse, err, single_err, t, dcp)


def compare_with_single(latent, lse, single_latent, single_lse, err, single_err, t, dcp):
    """DCP vs the single-device decode: the same LSE up to FP32 summation order, and a
    latent whose error is that of the single-device decode (same P rounding, other
    anchors) plus the bf16 rounding of the partials."""
    if dcp == 1:  # no collectives: the very same computation
        np.testing.assert_array_equal(np.asarray(latent), np.asarray(single_latent))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(single_lse))
        return
    live = t["n_keys"] > 0
    # Same FP32 logits and unquantized-P sums, other summation order: a few FP32 ulps (the
    # worst-case bound vs float64, lse_bound, is checked separately and is much looser).
    np.testing.assert_allclose(
        np.asarray(lse)[live], np.asarray(single_lse)[live], rtol=2.0**-16, atol=2.0**-16
    )
    np.testing.assert_array_equal(np.asarray(lse)[~live], -np.inf)
    scale = np.abs(t["latent"]).max()
    assert err.max() <= 2 * single_err.max() + 2.0**-8 * scale
    rms = np.sqrt((err**2).mean())
    assert rms <= 1.5 * np.sqrt((single_err**2).mean()) + 2.0**-9 * scale


@pytest.mark.parametrize("shared_table", [False, True])
@pytest.mark.parametrize(("dcp", "heads_own"), [(1, 3), (2, 7), (4, 16), (8, 5)])
def test_dcp_decode_paged(dcp, heads_own, shared_table):
    rng = np.random.default_rng(200 + dcp)
    batch, width, n_local, block_size = 6, 40, 45, 8
    n_global = dcp * n_local
    n_seqs = 1 if shared_table else batch
    q = fp8(rng, (batch, dcp * heads_own, 576))
    seqs = fp8(rng, (n_seqs, n_global, 576))
    tokens = make_tokens(rng, batch, width, dcp, n_global)
    pools, tables = shard_paged_cache(rng, seqs, dcp, block_size)

    latent, lse = run_dcp(
        mesh_of(dcp), q, pools, tokens, tables, block_size=block_size, q_scale=1.0, kv_scale=1.0
    )

    keys = np.asarray(seqs.astype(jnp.float32), np.float64)
    t = truth(q, lambda b: keys[b % n_seqs][tokens[b][tokens[b] >= 0]], SOFTMAX_SCALE, 1, 1)
    err = check_against_truth(latent, lse, t)

    rows, valid = global_rows(tokens, n_global, per_row_seq=not shared_table)
    single_latent, single_lse = jax_sparse_mla.decode(
        q, seqs.reshape(-1, 576), rows, valid, softmax_scale=SOFTMAX_SCALE
    )
    single_err = check_against_truth(single_latent, single_lse, t)
    compare_with_single(latent, lse, single_latent, single_lse, err, single_err, t, dcp)


def test_dcp_decode_padded_rows_equal_unpadded():
    """A cache whose rows are padded to 640 bytes (NaN padding, never read) gives the same
    bits as the 576-byte cache, flat and paged."""
    dcp, heads_own, batch, width, n_local, block_size = 2, 6, 5, 32, 48, 8
    rng = np.random.default_rng(11)
    q = fp8(rng, (batch, dcp * heads_own, 576))
    kv_global = fp8(rng, (dcp * n_local, 576))
    tokens = make_tokens(rng, batch, width, dcp, dcp * n_local)
    kv = shard_flat_cache(kv_global, dcp)
    padded = jnp.concatenate([kv, jnp.full((kv.shape[0], 64), jnp.nan, FP8)], axis=1)
    run = dict(block_size=None, q_scale=1.0, kv_scale=1.0)
    want = run_dcp(mesh_of(dcp), q, kv, tokens, None, **run)
    got = run_dcp(mesh_of(dcp), q, padded, tokens, None, **run)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Paged: each rank's pool [blocks, block_size, 640], identity block tables.
    pools = padded.reshape(dcp * n_local // block_size, block_size, 640)
    table = np.arange(dcp * n_local // block_size, dtype=np.int32).reshape(dcp, -1)
    table = jnp.asarray(table - np.arange(dcp)[:, None] * table.shape[1])  # local block ids
    run["block_size"] = block_size
    paged = run_dcp(mesh_of(dcp), q, pools, tokens, table, **run)
    for a, b in zip(want, paged, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.isfinite(np.asarray(want[0], np.float32)).all()


def test_dcp_decode_precomputed_rows_and_nan_isolation():
    """rows / valid built outside (per-rank shards, out-of-range and past-valid garbage
    entries); a NaN query head stays in its own (row, head)."""
    dcp, heads_own, batch, width, n_local = 4, 3, 3, 16, 32
    rng = np.random.default_rng(7)
    q_clean = fp8(rng, (batch, dcp * heads_own, 576))
    q = np.array(q_clean.astype(jnp.float32))
    q[1, 5, 0] = np.nan
    q = jnp.asarray(q, FP8)
    kv_global = fp8(rng, (dcp * n_local, 576))
    tokens = make_tokens(rng, batch + 2, width, dcp, dcp * n_local)[[0, 3, 4]]
    per_rank = [local_rows_numpy(tokens, r, dcp) for r in range(dcp)]
    rows = np.concatenate([r for r, _ in per_rank])
    valid = np.concatenate([v for _, v in per_rank])
    rows[rows == FILL_ROW] = 10**6  # past valid: never read
    rows[0, valid[0]] = -5  # an out-of-range entry inside valid is skipped ...
    valid[0] += 1  # ... so this row keeps its keys

    fn = jax.jit(
        jax.shard_map(
            lambda q, kv, rows, valid: dcp_decode(
                q, kv, rows, valid, axis_name=AXIS, softmax_scale=SOFTMAX_SCALE
            ),
            mesh=mesh_of(dcp),
            in_specs=(P(None, AXIS), P(AXIS), P(AXIS), P(AXIS)),
            out_specs=(P(None, AXIS), P(None, AXIS)),
        )
    )
    latent, lse = fn(q, shard_flat_cache(kv_global, dcp), jnp.asarray(rows), jnp.asarray(valid))

    keys = np.asarray(kv_global.astype(jnp.float32), np.float64)
    t = truth(q_clean, lambda b: keys[tokens[b][tokens[b] >= 0]], SOFTMAX_SCALE, 1, 1)
    latent = np.array(latent.astype(jnp.float32))
    lse = np.array(lse)
    assert np.isnan(lse[1, 5]) and np.isnan(latent[1, 5]).all()
    latent[1, 5], lse[1, 5] = t["latent"][1, 5], t["lse"][1, 5]  # the other heads: exact
    check_against_truth(jnp.asarray(latent), lse, t)


# ---------------------------------------------------------------------------------------
# Collectives in the lowered and compiled HLO


def test_dcp_collectives_in_hlo():
    """One all-gather (of q, as bytes) and one all-to-all (the packed partials); the cache
    never moves."""
    dcp, heads_own, batch, width, n_local = 8, 5, 3, 24, 44
    rng = np.random.default_rng(0)
    q = fp8(rng, (batch, dcp * heads_own, 576))
    kv = fp8(rng, (dcp * n_local, 576))
    tokens = jnp.asarray(make_tokens(rng, batch + 2, width, dcp, dcp * n_local)[:batch])

    def body(q, kv, tokens):
        rows, valid = local_rows(tokens, rank=lax.axis_index(AXIS), dcp_size=dcp)
        return dcp_decode(q, kv, rows, valid, axis_name=AXIS, softmax_scale=SOFTMAX_SCALE)

    fn = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh_of(dcp),
            in_specs=(P(None, AXIS), P(AXIS), P()),
            out_specs=(P(None, AXIS), P(None, AXIS)),
        )
    )
    lowered = fn.lower(q, kv, tokens)

    stablehlo = lowered.as_text()
    collectives = re.findall(
        r"stablehlo\.(all_gather|all_to_all|all_reduce|"
        r"collective_permute|reduce_scatter|collective_broadcast)",
        stablehlo,
    )
    assert sorted(collectives) == ["all_gather", "all_to_all"], collectives
    gather = re.search(r"stablehlo\.all_gather.*", stablehlo).group(0)
    assert (
        f"(tensor<{batch}x{heads_own}x576xui8>) -> tensor<{batch}x{dcp * heads_own}x576xui8>"
        in gather
    ), gather
    exchange = re.search(r"stablehlo\.all_to_all.*", stablehlo).group(0)
    assert f"tensor<{batch}x{dcp}x{heads_own}x514xui16>" in exchange, exchange

    compiled = lowered.compile().as_text()
    ops = [
        (line.split(" = ", 1)[1].split(f" {m.group(1)}")[0], m.group(1))
        for line in compiled.splitlines()
        if (
            m := re.search(
                r"\s(all-gather|all-to-all|all-reduce|collective-permute|"
                r"reduce-scatter|collective-broadcast)(?:-start)?\(",
                line,
            )
        )
    ]
    assert sorted(op for _, op in ops) == ["all-gather", "all-to-all"], ops
    gather_type = next(t for t, op in ops if op == "all-gather")
    assert gather_type.startswith(f"u8[{batch},{dcp * heads_own},576]"), gather_type


# ---------------------------------------------------------------------------------------
# Argument errors


def test_dcp_decode_errors():
    q = jnp.zeros((2, 4, 576), FP8)
    kv = jnp.zeros((16, 576), FP8)
    rows = jnp.zeros((2, 8), jnp.int32)
    valid = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match=r"inside jax\.shard_map"):
        dcp_decode(q, kv, rows, valid, axis_name=AXIS, softmax_scale=1.0)

    mesh = mesh_of(2)

    def call(q, kv, rows, valid):
        fn = jax.shard_map(
            lambda *a: dcp_decode(*a, axis_name=AXIS, softmax_scale=1.0),
            mesh=mesh,
            in_specs=(P(None, AXIS), P(AXIS), P(), P()),
            out_specs=(P(None, AXIS),) * 2,
        )
        return fn(q, kv, rows, valid)

    with pytest.raises(ValueError, match=r"q must be \[B, H, 576\].*\(2, 2, 512\)"):
        call(jnp.zeros((2, 4, 512), FP8), kv, rows, valid)
    with pytest.raises(TypeError, match="q must be float8_e4m3fn"):
        call(q.astype(jnp.bfloat16), kv, rows, valid)
    with pytest.raises(ValueError, match="agree on B"):
        call(q, kv, jnp.zeros((3, 8), jnp.int32), valid)
    with pytest.raises(TypeError, match="rows must be int32"):
        call(q, kv, rows.astype(jnp.int16), valid)


# ---------------------------------------------------------------------------------------
# dcp_decode_tokens: local_rows + dcp_decode in one call


def tokens_program(mesh, *, block_size=None, exchange="collectives"):
    """jit(shard_map(dcp_decode_tokens)): fn(q, kv, tokens, table, step), as dcp_program."""
    paged = block_size is not None

    def body(q, kv, tokens, table, step):
        extra = dict(block_table=table, block_size=block_size) if paged else {}
        return jax_sparse_mla.dcp_decode_tokens(
            q, kv, tokens, axis_name=AXIS, softmax_scale=SOFTMAX_SCALE, q_scale=1.5,
            kv_scale=0.75, exchange=exchange, step=step, **extra,
        )  # fmt: skip

    in_specs = (P(None, AXIS), P(AXIS), P(), P(AXIS) if paged else None, P())
    out_specs = (P(None, AXIS), P(None, AXIS))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_dcp_decode_tokens_equals_local_rows_and_dcp_decode(dcp, paged):
    """Bit for bit what local_rows + dcp_decode give, flat and paged (int16 tokens: cast)."""
    rng = np.random.default_rng(300 + dcp)
    batch, heads_own, width, n_local, block_size = 6, 5, 24, 40, 8
    q = fp8(rng, (batch, dcp * heads_own, 576))
    tokens = make_tokens(rng, batch, width, dcp, dcp * n_local)
    if paged:
        seqs = fp8(rng, (1, dcp * n_local, 576))
        kv, table = shard_paged_cache(rng, seqs, dcp, block_size)
    else:
        kv, table, block_size = shard_flat_cache(fp8(rng, (dcp * n_local, 576)), dcp), None, None
    want = run_dcp(
        mesh_of(dcp), q, kv, tokens, table, block_size=block_size, q_scale=1.5, kv_scale=0.75
    )
    fn = tokens_program(mesh_of(dcp), block_size=block_size)
    got = fn(q, kv, jnp.asarray(tokens, jnp.int16), table, jnp.int32(0))
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.isfinite(np.asarray(got[0], np.float32)).all()


def test_dcp_decode_tokens_errors():
    q, kv = jnp.zeros((2, 4, 576), FP8), jnp.zeros((16, 576), FP8)
    tokens = jnp.zeros((2, 8), jnp.int32)
    mesh = mesh_of(2)

    def call(q, kv, tokens, **options):
        fn = jax.shard_map(
            lambda q, kv, tokens: jax_sparse_mla.dcp_decode_tokens(
                q, kv, tokens, axis_name=AXIS, softmax_scale=1.0, **options
            ),
            mesh=mesh,
            in_specs=(P(None, AXIS), P(AXIS), P()),
            out_specs=(P(None, AXIS),) * 2,
        )
        return fn(q, kv, tokens)

    with pytest.raises(ValueError, match=r"tokens must be \[B, K\]"):
        call(q, kv, jnp.zeros((2, 8, 1), jnp.int32))
    with pytest.raises(TypeError, match="tokens must be an integer array"):
        call(q, kv, tokens.astype(jnp.float32))
    with pytest.raises(ValueError, match="agree on B"):
        call(q, kv, jnp.zeros((3, 8), jnp.int32))
    with pytest.raises(ValueError, match="block_table and block_size go together"):
        call(q, kv, tokens, block_size=4)
    with pytest.raises(TypeError, match="q must be float8_e4m3fn"):
        call(q.astype(jnp.bfloat16), kv, tokens)
    with pytest.raises(ValueError, match="exchange must be one of"):
        call(q, kv, tokens, exchange="nccl")
    with pytest.raises(ValueError, match="needs step="):
        call(q, kv, tokens, exchange="push")
