"""Launch a sparse decode cubin with the CUDA driver API (cuda.bindings), for GPU tests.

Loads the cubin with cuModuleLoadData, opts in to its dynamic shared memory, and launches
with cuLaunchKernelEx: cluster dims and the PDL attribute (programmatic stream
serialization), as the FFI handler does. Buffers are plain cuMemAlloc allocations.
"""

from __future__ import annotations

import ctypes

import numpy as np
from cuda.bindings import driver as cu


def check(result):
    """Unwrap a cuda.bindings (err, *values) tuple, raising on an error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        raise RuntimeError(f"CUDA driver error {err}: {name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


class Context:
    """The device's primary context, current on this thread."""

    def __init__(self, ordinal: int = 0):
        check(cu.cuInit(0))
        self.device = check(cu.cuDeviceGet(ordinal))
        self.context = check(cu.cuDevicePrimaryCtxRetain(self.device))
        check(cu.cuCtxSetCurrent(self.context))
        self.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))

    def synchronize(self) -> None:
        check(cu.cuStreamSynchronize(self.stream))


class Buffer:
    """A device allocation holding a copy of a numpy array (or of its shape and dtype)."""

    def __init__(self, array: np.ndarray, *, upload: bool = True):
        self.shape, self.dtype = array.shape, array.dtype
        self.nbytes = max(int(array.nbytes), 16)
        self.ptr = check(cu.cuMemAlloc(self.nbytes))
        if upload and array.nbytes:
            host = np.ascontiguousarray(array)
            check(cu.cuMemcpyHtoD(self.ptr, host.ctypes.data, host.nbytes))

    @property
    def address(self) -> int:
        return int(self.ptr)

    def fill(self, byte: int) -> None:
        check(cu.cuMemsetD8(self.ptr, byte, self.nbytes))

    def download(self) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        if out.nbytes:
            check(cu.cuMemcpyDtoH(out.ctypes.data, self.ptr, out.nbytes))
        return out

    def free(self) -> None:
        check(cu.cuMemFree(self.ptr))


class CubinKernel:
    """One sparse decode cubin, launchable on a Context's stream."""

    def __init__(self, cubin: bytes, meta: dict):
        self.meta = meta
        self.module = check(cu.cuModuleLoadData(cubin))
        self.function = check(cu.cuModuleGetFunction(self.module, meta["kernel_name"].encode()))
        attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(cu.cuFuncSetAttribute(self.function, attribute, meta["smem_bytes"]))
        if int(np.prod(meta["cluster"])) > 8:  # a non-portable size, as the FFI handler allows
            attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
            check(cu.cuFuncSetAttribute(self.function, attribute, 1))

    def launch(
        self,
        stream,
        pointers: list[int],
        sizes: tuple[int, ...],
        batch: int,
        pdl: bool = True,
        exchange: tuple[int, ...] | None = None,
    ) -> None:
        """Launch with the ABI's seven device pointers and four sizes (n_rows, width, heads,
        row_bytes) over the grid of ``batch`` rows, as the FFI handler computes it; with the
        PDL attribute unless ``pdl`` is False. ``exchange``: the push exchange's (header, rank
        pointer, step pointer, D, H_own, latent offset, LSE offset, query offset, query flags
        offset; q then holds this rank's H_own heads), or None for none (null pointers; D = 1,
        H_own = heads, zero offsets)."""
        meta = self.meta
        heads = sizes[2]
        config = cu.CUlaunchConfig()
        config.gridDimX = grid_columns(self, heads)
        config.gridDimY, config.gridDimZ = batch, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = meta["block"]
        config.sharedMemBytes = meta["smem_bytes"]
        config.hStream = stream
        cluster = cu.CUlaunchAttribute()
        cluster.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        dims = cluster.value.clusterDim
        dims.x, dims.y, dims.z = meta["cluster"]
        programmatic = cu.CUlaunchAttribute()
        programmatic.id = (
            cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        )
        programmatic.value.programmaticStreamSerializationAllowed = 1
        config.attrs = [cluster, programmatic] if pdl else [cluster]
        config.numAttrs = len(config.attrs)
        values = (*pointers, *sizes, *(exchange or (0, 0, 0, 1, heads, 0, 0, 0, 0)))
        types = (ctypes.c_void_p,) * len(pointers) + (ctypes.c_int,) * len(sizes)
        types += (ctypes.c_void_p,) * 3 + (ctypes.c_int,) * 6
        check(cu.cuLaunchKernelEx(config, self.function, (values, types), 0))


def grid_columns(kernel: CubinKernel, heads: int) -> int:
    """The launch's CTAs per row for ``heads`` padded heads (the push exchange's flags per
    row)."""
    return -(-heads // kernel.meta["head_tile"]) * kernel.meta["cluster"][0]


def run_decode(context: Context, kernel: CubinKernel, q, kv, rows, valid, scales):
    """Run one decode: numpy q [B, Hp, 576] / kv [N, W] (FP8, W >= 576), rows [B, K], valid [B],
    scales [2] -> latent [B, Hp, 512] (uint16 BF16 bits), lse [B, Hp] float32.

    The outputs are pre-filled with 0xFF bytes (NaN) so that unwritten elements show."""
    batch, heads, _ = q.shape
    sizes = (kv.shape[0], rows.shape[1], heads, kv.shape[1])
    inputs = [
        Buffer(q.view(np.uint8)),
        Buffer(kv.view(np.uint8)),
        Buffer(rows.astype(np.int32)),
        Buffer(valid.astype(np.int32)),
        Buffer(scales.astype(np.float32)),
    ]
    latent = Buffer(np.empty((batch, heads, 512), np.uint16), upload=False)
    lse = Buffer(np.empty((batch, heads), np.float32), upload=False)
    latent.fill(0xFF)
    lse.fill(0xFF)
    buffers = [*inputs, latent, lse]
    try:
        kernel.launch(context.stream, [buf.address for buf in buffers], sizes, batch)
        context.synchronize()
        return latent.download(), lse.download()
    finally:
        for buf in buffers:
            buf.free()
