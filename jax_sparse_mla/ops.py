"""The public single-device decode."""

from __future__ import annotations

import jax.numpy as jnp

from jax_sparse_mla import reference, validation
from jax_sparse_mla.kernel.config import KernelConfig
from jax_sparse_mla.primitive import sparse_mla_decode_p


def decode(
    q,
    kv,
    rows,
    valid,
    *,
    softmax_scale,
    q_scale=1.0,
    kv_scale=1.0,
    implementation=None,
    kernel_config=None,
    valid_hint=None,
):
    """Sparse MLA decode over an FP8 E4M3 cache: each query row attends its selected keys.

    Args:
      q: [B, H, 576] float8_e4m3fn. Per head, the absorbed query: 512 latent + 64 RoPE
        bytes. Any H >= 1 (padded to a multiple of 16 internally).
      kv: [N, W] float8_e4m3fn flat cache rows, or a paged cache [num_blocks, block_size, W]
        whose flat row is block * block_size + offset. A row's first 576 bytes are read (512
        latent, which is also V, + 64 RoPE); W >= 576 with W % 16 == 0, so rows padded to
        640 bytes (as JAX paged-MLA caches lay them out) need no copy.
      rows: [B, K] int32 flat cache rows selected for each query row (the top-k).
      valid: [B] int32. Row b attends rows[b, :clamp(valid[b], 0, K)]; entries past that are
        never read, and entries outside [0, N) are skipped (never read). Duplicates count
        once per occurrence.
      softmax_scale: static Python float multiplying q.k (e.g. 1/sqrt(192)).
      q_scale, kv_scale: per-tensor FP8 dequantization scales: Python floats or float32
        scalars (may be traced). Logits are softmax_scale * q_scale * kv_scale * (q.k) and
        the output is multiplied by kv_scale.
      implementation: None (the kernel on a Hopper GPU, else the reference, noted once in the
        "jax_sparse_mla" logger), "cute" (the kernel or NotImplementedError at lowering),
        "reference" (pure jax.numpy).
      kernel_config: a ``jax_sparse_mla.kernel.KernelConfig`` to force one compiled kernel
        variant (tests, benchmarks); None (default) lets the dispatch rule choose by shape
        (``jax_sparse_mla.kernel.dispatch.choose_config``). Not allowed with
        implementation="reference".
      valid_hint: None (default) or a static Python int: about how many keys per row are
        valid (e.g. the batch's longest context, or its bucket, when it is below K). Only
        the dispatch rule reads it: it picks the kernel config as if K were
        min(K, valid_hint), since the kernel's speed follows the valid counts, which it
        cannot see (they live on the device). Results never depend on it; a wrong hint only
        costs speed. Ignored with kernel_config or implementation="reference".

    Returns:
      latent: [B, H, 512] bfloat16, softmax(logits) @ V * kv_scale.
      lse: [B, H] float32, natural log of sum(exp(logits)).
      A row with no keys gives latent zeros and lse -inf.

    Not differentiable (inference only).
    """
    implementation, operands = kernel_operands(
        q,
        kv,
        rows,
        valid,
        softmax_scale=softmax_scale,
        q_scale=q_scale,
        kv_scale=kv_scale,
        implementation=implementation,
        kernel_config=kernel_config,
        valid_hint=valid_hint,
    )
    if implementation == "reference":  # arguments checked: straight to the math
        return reference.decode_flat(*operands)
    heads = jnp.shape(q)[1]
    latent, lse = sparse_mla_decode_p.bind(
        *operands,
        require_kernel=implementation == "cute",
        config=kernel_config,
        valid_hint=valid_hint,
    )
    if operands[0].shape[1] != heads:
        latent, lse = latent[:, :heads], lse[:, :heads]
    return latent, lse


def kernel_operands(
    q,
    kv,
    rows,
    valid,
    *,
    softmax_scale,
    q_scale,
    kv_scale,
    implementation,
    kernel_config,
    valid_hint,
):
    """decode's arguments checked (errors name the argument) and normalized for the kernel:
    (implementation, (q [B, Hp, 576] with H padded to Hp, a multiple of 16, for every
    implementation but "reference"; kv [N, W] flat rows; rows; valid; scales f32[2]))."""
    implementation = validation.check_implementation(implementation)
    if kernel_config is not None:
        if not isinstance(kernel_config, KernelConfig):
            raise TypeError(
                f"kernel_config must be a jax_sparse_mla.kernel.KernelConfig or None, got "
                f"{kernel_config!r}"
            )
        if implementation == "reference":
            raise ValueError(
                f"kernel_config={kernel_config} picks a kernel variant, but "
                "implementation='reference' runs no kernel"
            )
        if kernel_config.exchange:
            raise ValueError(
                f"kernel_config={kernel_config}: exchange=True names the push exchange's own "
                "cubin (dcp_decode(exchange='push') picks it); pass the plain config"
            )
    shapes = validation.check_decode_args(q, kv, rows, valid)
    softmax_scale = validation.check_softmax_scale(softmax_scale)
    valid_hint = validation.check_valid_hint(valid_hint)
    q_scale = validation.check_scale("q_scale", q_scale)
    kv_scale = validation.check_scale("kv_scale", kv_scale)
    scales = validation.kernel_scales(softmax_scale, q_scale, kv_scale)
    kv = validation.flat_cache(jnp.asarray(kv))
    q = jnp.asarray(q)
    heads = shapes.heads
    padded = -(-heads // validation.HEAD_TILE) * validation.HEAD_TILE
    if padded != heads and implementation != "reference":
        q = jnp.pad(q, ((0, 0), (0, padded - heads), (0, 0)))
    return implementation, (q, kv, jnp.asarray(rows), jnp.asarray(valid), scales)
