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

import functools
import logging

import jax.numpy as jnp
from jax._src import dispatch
from jax.core import ShapedArray
from jax.extend import core
from jax.interpreters import ad, batching, mlir

from jax_sparse_mla import reference
from jax_sparse_mla.validation import LATENT

log = logging.getLogger("jax_sparse_mla")

sparse_mla_decode_p = core.Primitive("sparse_mla_decode")
sparse_mla_decode_p.multiple_results = True
sparse_mla_decode_p.def_impl(functools.partial(dispatch.apply_primitive, sparse_mla_decode_p))


def _abstract_eval(q, kv, rows, valid, scales, **params):
    del params
    batch, heads, _ = q.shape
    assert heads % 16 == 0 and kv.ndim == 2 and rows.shape[0] == batch == valid.shape[0]
    assert scales.shape == (2,), scales.shape
    return (
        ShapedArray((batch, heads, LATENT), jnp.bfloat16),
        ShapedArray((batch, heads), jnp.float32),
    )


sparse_mla_decode_p.def_abstract_eval(_abstract_eval)


def _reference_rule(q, kv, rows, valid, scales, **params):
    del params
    return reference.decode_flat(q, kv, rows, valid, scales)


reference_lowering = mlir.lower_fun(_reference_rule, multiple_results=True)
"""Lowers the primitive to the reference (any platform)."""


@functools.cache
def _note_reference(platform: str) -> None:
    log.info(
        "jax_sparse_mla.decode: the kernel needs a Hopper GPU; using the reference on %s", platform
    )


def _portable_lowering(ctx, *args, require_kernel, **params):
    platform = ctx.module_context.platforms[0] if ctx.module_context.platforms else "?"
    if require_kernel:
        raise NotImplementedError(
            f"implementation='cute' needs a Hopper (sm_90) CUDA GPU; lowering for {platform!r}. "
            "Use implementation=None to fall back to the reference."
        )
    _note_reference(platform)
    return reference_lowering(ctx, *args, require_kernel=require_kernel, **params)


mlir.register_lowering(sparse_mla_decode_p, _portable_lowering)


def _no_differentiation(primals, tangents, **params):
    raise NotImplementedError(
        "jax_sparse_mla.decode is inference-only: it has no gradient (FP8 inputs, no backward "
        "kernel). Wrap its inputs in jax.lax.stop_gradient if it sits inside a differentiated "
        "function."
    )


ad.primitive_jvps[sparse_mla_decode_p] = _no_differentiation


def _no_vmap(args, dims, **params):
    raise NotImplementedError(
        "jax_sparse_mla.decode has no vmap rule: rows of a decode are independent, so fold the "
        "mapped axis into B (q [V*B, H, 576], rows [V*B, K], valid [V*B]) and call it once."
    )


batching.primitive_batchers[sparse_mla_decode_p] = _no_vmap
