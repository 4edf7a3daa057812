"""Argument checks shared by the public entry points.

Every check raises before anything is traced into a computation, with a message that names the
argument and shows the shapes or dtypes it saw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ROW_BYTES = 576  # one cache / query row: 512 latent + 64 RoPE, FP8 E4M3
ROW_ALIGN = 16  # a padded cache row's width W: a multiple of this (bulk copies need 16 B)
LATENT = 512
HEAD_TILE = 16  # the kernel takes heads 16 at a time
IMPLEMENTATIONS = (None, "cute", "reference")
FP8 = jnp.float8_e4m3fn


@dataclass(frozen=True)
class DecodeShapes:
    """Sizes of one decode call: B rows, H heads, N flat cache rows, K index slots."""

    batch: int
    heads: int
    cache_rows: int
    width: int
    paged: bool


def shape_of(x) -> tuple[int, ...]:
    """The shape of an array or array-like (for error messages and checks)."""
    return tuple(np.shape(x))


def dtype_of(x):
    """The dtype of an array or array-like."""
    return x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype


def check_decode_args(q, kv, rows, valid) -> DecodeShapes:
    """Validate the array arguments of decode; return the sizes they imply."""
    if dtype_of(q) != FP8:
        raise TypeError(f"q must be float8_e4m3fn, got {dtype_of(q)} ({shape_of(q)=})")
    if dtype_of(kv) != FP8:
        raise TypeError(f"kv must be float8_e4m3fn, got {dtype_of(kv)} ({shape_of(kv)=})")
    for name, x in (("rows", rows), ("valid", valid)):
        if dtype_of(x) != jnp.int32:
            raise TypeError(f"{name} must be int32, got {dtype_of(x)} ({name}.shape={shape_of(x)})")
    q_shape, kv_shape = shape_of(q), shape_of(kv)
    rows_shape, valid_shape = shape_of(rows), shape_of(valid)
    if len(q_shape) != 3 or q_shape[2] != ROW_BYTES:
        raise ValueError(f"q must be [B, H, {ROW_BYTES}], got {q_shape=}")
    if len(kv_shape) not in (2, 3):
        raise ValueError(
            f"kv must be [N, W] or paged [num_blocks, block_size, W] (W >= {ROW_BYTES}), "
            f"got {kv_shape=}"
        )
    row_bytes = kv_shape[-1]
    if row_bytes < ROW_BYTES or row_bytes % ROW_ALIGN:
        raise ValueError(
            f"kv rows must be W >= {ROW_BYTES} bytes with W % {ROW_ALIGN} == 0 (the first "
            f"{ROW_BYTES} are read; 576 or a padded 640 are usual), got W={row_bytes} "
            f"({kv_shape=})"
        )
    if len(rows_shape) != 2:
        raise ValueError(f"rows must be [B, K], got {rows_shape=}")
    if len(valid_shape) != 1:
        raise ValueError(f"valid must be [B], got {valid_shape=}")
    batch, heads = q_shape[0], q_shape[1]
    if rows_shape[0] != batch or valid_shape[0] != batch:
        raise ValueError(
            f"q, rows and valid must agree on B: {q_shape=}, {rows_shape=}, {valid_shape=}"
        )
    if heads < 1:
        raise ValueError(f"q must have at least one head, got {q_shape=}")
    if rows_shape[1] < 1:
        raise ValueError(f"rows must have at least one index slot (K >= 1), got {rows_shape=}")
    cache_rows = math.prod(kv_shape[:-1])
    if cache_rows >= 2**31:
        raise ValueError(
            f"kv holds {cache_rows} rows; int32 row indices reach 2**31 - 1 ({kv_shape=})"
        )
    return DecodeShapes(batch, heads, cache_rows, rows_shape[1], paged=len(kv_shape) == 3)


def check_softmax_scale(softmax_scale) -> float:
    """softmax_scale is static: a finite positive Python number."""
    if isinstance(softmax_scale, jax.core.Tracer) or not isinstance(
        softmax_scale, (int, float, np.floating, np.integer)
    ):
        raise TypeError(
            f"softmax_scale must be a static Python float, got {type(softmax_scale).__name__}"
        )
    value = float(softmax_scale)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale=}")
    return value


def check_valid_hint(valid_hint) -> int | None:
    """valid_hint is static: None or a Python int >= 1."""
    if valid_hint is None:
        return None
    if isinstance(valid_hint, bool) or not isinstance(valid_hint, (int, np.integer)):
        raise TypeError(
            f"valid_hint must be None or a static Python int, got {type(valid_hint).__name__}"
        )
    if valid_hint < 1:
        raise ValueError(f"valid_hint must be >= 1, got {valid_hint=}")
    return int(valid_hint)


def check_scale(name: str, scale):
    """q_scale / kv_scale: a Python number or a float scalar array (may be traced)."""
    if isinstance(scale, (int, float, np.floating, np.integer)) and not isinstance(scale, bool):
        return float(scale)
    shape = shape_of(scale)
    if shape != ():
        raise ValueError(f"{name} must be a scalar, got {name}.shape={shape}")
    if not jnp.issubdtype(dtype_of(scale), jnp.floating):
        raise TypeError(f"{name} must be a float scalar, got dtype {dtype_of(scale)}")
    return scale


def check_implementation(implementation):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    return implementation


def flat_cache(kv):
    """kv as [N, W] flat rows (a paged cache's flat row = block * block_size + offset)."""
    return kv.reshape(-1, kv.shape[-1]) if kv.ndim == 3 else kv


def kernel_scales(softmax_scale: float, q_scale, kv_scale):
    """(scale_log2, out_scale) as float32[2]: logits in log2 units, and the output's kv scale."""
    scale_log2 = jnp.float32(softmax_scale * math.log2(math.e)) * (
        jnp.float32(q_scale) * jnp.float32(kv_scale)
    )
    return jnp.stack([scale_log2, jnp.float32(kv_scale)]).astype(jnp.float32)


def axis_size(axis_name, op: str) -> int:
    """The size of the mapped axis ``axis_name``, or a ValueError saying that ``op`` must run
    inside ``jax.shard_map`` over it."""
    try:
        return lax.axis_size(axis_name)
    except NameError as error:
        raise ValueError(
            f"{op} must run inside jax.shard_map (or another mapped context) over "
            f"axis_name={axis_name!r}: {error}"
        ) from error
