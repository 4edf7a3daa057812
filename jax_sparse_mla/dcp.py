"""Decode context parallelism (DCP): sparse MLA decode over a token-sharded KV cache.

The KV cache is sharded by token over the D ranks of a mesh axis, vLLM's interleaved
layout: global token t lives on rank ``t % D`` at local position ``t // D``. Every rank
attends its own keys for the query heads of *all* ranks and sends each partial result back
to the head's owner, which merges the D partials by their log-sum-exp.

Per call, inside ``jax.shard_map``, the collectives are:

1. one ``all_gather`` of q over the heads axis, as raw uint8 bytes (576 B per head and row;
   XLA:CPU would widen an FP8 collective to f16, and bytes are what NCCL moves anyway);
2. one ``all_to_all`` of the partials: latent (bf16) and LSE (f32) packed bit-exactly into
   one uint16 buffer ``[B, D, H_own, 512 + 2]`` (latent words 0..511, LSE words 512..513),
   so the partials cost one collective launch and one synchronization instead of two. At
   decode sizes the exchange is latency-bound (~0.5 MB at DCP8, B=5, 96 heads), so the 2
   extra columns and the pack (one small copy) and unpack (bitcasts fused into the merge)
   are cheaper than a second collective. Integer words, not bf16: no backend may touch
   the bits (an f32 half can look like a bf16 NaN).

``exchange="push"`` replaces both collectives on CUDA GPUs with the one-sided exchange of
``push_exchange`` (mailboxes set up once by ``dcp_setup``): the decode kernel pushes this
rank's query heads to the other ranks' decodes and its partials to the heads' owners, the
owner's kernel merges; elsewhere it runs as above. Its kernel takes the global top-k tokens
and compacts this rank's itself: ``dcp_decode_tokens`` passes them straight (no ``local_rows``
kernels in the step), ``dcp_decode`` encodes its rows and valid as such tokens.

The KV cache never moves.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jax_sparse_mla import push_exchange, validation
from jax_sparse_mla.kernel.config import KernelConfig
from jax_sparse_mla.merge import merge_along
from jax_sparse_mla.ops import decode

__all__ = ["FILL_ROW", "dcp_decode", "dcp_decode_tokens", "local_rows"]

FILL_ROW = -1
"""Value of ``local_rows``'s entries past ``valid`` (and of tokens that map outside the
block table): out of range for every cache, so a kernel that read it would skip it."""

# An f32 LSE travels as two uint16 words next to the 512 bf16 (uint16) latent columns.
_PACKED_DIM = validation.LATENT + 2

AxisName = Hashable | Sequence[Hashable]
EXCHANGES = ("collectives", "push")


def _shape_str(x: jax.Array) -> str:
    return f"shape={tuple(x.shape)} dtype={x.dtype}"


def local_rows(
    tokens: jax.Array,
    *,
    rank: int | jax.Array,
    dcp_size: int,
    block_table: jax.Array | None = None,
    block_size: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Map exact global top-k token positions to one DCP rank's compacted local cache rows.

    Token ``t`` lives on rank ``t % dcp_size`` at local position ``p = t // dcp_size``
    (vLLM's interleaved DCP layout). For each row ``b`` this returns the local flat cache
    rows of the tokens of ``tokens[b]`` that this rank holds, in their original order,
    packed to the front.

    Args:
      tokens: [B, K] integer global token positions; any negative entry means "no token".
      rank: this rank, a Python int or a traced int32 scalar (e.g. ``lax.axis_index``).
      dcp_size: D, the number of ranks (static).
      block_table: optional [B, blocks] or [1, blocks] int32 table of a paged local cache
        (a [1, blocks] table is shared by all rows). Local position ``p`` maps to flat row
        ``block_table[b, p // block_size] * block_size + p % block_size``, the row index
        of ``kv.reshape(-1, W)`` for a paged ``kv`` [num_blocks, block_size, W].
      block_size: tokens per block; required with ``block_table``, else not allowed.

    Returns:
      rows: [B, K] int32. ``rows[b, :valid[b]]`` are the local flat rows, in token order;
        entries past ``valid[b]`` are ``FILL_ROW`` (-1). A token whose block index falls
        outside the table, or whose table entry is negative, keeps its slot (it is counted
        in ``valid``) with row -1, which decode skips as out of range.
      valid: [B] int32 number of this rank's tokens per row.

    Jittable with no host synchronization; ``rank`` may be traced.
    """
    if not isinstance(dcp_size, int) or isinstance(dcp_size, bool) or dcp_size < 1:
        raise ValueError(f"dcp_size must be a Python int >= 1, got {dcp_size!r}")
    if not hasattr(tokens, "ndim") or tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, K], got {getattr(tokens, 'shape', tokens)!r}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be an integer array, got {_shape_str(tokens)}")
    if isinstance(rank, int) and not 0 <= rank < dcp_size:
        raise ValueError(f"rank must be in [0, {dcp_size}), got {rank}")
    check_block_table(tokens, block_table, block_size)
    batch, width = tokens.shape

    tokens = tokens.astype(jnp.int32)
    rank = jnp.asarray(rank, jnp.int32)
    mine = (tokens >= 0) & (tokens % dcp_size == rank)
    position = tokens // dcp_size
    if block_table is not None:
        position = paged_rows(position, block_table, block_size)

    # Stable compaction by scatter: the i-th token of this rank goes to slot i; each other
    # entry aims at its own slot past K (indices stay unique: no atomics), which is dropped.
    column = jnp.arange(width, dtype=jnp.int32)
    slot = jnp.where(mine, jnp.cumsum(mine, axis=1, dtype=jnp.int32) - 1, width + column)
    batch_index = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], slot.shape)
    rows = jnp.full((batch, width), FILL_ROW, jnp.int32)
    rows = rows.at[batch_index, slot].set(position, mode="drop", unique_indices=True)
    valid = jnp.sum(mine, axis=1, dtype=jnp.int32)
    return rows, valid


