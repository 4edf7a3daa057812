"""The indexer's kernels under compute-sanitizer (memcheck, racecheck, synccheck) via jax.jit.

    compute-sanitizer --tool memcheck --kernel-name kns=jax_sparse_mlakernelindex \\
        python3 tests/gpu/sanitize_index_topk.py

Covers every top-k cluster size, a flat cache, paged caches (blocks of whole key tiles and not)
whose tables hold out-of-range blocks (never read), lengths
0, 1, below, at and above top_k and above the capacity (clamped), T = 1 and 5, Hi = 3 and 130
(padded to 64 and 192 heads), on small caches so that a stray read would leave them.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jax_sparse_mla
from jax_sparse_mla import index_lowering
from jax_sparse_mla.kernel.index.config import TOPK_CLUSTERS

FP8 = ml_dtypes.float8_e4m3fn


def index_topk(*args, **kwargs):
    """index_topk(implementation="cute") jitted afresh: the lowering picks the cubins again."""
    return jax.jit(lambda *a: jax_sparse_mla.index_topk(*a, implementation="cute", **kwargs))(*args)


def main() -> None:
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((1500, 128)).astype(FP8)
    scales = rng.uniform(0.5, 2.0, 1500).astype(np.float32)
    lengths = np.asarray([0, 1, 300, 5000], np.int32)
    for cluster in TOPK_CLUSTERS:
        index_lowering.topk_cluster = lambda rows, capacity, sm_count, cluster=cluster: cluster
        for steps, heads in ((1, 3), (5, 130)):
            q = rng.standard_normal((4, steps, heads, 128)).astype(FP8)
            weights = rng.standard_normal((4, steps, heads)).astype(np.float32)
            flat = index_topk(q, weights, keys, scales, lengths, top_k=256)
            kept = [int((flat >= 0).sum())]
            for block_size in (64, 48):  # whole key tiles per block, and not
                blocks = 1500 // block_size
                table = rng.integers(-3, blocks + 3, (4, 2000 // block_size)).astype(np.int32)
                paged = index_topk(
                    q, weights, keys[: blocks * block_size].reshape(blocks, block_size, 128),
                    scales[: blocks * block_size].reshape(blocks, block_size), lengths,
                    top_k=300, block_table=jnp.asarray(table),  # some blocks outside the cache
                )  # fmt: skip
                kept.append(int((paged >= 0).sum()))
            print(f"top-k cluster {cluster}, T={steps} Hi={heads}: rows kept {kept}")


if __name__ == "__main__":
    main()
