"""Merging partial attention outputs by their log-sum-exp (split-KV / DCP combine)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_sparse_mla.validation import LATENT


def merge_along(latent, lse, axis: int):
    """Merge partials along ``axis`` of ``lse`` (the same axis of ``latent``).

    latent [..., 512] (any float dtype), lse [...] float32 natural-log LSEs. Each partial is
    weighted by exp(lse_s - lse_max) / sum; partials with lse -inf weigh exactly 0, and when
    all are -inf the result is zeros and -inf. Returns latent in latent's dtype (FP32 math)
    and lse float32.
    """
    lse = lse.astype(jnp.float32)
    top = jnp.max(lse, axis=axis, keepdims=True)
    top = jnp.where(top == -jnp.inf, 0.0, top)  # all-empty: weights exp(-inf) = 0
    weight = jnp.exp(lse - top)
    total = jnp.sum(weight, axis=axis)
    merged = jnp.sum(weight[..., None] * latent.astype(jnp.float32), axis=axis)
    empty = total == 0
    safe_total = jnp.where(empty, 1.0, total)
    merged = jnp.where(empty[..., None], 0.0, merged / safe_total[..., None])
    merged_lse = jnp.where(empty, -jnp.inf, jnp.squeeze(top, axis) + jnp.log(safe_total))
    return merged.astype(latent.dtype), merged_lse


def merge_partials(latent, lse):
    """LSE-weighted merge of S partials over the leading axis.

    latent [S, B, H, 512] float (bfloat16 or float32), lse [S, B, H] float32 (natural log)
    -> latent [B, H, 512] (latent's dtype), lse [B, H] float32. Exact for -inf partials:
    a partial with lse -inf contributes nothing; all-empty gives zeros and -inf.
    """
    latent_shape, lse_shape = tuple(np.shape(latent)), tuple(np.shape(lse))
    if len(latent_shape) != 4 or latent_shape[-1] != LATENT:
        raise ValueError(f"latent must be [S, B, H, {LATENT}], got {latent_shape=}")
    if lse_shape != latent_shape[:3]:
        raise ValueError(
            f"lse must be [S, B, H] matching latent, got {lse_shape=}, {latent_shape=}"
        )
    if not jnp.issubdtype(latent.dtype, jnp.floating):
        raise TypeError(f"latent must be a float array, got {latent.dtype}")
    if lse.dtype != jnp.float32:
        raise TypeError(f"lse must be float32, got {lse.dtype}")
    return merge_along(latent, lse, axis=0)