def check_block_table(tokens: jax.Array, block_table, block_size) -> None:
    """ValueError unless block_table [B or 1, blocks] (integer) and block_size (int >= 1) are
    both given or both None, for tokens [B, K]."""
    if (block_table is None) != (block_size is None):
        raise ValueError(
            "block_table and block_size go together, got "
            f"block_table={'None' if block_table is None else _shape_str(block_table)}, "
            f"block_size={block_size!r}"
        )
    if block_table is None:
        return
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a Python int >= 1, got {block_size!r}")
    batch = tokens.shape[0]
    if (
        not hasattr(block_table, "ndim")
        or block_table.ndim != 2
        or block_table.shape[0] not in (1, batch)
        or not jnp.issubdtype(block_table.dtype, jnp.integer)
    ):
        raise ValueError(
            f"block_table must be integer [{batch} or 1, blocks] for tokens "
            f"{tuple(tokens.shape)}, got "
            f"{_shape_str(block_table) if hasattr(block_table, 'shape') else block_table!r}"
        )


def paged_rows(position: jax.Array, block_table: jax.Array, block_size: int) -> jax.Array:
    """Flat rows [B, K] int32 of the local positions [B, K] (>= 0) through a [B or 1, blocks]
    block table: FILL_ROW where the block index is past the table or its entry is negative."""
    batch = position.shape[0]
    table = block_table.astype(jnp.int32)
    blocks = table.shape[1]
    block_index = position // block_size
    block = jnp.take_along_axis(
        jnp.broadcast_to(table, (batch, blocks)), jnp.clip(block_index, 0, blocks - 1), axis=1
    )
    mapped = (block_index < blocks) & (block >= 0)
    return jnp.where(mapped, block * block_size + position % block_size, FILL_ROW)


def _step_scalar(step) -> jax.Array:
    if step is None:
        raise ValueError(
            "dcp_decode(exchange='push') needs step=, the decode step counter (an int32 "
            "scalar, traced or not, that advances at every exchange: its parity picks the "
            "mailbox slot)"
        )
    if not jnp.issubdtype(jnp.result_type(step), jnp.integer) or jnp.ndim(step) != 0:
        raise TypeError(f"step must be an integer scalar, got {getattr(step, 'shape', step)!r}")
    return jnp.asarray(step, jnp.int32)


