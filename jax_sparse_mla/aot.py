"""Compile sparse decode cubins ahead of time into a cache directory (no GPU needed).

    python -m jax_sparse_mla.aot --arch sm_90a --out DIR --case latency-h96 --case throughput
    python -m jax_sparse_mla.aot --arch sm_90a --out DIR --config 5,96,2048

DIR then works as JAX_SPARSE_MLA_CACHE_DIR on a machine without nvidia-cutlass-dsl.
Case names are DESIGN.md's (section 4); the kernel is static in (B, padded H, K) only, so
cases that differ only in their valid counts share one cubin.
"""

from __future__ import annotations

import argparse
import sys
import time

from jax_sparse_mla.kernel.config import ARCH, HEADS, KernelConfig

# name -> (batch B, query heads H, width K)
CASES: dict[str, tuple[int, int, int]] = {
    "latency-h64": (5, 64, 2048),
    "latency-h96": (5, 96, 2048),
    "latency-h128": (5, 128, 2048),
    "rank-full": (5, 128, 2048),
    "throughput": (64, 128, 2048),
}


def config_for(batch: int, heads: int, width: int) -> KernelConfig:
    """The kernel config of B rows, H heads (padded to a multiple of 16), width K."""
    padded = -(-heads // HEADS) * HEADS
    return KernelConfig(batch=batch, heads=padded, width=width)


def _parse_config(text: str) -> tuple[int, int, int]:
    try:
        batch, heads, width = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--config wants B,H,K, got {text!r}") from None
    return batch, heads, width


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jax_sparse_mla.aot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--arch", default=ARCH, choices=[ARCH], help="target (only sm_90a)")
    parser.add_argument("--out", required=True, help="cache directory to fill")
    parser.add_argument(
        "--case", action="append", default=[], choices=sorted(CASES), help="named case (repeatable)"
    )
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        type=_parse_config,
        metavar="B,H,K",
        help="explicit batch,heads,width (repeatable)",
    )
    args = parser.parse_args(argv)
    shapes = [CASES[name] for name in args.case] + list(args.config)
    if not shapes:
        parser.error("give at least one --case or --config")
    configs = list(dict.fromkeys(config_for(*shape) for shape in shapes))

    from jax_sparse_mla.kernel.compile import get_kernel

    for i, config in enumerate(configs, 1):
        start = time.perf_counter()
        print(f"[{i}/{len(configs)}] {config.slug}: compiling ...", end="", flush=True)
        kernel = get_kernel(config, cache_dir=args.out)
        seconds = time.perf_counter() - start
        print(f" {len(kernel.cubin)} bytes, {kernel.meta['kernel_name'][:40]}... ({seconds:.1f} s)")
    print(f"wrote {len(configs)} cubin(s) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
