"""Each decode kernel config's accuracy against float64 truth, on the GPU.

    python benchmarks/decode_accuracy.py

For every shipped kernel config (forced with kernel_config=) and the cases below, the kernel
runs on random FP8 inputs (N(0, 1) before E4M3 rounding; softmax_scale 576^-0.5, q_scale 0.5,
kv_scale 1.75) and its latent and LSE are compared with tests/truth.py's float64 softmax
attention over the same FP8 values: LSE max |error| (natural log units), the latent's max
|error| relative to max |latent|, and its mean |error| relative to mean |latent|. The reference
(implementation="reference", on the same GPU) is the first row of each case. Exits with 2
without a CUDA GPU; the kernel path fails loudly rather than fall back to the reference.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests"))
from truth import make_inputs, truth_decode

import jax_sparse_mla
from jax_sparse_mla.kernel.config import ALL_CONFIGS

CASES = [  # (B rows, H heads, K keys per row)
    (5, 96, 256),
    (5, 128, 2048),
    (64, 128, 2048),
]
CACHE_ROWS = 65536
SCALES = dict(softmax_scale=576**-0.5, q_scale=0.5, kv_scale=1.75)


def errors(latent, lse, want, want_lse) -> tuple[float, float, float]:
    latent, lse = np.asarray(latent, np.float64), np.asarray(lse, np.float64)
    difference = np.abs(latent - want)
    return (
        float(np.max(np.abs(lse - want_lse))),
        float(np.max(difference) / np.max(np.abs(want))),
        float(np.mean(difference) / np.mean(np.abs(want))),
    )


def main() -> int:
    if jax.default_backend() != "gpu":
        print("decode_accuracy needs a CUDA GPU (Hopper for the kernel).", file=sys.stderr)
        return 2
    print(
        "| case B x H x K | path | LSE max abs error | latent max error / max abs(latent) | "
        "latent mean error / mean abs(latent) |\n|---|---|---|---|---|"
    )
    for batch, heads, width in CASES:
        rng = np.random.default_rng(batch * heads + width)
        q, kv, rows = make_inputs(rng, batch, heads, CACHE_ROWS, width)
        valid = np.full((batch,), width, np.int32)
        want, want_lse, _ = truth_decode(q, kv, rows, valid, **SCALES)
        paths = [("reference", dict(implementation="reference"))]
        paths += [(c.slug, dict(implementation="cute", kernel_config=c)) for c in ALL_CONFIGS]
        for name, options in paths:
            run = jax.jit(lambda *a, o=options: jax_sparse_mla.decode(*a, **SCALES, **o))
            lse_error, max_error, mean_error = errors(*run(q, kv, rows, valid), want, want_lse)
            print(
                f"| {batch}x{heads}x{width} | {name} | {lse_error:.2e} | {max_error:.2e} | "
                f"{mean_error:.2e} |",
                flush=True,
            )
    print(
        f"\nMethod: {jax.devices()[0].device_kind}, jax {jax.__version__}; each config forced "
        f"with kernel_config=, the same inputs for every path of a case, truth in float64."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