def _as_tokens(rows, keys, *, n_rows: int, rank, dcp_size: int) -> jax.Array:
    """Local rows [B, K] as the global tokens the push cubins compact back to the same keys in
    the same order: where ``keys`` (this rank's key slots), token row * D + rank (a row
    outside [0, n_rows) as row n_rows, which the kernel skips as it would have), else -1
    (not this rank's). One elementwise kernel."""
    if n_rows * dcp_size + dcp_size > 2**31:
        raise ValueError(
            f"exchange='push' encodes rows as tokens row * D + rank in int32: kv's {n_rows} "
            f"rows times D={dcp_size} do not fit; use exchange='collectives'"
        )
    row = jnp.where((rows >= 0) & (rows < n_rows), rows, n_rows)
    return jnp.where(keys, row * dcp_size + rank, -1)


def paged_as_tokens(tokens, block_table, *, block_size: int, n_rows: int, rank, dcp_size: int):
    """Global tokens [B, K] int32 on a paged cache as the push cubins take them: this rank's
    mapped through its block table to flat rows, encoded by ``_as_tokens``. One elementwise
    kernel (XLA fuses it with the tokens' producer where it can: measured cheaper than the
    same lookup inside the kernel, session 44)."""
    mine = (tokens >= 0) & (tokens % dcp_size == rank)
    rows = paged_rows(jnp.where(mine, tokens // dcp_size, 0), block_table, block_size)
    return _as_tokens(rows, mine, n_rows=n_rows, rank=rank, dcp_size=dcp_size)


def _collectives_exchange(latent, lse, *, axis_name, dcp_size):
    """all_to_all of the packed partials, then the merge (see the module docstring)."""
    batch, gathered, _ = latent.shape
    heads_own = gathered // dcp_size
    # [B, D*H_own, ...] -> [B, D, H_own, ...] is free; the all_to_all then sends slice
    # [:, r] to rank r and stacks what it receives by source rank along the same axis.
    latent = lax.bitcast_convert_type(latent, jnp.uint16)
    lse = lax.bitcast_convert_type(lse, jnp.uint16)
    packed = jnp.concatenate([latent, lse], axis=-1).reshape(
        batch, dcp_size, heads_own, _PACKED_DIM
    )
    packed = lax.all_to_all(packed, axis_name, split_axis=1, concat_axis=1, tiled=True)
    latent = lax.bitcast_convert_type(packed[..., : validation.LATENT], jnp.bfloat16)
    lse = lax.bitcast_convert_type(packed[..., validation.LATENT :], jnp.float32)
    return merge_along(latent, lse, axis=1)


def dcp_decode(
    q: jax.Array,
    kv: jax.Array,
    rows: jax.Array,
    valid: jax.Array,
    *,
    axis_name: AxisName,
    softmax_scale: float,
    q_scale: float | jax.Array = 1.0,
    kv_scale: float | jax.Array = 1.0,
    implementation: str | None = None,
    exchange: str = "collectives",
    step: int | jax.Array | None = None,
    valid_hint: int | None = None,
    kernel_config: KernelConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Sparse MLA decode under decode context parallelism; call inside ``jax.shard_map``.

    All arguments are this rank's shard (shapes below are per rank; D is the size of
    ``axis_name``):

    Args:
      q: [B, H_own, 576] float8_e4m3fn, this rank's own query heads (absorbed MLA: 512
        latent + 64 RoPE). The heads of all ranks are gathered; gathered head
        ``rank * H_own + h`` is head ``h`` of rank ``rank``.
      kv: [N_local, W] float8_e4m3fn, this rank's token shard of the cache, or paged
        [num_blocks, block_size, W] (flat row = block * block_size + offset); W >= 576 as
        for ``jax_sparse_mla.decode``.
      rows: [B, K] int32 local flat rows of this rank's keys (see ``local_rows``).
      valid: [B] int32; row b attends ``rows[b, :clamp(valid[b], 0, K)]``; entries outside
        [0, N_local) are skipped.
      axis_name: the mesh axis (or axes) the cache is sharded over.
      softmax_scale, q_scale, kv_scale, implementation: as for ``jax_sparse_mla.decode``
        (same on every rank).
      exchange: how the partials reach their owners. "collectives" (default): one XLA
        all_to_all, any platform. "push": on CUDA GPUs set up by ``jax_sparse_mla.dcp_setup``,
        no collective: each rank's decode kernel pushes its query heads to the others' and
        its partials straight into the owners' mailboxes, and the owner merges them
        (see ``jax_sparse_mla.push_exchange``: its step rule, timeout and errors); with
        ``implementation="reference"`` or on other platforms it runs as "collectives", with
        the same results. Its kernel takes global tokens and compacts them itself: here
        rows and valid are handed over as such tokens (one elementwise kernel);
        ``dcp_decode_tokens`` takes the tokens straight and runs no ``local_rows``.
      step: int32 scalar (traced or not), required with "push": each push exchange must
        advance it past the previous one's by an odd amount below 2^30 (int32, wrapping; a
        decode loop's counter, ``step * layers + layer`` with several exchanges per step;
        never restarted without ``dcp_setup``): otherwise NaN rows and a recorded error.
        Unused by "collectives".
      valid_hint: as for ``jax_sparse_mla.decode``, of this rank's valid keys per row. None
        (default): ceil(K / D), what a rank holds of a full row under the interleaved layout
        (``local_rows``), so the kernel config suits the keys a rank really has. Results never
        depend on it; where one rank holds far more of a row (a skewed row, another layout)
        that call is only slower: pass K (or a ``kernel_config``) there.
      kernel_config: as for ``jax_sparse_mla.decode`` (both exchanges run that config; "push"
        its cubin that also exchanges the query heads).

    Returns:
      latent: [B, H_own, 512] bfloat16, this rank's heads merged over all ranks' keys.
      lse: [B, H_own] float32, natural-log sum of exp(logits) over all ranks' keys.
      A (row, head) with no keys on any rank gets zeros and -inf.

    Numerics: each rank's partial is rounded to bf16 before the exchange (as the kernel's
    output), the LSE travels exactly, and the merge runs in f32 with one final bf16
    rounding. The push merge uses the GPU's exp2/log2 approximations: it agrees with the
    collectives' merge to within a bf16 rounding, not bit for bit.
    """
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    step_value = _step_scalar(step) if exchange == "push" else None
    # Checked on this rank's shard, before the gather, so errors show the local shapes.
    validation.check_decode_args(q, kv, rows, valid)
    dcp_size = validation.axis_size(axis_name, "dcp_decode")
    n_rows = math.prod(kv.shape[:-1])

    def to_tokens(rank, rows, valid):
        keys = jnp.arange(rows.shape[1], dtype=jnp.int32) < valid[:, None]
        return _as_tokens(rows, keys, n_rows=n_rows, rank=rank, dcp_size=dcp_size)

    return _sharded_decode(
        q, kv, (rows, valid), to_local=lambda rank, rows, valid: (rows, valid),
        to_tokens=to_tokens, axis_name=axis_name, dcp_size=dcp_size, exchange=exchange,
        step=step_value, softmax_scale=softmax_scale, q_scale=q_scale, kv_scale=kv_scale,
        implementation=implementation, valid_hint=valid_hint, kernel_config=kernel_config,
    )  # fmt: skip


def dcp_decode_tokens(
    q: jax.Array,
    kv: jax.Array,
    tokens: jax.Array,
    *,
    axis_name: AxisName,
    softmax_scale: float,
    block_table: jax.Array | None = None,
    block_size: int | None = None,
    q_scale: float | jax.Array = 1.0,
    kv_scale: float | jax.Array = 1.0,
    implementation: str | None = None,
    exchange: str = "collectives",
    step: int | jax.Array | None = None,
    valid_hint: int | None = None,
    kernel_config: KernelConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``local_rows`` and ``dcp_decode`` in one call, from the indexer's global top-k tokens;
    call inside ``jax.shard_map``.

    Same results as ``rows, valid = local_rows(tokens, rank=lax.axis_index(axis_name),
    dcp_size=D, block_table=block_table, block_size=block_size)`` followed by ``dcp_decode(q,
    kv, rows, valid, ...)``, and that is how it runs with ``exchange="collectives"`` (or the
    reference, or off CUDA). With ``exchange="push"`` on CUDA the pushing decode kernel
    compacts this rank's tokens itself, so the step runs no ``local_rows`` kernels (~4-7 us
    of XLA kernels per call on an H200); with a ``block_table`` one elementwise kernel maps
    the tokens to flat rows first.

    Args:
      q, kv: as for ``dcp_decode`` (this rank's own heads; this rank's shard of the cache).
      tokens: [B, K] integer global token positions, the same on every rank (e.g.
        ``dcp_index_topk``'s result); any negative entry means "no token". Token t is local
        position ``t // D`` of rank ``t % D``.
      block_table, block_size: as for ``local_rows`` (this rank's table of a paged cache).
      The rest: as for ``dcp_decode`` (``valid_hint`` counts this rank's keys per row; its
      default ceil(K / D) suits the interleaved layout).

    Returns:
      latent [B, H_own, 512] bfloat16 and lse [B, H_own] float32, as ``dcp_decode``.
    """
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    step_value = _step_scalar(step) if exchange == "push" else None
    if not hasattr(tokens, "ndim") or tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, K], got {getattr(tokens, 'shape', tokens)!r}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"tokens must be an integer array, got {_shape_str(tokens)}")
    check_block_table(tokens, block_table, block_size)
    batch, width = tokens.shape
    # rows and valid as local_rows makes them: the decode's checks name q, kv and the sizes.
    validation.check_decode_args(
        q, kv, jax.ShapeDtypeStruct((batch, width), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )  # fmt: skip
    dcp_size = validation.axis_size(axis_name, "dcp_decode_tokens")
    n_rows = math.prod(kv.shape[:-1])
    tables = () if block_table is None else (block_table,)

    def to_local(rank, tokens, *table):
        return local_rows(
            tokens, rank=rank, dcp_size=dcp_size, block_table=table[0] if table else None,
            block_size=block_size,
        )  # fmt: skip

    def to_tokens(rank, tokens, *table):
        tokens = tokens.astype(jnp.int32)
        if not table:
            return tokens  # the kernel compacts them as they are
        return paged_as_tokens(
            tokens, table[0], block_size=block_size, n_rows=n_rows, rank=rank, dcp_size=dcp_size
        )

    return _sharded_decode(
        q, kv, (tokens, *tables), to_local=to_local, to_tokens=to_tokens, axis_name=axis_name,
        dcp_size=dcp_size, exchange=exchange, step=step_value, softmax_scale=softmax_scale,
        q_scale=q_scale, kv_scale=kv_scale, implementation=implementation,
        valid_hint=valid_hint, kernel_config=kernel_config,
    )  # fmt: skip


def _sharded_decode(
    q, kv, operands, *, to_local, to_tokens, axis_name, dcp_size, exchange, step,
    softmax_scale, q_scale, kv_scale, implementation, valid_hint, kernel_config,
):  # fmt: skip
    """dcp_decode's run from ``operands``, which ``to_local(rank, *operands)`` turns into this
    rank's (rows, valid) and ``to_tokens(rank, *operands)`` into the push cubins' global
    tokens [B, K] int32 (rank: the traced axis index; D = dcp_size)."""
    width = operands[0].shape[1]
    if valid_hint is None:
        valid_hint = -(-width // dcp_size)
    kwargs = dict(
        softmax_scale=softmax_scale,
        q_scale=q_scale,
        kv_scale=kv_scale,
        implementation=implementation,
        valid_hint=valid_hint,
        kernel_config=kernel_config,
    )
    if dcp_size == 1:
        return decode(q, kv, *to_local(0, *operands), **kwargs)

    def collectives(q, kv, rank, step, *operands):
        del step
        rows, valid = to_local(rank, *operands)
        # Gathered as raw bytes: a backend may widen an FP8 collective (XLA:CPU gathers f16).
        gathered = lax.all_gather(
            lax.bitcast_convert_type(q, jnp.uint8), axis_name, axis=1, tiled=True
        )
        gathered = lax.bitcast_convert_type(gathered, q.dtype)
        latent, lse = decode(gathered, kv, rows, valid, **kwargs)
        return _collectives_exchange(latent, lse, axis_name=axis_name, dcp_size=dcp_size)

    rank = lax.axis_index(axis_name).astype(jnp.int32)
    if exchange == "collectives" or implementation == "reference":
        return collectives(q, kv, rank, None, *operands)

    def push(q, kv, rank, step, *operands):
        merged = push_exchange.decode_and_exchange_tokens(
            q,
            kv,
            to_tokens(rank, *operands),
            rank=rank,
            step=step,
            dcp_size=dcp_size,
            softmax_scale=softmax_scale,
            q_scale=q_scale,
            kv_scale=kv_scale,
            valid_hint=valid_hint,
            kernel_config=kernel_config,
        )
        # Typed like the collectives' results: they vary over the axis (shard_map's check_vma).
        return lax.pcast(merged, axis_name, to="varying")

    return lax.platform_dependent(q, kv, rank, step, *operands, default=collectives, cuda=push)
