"""Pure jax.numpy sparse MLA decode: the contract's semantics and the kernel's precision.

Runs on every backend; it is also the baseline a JAX user has today (gather + einsum).

What it models of the kernel:
- FP8 E4M3 q and cache rows widened exactly to BF16 (V to F16); FP32 logits q.k (the
  products of two E4M3 values are exact in FP32; the 576-term sum is FP32: on GPUs a
  tensor-core GEMM with FP32 accumulation, as the kernels run it).
- Logits in log2 units: s = (q.k) * scale_log2, scale_log2 = softmax_scale * q_scale *
  kv_scale * log2(e).
- P = exp2((s - max) + log2(448)) in FP32; the softmax sums are FP32 sums of this
  *unquantized* P; the P that multiplies V is P rounded to F16 (RN; P <= 448 always fits),
  as both kernel variants round it.
- FP32 accumulation of P x V, then one BF16 rounding of acc * kv_scale / sum.
- LSE = (max + log2(sum / 448)) * ln 2: the natural log of sum(exp(logits)).

What it does not model: the kernels anchor P at the running max of each CTA's share of the
keys and of each chunk (rescaling earlier chunks in FP32 when the max rises), and merge the
CTAs' partials in FP32 (after rounding each to F16 where split > 1); here P is anchored at the
row's global max. The sums are also taken in another order. Both differ from the kernels by
rounding only: an F16 ulp of P (2^-11 relative per key, averaging out over keys), the F16
partials and FP32 summation order.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jax_sparse_mla import index_validation, validation

LOG2_P_SCALE = math.log2(448.0)  # P is scaled to 448 at the row max, as the kernels do
HIGHEST = jax.lax.Precision.HIGHEST  # FP32 products on GPUs too (no TF32)


def exact_operand(x, dtype):
    """FP8 ``x`` widened exactly to ``dtype`` (BF16 or F16: E4M3 is a subset of both) behind
    an optimization barrier. Without it XLA's GPU GEMM rewriter turns dot(convert(f8),
    convert(f8)) into an FP8 cuBLASLt matmul, whose accumulation is reduced-precision whatever
    ``precision`` says (measured on an H200: logits off by 3e-2 at |logit| ~100, the LSE by
    8e-5). One operand behind the barrier is enough; the other 16-bit operand then makes the
    dot a tensor-core GEMM with exact products and FP32 accumulation."""
    return jax.lax.optimization_barrier(x.astype(dtype))


def as_stored(q):
    """The FP8 query as the kernels read it: behind an optimization barrier, so that XLA
    cannot fold a producer's rounding to E4M3 into our widening. With excess precision
    allowed (the GPU default) its SimplifyFPConversions turns f32 -> f8 -> bf16 into f32 ->
    bf16: in a jitted step that quantizes q, the reference would attend with the unrounded q
    (the example step's reference was 2.5e-2 off on an H200 while the kernel path was 1.7e-3
    off; with the barrier both are 1.7e-3 off). Cache rows need none: the gather between
    their rounding and our widening breaks the chain (and a barrier on the whole cache costs
    a copy of it)."""
    return jax.lax.optimization_barrier(q)


def decode_flat(q, kv, rows, valid, scales):
    """Sparse decode on normalized operands (any H; no argument checks).

    q [B, H, 576] float8_e4m3fn, kv [N, W] float8_e4m3fn (W >= 576: the first 576 bytes of
    a row are read), rows [B, K] int32,
    valid [B] int32, scales float32[2] = (scale_log2, out_scale)
    -> latent [B, H, 512] bfloat16, lse [B, H] float32 (natural log).
    """
    q = as_stored(q)
    batch, heads, _ = q.shape
    cache_rows, width = kv.shape[0], rows.shape[1]
    if cache_rows == 0:  # every index is out of range: every row is empty
        latent = jnp.zeros((batch, heads, validation.LATENT), jnp.bfloat16)
        return latent, jnp.full((batch, heads), -jnp.inf, jnp.float32)
    scale_log2, out_scale = scales[0], scales[1]
    count = jnp.clip(valid, 0, width)
    live = (jnp.arange(width)[None, :] < count[:, None]) & (rows >= 0) & (rows < cache_rows)
    keys = kv[jnp.where(live, rows, 0), : validation.ROW_BYTES]  # [B, K, 576] E4M3
    logits = jnp.einsum(
        "bhd,bkd->bhk",
        exact_operand(q, jnp.bfloat16),
        keys.astype(jnp.bfloat16),
        preferred_element_type=jnp.float32,
    )
    s = jnp.where(live[:, None, :], logits * scale_log2, -jnp.inf)
    row_max = jnp.max(s, axis=-1)
    empty = row_max == -jnp.inf
    top = jnp.where(empty, 0.0, row_max)
    # s - top first: exactly <= 0, so P <= 448 even where |s| is so large that s - (top -
    # log2 448) would round upwards (and overflow exp2).
    p = jnp.exp2((s - top[..., None]) + LOG2_P_SCALE)  # exactly 0 for skipped keys
    total = jnp.sum(p, axis=-1)
    p16 = p.astype(jnp.float16)  # RN
    values = keys[..., : validation.LATENT].astype(jnp.float16)
    acc = jnp.einsum("bhk,bkc->bhc", p16, values, preferred_element_type=jnp.float32)
    safe_total = jnp.where(empty, 1.0, total)
    latent = jnp.where(empty[..., None], 0.0, acc * (out_scale / safe_total)[..., None])
    lse2 = (top - LOG2_P_SCALE) + jnp.log2(safe_total)
    lse = jnp.where(empty, -jnp.inf, lse2 * math.log(2.0))
    return latent.astype(jnp.bfloat16), lse.astype(jnp.float32)


def decode(q, kv, rows, valid, *, softmax_scale, q_scale=1.0, kv_scale=1.0, implementation=None):
    """The reference decode, same signature and semantics as ``jax_sparse_mla.decode``.

    ``implementation`` is accepted for signature parity and must be None or "reference".
    """
    if implementation not in (None, "reference"):
        raise ValueError(f"reference.decode runs the reference only; got {implementation=!r}")
    validation.check_decode_args(q, kv, rows, valid)
    softmax_scale = validation.check_softmax_scale(softmax_scale)
    q_scale = validation.check_scale("q_scale", q_scale)
    kv_scale = validation.check_scale("kv_scale", kv_scale)
    scales = validation.kernel_scales(softmax_scale, q_scale, kv_scale)
    return decode_flat(jnp.asarray(q), validation.flat_cache(jnp.asarray(kv)), rows, valid, scales)


# ---- the DSA indexer's scores and top-k ----------------------------------------------------

INDEX_DIM = index_validation.INDEX_DIM  # bytes of an index query head or key (FP8 E4M3)
INT32_MIN = -(2**31)


def order_key(scores):
    """int32 keys whose signed order is the selection's order of float32 ``scores``: higher
    score, higher key; -0.0 equals +0.0; NaN below every number (even -inf)."""
    bits = jax.lax.bitcast_convert_type(scores + jnp.float32(0.0), jnp.int32)  # -0.0 -> +0.0
    key = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
    return jnp.where(jnp.isnan(scores), jnp.int32(INT32_MIN + 1), key)


def select_topk(scores, live, top_k: int):
    """The exact top-k of each row: scores [..., C] float32, live [..., C] bool (the row's
    candidates) -> (tokens [..., top_k] int32, their scores [..., top_k] float32).

    Order: the higher score first, ties to the smaller position (``order_key``); at most
    ``top_k`` of the live positions, returned in ascending position order, then -1 (score
    -inf) where a row has fewer live positions than top_k.
    """
    width = scores.shape[-1]
    key = jnp.where(live, order_key(scores), jnp.int32(INT32_MIN))
    if width < top_k:
        pad = [(0, 0)] * (key.ndim - 1) + [(0, top_k - width)]
        key = jnp.pad(key, pad, constant_values=INT32_MIN)
    # lax.top_k puts the lower index first among equal keys: exactly the tie rule.
    _, positions = jax.lax.top_k(key, top_k)
    taken = jnp.take_along_axis(key, positions, axis=-1) != INT32_MIN
    tokens = jnp.sort(jnp.where(taken, positions, jnp.iinfo(jnp.int32).max), axis=-1)
    tokens = jnp.where(tokens == jnp.iinfo(jnp.int32).max, -1, tokens)
    picked = jnp.take_along_axis(scores, jnp.clip(tokens, 0, width - 1), axis=-1)
    return tokens.astype(jnp.int32), jnp.where(tokens >= 0, picked, -jnp.inf)


def index_scores_flat(q, weights, keys, key_scales, block_table, limits):
    """The indexer's scores on normalized operands (no argument checks).

    q [B, T, H, 128] float8_e4m3fn, weights [B, T, H] float32, keys [num_blocks, block_size,
    128] float8_e4m3fn, key_scales [num_blocks, block_size] float32, block_table [B,
    max_blocks] int32, limits [B, T] int32 (row (b, t) scores positions [0, limits[b, t]))
    -> (scores [B, T, C] float32, live [B, T, C] bool), C = max_blocks * block_size.

    score[b, t, n] = key_scales[n] * sum_h weights[b, t, h] * relu(q[b, t, h] . keys[n]) with
    n the cache row of position n (block_table[b, n // block_size], n % block_size); dot
    products of the FP8 values in FP32. Positions whose block is outside [0, num_blocks) are
    not live (never read).
    """
    q = as_stored(q)
    num_blocks, block_size = keys.shape[0], keys.shape[1]
    batch = limits.shape[0]
    width = block_table.shape[1] * block_size
    in_cache = (block_table >= 0) & (block_table < num_blocks)  # [B, max_blocks]
    safe_table = jnp.where(in_cache, block_table, 0)
    row_keys = keys[safe_table].reshape(batch, width, INDEX_DIM).astype(jnp.bfloat16)
    row_scales = key_scales[safe_table].reshape(batch, width)
    q16 = exact_operand(q, jnp.bfloat16)
    dots = jnp.einsum("bthd,bnd->bthn", q16, row_keys, preferred_element_type=jnp.float32)
    head_sum = jnp.einsum("bth,bthn->btn", weights, jnp.maximum(dots, 0.0), precision=HIGHEST)
    scores = head_sum * row_scales[:, None, :]
    position = jnp.arange(width, dtype=jnp.int32)
    readable = jnp.repeat(in_cache, block_size, axis=1)  # [B, C]
    live = (position[None, None, :] < limits[..., None]) & readable[:, None, :]
    return scores, live


def index_topk_flat(
    q, weights, keys, key_scales, block_table, lengths, rank, top_k: int, dcp_size: int = 1
):
    """Scores (``index_scores_flat``) and their exact top-k (``select_topk``) on the
    primitive's operands (lengths [B] int32 and rank [1] int32: index_validation.row_limits)
    -> (tokens [B, T, top_k] int32 ascending then -1, scores [B, T, top_k] f32)."""
    limits = index_validation.row_limits(
        lengths,
        rank[0],
        steps=q.shape[1],
        capacity=block_table.shape[1] * keys.shape[1],
        dcp_size=dcp_size,
    )
    scores, live = index_scores_flat(q, weights, keys, key_scales, block_table, limits)
    return select_topk(scores, live, top_k)


def index_topk(
    q_index,
    weights,
    index_keys,
    index_scales,
    lengths,
    *,
    top_k=2048,
    block_table=None,
    implementation=None,
):
    """The reference indexer top-k, same signature and semantics as
    ``jax_sparse_mla.index_topk``: tokens [B, T, top_k] int32.

    ``implementation`` is accepted for signature parity and must be None or "reference".
    """
    if implementation not in (None, "reference"):
        raise ValueError(f"reference.index_topk runs the reference only; got {implementation=!r}")
    top_k = index_validation.check_top_k(top_k)
    _, operands = index_validation.index_operands(
        q_index, weights, index_keys, index_scales, lengths, block_table
    )
    tokens, _ = index_topk_flat(*operands, top_k)
    return tokens
