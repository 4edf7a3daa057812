"""The public DSA indexer top-k (``index_topk``) and the map from its tokens to decode's rows
(``token_rows``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_sparse_mla import index_validation, reference, validation
from jax_sparse_mla.dcp import FILL_ROW, check_block_table, paged_rows
from jax_sparse_mla.index_primitive import HEAD_TILE, index_topk_p

__all__ = ["index_topk", "token_rows"]


def index_topk(
    q_index: jax.Array,
    weights: jax.Array,
    index_keys: jax.Array,
    index_scales: jax.Array,
    lengths: jax.Array,
    *,
    top_k: int = 2048,
    block_table: jax.Array | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """The DSA indexer's exact top-k: which cached tokens each query row attends.

    score(b, t, n) = index_scales[n] * sum_h weights[b, t, h] * relu(q_index[b, t, h] .
    index_keys[n]), the dot products of the FP8 values in FP32 (exact products, FP32 sums),
    the head sum in FP32.

    Args:
      q_index: [B, T, Hi, 128] float8_e4m3fn, the index query heads of T verify rows per
        request (T = 1: plain decode). Any Hi >= 1 (padded internally with zero heads to a
        multiple of 64; they add exactly 0).
      weights: [B, T, Hi] float32 head weights, with the query's FP8 scale and any constant
        factors already folded in. May be negative.
      index_keys: the index cache, one FP8 E4M3 key per token. Either flat [N, 128]: token t
        is row t, and every request reads this same token sequence (one request's cache
        shared by the B rows, e.g. speculative rows laid out as B requests of one context);
        or paged [num_blocks, block_size, 128]: token t of request b is at block
        ``block_table[b, t // block_size]``, offset ``t % block_size``.
      index_scales: float32 key scales, [N] (flat) or [num_blocks, block_size] (paged).
      lengths: [B] int32 context length of each request, the T new tokens included, clamped
        to [0, capacity] (capacity: N flat, max_blocks * block_size paged). Verify row t of
        a request with clamped length L scores positions [0, L - T + t + 1) (clamped to
        [0, capacity]).
      top_k: static Python int >= 1, tokens kept per row (DeepSeek V3.2: 2048).
      block_table: [B, max_blocks] int32 with a paged cache, None with a flat one. Entries
        outside [0, num_blocks) are never read: their tokens are not candidates.
      implementation: None (the kernel on a Hopper GPU, else the reference, noted once in
        the "jax_sparse_mla" logger), "cute" (the kernel or NotImplementedError at
        lowering), "reference" (pure jax.numpy).

    Returns:
      tokens: [B, T, top_k] int32, the top_k highest-scoring positions of each row in
      ascending position order, then -1 where a row has fewer than top_k candidates. Ties go
      to the higher score, then the smaller position; -0.0 equals +0.0 and NaN scores rank
      below every number. Exact on the scores the implementation computes: the kernel's
      FP8 tensor-core sums are within 2^-14 of each score's magnitude (README), so it and
      the reference can differ only where scores tie that closely at a row's k-th.

    Not differentiable (``jax.grad`` through it raises) and has no vmap rule (fold the
    mapped axis into B). ``token_rows`` turns the tokens into ``decode``'s rows and valid.
    """
    implementation = validation.check_implementation(implementation)
    top_k = index_validation.check_top_k(top_k)
    head_tile = 1 if implementation == "reference" else HEAD_TILE
    _, operands = index_validation.index_operands(
        q_index, weights, index_keys, index_scales, lengths, block_table, head_tile=head_tile
    )
    if implementation == "reference":  # arguments checked: straight to the math
        tokens, _ = reference.index_topk_flat(*operands, top_k)
        return tokens
    tokens, _ = index_topk_p.bind(
        *operands, top_k=top_k, dcp_size=1, require_kernel=implementation == "cute"
    )
    return tokens


def token_rows(
    tokens: jax.Array,
    *,
    block_table: jax.Array | None = None,
    block_size: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Map ``index_topk``'s tokens to the flat cache rows and valid counts of ``decode``, each
    verify row its own decode row.

    Args:
      tokens: [B, T, K] (or [B, K]) integer token positions as ``index_topk`` returns them:
        ascending, then -1 (any negative entry means "no token").
      block_table: optional [B, max_blocks] (or [1, max_blocks], shared by all requests)
        integer table of the decode's paged KV cache [num_blocks, block_size, W]: position
        t of request b is flat row ``block_table[b, t // block_size] * block_size + t %
        block_size`` of ``kv.reshape(-1, W)``. Without it a position is its flat row.
      block_size: tokens per block; required with ``block_table``, else not allowed.

    Returns:
      rows: [B * T, K] (or [B, K]) int32; slot i of row ``b * T + t`` holds the flat row of
        ``tokens[b, t, i]``, or ``FILL_ROW`` (-1) where that token is negative, its block
        index falls outside the table or its table entry is negative (decode skips rows
        outside [0, N)).
      valid: [B * T] (or [B]) int32, one past the last slot holding a token >= 0. For
        ``index_topk``'s tokens (packed to the front) that is their count, and
        ``rows[r, :valid[r]]`` are exactly the row's tokens. Tokens keep their slots (no
        compaction: index_topk's are already packed, and a cumsum, a scatter and a fill
        cost ~9 us per step in the example on an H200), so a -1 between tokens stays
        there and decode skips it.

    Jittable, no host synchronization.
    """
    if not hasattr(tokens, "ndim") or tokens.ndim not in (2, 3):
        raise ValueError(f"tokens must be [B, T, K] or [B, K], got {_describe(tokens)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be an integer array, got {_describe(tokens)}")
    check_block_table(tokens, block_table, block_size)
    batch, steps, width = (
        tokens.shape[0],
        tokens.shape[1] if tokens.ndim == 3 else 1,
        tokens.shape[-1],
    )
    tokens = tokens.astype(jnp.int32).reshape(batch * steps, width)
    present = tokens >= 0
    valid = jnp.max(
        jnp.where(present, jnp.arange(1, width + 1, dtype=jnp.int32), 0), axis=1, initial=0
    )
    if block_table is None:
        return jnp.where(present, tokens, FILL_ROW), valid
    if block_table.shape[0] == batch and steps > 1:  # one table row per verify row
        block_table = jnp.repeat(block_table, steps, axis=0)
    rows = paged_rows(jnp.maximum(tokens, 0), block_table, block_size)
    return jnp.where(present, rows, FILL_ROW), valid


def _describe(x) -> str:
    if x is None:
        return "None"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"shape={tuple(x.shape)} dtype={x.dtype}"
    return repr(x)
