"""The indexer's top-k as a JAX primitive: shape rules, the portable lowering, no
differentiation.

Operands are normalized by ``indexer.index_topk`` (and ``dcp_indexer``): q [B, T, Hp, 128]
float8_e4m3fn with Hp a multiple of ``HEAD_TILE`` (zero heads appended), weights [B, T, Hp]
float32 (zero weights for the appended heads), keys [num_blocks, block_size, 128]
float8_e4m3fn, key_scales [num_blocks, block_size] float32, block_table [B, max_blocks] int32
(a flat cache is one block: [1, N, 128] with a zero table), lengths [B] int32 (the requests'
global context lengths, any value) and rank [1] int32 (this rank of ``dcp_size``; 0 without
DCP): row (b, t) scores positions [0, index_validation.row_limits(...)[b, t]), computed
in the kernels from these (no XLA op before the custom call).

Results: tokens [B, T, top_k] int32 (the selected positions in ascending order, then -1) and
their scores [B, T, top_k] float32 (-inf at the -1 slots). Parameters: ``top_k``, ``dcp_size``
and ``require_kernel`` (no fallback to the reference). The CUDA lowering to the kernel lives in
``index_lowering``; every other platform lowers to ``reference.index_topk_flat``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.core import ShapedArray

from jax_sparse_mla import inference_primitive, reference

HEAD_TILE = 64  # the kernel's MMA takes index heads 64 at a time


def _abstract_eval(
    q, weights, keys, key_scales, block_table, lengths, rank, *, top_k, dcp_size, **params
):
    del params, dcp_size
    batch, steps, heads, dim = q.shape
    assert heads % HEAD_TILE == 0 and dim == reference.INDEX_DIM, q.shape
    assert weights.shape == (batch, steps, heads), weights.shape
    assert keys.ndim == 3 and key_scales.shape == keys.shape[:2], (keys.shape, key_scales.shape)
    assert block_table.shape[0] == batch and lengths.shape == (batch,) and rank.shape == (1,)
    return (
        ShapedArray((batch, steps, top_k), jnp.int32),
        ShapedArray((batch, steps, top_k), jnp.float32),
    )


def _reference_rule(
    q, weights, keys, key_scales, block_table, lengths, rank, *, top_k, dcp_size, **params
):
    del params
    return reference.index_topk_flat(
        q, weights, keys, key_scales, block_table, lengths, rank, top_k, dcp_size
    )


# reference_lowering: the primitive lowered to the reference (any platform).
index_topk_p, reference_lowering = inference_primitive.define(
    "jax_sparse_mla_index_topk",
    _abstract_eval,
    _reference_rule,
    op="jax_sparse_mla.index_topk",
    no_gradient=(
        "jax_sparse_mla.index_topk selects integer positions: it has no gradient (inference "
        "only). Wrap its inputs in jax.lax.stop_gradient inside a differentiated function."
    ),
    no_vmap=(
        "jax_sparse_mla.index_topk has no vmap rule: fold the mapped axis into B (requests "
        "are independent) and call it once."
    ),
)
