"""One decode step of a DeepSeek-Sparse-Attention (DSA) MLA layer on jax_sparse_mla.

What a JAX inference stack runs for one attention layer of a Kimi-K3-class model during a
speculative-decode verify step, with random weights (nothing is downloaded):

1. the new tokens' cache entries: kv_a projection -> RMSNorm on the 512 latent, RoPE on the 64
   rope dims -> FP8 E4M3 with the cache's per-tensor scale, written into the [N, 576] cache;
   and each token's DSA index key, LayerNorm(W_k x) with RoPE on its first 64 dims -> FP8 E4M3
   with one FP32 scale per token (amax / 448 of its 128 values), written into the [N, 128]
   index cache and its [N] scales (DeepSeek V3.2's layout);
2. the absorbed MLA query: q = W_q_b(rmsnorm(W_q_a x)), RoPE on the rope part, W_UK absorbed
   into the nope part (-> 512 latent), concat to 576, FP8 with a per-tensor scale;
3. the DSA indexer, DeepSeek V3.2's lightning indexer: the index query (RoPE on each head's
   first 64 dims) -> FP8 E4M3 with one scale per (row, head), folded into the head weights
   w = W_w(x) * heads^-0.5 * 128^-0.5 * q_scale; then ``jax_sparse_mla.index_topk``: score[t] =
   k_scale[t] * sum_h w_h * relu(q_h . k_t) in FP32, causal (verify row i at position pos + i
   sees tokens t <= pos + i, its own included), the exact top-k in ascending token order
   (under --dcp: ``jax_sparse_mla.dcp_index_topk`` over the token-sharded index cache);
4. sparse attention over the selected keys with ``jax_sparse_mla.decode`` (or, with --dcp N,
   ``jax_sparse_mla.dcp_decode`` inside ``jax.shard_map``: both caches sharded by token, token t
   on rank t % N at local row t // N, and each rank holding its own 1/N of the heads);
5. W_UV (latent -> v_head_dim per head) and the output projection (row-parallel under DCP:
   a psum over ranks).

The weight matrices are bf16 GEMMs with f32 accumulation, or with --weights fp8 FP8 E4M3
with one scale per output (as DeepSeek V3 / Kimi K2 ship FP8 weights; they scale 128 x 128
blocks) used weight-only: bf16 activations, the E4M3 values widened inside the GEMM, half the
weight bytes read.

Two paths run the same step: "kernel" (index_topk with implementation=None: its kernel on a
Hopper GPU, else the reference, as the log says; the attention with implementation='cute') and
"reference" (both implementation='reference': the pure-jnp baseline). On a GPU both run side
by side, on a CPU the reference only. Per path the script checks the layer output against a
dense float32 attention over the same selected keys (dequantized FP8 query and cache, exact
softmax) and the selected tokens against a float64 top-k of the same FP8 index operands; on a
GPU it checks that the kernel path selects the reference path's tokens, except where scores tie
within FP32 rounding at a row's k-th score (examples/token_agreement.py). Then it times the
jitted step. Each phase of the step is a ``jax.named_scope``: projections (1-3: every
projection of x, one GEMM over the fused weights), cache_write (1), query (2: both
projections of q_a, one GEMM over the fused [wq_b | wi_q], and the absorbed MLA query),
index_query (3: the index query's RoPE, its quantization and the weights) and index_topk
(3: the op), sparse_decode (4), output_projection (5).

Output, per path:

    CHECK <path>: ...        the layer output's relative error vs the dense attention
    CHECK <path> index_topk: ...   its selected tokens vs the float64 top-k: differing tokens,
                             and how many lie beyond FP32 rounding of the row's k-th score
    TIME <path>: ...         the jitted step's wall clock incl. dispatch (host work and
                             launches included: not a measure of the GPU work)
    GPU step, <path> path (/device:GPU:N): median [p10, p90] GPU time per step over
                             --profile-calls profiled steps (GPU only), then a table per GPU:
      phase  us/step  share  median us  events
                             the time of the kernels and copies (CUPTI records from the
                             JAX profiler) of each phase, "collectives" under DCP (their
                             time includes waiting for the other ranks) and "other" (what
                             no phase claims); the rows add up to the step's total
                             (examples/phase_times.py says how events are attributed)

and at the end, on a GPU:

    CHECK index_topk, kernel vs reference path: N differing tokens ...
    GPU TIME index_topk (...): kernel path X us vs reference path Y us per step, per device
    GPU TIME sparse_decode (...): ...
    GPU TIME whole step (...): ...   (and "collectives" under DCP)
    RESULT: PASS | FAIL

On a CPU the GPU lines are replaced by a line saying that they need a GPU.

Run (from the repository root):

    .venv/bin/python examples/kimi_decode_step.py                  # Kimi-K3-class layer
    .venv/bin/python examples/kimi_decode_step.py --small          # tiny layer, seconds
    .venv/bin/python examples/kimi_decode_step.py --dcp 8          # 8 GPUs, or 8 CPU devices
    .venv/bin/python examples/kimi_decode_step.py --dcp 2 --exchange push   # one-sided exchange
    .venv/bin/python examples/kimi_decode_step.py --weights fp8    # FP8 weight matrices
    .venv/bin/python examples/kimi_decode_step.py --help

On a CPU machine --dcp N creates N virtual CPU devices itself (XLA_FLAGS is set before jax
is imported). The script exits with status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

KV_LORA_RANK = 512  # latent width of the cache row; fixed by the FP8 [N, 576] layout
QK_ROPE_DIM = 64  # rope width of the cache row (and of each indexer head's first dims)
CACHE_WIDTH = KV_LORA_RANK + QK_ROPE_DIM
INDEX_HEAD_DIM = 128  # width of an index head and key; fixed by index_topk's FP8 index cache
FP8_MAX = 448.0  # largest finite float8_e4m3fn
ROPE_THETA = 50000.0
NORM_EPS = 1e-6
MESH_AXIS = "dcp"
KERNEL_TARGET = "jax_sparse_mla_decode"  # the kernel's XLA custom call (cuda_lowering.FFI_TARGET)
PUSH_TARGET = "jax_sparse_mla_decode_push"  # the pushing decode (cuda_lowering.PUSH_FFI_TARGET)
INDEX_TARGET = "jax_sparse_mla_index_topk"  # index_topk's kernel (its XLA custom call)
# The step's phases: jax.named_scope names in the step, rows of the GPU time table (plus
# "collectives" under DCP and "other" for what no phase claims).
PHASES = (
    "projections",
    "cache_write",
    "query",
    "index_query",
    "index_topk",
    "sparse_decode",
    "output_projection",
)

# Relative error (Frobenius, over all verify rows) of the layer output against the dense
# float32 attention over the same keys. Both sides read the same FP8 query and cache, so the
# difference is the attention's own rounding: P rounded to F16 (2^-11 relative per weight,
# independent from key to key, averaging out over the keys), one BF16 rounding of the latent
# (2^-9) and the bf16 W_UV / output projections (2^-9 per rounding, f32 sums): measured
# 0.24-0.27% on CPU (Kimi sizes, 1 and 4 ranks). The threshold, 2^-6 (1.6%), leaves a 6x
# margin over that, while a wrong key, head or merge gives errors of order 1 and a kv_scale
# off by 5% gives ~10%.
TOLERANCE = 2.0**-6


def _force_host_devices(argv: Sequence[str]) -> None:
    """Asks XLA for --dcp virtual CPU devices; must run before jax is imported."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--dcp", type=int, default=1)
    count = pre.parse_known_args(argv)[0].dcp
    flags = os.environ.get("XLA_FLAGS", "")
    if count > 1 and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}"


