"""The exchange's cubins: shipped in the wheel, cached on disk, or compiled by the DSL.

Looked up like the decode's (``kernel/compile.py``): this process, the installed package's
``_cubins``, the disk cache, then a compile with nvidia-cutlass-dsl for sm_90a (no GPU
needed). The fingerprint hashes this folder's sources and the shared ``kernel/ptx.py``.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

from jax_sparse_mla.kernel import compile as kernel_compile
from jax_sparse_mla.kernel.exchange.config import ARCH, ExchangeKernel

_SOURCES = (
    *sorted(pathlib.Path(__file__).resolve().parent.glob("*.py")),
    pathlib.Path(kernel_compile.__file__).resolve().parent / "ptx.py",
    pathlib.Path(kernel_compile.__file__).resolve().parent / "config.py",  # constants it takes
)
_MEMORY: dict[ExchangeKernel, kernel_compile.CompiledKernel] = {}


def source_fingerprint() -> str:
    """Hash of the sources that shape the exchange's cubins, 16 hex digits."""
    return kernel_compile.hash_sources(_SOURCES)


def get_kernel(
    kernel: ExchangeKernel, *, cache_dir: str | os.PathLike | None = None
) -> kernel_compile.CompiledKernel:
    """The compiled cubin of ``kernel`` (see ``kernel/index/compile.get_kernel``)."""
    return kernel_compile.cached_kernel(
        kernel,
        kernel.slug,
        lambda meta: (
            meta.get("exchange_kernel") == dataclasses.asdict(kernel)
            and meta.get("params") == list(kernel.params)
        ),
        source_fingerprint,
        compile_kernel,
        _MEMORY,
        cache_dir,
    )


def compile_kernel(kernel: ExchangeKernel, fingerprint: str, version: str):
    """Compile ``kernel`` to an sm_90a cubin with the DSL (works without a GPU)."""
    os.environ["CUTE_DSL_ARCH"] = ARCH  # read at the DSL's import: else it targets sm_100a
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    from jax_sparse_mla.kernel.exchange.kernels import DcpMerge

    gmem = cute.AddressSpace.gmem
    # latent, lse, step, header (config.MERGE_PARAMS), then two byte offsets and the sizes
    pointers = [make_ptr(cutlass.Int32, 0, gmem, assumed_align=16) for _ in range(4)]
    offsets = [cutlass.Int64(0), cutlass.Int64(0)]
    sizes = [cutlass.Int32(1) for kind in kernel.param_types if kind == "u32"]
    cubin, name = kernel_compile.dsl_compile(
        DcpMerge(), (*pointers, *offsets, *sizes), kernel.param_types
    )
    meta = {
        "kernel_name": name,
        "threads": kernel.threads,
        "smem_bytes": 0,
        "params": list(kernel.params),
        "arch": ARCH,
        "dsl_version": version,
        "fingerprint": fingerprint,
        "exchange_kernel": dataclasses.asdict(kernel),
    }
    return kernel_compile.CompiledKernel(cubin, meta)
