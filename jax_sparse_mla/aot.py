"""Compile the kernels' cubins ahead of time into a folder (no GPU needed).

    python -m jax_sparse_mla.aot --out DIR                 # every decode config + the indexer's
    python -m jax_sparse_mla.aot --out DIR --variant cluster-mma
    python -m jax_sparse_mla.aot --out DIR --variant index  # the indexer's two kernels only
    python -m jax_sparse_mla.aot --out DIR --variant exchange  # the push exchange's merge

A cubin serves every batch size, head count, top-k width and cache size, so one per config
(variant and cluster split, plain and for the push exchange) is all a machine needs. The
wheel build runs this command and ships DIR inside the package (``jax_sparse_mla/_cubins``);
DIR also works as JAX_SPARSE_MLA_CACHE_DIR on a machine without nvidia-cutlass-dsl.
"""

from __future__ import annotations

import argparse
import sys
import time

from jax_sparse_mla.kernel.config import ALL_CONFIGS, ARCH, PUSH_CONFIGS, VARIANTS
from jax_sparse_mla.kernel.exchange.config import EXCHANGE_KERNELS, ExchangeKernel
from jax_sparse_mla.kernel.index.config import INDEX_KERNELS, IndexKernel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jax_sparse_mla.aot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--arch", default=ARCH, choices=[ARCH], help="target (only sm_90a)")
    parser.add_argument("--out", required=True, help="folder to fill")
    parser.add_argument(
        "--variant",
        action="append",
        choices=[*VARIANTS, "index", "exchange"],
        help="decode kernel variant, 'index' or 'exchange' (repeatable; default: all)",
    )
    args = parser.parse_args(argv)
    variants = set(args.variant or [*VARIANTS, "index", "exchange"])
    configs = [config for config in ALL_CONFIGS + PUSH_CONFIGS if config.variant in variants]
    if "index" in variants:
        configs += INDEX_KERNELS
    if "exchange" in variants:
        configs += EXCHANGE_KERNELS

    from jax_sparse_mla.kernel.compile import get_kernel
    from jax_sparse_mla.kernel.exchange.compile import get_kernel as get_exchange_kernel
    from jax_sparse_mla.kernel.index.compile import get_kernel as get_index_kernel

    families = {IndexKernel: get_index_kernel, ExchangeKernel: get_exchange_kernel}
    for i, config in enumerate(configs, 1):
        start = time.perf_counter()
        print(f"[{i}/{len(configs)}] {config.slug}: compiling ...", end="", flush=True)
        compile_one = families.get(type(config), get_kernel)
        kernel = compile_one(config, cache_dir=args.out)
        seconds = time.perf_counter() - start
        print(f" {len(kernel.cubin)} bytes, {kernel.meta['kernel_name'][:40]}... ({seconds:.1f} s)")
    print(f"wrote {len(configs)} cubin(s) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
