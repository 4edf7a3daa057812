"""Compiled sparse decode cubins: shipped in the wheel, cached on disk, or compiled by the DSL.

``get_kernel(config)`` looks up, in order: this process's cache, the cubins shipped inside
the installed package (``jax_sparse_mla/_cubins``, written by the wheel build), the disk cache
(``$JAX_SPARSE_MLA_CACHE_DIR``, default ``~/.cache/jax_sparse_mla``), and finally compiles
with nvidia-cutlass-dsl for sm_90a (no GPU needed) and stores the result in the disk cache.
Entries are ``<slug>-<fingerprint>-<dsl version>.{cubin,json}``; the fingerprint hashes this
package's kernel sources (not the dispatch rule), so editing the kernel invalidates every
entry (shipped ones too).
Shipped entries, and every entry on a machine without the DSL, are accepted whatever DSL
version compiled them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import pathlib
import re
import tempfile
import threading

from jax_sparse_mla import installed
from jax_sparse_mla.kernel.config import (
    ARCH,
    PARAM_TYPES,
    PARAMS,
    ROW,
    KernelConfig,
    KernelUnavailableError,
)

_KERNEL_DIR = pathlib.Path(__file__).resolve().parent
_DSL_PACKAGE = "nvidia-cutlass-dsl"
_MEMORY: dict[KernelConfig, CompiledKernel] = {}
_LOCK = threading.Lock()
SHIPPED_DIR = "_cubins"  # inside the package


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """A cubin and its launch metadata (kernel_name, grid, block, cluster, smem_bytes, ...)."""

    cubin: bytes
    meta: dict


# Modules of the kernel package that do not shape a cubin: editing them keeps every cache.
_NOT_COMPILED = frozenset({"dispatch.py"})


def hash_sources(paths) -> str:
    """Hash of source files (names and bytes, in the given order), 16 hex digits."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def source_fingerprint() -> str:
    """Hash of the kernel package's sources that shape a cubin; the dispatch rule is not one
    of them."""
    paths = sorted(_KERNEL_DIR.glob("*.py"))
    paths = [path for path in paths if path.name not in _NOT_COMPILED]
    # The decodes' part of the push exchange uses the exchange's PTX helpers and constants.
    exchange = _KERNEL_DIR / "exchange"
    return hash_sources([*paths, exchange / "ptx.py", exchange / "config.py"])