if __name__ == "__main__":
    _force_host_devices(sys.argv[1:])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

try:
    import jax_sparse_mla
except ModuleNotFoundError:  # run from a checkout without installing: the package is one up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax_sparse_mla
try:
    import phase_times
    import token_agreement
except ModuleNotFoundError:  # imported from elsewhere (the tests): they sit next to this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import phase_times
    import token_agreement


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """Sizes of one DSA MLA attention layer (heads = gathered heads of all DCP ranks)."""

    hidden: int = 7168
    heads: int = 96
    q_lora_rank: int = 1536
    qk_nope_dim: int = 128
    v_head_dim: int = 128
    index_topk: int = 2048
    index_heads: int = 64

    @property
    def softmax_scale(self) -> float:
        return (self.qk_nope_dim + QK_ROPE_DIM) ** -0.5


KIMI = LayerConfig()
SMALL = LayerConfig(
    hidden=256,
    heads=8,
    q_lora_rank=64,
    qk_nope_dim=32,
    v_head_dim=32,
    index_topk=64,
    index_heads=4,
)
SIZE_FLAGS = {
    "hidden": "model width",
    "heads": "attention heads (gathered over all DCP ranks)",
    "q_lora_rank": "query low-rank width",
    "qk_nope_dim": "per-head no-rope query/key width (absorbed into the 512 latent)",
    "v_head_dim": "per-head value width after W_UV",
    "index_topk": "DSA top-k: keys attended per verify row",
    "index_heads": "DSA indexer heads (each 128 wide, RoPE on its first 64 dims)",
}


class Cache(NamedTuple):
    """The layer's caches. Rows are in token order on one device; under DCP each global array
    is rank-major (row r * N_local + j holds token j * D + r) and sharded by rank."""

    kv: jax.Array  # [N, 576] float8_e4m3fn: latent 512 (RMSNorm'd) + rope 64 (RoPE'd)
    kv_scale: jax.Array  # [] float32 per-tensor dequantization scale of kv
    index_keys: jax.Array  # [N, 128] float8_e4m3fn: the DSA indexer's key of each token
    index_scales: jax.Array  # [N] float32: each index key's dequantization scale


# Under DCP: both caches sharded by rank (rank-major rows), the per-tensor kv_scale replicated.
CACHE_SPECS = Cache(P(MESH_AXIS, None), P(), P(MESH_AXIS, None), P(MESH_AXIS))


class StepAux(NamedTuple):
    """What the step attended with, for the dense check and the top-k checks."""

    q: jax.Array  # [R, H, 576] float8_e4m3fn
    q_scale: jax.Array  # [] float32
    tokens: jax.Array  # [R, K] int32 global token ids ascending, then -1 (DCP: [D, R, K],
    # every rank's copy)
    latent: jax.Array  # [R, H, 512] bfloat16 attention output
    index_q: jax.Array  # [R, index_heads, 128] float8_e4m3fn
    index_weights: jax.Array  # [R, index_heads] float32, the query's scales folded in


_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", flush=True)


# ---------------------------------------------------------------------------------------------
# Model pieces
# ---------------------------------------------------------------------------------------------


class XParts(NamedTuple):
    """The projections of the step's input x [R, hidden], float32 (x_projections)."""

    q_a: jax.Array  # [R, q_lora_rank], before its RMSNorm
    kv: jax.Array  # [R, 576]: the cache row's latent and rope parts, before norm and RoPE
    index_key: jax.Array  # [R, 128], before its LayerNorm and RoPE
    index_weights: jax.Array  # [R, index_heads]: the indexer's head weights, unscaled


X_PARTS = ("wq_a", "wkv_a", "wi_k", "wi_w")  # XParts' weights, fused into w["w_x"]


def x_projections(w: dict, x: jax.Array) -> XParts:
    """x [R, hidden] times the fused [wq_a | wkv_a | wi_k | wi_w], split into its parts."""
    fused = dot(x, w["w_x"], "rd,dc->rc")
    ends = np.cumsum([w["q_a_norm"].shape[0], CACHE_WIDTH, INDEX_HEAD_DIM])
    return XParts(*jnp.split(fused, ends, axis=-1))


def init_weights(cfg: LayerConfig, seed: int, precision: str = "bf16") -> dict[str, Any]:
    """Random bf16 weights, N(0, 1/fan_in) so activations stay O(1). numpy's generator: far
    quicker here than compiling jax.random for every weight shape on a CPU. precision "fp8":
    the matrices of WEIGHT_SPECS as Fp8Weight (the norms' gammas and bias stay bf16)."""
    shapes = {
        "wq_a": ((cfg.hidden, cfg.q_lora_rank), cfg.hidden),
        "wq_b": ((cfg.q_lora_rank, cfg.heads, cfg.qk_nope_dim + QK_ROPE_DIM), cfg.q_lora_rank),
        "wkv_a": ((cfg.hidden, CACHE_WIDTH), cfg.hidden),
        # kv_b = [W_UK | W_UV] acting on the 512 latent, split per head.
        "w_uk": ((cfg.heads, cfg.qk_nope_dim, KV_LORA_RANK), KV_LORA_RANK),
        "w_uv": ((cfg.heads, KV_LORA_RANK, cfg.v_head_dim), KV_LORA_RANK),
        "wo": ((cfg.heads, cfg.v_head_dim, cfg.hidden), cfg.heads * cfg.v_head_dim),
        "wi_q": ((cfg.q_lora_rank, cfg.index_heads, INDEX_HEAD_DIM), cfg.q_lora_rank),
        "wi_k": ((cfg.hidden, INDEX_HEAD_DIM), cfg.hidden),
        "wi_w": ((cfg.hidden, cfg.index_heads), cfg.hidden),
    }
    rng = np.random.default_rng(seed)
    weights = {}
    for name, (shape, fan_in) in shapes.items():
        sample = rng.standard_normal(shape, dtype=np.float32)
        sample *= fan_in**-0.5
        weights[name] = jnp.asarray(sample, dtype=jnp.bfloat16)
    for name, width in [
        ("q_a_norm", cfg.q_lora_rank),
        ("kv_a_norm", KV_LORA_RANK),
        ("wi_k_norm", INDEX_HEAD_DIM),
    ]:
        weights[name] = jnp.ones((width,), jnp.bfloat16)
    weights["wi_k_bias"] = jnp.zeros((INDEX_HEAD_DIM,), jnp.bfloat16)
    # The projections of x run as one GEMM (as serving stacks fuse q_a and kv_a): a [hidden,
    # 64] or [hidden, 128] product alone leaves most of the GPU idle.
    weights["w_x"] = jnp.concatenate([weights.pop(name) for name in X_PARTS], axis=1)
    # So do the two projections of q_a: XLA merges them itself, but not always in place (for
    # an FP8 x FP8 GEMM it copied both matrices into one on every step: 34 us on the H200).
    weights["w_q"] = jnp.concatenate(
        [weights.pop(name).reshape(cfg.q_lora_rank, -1) for name in ("wq_b", "wi_q")], axis=1
    )
    if precision == "fp8":
        for name, spec in WEIGHT_SPECS.items():
            weights[name] = quantize_weight(weights[name], spec)
    return weights


