"""The smallest use of jax_sparse_mla.decode, checked against a dense float32 softmax.

    python examples/minimal_decode.py

Runs on the default JAX device: the kernel on a Hopper GPU, the reference elsewhere.
"""

import argparse
import logging

import jax
import jax.numpy as jnp
import numpy as np

import jax_sparse_mla


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=5, help="query rows B (default 5)")
    parser.add_argument("--heads", type=int, default=16, help="query heads H (default 16)")
    parser.add_argument("--keys", type=int, default=256, help="selected keys per row K")
    parser.add_argument("--cache", type=int, default=4096, help="cache rows N")
    args = parser.parse_args()
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("jax_sparse_mla").setLevel(logging.INFO)  # says which path runs

    rng = np.random.default_rng(0)
    fp8 = jnp.float8_e4m3fn
    q = jnp.asarray(rng.standard_normal((args.rows, args.heads, 576)), fp8)
    kv = jnp.asarray(rng.standard_normal((args.cache, 576)), fp8)
    rows = jnp.asarray(rng.integers(0, args.cache, (args.rows, args.keys)), jnp.int32)
    valid = jnp.full((args.rows,), args.keys, jnp.int32)
    scale = 576**-0.5
    latent, lse = jax.jit(lambda *a: jax_sparse_mla.decode(*a, softmax_scale=scale))(
        q, kv, rows, valid
    )

    keys = np.asarray(kv, np.float32)[np.asarray(rows)]  # [B, K, 576]
    logits = np.einsum("bhd,bkd->bhk", np.asarray(q, np.float32), keys) * scale
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("bhk,bkc->bhc", weights / weights.sum(-1, keepdims=True), keys[..., :512])
    want_lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    err = np.abs(np.asarray(latent, np.float32) - want).max() / np.abs(want).max()
    lse_err = np.abs(np.asarray(lse) - want_lse).max()
    print(f"device: {jax.devices()[0].device_kind}; latent {latent.shape} {latent.dtype}")
    print(f"max relative error vs dense float32 softmax: {err:.2e}; max LSE error {lse_err:.2e}")
    ok = err < 0.05 and lse_err < 1e-3  # FP8 P rounding: a few percent at most
    print("check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