def dsl_version() -> str | None:
    """The installed nvidia-cutlass-dsl version, or None without the DSL."""
    try:
        return importlib.metadata.version(_DSL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def default_cache_dir() -> pathlib.Path:
    """$JAX_SPARSE_MLA_CACHE_DIR, else ~/.cache/jax_sparse_mla."""
    value = os.environ.get("JAX_SPARSE_MLA_CACHE_DIR")
    return pathlib.Path(value) if value else pathlib.Path.home() / ".cache" / "jax_sparse_mla"


def shipped_dir() -> pathlib.Path | None:
    """The installed package's folder of prebuilt cubins, or None (a checkout, a DSL-less
    build without cubins)."""
    return installed.find(SHIPPED_DIR)


def get_kernel(
    config: KernelConfig, *, cache_dir: str | os.PathLike | None = None
) -> CompiledKernel:
    """The compiled kernel of ``config``: from memory, the shipped cubins, the disk cache
    (``cache_dir`` or the default), or the DSL. An explicit ``cache_dir`` skips memory and
    shipped cubins (the ahead-of-time command fills it)."""
    return cached_kernel(
        config,
        config.slug,
        lambda meta: (
            meta.get("config") == dataclasses.asdict(config) and meta.get("params") == list(PARAMS)
        ),
        source_fingerprint,
        compile_kernel,
        _MEMORY,
        cache_dir,
    )


def cached_kernel(key, slug: str, matches, fingerprint_of, compile_of, memory: dict, cache_dir):
    """The lookup of both kernel families: ``key``'s cubin (files named ``slug``) from
    ``memory`` (this process's), the shipped cubins, the disk cache (``cache_dir`` or the
    default), or ``compile_of(key, fingerprint, version)`` with the DSL, stored in the disk
    cache. An entry is read only where ``matches(meta)`` (its metadata names ``key``);
    ``fingerprint_of()`` hashes the family's sources. An explicit ``cache_dir`` skips memory
    and shipped cubins."""
    with _LOCK:
        if key in memory and cache_dir is None:
            return memory[key]
        directory = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
        fingerprint, version = fingerprint_of(), dsl_version()
        shipped = shipped_dir() if cache_dir is None else None
        kernel = None
        if shipped is not None:
            kernel = _load(shipped, slug, matches, fingerprint, None)
        if kernel is None:
            kernel = _load(directory, slug, matches, fingerprint, version)
        if kernel is None:
            if version is None:
                raise KernelUnavailableError(
                    f"no cubin for {slug} (fingerprint {fingerprint}): none shipped in the "
                    f"installed package ({shipped or 'no ' + SHIPPED_DIR + ' folder'}), none "
                    f"cached in {directory}, and {_DSL_PACKAGE} is not installed to compile "
                    "one. Install a wheel built from these sources, install the "
                    "'kernel-dev' extra, or fill a cache with `python -m jax_sparse_mla.aot "
                    "--out DIR` and point JAX_SPARSE_MLA_CACHE_DIR at DIR."
                )
            kernel = compile_of(key, fingerprint, version)
            _store(directory, slug, kernel)
        if cache_dir is None:
            memory[key] = kernel
        return kernel


def _stem(slug: str, fingerprint: str, version: str) -> str:
    return f"{slug}-{fingerprint}-{version}"


def _load(directory, slug, matches, fingerprint, version) -> CompiledKernel | None:
    """The entry of ``slug`` with this fingerprint (of DSL ``version``, or any if None) whose
    metadata ``matches``, else None."""
    if version is not None:
        candidates = [directory / f"{_stem(slug, fingerprint, version)}.json"]
    else:
        candidates = sorted(directory.glob(f"{slug}-{fingerprint}-*.json"))
    for meta_path in candidates:
        try:
            meta = json.loads(meta_path.read_text())
            cubin = meta_path.with_suffix(".cubin").read_bytes()
        except (OSError, ValueError):
            continue
        if matches(meta):
            return CompiledKernel(cubin, meta)
    return None


def _store(directory: pathlib.Path, slug: str, kernel: CompiledKernel) -> None:
    """Writes the entry atomically (a concurrent reader sees the old file or the new one)."""
    meta = kernel.meta
    stem = _stem(slug, meta["fingerprint"], meta["dsl_version"])
    directory.mkdir(parents=True, exist_ok=True)
    for suffix, data in ((".cubin", kernel.cubin), (".json", json.dumps(meta, indent=1).encode())):
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{stem}", suffix=suffix)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, directory / f"{stem}{suffix}")


def parse_entry(ptx: str) -> tuple[str, list[str]]:
    """The kernel entry's name and parameter types (u64 / u32 ...) from PTX text."""
    match = re.search(r"\.visible\s+\.entry\s+(\w+)\s*\((.*?)\)", ptx, re.S)
    if match is None:
        raise RuntimeError("no .entry in the compiled PTX")
    name, params = match.group(1), match.group(2)
    types = re.findall(r"\.param\s+\.(\w+)", params)
    return name, types


def compile_kernel(config: KernelConfig, fingerprint: str, version: str) -> CompiledKernel:
    """Compile ``config`` to an sm_90a cubin with the DSL (works without a GPU)."""
    # The DSL reads its environment at import: without this it targets sm_100a.
    os.environ["CUTE_DSL_ARCH"] = ARCH
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    from jax_sparse_mla.kernel.sparse_decode import SparseDecode
    from jax_sparse_mla.kernel.wgmma_decode import WgmmaDecode

    kernel_class = {"cluster-mma": SparseDecode, "wgmma": WgmmaDecode}[config.variant]

    gmem = cute.AddressSpace.gmem
    args = (
        make_ptr(cutlass.Uint8, 0, gmem, assumed_align=16),  # q
        make_ptr(cutlass.Uint8, 0, gmem, assumed_align=16),  # kv
        make_ptr(cutlass.Int32, 0, gmem, assumed_align=4),  # rows
        make_ptr(cutlass.Int32, 0, gmem, assumed_align=4),  # valid
        make_ptr(cutlass.Float32, 0, gmem, assumed_align=4),  # scales
        make_ptr(cutlass.BFloat16, 0, gmem, assumed_align=16),  # latent
        make_ptr(cutlass.Float32, 0, gmem, assumed_align=4),  # lse
        cutlass.Int32(1),  # n_rows
        cutlass.Int32(1),  # width
        cutlass.Int32(config.head_tile),  # heads
        cutlass.Int32(ROW),  # row_bytes
        make_ptr(cutlass.Uint8, 0, gmem, assumed_align=16),  # exchange
        make_ptr(cutlass.Int32, 0, gmem, assumed_align=4),  # rank
        make_ptr(cutlass.Int32, 0, gmem, assumed_align=4),  # step
        cutlass.Int32(1),  # dcp
        cutlass.Int32(config.head_tile),  # heads_own
        cutlass.Int32(0),  # latent_offset
        cutlass.Int32(0),  # lse_offset
        cutlass.Int32(0),  # query_offset
        cutlass.Int32(0),  # query_flags_offset
    )
    cubin, name = dsl_compile(kernel_class(config), args, PARAM_TYPES)
    meta = {
        "kernel_name": name,
        "head_tile": config.head_tile,
        "block": list(config.block),
        "cluster": list(config.cluster),
        "smem_bytes": config.smem_bytes,
        "params": list(PARAMS),
        "arch": ARCH,
        "dsl_version": version,
        "fingerprint": fingerprint,
        "config": dataclasses.asdict(config),
    }
    return CompiledKernel(cubin, meta)


def dsl_compile(builder, args, param_types) -> tuple[bytes, str]:
    """``builder``'s kernel compiled by the DSL for ARCH with placeholder ``args`` (the
    caller has set CUTE_DSL_ARCH before importing the DSL): its cubin and entry name, after
    checking the target and that the entry's parameters are ``param_types`` (the ABI)."""
    import cutlass.cute as cute

    with tempfile.TemporaryDirectory(prefix="jax_sparse_mla-") as dump:
        options = f"--gpu-arch {ARCH} --keep-cubin --keep-ptx --dump-dir {dump}"
        compiled = cute.compile(builder, *args, options=options)
        cubin, ptx = compiled.artifacts.CUBIN, compiled.artifacts.PTX
        if not cubin or not ptx:  # older DSLs only dump the files
            cubin = next(pathlib.Path(dump).glob("*.cubin")).read_bytes()
            ptx = next(pathlib.Path(dump).glob("*.ptx")).read_text()
    if f".target {ARCH}" not in ptx:
        raise RuntimeError(f"the DSL compiled for another arch than {ARCH}")
    name, types = parse_entry(ptx)
    if tuple(types) != tuple(param_types):
        raise RuntimeError(f"kernel {name} has params {types}, the ABI wants {param_types}")
    return bytes(cubin), name
