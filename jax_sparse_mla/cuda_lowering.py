"""CUDA lowering of ``sparse_mla_decode_p``: an XLA FFI custom call that launches the kernel.

The lowering picks the kernel config (the caller's, else ``kernel.dispatch.choose_config``
by shape), loads its cubin with ``kernel.compile.get_kernel`` (one cubin per config serves
every shape: the handler computes the grid from the operand shapes) and emits a
typed-FFI custom call to ``FFI_TARGET`` whose attributes carry the cubin bytes (a ``u8``
array, so NUL bytes survive) and the launch metadata. A lowered, exported or persistently
cached executable is therefore self-contained; the handler library
(``ffi/sparse_mla_ffi.cc``, installed as ``jax_sparse_mla/_ffi/libsparse_mla_ffi.so``) loads
the cubin once per executable and launches it with cuLaunchKernelEx (cluster dims, dynamic
shared memory, PDL).

Importing the package registers the FFI target when the handler library is installed (a
process that only runs a deserialized ``jax.export`` artifact needs nothing more than
``import jax_sparse_mla``); ``jax.export`` needs ``jax_sparse_mla.export_disabled_checks()``
to accept the custom call.

Where the kernel cannot run (a CUDA GPU that is not Hopper, no cubin available, no handler
library), ``require_kernel=False`` lowers to the reference after one ``logging.warning`` and
``require_kernel=True`` (``implementation="cute"``) raises NotImplementedError with the reason.
Lowering for CUDA on a machine without a CUDA GPU (``lowering_platforms=("cuda",)``,
``jax.export``) assumes a Hopper target.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import pathlib
import threading
from collections.abc import Sequence

import jax
import numpy as np
from jax.interpreters import mlir

from jax_sparse_mla import installed, primitive
from jax_sparse_mla.kernel import compile as kernel_compile
from jax_sparse_mla.kernel import dispatch
from jax_sparse_mla.kernel.config import (
    MAX_BATCH,
    PARAMS,
    KernelConfig,
    KernelUnavailableError,
)

FFI_TARGET = "jax_sparse_mla_decode"
"""Name of the custom call target (registered for the CUDA platform)."""
PUSH_FFI_TARGET = "jax_sparse_mla_decode_push"
"""The decode that pushes its rows into the owners' mailboxes (``push_exchange``)."""

STATE_TYPE = "jax_sparse_mla_decode_state"
LIBRARY_NAME = "libsparse_mla_ffi.so"
LIBRARY_ENV = "JAX_SPARSE_MLA_FFI_LIBRARY"
"""Environment variable naming the handler library explicitly (overrides the search)."""

HOPPER = "9.0"

log = logging.getLogger("jax_sparse_mla")
_REGISTER_LOCK = threading.Lock()
_registered_library: pathlib.Path | None = None


def find_library() -> pathlib.Path:
    """Path of the handler library: $JAX_SPARSE_MLA_FFI_LIBRARY, else inside the installed
    package (``installed.find``)."""
    explicit = os.environ.get(LIBRARY_ENV)
    if explicit:
        path = pathlib.Path(explicit)
        if not path.is_file():
            raise FileNotFoundError(f"{LIBRARY_ENV}={explicit} is not a file")
        return path
    path = installed.find(f"_ffi/{LIBRARY_NAME}")
    if path is not None and path.is_file():
        return path
    raise FileNotFoundError(
        f"the XLA FFI handler {LIBRARY_NAME} is not installed: build it with "
        "`pip install .` (needs a C++ compiler) or point "
        f"{LIBRARY_ENV} at a built copy"
    )


def register_ffi_target() -> pathlib.Path:
    """Registers the FFI target and its state type for CUDA (once); returns the library path."""
    global _registered_library
    with _REGISTER_LOCK:
        if _registered_library is not None:
            return _registered_library
        path = find_library()
        register_handlers(
            ctypes.CDLL(str(path)),
            STATE_TYPE,
            "JaxSparseMlaDecode",
            {FFI_TARGET: "JaxSparseMlaDecode", PUSH_FFI_TARGET: "JaxSparseMlaDecodePush"},
        )
        _registered_library = path
        return path


def register_handlers(
    library: ctypes.CDLL, state_type: str, state: str, targets: dict[str, str]
) -> None:
    """Registers for CUDA a handler library's FFI state type ``state_type`` (its symbols
    ``{state}StateTypeId`` / ``StateTypeInfo``) and its targets (name -> symbol stem: the
    stages ``{stem}Instantiate`` and ``{stem}Execute``)."""
    for name in (f"{state}StateTypeId", f"{state}StateTypeInfo"):
        getattr(library, name).restype = ctypes.c_void_p
    jax.ffi.register_ffi_type(
        state_type,
        {
            "type_id": jax.ffi.pycapsule(getattr(library, f"{state}StateTypeId")()),
            "type_info": jax.ffi.pycapsule(getattr(library, f"{state}StateTypeInfo")()),
        },
        platform="CUDA",
    )
    for target, stem in targets.items():
        stages = {
            stage: jax.ffi.pycapsule(getattr(library, f"{stem}{stage.title()}"))
            for stage in ("instantiate", "execute")
        }
        jax.ffi.register_ffi_target(target, stages, platform="CUDA")


