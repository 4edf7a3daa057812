"""The indexer's kernels under compute-sanitizer (memcheck, racecheck, synccheck) via jax.jit.

    compute-sanitizer --tool memcheck --kernel-name kns=jax_sparse_mlakernelindex \\
        python3 tests/gpu/sanitize_index_topk.py

Covers a flat cache, a paged cache whose table holds out-of-range blocks (never read), lengths
0, 1, below, at and above top_k and above the capacity (clamped), T = 1 and 5, Hi = 3 and 130
(padded to 64 and 192 heads), on small caches so that a stray read would leave them.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jax_sparse_mla

FP8 = ml_dtypes.float8_e4m3fn


def main() -> None:
    rng = np.random.default_rng(0)
    for steps, heads in ((1, 3), (5, 130)):
        q = rng.standard_normal((4, steps, heads, 128)).astype(FP8)
        weights = rng.standard_normal((4, steps, heads)).astype(np.float32)
        lengths = np.asarray([0, 1, 300, 5000], np.int32)
        keys = rng.standard_normal((1500, 128)).astype(FP8)
        scales = rng.uniform(0.5, 2.0, 1500).astype(np.float32)
        flat = jax_sparse_mla.index_topk(
            q, weights, keys, scales, lengths, top_k=256, implementation="cute"
        )
        blocks = keys[:1472].reshape(23, 64, 128)
        table = rng.integers(-3, 26, (4, 20)).astype(np.int32)  # some outside [0, 23)
        paged = jax_sparse_mla.index_topk(
            q, weights, blocks, scales[:1472].reshape(23, 64), lengths, top_k=300,
            block_table=jnp.asarray(table), implementation="cute",
        )  # fmt: skip
        jax.block_until_ready((flat, paged))
        print(f"T={steps} Hi={heads}: flat rows kept {int((flat >= 0).sum())}, "
              f"paged {int((paged >= 0).sum())}")  # fmt: skip


if __name__ == "__main__":
    main()
