"""The decode as a JAX primitive: shape rules, the portable lowering, no differentiation.

Operands are normalized by ``ops.decode``: q [B, Hp, 576] float8_e4m3fn with Hp a multiple of
16, kv [N, W] float8_e4m3fn flat rows (W >= 576, the first 576 bytes read), rows [B, K]
int32, valid [B] int32, scales float32[2] (scale_log2, out_scale). Results: latent
[B, Hp, 512] bfloat16, lse [B, Hp] float32. Parameters: ``require_kernel`` (no fallback to the
reference), ``config`` (a ``KernelConfig`` forced by the caller, or None for the dispatch
rule) and ``valid_hint`` (None, or the dispatch rule's estimate of valid keys per row). The
CUDA lowering to the kernel lives in ``cuda_lowering``; every other platform lowers to the
reference.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.core import ShapedArray

from jax_sparse_mla import inference_primitive, reference
from jax_sparse_mla.validation import LATENT


def _abstract_eval(q, kv, rows, valid, scales, **params):
    del params
    batch, heads, _ = q.shape
    assert heads % 16 == 0 and kv.ndim == 2 and rows.shape[0] == batch == valid.shape[0]
    assert scales.shape == (2,), scales.shape
    return (
        ShapedArray((batch, heads, LATENT), jnp.bfloat16),
        ShapedArray((batch, heads), jnp.float32),
    )


def _reference_rule(q, kv, rows, valid, scales, **params):
    del params
    return reference.decode_flat(q, kv, rows, valid, scales)


# reference_lowering: the primitive lowered to the reference (any platform).
sparse_mla_decode_p, reference_lowering = inference_primitive.define(
    "sparse_mla_decode",
    _abstract_eval,
    _reference_rule,
    op="jax_sparse_mla.decode",
    no_gradient=(
        "jax_sparse_mla.decode is inference-only: it has no gradient (FP8 inputs, no backward "
        "kernel). Wrap its inputs in jax.lax.stop_gradient if it sits inside a differentiated "
        "function."
    ),
    no_vmap=(
        "jax_sparse_mla.decode has no vmap rule: rows of a decode are independent, so fold the "
        "mapped axis into B (q [V*B, H, 576], rows [V*B, K], valid [V*B]) and call it once."
    ),
)
