"""The indexer's cubins: shipped in the wheel, cached on disk, or compiled by the DSL.

Looked up like the decode's (``kernel/compile.py``): this process, the installed package's
``_cubins``, the disk cache, then a compile with nvidia-cutlass-dsl for sm_90a (no GPU
needed). Entries are ``<slug>-<fingerprint>-<dsl version>.{cubin,json}``; the
fingerprint hashes this folder's sources and the shared ``kernel/ptx.py``.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

from jax_sparse_mla.kernel import compile as kernel_compile
from jax_sparse_mla.kernel.index.config import ARCH, IndexKernel

_SOURCES = (
    *sorted(pathlib.Path(__file__).resolve().parent.glob("*.py")),
    pathlib.Path(kernel_compile.__file__).resolve().parent / "ptx.py",
)
_MEMORY: dict[IndexKernel, kernel_compile.CompiledKernel] = {}


def source_fingerprint() -> str:
    """Hash of the sources that shape the indexer's cubins, 16 hex digits."""
    return kernel_compile.hash_sources(_SOURCES)


def get_kernel(
    kernel: IndexKernel, *, cache_dir: str | os.PathLike | None = None
) -> kernel_compile.CompiledKernel:
    """The compiled cubin of ``kernel``: from memory, the shipped cubins, the disk cache
    (``cache_dir`` or the default) or the DSL. An explicit ``cache_dir`` skips memory and
    shipped cubins (the ahead-of-time command fills it)."""
    return kernel_compile.cached_kernel(
        kernel,
        kernel.slug,
        lambda meta: (
            meta.get("index_kernel") == dataclasses.asdict(kernel)
            and meta.get("params") == list(kernel.params)
        ),
        source_fingerprint,
        compile_kernel,
        _MEMORY,
        cache_dir,
    )


def compile_kernel(kernel: IndexKernel, fingerprint: str, version: str):
    """Compile ``kernel`` to an sm_90a cubin with the DSL (works without a GPU)."""
    os.environ["CUTE_DSL_ARCH"] = ARCH  # read at the DSL's import: else it targets sm_100a
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    from jax_sparse_mla.kernel.index.scores import IndexScores
    from jax_sparse_mla.kernel.index.topk import RadixTopk

    gmem = cute.AddressSpace.gmem
    kinds = {"q": cutlass.Uint8, "keys": cutlass.Uint8, "weights": cutlass.Float32}
    pointers = [
        make_ptr(kinds.get(name, cutlass.Int32), 0, gmem, assumed_align=16)
        for name, kind in zip(kernel.params, kernel.param_types, strict=True)
        if kind == "u64"
    ]
    sizes = [cutlass.Int32(1) for kind in kernel.param_types if kind == "u32"]
    builder = IndexScores() if kernel.stage == "scores" else RadixTopk(kernel.cluster)
    cubin, name = kernel_compile.dsl_compile(builder, (*pointers, *sizes), kernel.param_types)
    meta = {
        "kernel_name": name,
        "threads": kernel.threads,
        "smem_bytes": kernel.smem_bytes,
        "params": list(kernel.params),
        "arch": ARCH,
        "dsl_version": version,
        "fingerprint": fingerprint,
        "index_kernel": dataclasses.asdict(kernel),
    }
    return kernel_compile.CompiledKernel(cubin, meta)
