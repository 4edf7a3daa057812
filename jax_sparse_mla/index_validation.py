"""Argument checks and operand normalization for the indexer's top-k (``index_topk``,
``dcp_index_topk``, ``reference.index_topk``).

Every check raises before anything is traced into a computation, with a message that names the
argument and shows the shapes or dtypes it saw. The normalized operands are the contract of
``index_primitive``: a paged cache, a block table per request and a causal limit per row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jax_sparse_mla import validation
from jax_sparse_mla.validation import dtype_of, shape_of

INDEX_DIM = 128  # bytes of an index query head or key (FP8 E4M3)
FP8 = validation.FP8


@dataclass(frozen=True)
class IndexShapes:
    """Sizes of one index_topk call: B requests, T verify rows each, H index heads, and the
    positions a row can address (``capacity``: N for a flat cache, max_blocks * block_size
    for a paged one)."""

    batch: int
    steps: int
    heads: int
    capacity: int
    paged: bool


def _check_dtype(name: str, x, dtype) -> None:
    if dtype_of(x) != dtype:
        raise TypeError(
            f"{name} must be {jnp.dtype(dtype).name}, got {dtype_of(x)} "
            f"({name}.shape={shape_of(x)})"
        )


def check_top_k(top_k) -> int:
    """top_k is static: a Python int >= 1."""
    if isinstance(top_k, (bool, jax.core.Tracer)) or not isinstance(top_k, (int, np.integer)):
        raise TypeError(f"top_k must be a static Python int, got {type(top_k).__name__}")
    if not 1 <= top_k < 2**31:
        raise ValueError(f"top_k must be in [1, 2**31), got {top_k=}")
    return int(top_k)


def check_index_args(
    q_index, weights, index_keys, index_scales, lengths, block_table
) -> IndexShapes:
    """Validate the array arguments of index_topk; return the sizes they imply."""
    _check_dtype("q_index", q_index, FP8)
    _check_dtype("weights", weights, jnp.float32)
    _check_dtype("index_keys", index_keys, FP8)
    _check_dtype("index_scales", index_scales, jnp.float32)
    _check_dtype("lengths", lengths, jnp.int32)
    q_shape, weights_shape = shape_of(q_index), shape_of(weights)
    keys_shape, scales_shape = shape_of(index_keys), shape_of(index_scales)
    lengths_shape = shape_of(lengths)
    if len(q_shape) != 4 or q_shape[3] != INDEX_DIM:
        raise ValueError(f"q_index must be [B, T, Hi, {INDEX_DIM}], got {q_shape=}")
    batch, steps, heads = q_shape[:3]
    if steps < 1:
        raise ValueError(f"q_index must have at least one verify row (T >= 1), got {q_shape=}")
    if heads < 1:
        raise ValueError(f"q_index must have at least one head (Hi >= 1), got {q_shape=}")
    if weights_shape != (batch, steps, heads):
        raise ValueError(
            f"weights must be [B, T, Hi] = {(batch, steps, heads)} like q_index, got "
            f"{weights_shape=} ({q_shape=})"
        )
    if lengths_shape != (batch,):
        raise ValueError(f"lengths must be [B] = ({batch},), got {lengths_shape=} ({q_shape=})")
    if len(keys_shape) not in (2, 3) or keys_shape[-1] != INDEX_DIM:
        raise ValueError(
            f"index_keys must be [N, {INDEX_DIM}] or paged [num_blocks, block_size, "
            f"{INDEX_DIM}], got {keys_shape=}"
        )
    if scales_shape != keys_shape[:-1]:
        raise ValueError(
            f"index_scales must be {list(keys_shape[:-1])} (one scale per key), got "
            f"{scales_shape=} ({keys_shape=})"
        )
    if min(keys_shape[:-1]) < 1:
        raise ValueError(f"index_keys must hold at least one key, got {keys_shape=}")
    cache_rows = math.prod(keys_shape[:-1])
    paged = len(keys_shape) == 3
    if not paged:
        if block_table is not None:
            raise ValueError(
                f"block_table goes with a paged cache [num_blocks, block_size, {INDEX_DIM}]; "
                f"index_keys is flat ({keys_shape=}): pass block_table=None"
            )
        capacity = cache_rows
    else:
        if block_table is None:
            raise ValueError(
                f"a paged cache ({keys_shape=}) needs block_table [B, max_blocks] int32"
            )
        _check_dtype("block_table", block_table, jnp.int32)
        table_shape = shape_of(block_table)
        if len(table_shape) != 2 or table_shape[0] != batch or table_shape[1] < 1:
            raise ValueError(
                f"block_table must be [B, max_blocks] with B = {batch} and max_blocks >= 1, "
                f"got {table_shape=} ({q_shape=})"
            )
        capacity = table_shape[1] * keys_shape[1]
    if max(capacity, cache_rows) >= 2**31:
        raise ValueError(
            f"int32 positions and cache rows reach 2**31 - 1; this cache holds {cache_rows} "
            f"keys and addresses {capacity} positions ({keys_shape=})"
        )
    return IndexShapes(batch, steps, heads, capacity, paged)


def pad_heads(q_index, weights, head_tile: int):
    """Zero heads (and zero weights) appended up to a multiple of ``head_tile``: they add
    exactly 0 to every score."""
    heads = q_index.shape[2]
    padded = -(-heads // head_tile) * head_tile
    if padded == heads:
        return q_index, weights
    q_index = jnp.pad(q_index, ((0, 0), (0, 0), (0, padded - heads), (0, 0)))
    return q_index, jnp.pad(weights, ((0, 0), (0, 0), (0, padded - heads)))


def paged_cache(index_keys, index_scales, block_table, batch: int):
    """The cache in paged form: (keys [num_blocks, block_size, 128], scales [num_blocks,
    block_size], block_table [B, max_blocks]); a flat cache is one block of N keys that every
    request reads through a zero table."""
    if index_keys.ndim == 3:
        return index_keys, index_scales, jnp.asarray(block_table)
    table = jnp.zeros((batch, 1), jnp.int32)
    return index_keys[None], index_scales[None], table


def row_limits(lengths, rank=0, *, steps: int, capacity: int, dcp_size: int = 1):
    """limits [B, T] int32: how many of a cache's ``capacity`` positions each verify row
    scores. Verify row t of a request with context L = clamp(length, 0, D * capacity) (the T
    new tokens included) scores global positions [0, L - T + t + 1) (that limit clamped to
    [0, D * capacity]); with DCP (D = dcp_size ranks, global position p on rank p % D at local
    position p // D) this rank holds ceil((limit - rank) / D) of them. The kernels compute
    the same in-kernel (kernel/index/scores.row_limit)."""
    global_capacity = dcp_size * capacity
    context = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, global_capacity)
    row = jnp.arange(steps, dtype=jnp.int32)
    limits = jnp.maximum(context[:, None] - (steps - 1) + row[None, :], 0)
    return ((limits - rank + dcp_size - 1) // dcp_size).astype(jnp.int32)


def index_operands(
    q_index, weights, index_keys, index_scales, lengths, block_table, *, head_tile: int = 1
):
    """index_topk's arguments checked (errors name the argument) and normalized for the
    primitive: (sizes, (q, weights, keys, key_scales, block_table, lengths, rank)) with the
    heads padded to a multiple of ``head_tile``, lengths [B] int32 as given (the primitive
    clamps them: row_limits) and rank [1] int32 zero (one device)."""
    shapes = check_index_args(q_index, weights, index_keys, index_scales, lengths, block_table)
    q, w = pad_heads(jnp.asarray(q_index), jnp.asarray(weights), head_tile)
    keys, scales, table = paged_cache(
        jnp.asarray(index_keys), jnp.asarray(index_scales), block_table, shapes.batch
    )
    lengths = jnp.asarray(lengths).astype(jnp.int32)
    return shapes, (q, w, keys, scales, table, lengths, jnp.zeros((1,), jnp.int32))
