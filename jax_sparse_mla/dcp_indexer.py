"""The indexer's top-k under decode context parallelism: ``dcp_index_topk`` over an index cache
sharded by token like the KV cache (global token t on rank ``t % D`` at local position
``t // D``).

Each rank selects the exact top-k of its own tokens (with their global positions), the ranks
all-gather these (score, position) candidates, and every rank runs the same exact selection
over the D * top_k of them. Exact: under the total order (higher score, then smaller
position) a token of the global top-k has fewer than top_k tokens above it globally, so
fewer than top_k above it on its own rank, so it is among that rank's candidates; and the
scores travel bit-exactly. The result equals the single-device ``index_topk`` over the whole
cache, bit for bit.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jax_sparse_mla import index_validation, reference, validation
from jax_sparse_mla.index_primitive import HEAD_TILE, index_topk_p

__all__ = ["dcp_index_topk", "merge_candidates"]

AxisName = Hashable | Sequence[Hashable]
_INT32_MAX = jnp.iinfo(jnp.int32).max


def merge_candidates(scores: jax.Array, positions: jax.Array, top_k: int) -> jax.Array:
    """The exact top-k of each row's candidates: scores [..., C] float32 and positions
    [..., C] int32 (a candidate is live iff its position is >= 0; positions of live
    candidates are distinct) -> tokens [..., top_k] int32.

    The same order as ``reference.select_topk``: the higher score first (``order_key``: -0.0
    equals +0.0, NaN below every number), ties to the smaller position; the chosen positions
    in ascending order, then -1 where a row has fewer than top_k live candidates.
    """
    live = positions >= 0
    # Ascending (~key, position) is descending score, then ascending position; dead candidates
    # (~INT32_MIN = INT32_MAX, position INT32_MAX) sort last.
    key = jnp.where(live, reference.order_key(scores), jnp.int32(reference.INT32_MIN))
    position = jnp.where(live, positions, _INT32_MAX)
    _, ranked = lax.sort((~key, position), dimension=-1, num_keys=2)
    width = ranked.shape[-1]
    if width < top_k:
        pad = [(0, 0)] * (ranked.ndim - 1) + [(0, top_k - width)]
        ranked = jnp.pad(ranked, pad, constant_values=_INT32_MAX)
    tokens = jnp.sort(ranked[..., :top_k], axis=-1)
    return jnp.where(tokens == _INT32_MAX, -1, tokens).astype(jnp.int32)


def dcp_index_topk(
    q_index: jax.Array,
    weights: jax.Array,
    index_keys: jax.Array,
    index_scales: jax.Array,
    lengths: jax.Array,
    *,
    axis_name: AxisName,
    top_k: int = 2048,
    block_table: jax.Array | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """``index_topk`` over a token-sharded index cache; call inside ``jax.shard_map``.

    Args:
      q_index, weights: [B, T, Hi, 128] float8_e4m3fn and [B, T, Hi] float32, replicated
        (every rank passes all requests, verify rows and heads).
      index_keys, index_scales: this rank's shard of the index cache, laid out as for
        ``index_topk`` over its local positions: flat [N_local, 128] + [N_local] (local
        position j is row j), or paged [num_blocks, block_size, 128] + [num_blocks,
        block_size] with this rank's ``block_table`` [B, max_blocks] int32 mapping local
        positions to its blocks. Global token t is local position ``t // D`` of rank
        ``t % D`` (D: the size of ``axis_name``).
      lengths: [B] int32 GLOBAL context lengths (the T new tokens included), clamped to
        [0, D * local capacity] (local capacity: N_local flat, max_blocks * block_size
        paged, the same on every rank).
      axis_name: the mesh axis (or axes) the cache is sharded over.
      top_k, implementation: as for ``index_topk`` (same on every rank).

    Returns:
      tokens: [B, T, top_k] int32 GLOBAL token positions, the same on every rank and the
      same, bit for bit, as ``index_topk`` over the unsharded cache of capacity D * local
      capacity: ascending, then -1. ``local_rows`` maps them to each rank's decode rows.

    Per call: the local top-k on each rank and one all-gather of the D * top_k (score,
    position) candidates per row (8 bytes each, packed into one int32 buffer).
    """
    implementation = validation.check_implementation(implementation)
    top_k = index_validation.check_top_k(top_k)
    # Checked on this rank's shard, so errors show the local shapes.
    shapes = index_validation.check_index_args(
        q_index, weights, index_keys, index_scales, lengths, block_table
    )
    dcp_size = validation.axis_size(axis_name, "dcp_index_topk")
    capacity = dcp_size * shapes.capacity
    if capacity >= 2**31:
        raise ValueError(
            f"int32 global positions reach 2**31 - 1; {dcp_size} ranks of {shapes.capacity} "
            f"positions address {capacity}"
        )
    q, w = index_validation.pad_heads(
        jnp.asarray(q_index),
        jnp.asarray(weights),
        1 if implementation == "reference" else HEAD_TILE,
    )
    keys, scales, table = index_validation.paged_cache(
        jnp.asarray(index_keys), jnp.asarray(index_scales), block_table, shapes.batch
    )
    rank = lax.axis_index(axis_name).astype(jnp.int32)
    lengths = jnp.asarray(lengths).astype(jnp.int32)
    operands = (q, w, keys, scales, table, lengths, rank[None])
    if implementation == "reference":
        local, scores = reference.index_topk_flat(*operands, top_k, dcp_size)
    else:
        local, scores = index_topk_p.bind(
            *operands, top_k=top_k, dcp_size=dcp_size, require_kernel=implementation == "cute"
        )
    # Gathered as invariant over the axis: the merged tokens are the same on every rank, and
    # typed so (shard_map's out_specs may replicate them).
    if dcp_size == 1:
        return lax.all_gather(local, axis_name, to="invarying")[0]
    positions = jnp.where(local >= 0, local * dcp_size + rank, -1)
    # One collective: scores (as their int32 bits, untouched by any backend) and positions
    # packed side by side, [B, T, top_k, 2] -> [D, B, T, top_k, 2] -> [B, T, D * top_k, 2].
    packed = jnp.stack([lax.bitcast_convert_type(scores, jnp.int32), positions], axis=-1)
    packed = jnp.moveaxis(lax.all_gather(packed, axis_name, to="invarying"), 0, 2)
    packed = packed.reshape(shapes.batch, shapes.steps, dcp_size * top_k, 2)
    scores = lax.bitcast_convert_type(packed[..., 0], jnp.float32)
    return merge_candidates(scores, packed[..., 1], top_k)