def export_disabled_checks() -> tuple[jax.export.DisabledSafetyCheck, ...]:
    """The ``disabled_checks`` that let ``jax.export`` serialize the decode kernel's custom
    calls (plain and pushing); ``jax_sparse_mla.export_disabled_checks()`` allows all of the
    library's."""
    targets = (FFI_TARGET, PUSH_FFI_TARGET)
    return tuple(jax.export.DisabledSafetyCheck.custom_call(target) for target in targets)


def kernel_attributes(kernel: kernel_compile.CompiledKernel) -> dict[str, object]:
    """The custom call's attributes: the cubin bytes and its launch metadata."""
    meta = kernel.meta
    return {
        "cubin": np.frombuffer(kernel.cubin, dtype=np.uint8),
        "kernel_name": str(meta["kernel_name"]),
        "head_tile": np.int64(meta["head_tile"]),
        "block": np.asarray(meta["block"], dtype=np.int64),
        "cluster": np.asarray(meta["cluster"], dtype=np.int64),
        "smem_bytes": np.int64(meta["smem_bytes"]),
    }


def _local_cuda_devices() -> list[jax.Device]:
    try:
        return jax.devices("cuda")
    except RuntimeError:
        return []


@functools.cache
def _local_cuda_capabilities() -> tuple[str, ...] | None:
    """Compute capabilities of this process's CUDA devices; None when it has none."""
    devices = _local_cuda_devices()
    if not devices:
        return None
    return tuple(sorted({str(getattr(d, "compute_capability", "?")) for d in devices}))


@functools.cache
def sm_count() -> int:
    """The local GPUs' smallest SM count; the H200's when lowering without a GPU."""
    counts = [getattr(d, "core_count", 0) for d in _local_cuda_devices()]
    return min(counts) if counts and min(counts) > 0 else dispatch.H200_SMS


def _check_meta(kernel: kernel_compile.CompiledKernel, config: KernelConfig) -> None:
    meta = kernel.meta
    expected = {
        "head_tile": config.head_tile,
        "block": list(config.block),
        "cluster": list(config.cluster),
        "params": list(PARAMS),
    }
    seen = {key: meta.get(key) for key in expected}
    if seen != expected:
        raise RuntimeError(f"cubin metadata for {config} does not match the ABI: {seen=}")


def dispatched_config(batch: int, padded_heads: int, width: int, valid_hint: int | None):
    """The dispatch rule's config for B = ``batch``, Hp = ``padded_heads`` and K = ``width``
    index slots, read as min(K, valid_hint) when there is a hint, on the local GPUs."""
    width = width if valid_hint is None else min(width, valid_hint)
    return dispatch.choose_config(batch, padded_heads, width, sm_count())


def kernel_or_reason(
    avals: Sequence[jax.core.ShapedArray], config: KernelConfig | None, valid_hint: int | None
):
    """(CompiledKernel, None) when the kernel can run these shapes, else (None, reason)."""
    q, kv, rows = avals[0], avals[1], avals[2]
    batch, padded_heads = q.shape[0], q.shape[1]
    capabilities = _local_cuda_capabilities()
    if capabilities is not None and capabilities != (HOPPER,):
        return None, f"the kernel needs Hopper (sm_90) GPUs; this process has {capabilities}"
    if kv.shape[0] >= 2**31:
        return None, f"the kernel indexes kv rows with int32; {kv.shape=}"
    if batch > MAX_BATCH:
        return (
            None,
            f"the kernel launches one grid row per query row, at most {MAX_BATCH}; {batch=}",
        )
    try:
        register_ffi_target()
    except (FileNotFoundError, OSError) as err:
        return None, str(err)
    if config is None:
        config = dispatched_config(batch, padded_heads, rows.shape[1], valid_hint)
    try:
        kernel = kernel_compile.get_kernel(config)
    except (KernelUnavailableError, ImportError) as err:
        return None, f"no cubin for {config}: {err}"
    _check_meta(kernel, config)
    return kernel, None


@functools.cache
def _warn_fallback(reason: str) -> None:
    log.warning("jax_sparse_mla.decode: using the reference on CUDA: %s", reason)


def _cuda_lowering(ctx, q, kv, rows, valid, scales, *, require_kernel, config, valid_hint):
    avals = ctx.avals_in
    fallback = functools.partial(
        primitive.reference_lowering,
        require_kernel=require_kernel,
        config=config,
        valid_hint=valid_hint,
    )
    if any(size == 0 for aval in avals[:3] for size in aval.shape):
        # Nothing to launch: empty outputs, or no keys at all (zeros and -inf).
        return fallback(ctx, q, kv, rows, valid, scales)
    kernel, reason = kernel_or_reason(avals, config, valid_hint)
    if kernel is None:
        if require_kernel:
            raise NotImplementedError(f"implementation='cute' cannot use the kernel: {reason}")
        _warn_fallback(reason)
        return fallback(ctx, q, kv, rows, valid, scales)
    rule = jax.ffi.ffi_lowering(FFI_TARGET)
    return rule(ctx, q, kv, rows, valid, scales, **kernel_attributes(kernel))


mlir.register_lowering(primitive.sparse_mla_decode_p, _cuda_lowering, platform="cuda")


def _register_if_installed() -> None:
    try:
        register_ffi_target()
    except (FileNotFoundError, OSError) as err:  # the lowering reports it if the kernel is used
        log.debug("jax_sparse_mla: FFI handler not registered: %s", err)


_register_if_installed()
