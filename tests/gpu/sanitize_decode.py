"""Kernel launches for compute-sanitizer (memcheck, racecheck, synccheck) via jax.jit.

    compute-sanitizer --tool memcheck --kernel-name kns=jax_sparse_mlakernel \\
        python3 tests/gpu/sanitize_decode.py [SLUG_PART ...]

Covers every kernel config (cluster-mma and wgmma at split 1, 2, 4, 8), empty rows, counts
below 0 and above K, out-of-range and boundary rows, duplicates, garbage past each count and
rows padded past 576 bytes, on a small cache so that a stray read would leave it. Arguments
keep only the configs whose slug contains one of them (e.g. ``wgmma``).
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_sparse_mla
from jax_sparse_mla.kernel.config import ALL_CONFIGS


def main(parts: list[str]) -> None:
    chosen = [c for c in ALL_CONFIGS if not parts or any(p in c.slug for p in parts)]
    if not chosen:
        raise SystemExit(f"no kernel config matches {parts}")
    for config in chosen:
        run(config)


def run(config) -> None:
    rng = np.random.default_rng(0)
    for batch, heads, width, row_bytes in ((4, 20, 64, 576), (5, 96, 2048, 576), (5, 40, 333, 640)):
        cache_rows = 300
        q = jnp.asarray(rng.standard_normal((batch, heads, 576)), jnp.float8_e4m3fn)
        kv = jnp.asarray(rng.standard_normal((cache_rows, row_bytes)), jnp.float8_e4m3fn)
        rows = rng.integers(0, cache_rows, (batch, width)).astype(np.int32)
        rows[0, :6] = [-1, cache_rows, 2**31 - 1, -(2**31), cache_rows - 1, 0]
        rows[1, :] = 5  # one row repeated
        rows[2, 10:] = 2**31 - 1  # garbage past valid[2] = 10
        valid = np.array([width, width + 5, 10, -3, 0][:batch], np.int32)
        decode = jax.jit(
            lambda *a: jax_sparse_mla.decode(
                *a, softmax_scale=0.1, implementation="cute", kernel_config=config
            )
        )
        _, lse = jax.block_until_ready(decode(q, kv, jnp.asarray(rows), jnp.asarray(valid)))
        assert np.all(np.asarray(lse)[3] == -np.inf), "valid < 0 must give an empty row"
        assert np.all(np.isfinite(np.asarray(lse)[:3]))
        print(f"{config.slug} B={batch} H={heads} K={width} W={row_bytes}: ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