def rms_norm(x: jax.Array, gamma: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    x = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + NORM_EPS)
    return x * gamma.astype(jnp.float32)


def layer_norm(x: jax.Array, gamma: jax.Array, beta: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    x = x - jnp.mean(x, axis=-1, keepdims=True)
    x = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + NORM_EPS)
    return x * gamma.astype(jnp.float32) + beta.astype(jnp.float32)


def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotary embedding on the last dim (interleaved pairs, as DeepSeek); positions
    broadcast against x.shape[:-1]."""
    half = x.shape[-1] // 2
    inv_freq = ROPE_THETA ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], half, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape)


def rope_head(x: jax.Array, positions: jax.Array) -> jax.Array:
    """RoPE on the first QK_ROPE_DIM dims of each head (the DSA indexer layout)."""
    return jnp.concatenate([rope(x[..., :QK_ROPE_DIM], positions), x[..., QK_ROPE_DIM:]], -1)


def dot(x: jax.Array, w: jax.Array | Fp8Weight, spec: str) -> jax.Array:
    """bf16 x bf16 with f32 accumulation and an f32 result (XLA:CPU has no bf16 x bf16 -> f32
    dot, so there both sides are widened to f32 first: the same products); an Fp8Weight
    goes through ``fp8_dot``."""
    if isinstance(w, Fp8Weight):
        return fp8_dot(x, w, spec)
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    x, w = x.astype(jnp.bfloat16).astype(dtype), w.astype(dtype)
    return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)


def to_fp8(x: jax.Array, scale: jax.Array) -> jax.Array:
    return jnp.clip(x / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)


def fp8_scale(x: jax.Array) -> jax.Array:
    """Per-tensor E4M3 scale: the tensor's amax maps to 448."""
    return jnp.maximum(jnp.max(jnp.abs(x)), 1e-12).astype(jnp.float32) / FP8_MAX


def fp8_vector_scales(x: jax.Array) -> jax.Array:
    """E4M3 scales [..., 1] of the last axis's vectors (one index key or head: 128 values),
    each vector's amax mapped to 448."""
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    return jnp.maximum(amax, 1e-12).astype(jnp.float32) / FP8_MAX


def to_fp8_vectors(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., 128] float32 -> (E4M3 values [..., 128], their scales [...] float32)."""
    scales = fp8_vector_scales(x)
    return to_fp8(x, scales), scales[..., 0]


class Fp8Weight(NamedTuple):
    """A weight matrix in FP8 (``--weights fp8``), as DeepSeek V3 / Kimi K2 checkpoints ship
    theirs (they scale 128 x 128 blocks; here one scale per output element). ``values`` keep
    the axes of ``fp8_axes(spec)``: the batch axes, the output axes, then the contracted axes
    last (K-contiguous: the faster layout for the GEMM's weight reads at M = 5 rows on the
    H200); ``scales`` [batch and output axes] float32 map each output's amax to 448."""

    values: jax.Array
    scales: jax.Array


# The einsum spec each weight is used with (``dot``): it fixes its FP8 layout and scales.
WEIGHT_SPECS = {
    "w_x": "rd,dc->rc",
    "w_q": "rq,qc->rc",
    "w_uk": "rhn,hnc->rhc",
    "w_uv": "rhc,hcv->rhv",
    "wo": "rhv,hvd->rd",
}


def spec_parts(spec: str) -> tuple[str, str, str]:
    """(x's axis letters, the weight's, the output's) of an einsum spec "x,w->out"."""
    lhs, rest = spec.split(",")
    rhs, out = rest.split("->")
    return lhs, rhs, out


def fp8_axes(spec: str) -> tuple[str, str]:
    """(the FP8 weight's axis letters, those of its scales) for a weight used with ``spec``:
    batch axes (in x and the output), output axes, then contracted axes."""
    lhs, rhs, out = spec_parts(spec)
    batch = [c for c in rhs if c in lhs and c in out]
    output = [c for c in rhs if c not in lhs]
    contracted = [c for c in rhs if c in lhs and c not in out]
    return "".join(batch + output + contracted), "".join(batch + output)


def quantize_weight(w: jax.Array, spec: str) -> Fp8Weight:
    """bf16 weight (the axes of ``spec``'s right side) -> Fp8Weight."""
    _, rhs, _ = spec_parts(spec)
    letters, scale_letters = fp8_axes(spec)
    w = jnp.einsum(f"{rhs}->{letters}", w.astype(jnp.float32))
    contracted = tuple(range(len(scale_letters), len(letters)))
    scales = jnp.maximum(jnp.max(jnp.abs(w), axis=contracted), 1e-12) / FP8_MAX
    return Fp8Weight(to_fp8(w, scales.reshape(scales.shape + (1,) * len(contracted))), scales)


def dequantize(w: jax.Array | Fp8Weight, spec: str) -> jax.Array:
    """The float32 weight in ``spec``'s right-side axes, whichever its storage."""
    if not isinstance(w, Fp8Weight):
        return w.astype(jnp.float32)
    _, rhs, _ = spec_parts(spec)
    letters, scale_letters = fp8_axes(spec)
    product = f"{letters},{scale_letters}->{rhs}"
    return jnp.einsum(product, w.values.astype(jnp.float32), w.scales)


def weight_shape(w: dict, name: str) -> tuple[int, ...]:
    """Weight ``name``'s shape in its spec's right-side axes, whichever its storage."""
    weight = w[name]
    if not isinstance(weight, Fp8Weight):
        return weight.shape
    _, rhs, _ = spec_parts(WEIGHT_SPECS[name])
    letters, _ = fp8_axes(WEIGHT_SPECS[name])
    return tuple(weight.values.shape[letters.index(c)] for c in rhs)


def head_specs(weight: jax.Array | Fp8Weight, name: str) -> Any:
    """The PartitionSpec(s) that shard weight ``name`` by its head axis over the DCP mesh (an
    Fp8Weight: its values and its scales alike; a scale per output of a row-parallel
    projection, as wo's, is replicated: each rank scales its partial sums, then the psum)."""
    spec = WEIGHT_SPECS[name]

    def over_heads(letters: str) -> P:
        return P(*(MESH_AXIS if c == "h" else None for c in letters))

    if isinstance(weight, Fp8Weight):
        return Fp8Weight(*map(over_heads, fp8_axes(spec)))
    return over_heads(spec_parts(spec)[1])


def along(values: jax.Array, letters: str, out: str) -> jax.Array:
    """``values`` (axes ``letters``, a subset of ``out``'s in any order) shaped to broadcast
    against an array of axes ``out``."""
    order = sorted(letters, key=out.index)
    values = jnp.transpose(values, [letters.index(c) for c in order])
    return values.reshape([values.shape[order.index(c)] if c in order else 1 for c in out])


def fp8_dot(x: jax.Array, w: Fp8Weight, spec: str) -> jax.Array:
    """x times an Fp8Weight, weight-only: x rounded to bf16 as for bf16 weights, the E4M3
    values widened to bf16 (exact) inside the GEMM, f32 accumulation, the weight's scales
    applied to the f32 result. On the H200 XLA fuses the widening into its Triton GEMM, which
    then reads one byte per weight; at M = 5 rows that beat FP8 x FP8 GEMMs (w8a8), whose
    activations' quantization kernels cost more than the FP8 MMAs saved (BENCHMARKS.md)."""
    lhs, _, out = spec_parts(spec)
    letters, scale_letters = fp8_axes(spec)
    y = dot(x, w.values.astype(jnp.bfloat16), f"{lhs},{letters}->{out}")
    return y * along(w.scales, scale_letters, out)


