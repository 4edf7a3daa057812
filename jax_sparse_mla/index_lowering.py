"""CUDA lowering of ``index_topk_p``: one XLA FFI custom call that launches the indexer's two
kernels (scores, then the radix top-k under PDL; ``ffi/index_topk_ffi.cc``).

The custom call carries both cubins as attributes (a lowered, exported or cached executable
is self-contained), ``span``, the key tiles per scores CTA, and ``topk_cluster``, the top-k's
CTAs per verify row (its cubin is compiled for it), chosen here from the shapes and the GPU's
SM count. It has a third, scratch result: the scores' order keys [B, T, pitch],
which the primitive does not return.

Where the kernels cannot run (a GPU that is not Hopper, no cubins, no handler library, more
query tiles than a CTA stages), ``require_kernel=False`` lowers to the reference after one
``logging.warning`` and ``require_kernel=True`` raises NotImplementedError with the reason.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading

import jax
import numpy as np
from jax.core import ShapedArray
from jax.interpreters import mlir

from jax_sparse_mla import cuda_lowering, index_primitive
from jax_sparse_mla.kernel.config import KernelUnavailableError
from jax_sparse_mla.kernel.dispatch import active_clusters
from jax_sparse_mla.kernel.index import compile as index_compile
from jax_sparse_mla.kernel.index.config import (
    HEADS,
    MAX_QUERY_TILES,
    SCORE_SMEM_FIXED,
    SCORE_SMEM_PER_QUERY_TILE,
    TOKENS,
    TOPK_CLUSTERS,
    IndexKernel,
)

FFI_TARGET = "jax_sparse_mla_index_topk"
STATE_TYPE = "jax_sparse_mla_index_topk_state"
SM_SHARED_BYTES = 233472  # shared memory per SM on Hopper (228 KiB)
CTA_RESERVED_BYTES = 1024  # the driver's share of it per resident CTA
MAX_CTAS_PER_SM = 2  # the scores CTAs' registers (<= 128 per thread, 256 threads) allow no more
TOPK_SINGLE_CTA_TOKENS = 8192  # a row's token slots one top-k CTA takes alone
TOPK_MIN_SLICE = 4096  # token slots per CTA below which a larger cluster stops paying

log = logging.getLogger("jax_sparse_mla")
_LOCK = threading.Lock()
_registered = False


def register_ffi_target() -> None:
    """Registers the target and its state type for CUDA (once), from the handler library."""
    global _registered
    with _LOCK:
        if _registered:
            return
        path = cuda_lowering.find_library()
        library = ctypes.CDLL(str(path))
        if not hasattr(library, "JaxSparseMlaIndexTopkExecute"):
            raise OSError(f"{path} has no index_topk handler (built before it existed?)")
        cuda_lowering.register_handlers(
            library, STATE_TYPE, "JaxSparseMlaIndexTopk", {FFI_TARGET: "JaxSparseMlaIndexTopk"}
        )
        _registered = True


def pitch(capacity: int) -> int:
    """The order keys' row pitch: whole key tiles."""
    return -(-capacity // TOKENS) * TOKENS


def span(batch: int, steps: int, head_tiles: int, capacity: int, sm_count: int) -> int:
    """Key tiles per scores CTA. The grid (ceil(tiles / span) CTAs per request, B requests)
    fills one wave of the GPU: as many CTAs per request as fit B times into the resident
    slots (SMs x CTAs per SM, as shared memory allows), at least one."""
    tiles = pitch(capacity) // TOKENS
    smem = SCORE_SMEM_FIXED + steps * head_tiles * SCORE_SMEM_PER_QUERY_TILE
    per_sm = max(1, min(MAX_CTAS_PER_SM, SM_SHARED_BYTES // (smem + CTA_RESERVED_BYTES)))
    per_request = max(1, per_sm * sm_count // batch)
    return -(-tiles // per_request)


def topk_cluster(rows: int, capacity: int, sm_count: int) -> int:
    """CTAs per verify row of the top-k. One while a CTA can hold the row's
    TOPK_SINGLE_CTA_TOKENS (the cluster's barriers and exchanges then cost more than they
    save), else the largest of TOPK_CLUSTERS that leaves each CTA at least TOPK_MIN_SLICE token
    slots and of which ``rows`` clusters are resident at once (one wave), else 1. Fitted to
    the H200's top-k times per forced size (BENCHMARKS.md, 2026-12-01 session 14)."""
    slots = pitch(capacity)
    if slots <= TOPK_SINGLE_CTA_TOKENS:
        return 1
    return max(
        c
        for c in TOPK_CLUSTERS
        if c == 1 or (rows <= active_clusters(c, sm_count) and slots >= c * TOPK_MIN_SLICE)
    )


def kernels_or_reason(avals, dcp_size: int) -> tuple[dict | None, str | None]:
    """(the custom call's attributes, None) when the kernels can run these shapes, else
    (None, reason)."""
    q, _, keys, _, block_table, _, _ = avals
    batch, steps, heads, _ = q.shape
    capabilities = cuda_lowering._local_cuda_capabilities()
    if capabilities is not None and capabilities != (cuda_lowering.HOPPER,):
        return None, f"the kernels need Hopper (sm_90) GPUs; this process has {capabilities}"
    query_tiles = steps * heads // HEADS
    if query_tiles > MAX_QUERY_TILES:
        return None, (
            f"the scores kernel stages at most {MAX_QUERY_TILES} tiles of {HEADS} heads per "
            f"request (T * ceil(Hi / {HEADS})); got T={steps}, Hi padded to {heads}"
        )
    capacity = block_table.shape[1] * keys.shape[1]
    if batch > 65535 or steps > 65535 or steps * pitch(capacity) >= 2**31:
        return None, f"sizes beyond the kernels' int32 / grid limits: {q.shape=}, {capacity=}"
    try:
        register_ffi_target()
        cluster = topk_cluster(batch * steps, capacity, cuda_lowering.sm_count())
        compiled = {
            "scores": index_compile.get_kernel(IndexKernel("scores")),
            "topk": index_compile.get_kernel(IndexKernel("topk", cluster)),
        }
    except (FileNotFoundError, OSError, KernelUnavailableError, ImportError) as err:
        return None, str(err)
    attributes = {
        f"{stage}_cubin": np.frombuffer(kernel.cubin, dtype=np.uint8)
        for stage, kernel in compiled.items()
    }
    attributes |= {
        f"{stage}_kernel": str(kernel.meta["kernel_name"]) for stage, kernel in compiled.items()
    }
    attributes["topk_cluster"] = np.int64(cluster)
    attributes["dcp_size"] = np.int64(dcp_size)
    attributes["span"] = np.int64(
        span(batch, steps, heads // HEADS, capacity, cuda_lowering.sm_count())
    )
    return attributes, None


@functools.cache
def _warn_fallback(reason: str) -> None:
    log.warning("jax_sparse_mla.index_topk: using the reference on CUDA: %s", reason)


def _cuda_lowering(ctx, *operands, top_k, dcp_size, require_kernel):
    avals = ctx.avals_in
    q, keys, block_table = avals[0], avals[2], avals[4]
    fallback = functools.partial(
        index_primitive.reference_lowering,
        top_k=top_k,
        dcp_size=dcp_size,
        require_kernel=require_kernel,
    )
    if any(size == 0 for aval in (q, keys, block_table) for size in aval.shape):
        return fallback(ctx, *operands)  # nothing to score: every slot -1
    attributes, reason = kernels_or_reason(avals, dcp_size)
    if attributes is None:
        if require_kernel:
            raise NotImplementedError(
                f"index_topk(implementation='cute') cannot use the kernels: {reason}"
            )
        _warn_fallback(reason)
        return fallback(ctx, *operands)
    batch, steps = q.shape[0], q.shape[1]
    scratch = ShapedArray((batch, steps, pitch(block_table.shape[1] * keys.shape[1])), np.int32)
    rule = jax.ffi.ffi_lowering(FFI_TARGET)
    results = rule(ctx.replace(avals_out=(*ctx.avals_out, scratch)), *operands, **attributes)
    return results[:2]


mlir.register_lowering(index_primitive.index_topk_p, _cuda_lowering, platform="cuda")


def export_disabled_checks() -> tuple[jax.export.DisabledSafetyCheck, ...]:
    """The ``disabled_checks`` that let ``jax.export`` serialize the index_topk custom call."""
    return (jax.export.DisabledSafetyCheck.custom_call(FFI_TARGET),)


def _register_if_installed() -> None:
    try:
        register_ffi_target()
    except (FileNotFoundError, OSError) as err:  # the lowering reports it if the kernel is used
        log.debug("jax_sparse_mla: index_topk FFI handler not registered: %s", err)


_register_if_installed()
