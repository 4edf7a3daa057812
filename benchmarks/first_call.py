"""Time to the first decode in a fresh process: import, lowering (cubin lookup), XLA compile.

    python benchmarks/first_call.py            # on the GPU machine, package installed

With the shipped cubins nothing is compiled by the DSL: the first call costs the import, the
cubin lookup (a file read) and XLA's own compile. Prints where the cubin came from and fails
if the kernel path is not the one that ran.
"""

from __future__ import annotations

import argparse
import time

T0 = time.perf_counter()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_sparse_mla  # noqa: E402
from jax_sparse_mla import cuda_lowering  # noqa: E402
from jax_sparse_mla.kernel import compile as kernel_compile  # noqa: E402

IMPORTED = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=5)
    parser.add_argument("--heads", type=int, default=96)
    parser.add_argument("--width", type=int, default=2048)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    fp8 = jnp.float8_e4m3fn
    q = jnp.asarray(rng.standard_normal((args.batch, args.heads, 576)), fp8)
    kv = jnp.asarray(rng.standard_normal((131072, 576)), fp8)
    rows = jnp.asarray(rng.integers(0, 131072, (args.batch, args.width)), jnp.int32)
    valid = jnp.full((args.batch,), 256, jnp.int32)
    jax.block_until_ready((q, kv, rows, valid))
    fn = jax.jit(
        lambda *a: jax_sparse_mla.decode(*a, softmax_scale=192**-0.5, implementation="cute")
    )
    start = time.perf_counter()
    text = fn.trace(q, kv, rows, valid).lower().as_text()
    lowered = time.perf_counter()
    jax.block_until_ready(fn(q, kv, rows, valid))
    first = time.perf_counter()
    jax.block_until_ready(fn(q, kv, rows, valid))
    second = time.perf_counter()
    if cuda_lowering.FFI_TARGET not in text:
        raise SystemExit("FAIL: the kernel's custom call is not in the lowered program")
    shipped = kernel_compile.shipped_dir()
    print(f"device: {jax.devices()[0].device_kind}; shipped cubins: {shipped}")
    print(f"DSL installed: {kernel_compile.dsl_version() is not None}")
    print(f"import jax + jax_sparse_mla: {(IMPORTED - T0) * 1e3:.0f} ms")
    print(f"trace + lower (cubin lookup): {(lowered - start) * 1e3:.0f} ms")
    print(f"first call (XLA compile + run): {(first - lowered) * 1e3:.0f} ms")
    print(f"second call: {(second - first) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