def cache_entries(w: dict, parts: XParts, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Tokens' MLA cache rows [T, 576] and indexer keys [T, 128], float32."""
    latent = rms_norm(parts.kv[:, :KV_LORA_RANK], w["kv_a_norm"])
    k_rope = rope(parts.kv[:, KV_LORA_RANK:], positions)
    index_key = layer_norm(parts.index_key, w["wi_k_norm"], w["wi_k_bias"])
    return jnp.concatenate([latent, k_rope], axis=-1), rope_head(index_key, positions)


def q_projections(w: dict, parts: XParts) -> tuple[jax.Array, jax.Array]:
    """The normalized q_a [R, q_lora_rank] times the fused [wq_b | wi_q]: the MLA query
    [R, H, 192] and the indexer's query [R, index_heads, 128], float32, before RoPE."""
    q_a = rms_norm(parts.q_a, w["q_a_norm"])
    fused = dot(q_a, w["w_q"], "rq,qc->rc")
    heads, nope_dim, _ = weight_shape(w, "w_uk")
    q, index_q = jnp.split(fused, [heads * (nope_dim + QK_ROPE_DIM)], axis=-1)
    rows = fused.shape[0]
    return q.reshape(rows, heads, -1), index_q.reshape(rows, -1, INDEX_HEAD_DIM)


def absorbed_query(w: dict, q: jax.Array, positions: jax.Array) -> jax.Array:
    """The MLA query [R, H, 192] (q_projections) -> the absorbed query [R, H, 576] float32."""
    nope_dim = weight_shape(w, "w_uk")[1]
    q_latent = dot(q[..., :nope_dim], w["w_uk"], "rhn,hnc->rhc")
    q_rope = rope(q[..., nope_dim:], positions[:, None])
    return jnp.concatenate([q_latent, q_rope], axis=-1)


def index_query(
    index_q: jax.Array, parts: XParts, positions: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The DSA indexer's query [R, index_heads, 128] (q_projections) -> its float8_e4m3fn
    form, one scale per (row, head), and the head weights [R, index_heads] float32 with that
    scale folded in: index_topk's score is then k_scale * sum_h weights_h * relu(q8_h . k8),
    DeepSeek V3.2's indexer."""
    heads = index_q.shape[1]
    q, q_scales = to_fp8_vectors(rope_head(index_q, positions[:, None]))
    weights = parts.index_weights * (heads**-0.5 * INDEX_HEAD_DIM**-0.5)
    return q, weights * q_scales


def output_projection(w_uv: jax.Array, wo: jax.Array, latent: jax.Array) -> jax.Array:
    """[R, H, 512] latent -> per-head values (W_UV) -> output projection [R, hidden], f32."""
    values = dot(latent, w_uv, "rhc,hcv->rhv")
    return dot(values, wo, "rhv,hvd->rd")


# ---------------------------------------------------------------------------------------------
# The decode step: single device and DCP
# ---------------------------------------------------------------------------------------------


def make_step(
    cfg: LayerConfig, mesh: jax.sharding.Mesh | None, implementation: str, exchange: str
) -> Callable[..., tuple[jax.Array, Cache, StepAux]]:
    """step(weights, cache, x [R, hidden], pos, exchange_step) -> (out [R, hidden] f32, cache,
    aux), jitted with the cache donated (rewritten in place with the verify tokens' entries).
    implementation: "cute" (the kernel path: index_topk with implementation=None, the
    attention 'cute') or "reference" (both 'reference'). exchange_step (int32) is
    dcp_decode's step: it must advance by one at every call for exchange="push"."""
    index_implementation = None if implementation == "cute" else implementation

    def step(w: dict, cache: Cache, x: jax.Array, pos: jax.Array, exchange_step: jax.Array):
        positions = pos + jnp.arange(x.shape[0], dtype=jnp.int32)
        with jax.named_scope("projections"):
            parts = x_projections(w, x)
        with jax.named_scope("cache_write"):
            kv_new, index_new = cache_entries(w, parts, positions)
            kv_new = to_fp8(kv_new, cache.kv_scale)
            index_new, index_scales_new = to_fp8_vectors(index_new)
        with jax.named_scope("query"):
            q, index_q = q_projections(w, parts)
            q = absorbed_query(w, q, positions)
            q_scale = fp8_scale(q)
            q = to_fp8(q, q_scale)
        with jax.named_scope("index_query"):
            index_q, index_weights = index_query(index_q, parts, positions)
        # One request whose R verify rows are the last R tokens of its context.
        lengths = (pos + x.shape[0]).reshape(1).astype(jnp.int32)

        if mesh is None:
            with jax.named_scope("cache_write"):
                # The verify rows' positions are contiguous (pos, pos + 1, ...) and inside the
                # capacity (main sizes the cache so): in-place slice updates, which XLA can
                # fuse with the entries' last ops, instead of scatters.
                cache = cache._replace(
                    kv=lax.dynamic_update_slice(cache.kv, kv_new, (pos, 0)),
                    index_keys=lax.dynamic_update_slice(cache.index_keys, index_new, (pos, 0)),
                    index_scales=lax.dynamic_update_slice(
                        cache.index_scales, index_scales_new, (pos,)
                    ),
                )
            with jax.named_scope("index_topk"):
                tokens = jax_sparse_mla.index_topk(
                    index_q[None],
                    index_weights[None],
                    cache.index_keys,
                    cache.index_scales,
                    lengths,
                    top_k=cfg.index_topk,
                    implementation=index_implementation,
                )
            with jax.named_scope("sparse_decode"):
                rows, valid = jax_sparse_mla.token_rows(tokens)  # [1, R, K] -> [R, K], [R]
                latent, _ = jax_sparse_mla.decode(
                    q,
                    cache.kv,
                    rows,
                    valid,
                    softmax_scale=cfg.softmax_scale,
                    q_scale=q_scale,
                    kv_scale=cache.kv_scale,
                    implementation=implementation,
                )
            with jax.named_scope("output_projection"):
                out = output_projection(w["w_uv"], w["wo"], latent)
            tokens = tokens[0]
        else:
            out, cache, latent, tokens = dcp_attention(
                cfg,
                mesh,
                (implementation, index_implementation),
                exchange,
                exchange_step,
                w,
                cache,
                (kv_new, index_new, index_scales_new),
                positions,
                lengths,
                (q, q_scale, index_q, index_weights),
            )
        return out, cache, StepAux(q, q_scale, tokens, latent, index_q, index_weights)

    return jax.jit(step, donate_argnums=1)


def dcp_attention(
    cfg: LayerConfig,
    mesh: jax.sharding.Mesh,
    implementations: tuple[str, str | None],
    exchange: str,
    exchange_step: jax.Array,
    w: dict,
    cache: Cache,
    entries: tuple[jax.Array, jax.Array, jax.Array],
    positions: jax.Array,
    lengths: jax.Array,
    queries: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
) -> tuple[jax.Array, Cache, jax.Array, jax.Array]:
    """Indexer, attention and output projection with both caches sharded by token over the
    mesh: each rank writes the verify tokens it owns, takes the global top-k with
    dcp_index_topk over its index shard, runs dcp_decode_tokens (its local rows, dcp_decode)
    for its own heads, and the row-parallel output projection is psum'd. Returns (out, cache,
    latent, tokens [D, R, K]: every rank's copy of the global positions)."""
    dcp = mesh.shape[MESH_AXIS]
    implementation, index_implementation = implementations
    q, q_scale, index_q, index_weights = queries

    def per_rank(local: Cache, entries, q_own, index_q, index_weights, q_scale, step, w_uv, wo):
        rank = lax.axis_index(MESH_AXIS)
        with jax.named_scope("cache_write"):
            local_n = local.kv.shape[0]
            mine = positions % dcp == rank
            slots = jnp.where(mine, positions // dcp, local_n)  # local_n: dropped
            kv_new, index_new, index_scales_new = entries
            local = local._replace(
                kv=local.kv.at[slots].set(kv_new, mode="drop"),
                index_keys=local.index_keys.at[slots].set(index_new, mode="drop"),
                index_scales=local.index_scales.at[slots].set(index_scales_new, mode="drop"),
            )
        # Collectives (the candidates' exchange, dcp_decode's all-gather / all-to-all) go to
        # phase "collectives"; the push exchange's kernels stay in "sparse_decode".
        with jax.named_scope("index_topk"):
            tokens = jax_sparse_mla.dcp_index_topk(
                index_q[None],
                index_weights[None],
                local.index_keys,
                local.index_scales,
                lengths,
                axis_name=MESH_AXIS,
                top_k=cfg.index_topk,
                implementation=index_implementation,
            )[0]
        with jax.named_scope("sparse_decode"):
            # local_rows + dcp_decode; the push exchange's kernel compacts the tokens itself.
            latent, _ = jax_sparse_mla.dcp_decode_tokens(
                q_own,
                local.kv,
                tokens,
                axis_name=MESH_AXIS,
                softmax_scale=cfg.softmax_scale,
                q_scale=q_scale,
                kv_scale=local.kv_scale,
                implementation=implementation,
                exchange=exchange,
                step=step,
            )
        with jax.named_scope("output_projection"):
            out = lax.psum(output_projection(w_uv, wo, latent), MESH_AXIS)
        # Every rank's copy of the tokens comes out, for the check that they are identical.
        return out, local, latent, tokens[None]

    heads = P(None, MESH_AXIS, None)
    w_specs = (head_specs(w["w_uv"], "w_uv"), head_specs(w["wo"], "wo"))
    sharded = jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(CACHE_SPECS, P(), heads, P(), P(), P(), P(), *w_specs),
        out_specs=(P(), CACHE_SPECS, heads, P(MESH_AXIS)),
    )
    return sharded(
        cache, entries, q, index_q, index_weights, q_scale, exchange_step, w["w_uv"], w["wo"]
    )


# ---------------------------------------------------------------------------------------------
# Setup: weights, the existing context, the verify tokens
# ---------------------------------------------------------------------------------------------


def build_cache(w: dict, context: int, capacity: int, dcp: int, key: jax.Array) -> Cache:
    """Cache entries of `context` random hidden states at positions 0..context-1: the MLA
    rows FP8 with a per-tensor scale calibrated on them, the index keys FP8 with one scale
    each; rows up to `capacity` are empty (zero keys and scales)."""
    chunk = min(1024, context)
    kv_parts, index_parts = [], []
    for start in range(0, context, chunk):
        kv, index_key = context_entries(w, key, jnp.int32(start), chunk)
        kv_parts.append(kv)
        index_parts.append(index_key)
        if len(kv_parts) % 8 == 0:
            log(f"  cache: {start + chunk}/{context} tokens")
    return quantize_cache(kv_parts, index_parts, context, capacity, dcp)


@functools.partial(jax.jit, static_argnums=3)
def context_entries(
    w: dict, key: jax.Array, start: jax.Array, chunk: int
) -> tuple[jax.Array, jax.Array]:
    """Cache entries (float32) of `chunk` random hidden states at positions start.."""
    x = jax.random.normal(jax.random.fold_in(key, start), (chunk, weight_shape(w, "w_x")[0]))
    return cache_entries(w, x_projections(w, x), start + jnp.arange(chunk, dtype=jnp.int32))


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def quantize_cache(
    kv_parts: list[jax.Array],
    index_parts: list[jax.Array],
    context: int,
    capacity: int,
    dcp: int,
) -> Cache:
    """The first `context` float32 entries -> FP8 caches of `capacity` rows (rank-major
    under DCP): kv with a per-tensor scale from its amax, index keys with one scale each."""
    kv = jnp.concatenate(kv_parts)[:context]
    kv_scale = fp8_scale(kv)
    index_keys, index_scales = to_fp8_vectors(jnp.concatenate(index_parts)[:context])
    pad = ((0, capacity - context), (0, 0))
    kv = jnp.pad(to_fp8(kv, kv_scale), pad)
    index_keys = jnp.pad(index_keys, pad)
    index_scales = jnp.pad(index_scales, pad[:1])
    if dcp > 1:  # token t -> rank t % dcp, local row t // dcp; rank-major rows
        kv, index_keys, index_scales = (
            a.reshape(capacity // dcp, dcp, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
            for a in (kv, index_keys, index_scales)
        )
    return Cache(kv, kv_scale, index_keys, index_scales)


def flat_rows(tokens: jax.Array, capacity: int, dcp: int) -> jax.Array:
    """Row of each global token in the cache's arrays (rank-major under DCP)."""
    return (tokens % dcp) * (capacity // dcp) + tokens // dcp


@functools.partial(jax.jit, static_argnums=(0, 4))
def dense_check(
    cfg: LayerConfig, w: dict, cache: Cache, aux: StepAux, dcp: int
) -> tuple[jax.Array, jax.Array]:
    """Layer output [R, hidden] and latent [R, H, 512] from a dense float32 attention over
    the step's selected keys: dequantized FP8 query and cache, exact softmax, f32 weights."""
    capacity = cache.kv.shape[0]
    selected = aux.tokens >= 0
    rows = flat_rows(jnp.where(selected, aux.tokens, 0), capacity, dcp)
    # Widened behind a barrier: XLA's GPU GEMM rewriter would otherwise run the logits as an
    # FP8 GEMM with a reduced-precision accumulator (see reference.exact_operand).
    keys = jax.lax.optimization_barrier(cache.kv[rows].astype(jnp.float32)) * cache.kv_scale
    q = jax.lax.optimization_barrier(aux.q.astype(jnp.float32)) * aux.q_scale
    logits = jnp.einsum("rhc,rkc->rhk", q, keys, precision="highest") * cfg.softmax_scale
    probs = jax.nn.softmax(jnp.where(selected[:, None, :], logits, -jnp.inf), axis=-1)
    latent = jnp.einsum("rhk,rkc->rhc", probs, keys[..., :KV_LORA_RANK], precision="highest")
    w_uv, wo = (dequantize(w[name], WEIGHT_SPECS[name]) for name in ("w_uv", "wo"))
    values = jnp.einsum("rhc,hcv->rhv", latent, w_uv, precision="highest")
    out = jnp.einsum("rhv,hvd->rd", values, wo, precision="highest")
    return out, latent


def relative_error(actual: jax.Array, expected: jax.Array) -> float:
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


@dataclasses.dataclass(frozen=True)
class Selection:
    """One path's top-k and the FP8 index operands it scored: host copies, keys in token
    order (taken before the next call overwrites the donated cache)."""

    tokens: np.ndarray  # [R, K] int32 ascending, then -1
    q: np.ndarray  # [R, index_heads, 128] float32 holding the FP8 values
    weights: np.ndarray  # [R, index_heads] float32
    keys: np.ndarray  # [capacity, 128] float32 holding the FP8 values
    scales: np.ndarray  # [capacity] float32
    visible: tuple[int, ...]  # row r scores positions [0, visible[r])

    @classmethod
    def of_step(cls, tokens: np.ndarray, aux: StepAux, cache: Cache, dcp: int, pos: int):
        capacity = cache.index_keys.shape[0]
        order = flat_rows(np.arange(capacity), capacity, dcp)
        return cls(
            tokens,
            np.asarray(aux.index_q, np.float32),
            np.asarray(aux.index_weights, np.float32),
            np.asarray(cache.index_keys, np.float32)[order],
            np.asarray(cache.index_scales, np.float32)[order],
            tuple(pos + 1 + r for r in range(tokens.shape[0])),
        )

    def scores(self, row: int) -> token_agreement.RowScores:
        """Row's float64 scores over its visible positions and their FP32 rounding bounds."""
        end = self.visible[row]
        return token_agreement.row_scores(
            self.q[row], self.weights[row], self.keys[:end], self.scales[:end]
        )

    def operand_differences(self, other: Selection) -> int:
        """Index operand values (query, weights, keys, scales) that differ from other's."""
        pairs = [(self.q, other.q), (self.weights, other.weights)]
        pairs += [(self.keys, other.keys), (self.scales, other.scales)]
        return sum(int(np.sum(a != b)) for a, b in pairs)


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog=(
            f"Fixed by the FP8 cache layouts: kv_lora_rank {KV_LORA_RANK}, qk_rope_dim "
            f"{QK_ROPE_DIM} (cache rows of {CACHE_WIDTH} bytes), index heads and keys of "
            f"{INDEX_HEAD_DIM} (one FP32 scale per key). Size flags override the preset "
            f"(Kimi-K3 class by default, --small for a tiny layer). Wall-clock lines (TIME) "
            f"include dispatch; GPU time per phase (GPU lines) comes from the JAX profiler, on "
            f"a GPU only. Exit status 1 when a check fails."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="tiny preset (seconds on a CPU): " + preset_summary(SMALL),
    )
    for name, text in SIZE_FLAGS.items():
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=None,
            help=f"{text} (Kimi {getattr(KIMI, name)}, --small {getattr(SMALL, name)})",
        )
    parser.add_argument(
        "--context",
        type=int,
        default=None,
        help="tokens already in the cache; the verify rows sit at positions context.. "
        "(default: 32768 on GPU, 4096 on CPU, 256 with --small)",
    )
    parser.add_argument(
        "--verify-rows",
        type=int,
        default=5,
        help="speculative-decode verify rows: decode rows of this step (default 5)",
    )
    parser.add_argument(
        "--dcp",
        type=int,
        default=1,
        help="decode context parallel size: >1 shards both caches by token over N devices "
        "and runs dcp_index_topk and dcp_decode in shard_map (on CPU, N virtual devices are "
        "created; default 1: index_topk and decode on one device)",
    )
    parser.add_argument(
        "--exchange",
        choices=["collectives", "push"],
        default="collectives",
        help="with --dcp: how dcp_decode sends the partials to their owners (default "
        "collectives; push: the one-sided mailbox exchange on GPUs, set up by "
        "jax_sparse_mla.dcp_setup; on CPU it runs as collectives)",
    )
    parser.add_argument(
        "--weights",
        choices=["bf16", "fp8"],
        default="bf16",
        help="the layer's weight matrices: bf16 (default) or fp8 (E4M3 with one scale per "
        "output, as DeepSeek V3 / Kimi K2 ship FP8 weights; used weight-only: bf16 "
        "activations, the GEMMs read the E4M3 values)",
    )
    parser.add_argument(
        "--iters",
        type=int,
        default=None,
        help="wall-clock timed calls (default 50 on GPU, 5 on CPU; 0 skips the wall clock)",
    )
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed calls before the wall clock (default 3)"
    )
    parser.add_argument(
        "--profile-calls",
        type=int,
        default=30,
        help="GPU only: steps run under the JAX profiler for the GPU time per phase "
        "(default 30; 0 skips; ignored on CPU)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of weights and inputs (default 0)"
    )
    args = parser.parse_args(argv)
    preset = SMALL if args.small else KIMI
    sizes = {
        name: getattr(preset, name) if getattr(args, name) is None else getattr(args, name)
        for name in SIZE_FLAGS
    }
    args.config = LayerConfig(**sizes)
    if min(sizes.values()) < 1 or args.verify_rows < 1 or args.dcp < 1:
        parser.error(f"sizes, --verify-rows and --dcp must be positive: {sizes}")
    if (args.context is not None and args.context < 1) or min(
        args.iters or 0, args.warmup, args.profile_calls
    ) < 0:
        parser.error("--context must be positive, --iters, --warmup, --profile-calls not negative")
    if args.config.heads % args.dcp:
        parser.error(f"--heads {args.config.heads} must be a multiple of --dcp {args.dcp}")
    return args


def preset_summary(cfg: LayerConfig) -> str:
    return ", ".join(f"{name} {getattr(cfg, name)}" for name in SIZE_FLAGS)


def median_time(fn: Callable[[], Any], warmup: int, iters: int) -> tuple[float, float, float]:
    """(median, min, max) seconds of fn() with block_until_ready."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)


def seconds(value: float) -> str:
    return f"{value * 1e3:.2f} ms" if value >= 1e-3 else f"{value * 1e6:.1f} us"


def banner(lines: Sequence[str]) -> None:
    rule = "!" * 88
    print("\n".join([rule, *[f"!!! {line}" for line in lines], rule]), flush=True)


def make_mesh(dcp: int) -> jax.sharding.Mesh | None:
    if dcp == 1:
        return None
    devices = jax.devices()
    if len(devices) < dcp:
        raise SystemExit(
            f"--dcp {dcp} needs {dcp} devices; jax sees {len(devices)} "
            f"{devices[0].platform} device(s). On a CPU machine this script creates them "
            f"itself (XLA_FLAGS=--xla_force_host_platform_device_count={dcp} before jax is "
            f"imported); with GPUs, run on a host with {dcp} GPUs or set JAX_PLATFORMS=cpu."
        )
    return jax.sharding.Mesh(np.array(devices[:dcp]), (MESH_AXIS,))


def place(tree: Any, mesh: jax.sharding.Mesh | None, specs: Any) -> Any:
    if mesh is None:
        return tree
    return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the example; returns {"passed", "rel_error", "paths", "index_check" (per path:
    token_agreement.Agreement vs the float64 top-k), "kernel_vs_reference" (Agreement of the
    two paths' tokens, when both ran), "timings" (wall clock seconds per path), "gpu_times"
    (per path: {device plane: phase_times.PhaseTimes}, GPU only)}."""
    global _T0
    _T0 = time.perf_counter()
    args = parse_args(argv)
    cfg, dcp, rows = args.config, args.dcp, args.verify_rows
    platform = jax.devices()[0].platform
    on_gpu = platform == "gpu"
    context = args.context or (256 if args.small else 32768 if on_gpu else 4096)
    iters = args.iters if args.iters is not None else (50 if on_gpu else 5)
    capacity = max(context + rows, cfg.index_topk)
    capacity = -(-capacity // (16 * dcp)) * 16 * dcp
    mesh = make_mesh(dcp)
    if mesh is not None and args.exchange == "push":
        set_up = jax_sparse_mla.dcp_setup(mesh, MESH_AXIS)
        log(
            "push exchange: mailboxes set up on the GPUs (dcp_setup)"
            if set_up
            else f"push exchange on {platform}: runs as collectives (no setup needed)"
        )

    log(
        f"jax {jax.__version__}, {len(jax.devices())} {platform} device(s): "
        f"{jax.devices()[0].device_kind}"
    )
    log(
        f"layer: {preset_summary(cfg)}, kv_lora_rank {KV_LORA_RANK}, qk_rope {QK_ROPE_DIM}, "
        f"softmax_scale {cfg.softmax_scale:.5f}"
    )
    attention = (
        f"dcp_decode in shard_map over {dcp} devices, exchange={args.exchange!r}"
        if mesh
        else "decode (1 device)"
    )
    log(
        f"step: {rows} verify rows at positions {context}..{context + rows - 1}, "
        f"cache {context} tokens (capacity {capacity} x {CACHE_WIDTH} FP8, index "
        f"{capacity} x {INDEX_HEAD_DIM} FP8 + 1 FP32 scale each), top-k {cfg.index_topk} by "
        f"{'dcp_index_topk' if mesh else 'index_topk'}, attention: {attention}"
    )

    key = jax.random.key(args.seed)
    rng = np.random.default_rng(args.seed + 1)
    log("building random weights ...")
    weights = jax.block_until_ready(init_weights(cfg, args.seed, args.weights))
    leaves = jax.tree.leaves(weights)
    n_params = sum(a.size for a in leaves if a.dtype != jnp.float32)
    n_bytes = sum(a.size * a.dtype.itemsize for a in leaves)
    kind = "bf16" if args.weights == "bf16" else "FP8 E4M3 matrices, one scale per output"
    log(f"  {n_params / 1e6:.1f} M parameters ({kind}), {n_bytes / 1e6:.1f} MB")
    log(f"building the cache of {context} tokens ...")
    cache = build_cache(weights, context, capacity, dcp, jax.random.fold_in(key, 1))
    cache = jax.block_until_ready(cache)
    scales = np.asarray(cache.index_scales)[np.asarray(cache.index_scales) > 0]
    log(
        f"  kv_scale {float(cache.kv_scale):.4g}, index key scales {scales.min():.4g}.."
        f"{scales.max():.4g}"
    )
    x = jnp.asarray(rng.standard_normal((rows, cfg.hidden), np.float32), jnp.bfloat16)
    pos = jnp.int32(context)

    weight_specs = {name: P() for name in weights}
    weight_specs.update({name: head_specs(weights[name], name) for name in ("w_uv", "wo")})
    weights = place(weights, mesh, weight_specs)
    x, pos = place((x, pos), mesh, (P(), P()))  # replicated once, not copied at every call

    paths = ["kernel", "reference"] if on_gpu else ["reference"]
    if not on_gpu:
        log(f"on {platform}: only the pure-jnp reference path runs (the kernel needs a GPU)")
    results: dict[str, Any] = {
        "passed": True,
        "rel_error": {},
        "paths": [],
        "index_check": {},
        "timings": {},
        "gpu_times": {},
    }
    selections = {}
    for path in paths:
        step_cache = place(jax.tree.map(jnp.copy, cache), mesh, CACHE_SPECS)
        try:
            outcome = run_path(path, cfg, mesh, weights, step_cache, x, pos, args, iters)
        except Exception as failure:  # the kernel path: say loudly why, then run the reference
            if path != "kernel":
                raise
            expected = isinstance(failure, (NotImplementedError, kernel_unavailable_error()))
            banner(
                [
                    f"THE CuTe KERNEL IS NOT USED on this {platform}: implementation='cute' "
                    + ("is unavailable" if expected else "FAILED"),
                    f"{type(failure).__name__}: {failure}",
                    "only the pure-jnp reference path runs below",
                ]
            )
            results["kernel_error"] = f"{type(failure).__name__}: {failure}"
            results["passed"] &= expected
            continue
        results["paths"].append(path)
        results["rel_error"][path] = outcome.rel_error
        results["index_check"][path] = outcome.index_check
        results["passed"] &= bool(outcome.rel_error <= TOLERANCE) and outcome.index_check.agrees
        selections[path] = outcome.selection
        if outcome.wall_s is not None:
            results["timings"][path] = outcome.wall_s
        if outcome.gpu_times:
            results["gpu_times"][path] = outcome.gpu_times

    if {"kernel", "reference"} <= selections.keys():
        agreement = compare_paths(selections["kernel"], selections["reference"])
        results["kernel_vs_reference"] = agreement
        results["passed"] &= agreement.agrees
    if on_gpu and "kernel" not in results["paths"]:
        banner(["NO KERNEL: the step ran on the pure-jnp reference path only"])
    if not on_gpu:
        print(
            f"GPU TIME: GPU time per phase needs a GPU (this run: {platform}); the TIME "
            f"lines above are wall clock incl. dispatch",
            flush=True,
        )
    elif {"kernel", "reference"} <= results["gpu_times"].keys():
        print_headline(results["gpu_times"]["kernel"], results["gpu_times"]["reference"])
    print(f"RESULT: {'PASS' if results['passed'] else 'FAIL'}", flush=True)
    return results


class PathOutcome(NamedTuple):
    rel_error: float  # layer output vs the dense f32 attention
    index_check: token_agreement.Agreement  # the step's tokens vs the float64 top-k
    selection: Selection
    wall_s: float | None  # wall-clock median of the jitted step
    gpu_times: dict[str, phase_times.PhaseTimes] | None  # per device plane (GPU only)


def run_path(
    path: str,
    cfg: LayerConfig,
    mesh: jax.sharding.Mesh | None,
    weights: dict,
    cache: Cache,
    x: jax.Array,
    pos: jax.Array,
    args: argparse.Namespace,
    iters: int,
) -> PathOutcome:
    """Compiles, checks and times the step on one path ("kernel": the attention
    implementation='cute', index_topk implementation=None; "reference": both 'reference')."""
    implementation = "cute" if path == "kernel" else "reference"
    platform = jax.devices()[0].platform
    log(f"compiling the step ({path} path, implementation={implementation!r}) ...")
    step = make_step(cfg, mesh, implementation, args.exchange)
    counter = itertools.count()  # dcp_decode's step: advances at every call

    def exchange_step() -> np.int32:
        return np.int32(next(counter))

    compiled = step.lower(weights, cache, x, pos, exchange_step()).compile()
    what = "the CuTe DSL kernel" if path == "kernel" else "the pure-jnp reference"
    text = compiled.as_text()
    # With exchange="push" the kernel runs as the pushing decode (its own target).
    launches = sum(text.count(f'custom_call_target="{t}"') for t in (KERNEL_TARGET, PUSH_TARGET))
    index_launches = text.count(f'custom_call_target="{INDEX_TARGET}"')
    log(
        f"  compiled; PATH RUNNING: {what} on {platform} (implementation={implementation!r}; "
        f"{launches} decode kernel call(s) in the compiled step); index_topk: "
        + (f"its kernel ({index_launches} call(s))" if index_launches else "the jnp reference")
    )
    if path == "kernel" and launches == 0:
        raise RuntimeError(f"no {KERNEL_TARGET!r} custom call in the compiled kernel path")
    if path == "kernel" and index_launches == 0:
        banner(
            [
                f"index_topk(implementation=None) runs its jnp reference on this {platform}: "
                f"no {INDEX_TARGET!r} custom call in the compiled kernel path",
                "(the kernel path's indexer and top-k are then the reference's)",
            ]
        )
    if path == "kernel" and mesh is not None and args.exchange == "push":
        if f'custom_call_target="{PUSH_TARGET}"' not in text or " all-to-all(" in text:
            raise RuntimeError(f"exchange='push' but no {PUSH_TARGET!r} in the compiled step")
        log("  the pushing decode and the merge are in the compiled step (no all-to-all)")

    out, cache, aux = compiled(weights, cache, x, pos, exchange_step())
    out = jax.block_until_ready(out)
    dcp = 1 if mesh is None else mesh.shape[MESH_AXIS]
    rank_tokens = np.asarray(aux.tokens).reshape(dcp, *aux.q.shape[:1], cfg.index_topk)
    ranks_agree = all(np.array_equal(t, rank_tokens[0]) for t in rank_tokens)
    aux = aux._replace(tokens=jnp.asarray(rank_tokens[0]))
    expected_out, expected_latent = dense_check(cfg, weights, cache, aux, dcp)
    error = relative_error(out, expected_out)
    latent_error = relative_error(aux.latent, expected_latent)
    error = error if np.isfinite(error) else math.inf
    valid = np.asarray(jnp.sum(aux.tokens >= 0, axis=1))
    log(f"  keys attended per row: {valid.tolist()}; q_scale {float(aux.q_scale):.4g}")
    print(
        f"CHECK {path}: layer output vs dense f32 attention over the same keys: rel error "
        f"{error:.3e} (attention latent {latent_error:.3e}), threshold {TOLERANCE:.4g} -> "
        f"{'PASS' if error <= TOLERANCE else 'FAIL'}",
        flush=True,
    )
    selection = Selection.of_step(rank_tokens[0], aux, cache, dcp, int(pos))
    index_check = check_selection(path, selection, ranks_agree, dcp)
    state = {"cache": cache}

    def call() -> jax.Array:
        out, state["cache"], _ = compiled(weights, state["cache"], x, pos, exchange_step())
        return out

    median = None
    if iters > 0:
        median, low, high = median_time(call, args.warmup, iters)
        print(
            f"TIME {path}: jitted step median {seconds(median)} (min {seconds(low)}, max "
            f"{seconds(high)}) over {iters} calls, wall clock incl. dispatch",
            flush=True,
        )
    gpu_times = None
    if platform == "gpu" and args.profile_calls > 0:
        gpu_times = profile_phases(path, compiled.as_text(), call, args.profile_calls)
    return PathOutcome(error, index_check, selection, median, gpu_times)


def check_selection(
    path: str, selection: Selection, ranks_agree: bool, dcp: int
) -> token_agreement.Agreement:
    """The step's tokens vs the float64 top-k of the same FP8 operands (same order, same tie
    rule); under DCP every rank must also hold the same tokens. Prints the CHECK line."""
    log(f"  float64 scores of the {len(selection.visible)} rows for the top-k check ...")
    exact = [selection.scores(row) for row in range(len(selection.visible))]
    top_k = selection.tokens.shape[-1]
    want = np.stack([token_agreement.exact_selection(scores, top_k) for scores, _ in exact])
    agreement = token_agreement.compare(selection.tokens, want, exact.__getitem__)
    if not ranks_agree:  # counted as malformed: the step's tokens are not well defined
        agreement = dataclasses.replace(agreement, malformed_rows=agreement.rows)
    ranks = f"; identical on all {dcp} ranks: {ranks_agree}" if dcp > 1 else ""
    print(
        f"CHECK {path} index_topk: selected tokens vs the float64 top-k of the same FP8 "
        f"operands: {agreement.summary()}{ranks} -> {'PASS' if agreement.agrees else 'FAIL'}",
        flush=True,
    )
    return agreement


def compare_paths(kernel: Selection, reference: Selection) -> token_agreement.Agreement:
    """The kernel path's tokens vs the reference path's, differences judged on the reference
    path's operands (float64 scores, FP32 rounding bounds). Prints the CHECK line."""
    agreement = token_agreement.compare(kernel.tokens, reference.tokens, reference.scores)
    differing = kernel.operand_differences(reference)
    operands = (
        "the same index operands"
        if differing == 0
        else f"NOTE {differing} index operand values differ between the paths"
    )
    print(
        f"CHECK index_topk, kernel vs reference path ({operands}): {agreement.summary()} -> "
        f"{'PASS' if agreement.agrees else 'FAIL'}",
        flush=True,
    )
    return agreement


def profile_phases(
    path: str, hlo_text: str, call: Callable[[], jax.Array], calls: int
) -> dict[str, phase_times.PhaseTimes] | None:
    """Profiles `calls` steps and prints each GPU's time per phase; None (and a banner
    saying why) when the profile cannot be read: the numeric check stands either way."""
    log(f"  profiling {calls} steps ({path} path) for the GPU time per phase ...")
    try:
        ops = phase_times.instruction_phases(hlo_text, PHASES)
        missing = [phase for phase in PHASES if phase not in ops.phases_present()]
        if missing:
            log(f"  note: no instruction of the compiled step is in phase(s) {missing}")
        times = phase_times.profile(call, calls, ops, PHASES)
    except Exception as failure:
        banner(
            [f"GPU PHASE TIMES UNAVAILABLE ({path} path)", f"{type(failure).__name__}: {failure}"]
        )
        return None
    for _, device_times in sorted(times.items()):
        print(phase_times.summary_line(f"step, {path} path", device_times), flush=True)
        print("\n".join(phase_times.format_table(device_times)), flush=True)
    return times


def print_headline(
    kernel: dict[str, phase_times.PhaseTimes], reference: dict[str, phase_times.PhaseTimes]
) -> None:
    """GPU time per step, kernel vs reference, per device: the indexer's top-k, the sparse
    decode, the collectives (DCP only), the whole step. Medians over the profiled calls."""
    rows = [("index_topk", "index_topk"), ("sparse_decode", "sparse_decode")]
    rows.append((phase_times.COLLECTIVES, "collectives"))
    for device in sorted(kernel.keys() & reference.keys()):
        k, r = kernel[device], reference[device]
        for phase, label in [*rows, (None, "whole step")]:
            if phase == phase_times.COLLECTIVES and not (k.events[phase] or r.events[phase]):
                continue
            k_us, r_us = k.median_us(phase), r.median_us(phase)
            ratio = f"{r_us / k_us:.2f}x" if k_us > 0 else "n/a"
            print(
                f"GPU TIME {label} ({device}): kernel path {k_us:.1f} us vs reference path "
                f"{r_us:.1f} us per step (reference / kernel {ratio})",
                flush=True,
            )


def kernel_unavailable_error() -> type[Exception]:
    """The package's 'no kernel here' error, where it exists (else NotImplementedError)."""
    try:
        from jax_sparse_mla.kernel.config import KernelUnavailableError
    except ImportError:
        return NotImplementedError
    return KernelUnavailableError


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
