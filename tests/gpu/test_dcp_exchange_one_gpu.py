"""The push exchange's kernels (the pushing decodes and the merge) on ONE GPU.

The exchange's kernels only see addresses: every rank's data region is listed in each rank's
header. Here the D ranks' headers and data regions are plain allocations on one device. The
merge: the decode CTAs' pushes are simulated by writing partials and flags into a rank's
mailbox, that rank's merge runs alone and is compared with a numpy LSE merge. The whole step:
the D ranks' decodes (each pushing its query heads to the others and waiting for theirs, then
pushing its partials to the owners) and merges run at once on D streams, and every rank's
merged rows must equal the plain decodes merged in numpy. Both also with a rank that never
arrives (the timeout: NaN rows and the error record). So the kernels, their flag protocol
(slot by step parity, flag = (step & 0x7fffffff) + 1) and their timeouts are tested without
the two-GPU machine that test_dcp_push_gpu.py needs (the D ranks' grids must fit the one GPU
at once: small B).

The kernels are the CuTe DSL cubins the FFI loads (``kernel/exchange``, and the decodes' part
in ``kernel/entry.py``). Layouts as in ffi/dcp_exchange.cc (MakeLayout) and
kernel/exchange/config.py. test_push_exchange_one_gpu.py runs the same kernels through XLA and
the FFI.
"""

from __future__ import annotations

import ctypes
import dataclasses
import pathlib
import sys

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # cubin_launch, push_layout
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # test_dcp
from push_layout import HEADER_BYTES, mailbox_header, padded_heads, scratch_rows
from push_layout import mailbox_layout as layout
from test_dcp import local_rows_numpy

from jax_sparse_mla.kernel.config import KernelConfig
from jax_sparse_mla.kernel.exchange.config import (
    CHUNK_HEADS,
    CLAIMED_OFFSET,
    HAS_LAST_OFFSET,
    LAST_STEP_OFFSET,
    LATENT,
    QUERY_ROW,
    THREADS,
    ExchangeKernel,
)

pytestmark = pytest.mark.gpu


class Device:
    """The merge (the DSL cubin), streams and device memory."""

    def __init__(self):
        from cubin_launch import Context, check
        from cuda.bindings import driver as cu

        from jax_sparse_mla.kernel.exchange.compile import get_kernel

        self.cu, self.check = cu, check
        self.context = Context()
        self.streams = [self.context.stream]
        compiled = get_kernel(ExchangeKernel("merge"))
        module = check(cu.cuModuleLoadData(compiled.cubin))
        name = compiled.meta["kernel_name"].encode()
        self.merge = check(cu.cuModuleGetFunction(module, name))

    def stream(self, i: int):
        while len(self.streams) <= i:
            flags = self.cu.CUstream_flags.CU_STREAM_NON_BLOCKING
            self.streams.append(self.check(self.cu.cuStreamCreate(flags)))
        return self.streams[i]

    def alloc(self, nbytes: int, fill: int = 0) -> int:
        ptr = self.check(self.cu.cuMemAlloc(max(nbytes, 16)))
        self.check(self.cu.cuMemsetD8(ptr, fill, max(nbytes, 16)))
        return int(ptr)

    def upload(self, ptr: int, array: np.ndarray) -> None:
        host = np.ascontiguousarray(array)
        self.check(self.cu.cuMemcpyHtoD(ptr, host.ctypes.data, host.nbytes))

    def download(self, ptr: int, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        self.check(self.cu.cuMemcpyDtoH(out.ctypes.data, ptr, out.nbytes))
        return out

    def launch_merge(self, grid, output, step, header, places, sizes, stream: int = 0) -> None:
        """The merge of ``sizes`` (B, H_own, D, the decode's head tile, split, CTAs per row)
        into ``output`` (latent, lse pointers), under PDL as the FFI launches it."""
        cu = self.cu
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = THREADS, 1, 1
        config.hStream = self.stream(stream)
        pdl = cu.CUlaunchAttribute()
        pdl.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        pdl.value.programmaticStreamSerializationAllowed = 1
        config.attrs, config.numAttrs = [pdl], 1
        values = (*output, step, header, places["latent"], places["lse"], *sizes)
        types = (ctypes.c_void_p,) * 4 + (ctypes.c_uint64,) * 2 + (ctypes.c_uint32,) * 6
        self.check(cu.cuLaunchKernelEx(config, self.merge, (values, types), 0))

    def synchronize(self) -> None:
        for s in self.streams:
            self.check(self.cu.cuStreamSynchronize(s))


@pytest.fixture(scope="module")
def device():
    return Device()


def mailboxes(device, dcp, places, timeout_ns):
    """D data regions, error records and headers (each listing every region, its rank, the
    timeout, its error record and its own region again), as dcp_setup makes them."""
    regions = [device.alloc(places["bytes"]) for _ in range(dcp)]
    errors = [device.alloc(16) for _ in range(dcp)]
    headers = []
    for r in range(dcp):
        headers.append(device.alloc(HEADER_BYTES))
        device.upload(headers[-1], mailbox_header(regions, r, timeout_ns, errors[r]))
    return regions, headers, errors


def scalar(device, value: int) -> int:
    ptr = device.alloc(4)
    device.upload(ptr, np.array([value % 2**32], np.uint32))  # s32 bits
    return ptr


# ---- the merge -----------------------------------------------------------------------------


def reference_merge(latents, lses):
    """numpy LSE merge of D partials: latents [D, B, H, 512] (bf16 values), lses [D, B, H]
    (natural log, -inf for a partial without keys) -> rows [B, H, 512], lse [B, H]."""
    top = np.max(lses, axis=0)
    top = np.where(np.isneginf(top), 0.0, top)
    weights = np.exp(lses.astype(np.float64) - top)
    total = weights.sum(axis=0)
    rows = (weights[..., None] * latents.astype(np.float64)).sum(axis=0)
    empty = total == 0
    rows = np.where(empty[..., None], 0.0, rows / np.where(empty, 1.0, total)[..., None])
    lse = np.where(empty, -np.inf, top + np.log(np.where(empty, 1.0, total)))
    return rows, lse


def run_merge(device, *, dcp, rank, batch, heads, tile, split, step, latents, lses, flagged,
              timeout_ns=2_000_000_000):  # fmt: skip
    """Rank ``rank``'s mailbox holds every source's partials for ``step``, the flags of the
    (source, row) pairs in ``flagged`` set (the others hold an older step's); runs its merge
    and returns (rows as f32, lse, row bits, the error record, the header's words)."""
    flags_per_row = -(-dcp * heads // tile) * split  # the decode's CTAs per row
    places = layout(dcp, batch, heads, flags_per_row)
    regions, headers, errors = mailboxes(device, dcp, places, timeout_ns)
    slot, flag = step & 1, (step & 0x7FFFFFFF) + 1
    mine = regions[rank]
    flags = np.full((2, dcp, batch, flags_per_row), flag - 2, np.uint32)
    for source, b in flagged:
        flags[slot, source, b] = flag
    device.upload(mine, flags)
    slot_latents = np.zeros((2, dcp, batch, heads, LATENT), ml_dtypes.bfloat16)
    slot_latents[slot] = latents
    device.upload(mine + places["latent"], slot_latents)
    slot_lses = np.full((2, dcp, batch, heads), np.nan, np.float32)
    slot_lses[slot] = lses
    device.upload(mine + places["lse"], slot_lses)
    out_latent = device.alloc(batch * heads * LATENT * 2, 0xFF)
    out_lse = device.alloc(batch * heads * 4, 0xFF)
    error = errors[rank]
    device.launch_merge(
        (-(-heads // CHUNK_HEADS), batch, 1), (out_latent, out_lse), scalar(device, step),
        headers[rank], places, (batch, heads, dcp, tile, split, flags_per_row),
    )  # fmt: skip
    device.synchronize()
    bits = device.download(out_latent, (batch, heads, LATENT), np.uint16)
    rows = (bits.astype(np.uint32) << 16).view(np.float32)
    lse = device.download(out_lse, (batch, heads), np.float32)
    record = device.download(error, (4,), np.uint32)
    words = device.download(headers[rank], (HEADER_BYTES // 4,), np.uint32)
    return rows, lse, bits, record, words


def partials(rng, dcp, batch, heads):
    """Random bf16 partial rows and LSEs, with a partial without keys (-inf) and a head
    without keys anywhere."""
    latents = rng.normal(0, 1, (dcp, batch, heads, LATENT)).astype(ml_dtypes.bfloat16)
    lses = rng.normal(3, 4, (dcp, batch, heads)).astype(np.float32)
    lses[0, 0, 1] = -np.inf
    lses[:, batch - 1, heads - 1] = -np.inf
    return latents, lses


MERGE_CASES = [(2, 1, 3, 16, 16, 4, 5), (2, 0, 2, 96, 64, 1, 8), (4, 3, 5, 24, 16, 2, 2**31 + 6)]


@pytest.mark.parametrize("dcp, rank, batch, heads, tile, split, step", MERGE_CASES)
def test_merge_matches_numpy(device, dcp, rank, batch, heads, tile, split, step):
    rng = np.random.default_rng(dcp * 100 + heads)
    latents, lses = partials(rng, dcp, batch, heads)
    flagged = [(s, b) for s in range(dcp) for b in range(batch)]
    rows, lse, _, record, words = run_merge(
        device, dcp=dcp, rank=rank, batch=batch, heads=heads, tile=tile, split=split,
        step=step, latents=latents, lses=lses, flagged=flagged,
    )  # fmt: skip
    want_rows, want_lse = reference_merge(latents.astype(np.float32), lses)
    assert np.isfinite(rows).all()
    # bf16 output: one rounding (2^-8 relative) plus the kernel's ex2.approx / lg2.approx.
    atol = 1e-5 * np.abs(want_rows).max()
    np.testing.assert_allclose(rows, want_rows, rtol=2**-7, atol=atol)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    lse_err = np.abs(lse[finite] - want_lse[finite])
    assert (lse_err <= 1e-5 * (1 + np.abs(want_lse[finite]))).all(), lse_err.max()
    assert (rows[batch - 1, heads - 1] == 0).all()  # a head without keys: zeros and -inf
    assert record[0] == 0
    assert words[HAS_LAST_OFFSET // 4] == 1 and words[LAST_STEP_OFFSET // 4] == step % 2**32


def test_merge_times_out_to_nan_rows(device):
    """Source 0 never flags row 0: that row's merge CTAs give up after the timeout, write NaN
    rows and LSEs and record (1, step, row, source); the other rows merge normally. CTA
    (0, 0), the one that records a merged step, timed out: the step is not recorded."""
    dcp, rank, batch, heads, step = 2, 1, 3, 16, 41
    latents, lses = partials(np.random.default_rng(7), dcp, batch, heads)
    flagged = [(s, b) for s in range(dcp) for b in range(batch) if (s, b) != (0, 0)]
    rows, lse, _, record, words = run_merge(
        device, dcp=dcp, rank=rank, batch=batch, heads=heads, tile=16, split=4, step=step,
        latents=latents, lses=lses, flagged=flagged, timeout_ns=2_000_000,
    )  # fmt: skip
    assert np.isnan(rows[0]).all() and np.isnan(lse[0]).all()
    want_rows, _ = reference_merge(latents.astype(np.float32), lses)
    atol = 1e-5 * np.abs(want_rows).max()
    for b in (1, 2):
        np.testing.assert_allclose(rows[b], want_rows[b], rtol=2**-7, atol=atol)
    assert record.tolist() == [1, step, 0, 0]
    assert words[CLAIMED_OFFSET // 4] == 1
    assert words[HAS_LAST_OFFSET // 4] == 0


# ---- the whole push step: pushing decodes (query heads, then partials), merges ------------


def run_push_step(device, config, *, dcp, batch, heads, step, arriving, timeout_ns):
    """The ranks in ``arriving`` run their push step at once, rank r on stream r: its decode
    of all D * ``heads`` heads on its own cache (its exchange parameters as the FFI's push
    target passes them: it pushes its own query heads to the other ranks' decodes and waits
    for theirs, then pushes its partials into the owners' mailboxes), then its merge. Every
    rank's decode takes the same global tokens [B, 512] and compacts its own. Returns
    (queries [D, B, H, 576] fp8, caches, rows, valid, scales, {rank: (rows as f32 [B, H,
    512], lse [B, H], error record)}) with rank r's local rows and valid (``local_rows``) in
    rows[r], valid[r]; the decode is ``config``'s push cubin."""
    from cubin_launch import CubinKernel, grid_columns

    from jax_sparse_mla.kernel.compile import get_kernel

    n_rows, width = 600, 512
    padded = padded_heads(dcp, heads)
    compiled = get_kernel(dataclasses.replace(config, exchange=True))
    kernel = CubinKernel(compiled.cubin, compiled.meta)
    flags_per_row = grid_columns(kernel, padded)
    places = layout(dcp, batch, heads, flags_per_row)
    _, headers, errors = mailboxes(device, dcp, places, timeout_ns)
    rng = np.random.default_rng(5)
    queries = rng.uniform(-2, 2, (dcp, batch, heads, QUERY_ROW)).astype(ml_dtypes.float8_e4m3fn)
    caches = rng.uniform(-2, 2, (dcp, n_rows, QUERY_ROW)).astype(ml_dtypes.float8_e4m3fn)
    # Global tokens: some negative (none), some past the ranks' caches (skipped keys); row 0
    # all of rank 0's; a random share of row 1's for each rank, and none of rank 0's.
    tokens = rng.integers(-8 * dcp, (n_rows + 4) * dcp, (batch, width)).astype(np.int32)
    tokens[0] = tokens[0] - tokens[0] % dcp
    if batch > 1 and dcp > 1:
        tokens[1] = np.where(tokens[1] % dcp == 0, tokens[1] + 1, tokens[1])
    per_rank = [local_rows_numpy(tokens, r, dcp) for r in range(dcp)]
    rows, valid = np.stack([p[0] for p in per_rank]), np.stack([p[1] for p in per_rank])
    scratch = scratch_rows(batch, flags_per_row, width, config.split)
    scales = np.array([576**-0.5 * 1.44269504, 1.25], np.float32)
    step_ptr = scalar(device, step)
    outs = {}
    for r in arriving:
        inputs = []
        # The scratch zeroed: an entry read before its CTA wrote it would add cache row 0.
        for array in (queries[r].view(np.uint8), caches[r].view(np.uint8), tokens,
                      np.zeros(scratch, np.int32), scales):  # fmt: skip
            inputs.append(device.alloc(array.nbytes))
            device.upload(inputs[-1], array)
        rank_ptr = scalar(device, r)
        exchange = (headers[r], rank_ptr, step_ptr, dcp, heads, places["latent"], places["lse"],
                    places["queries"], places["query_flags"])  # fmt: skip
        kernel.launch(
            device.stream(r), [*inputs, 0, 0], (n_rows, width, padded, QUERY_ROW), batch,
            pdl=False, exchange=exchange,
        )  # fmt: skip
        out_latent = device.alloc(batch * heads * LATENT * 2, 0xFF)
        out_lse = device.alloc(batch * heads * 4, 0xFF)
        sizes = (batch, heads, dcp, compiled.meta["head_tile"], compiled.meta["cluster"][0],
                 flags_per_row)  # fmt: skip
        device.launch_merge(
            (-(-heads // CHUNK_HEADS), batch, 1), (out_latent, out_lse), step_ptr, headers[r],
            places, sizes, stream=r,
        )  # fmt: skip
        outs[r] = (out_latent, out_lse)
    device.synchronize()
    merged = {}
    for r, (out_latent, out_lse) in outs.items():
        bits = device.download(out_latent, (batch, heads, LATENT), np.uint16)
        latent = (bits.astype(np.uint32) << 16).view(np.float32)
        lse = device.download(out_lse, (batch, heads), np.float32)
        merged[r] = (latent, lse, device.download(errors[r], (4,), np.uint32))
    return queries, caches, rows, valid, scales, merged


CLUSTER_MMA_S4, WGMMA_S1 = KernelConfig("cluster-mma", 4), KernelConfig("wgmma", 1)


# D = 3 (24 heads each): a rank's heads split over two tiles, 8 padded heads; D = 8: tiles of
# two and four owners, 8 ranks of 16 heads being DCP8's per-rank share of 128 (one row: the 8
# ranks' grids fit the GPU at once).
@pytest.mark.parametrize(
    "config, dcp, batch",
    [
        (CLUSTER_MMA_S4, 2, 2),
        (WGMMA_S1, 2, 2),
        (CLUSTER_MMA_S4, 3, 2),
        (CLUSTER_MMA_S4, 4, 2),
        (WGMMA_S1, 4, 2),
        (KernelConfig("cluster-mma", 1), 8, 1),
        (KernelConfig("wgmma", 8), 8, 1),
    ],
    ids=lambda v: v.slug if isinstance(v, KernelConfig) else str(v),
)
def test_push_step_matches_plain_decodes_merged(device, config, dcp, batch):
    """D ranks' whole push step on one GPU, each on its own stream. Each rank's merged rows
    must match the plain decodes (the config's plain cubin) of all the ranks' queries on
    every rank's cache, merged by LSE in numpy (a rank without keys for a row included): so
    every decode got every rank's query heads. The flags of a decode tile cover 1 owner
    (cluster-mma s1's 16 heads at D = 8), 2 (cluster-mma s4's 32 heads; wgmma's 64 at D = 2)
    or 4 (wgmma at D = 4 and 8)."""
    from cubin_launch import CubinKernel, run_decode

    from jax_sparse_mla.kernel.compile import get_kernel

    heads, step = (24, 2**31 + 4) if dcp == 3 else (16, 7)
    queries, caches, rows, valid, scales, merged = run_push_step(
        device, config, dcp=dcp, batch=batch, heads=heads, step=step, arriving=range(dcp),
        timeout_ns=2_000_000_000,
    )  # fmt: skip
    padded = padded_heads(dcp, heads)
    plain = get_kernel(config)
    kernel = CubinKernel(plain.cubin, plain.meta)
    q_all = np.zeros((batch, padded, QUERY_ROW), ml_dtypes.float8_e4m3fn)
    q_all[:, : dcp * heads] = queries.transpose(1, 0, 2, 3).reshape(batch, dcp * heads, -1)
    partials = [
        run_decode(device.context, kernel, q_all, caches[s], rows[s], valid[s], scales)
        for s in range(dcp)
    ]
    for r, (rows_out, lse, record) in merged.items():
        assert record[0] == 0, (r, record)
        own = slice(r * heads, (r + 1) * heads)
        latents = np.stack([(bits[:, own].astype(np.uint32) << 16).view(np.float32)
                            for bits, _ in partials])  # fmt: skip
        lses = np.stack([lse[:, own] for _, lse in partials])
        want_rows, want_lse = reference_merge(latents, lses)
        atol = 1e-5 * np.abs(want_rows).max()
        np.testing.assert_allclose(rows_out, want_rows, rtol=2**-7, atol=atol)
        finite = np.isfinite(want_lse)
        assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse)), r
        lse_err = np.abs(lse[finite] - want_lse[finite])
        assert (lse_err <= 1e-5 * (1 + np.abs(want_lse[finite]))).all(), lse_err.max()


@pytest.mark.parametrize(
    "config, dcp, missing",
    [(CLUSTER_MMA_S4, 2, 1), (WGMMA_S1, 2, 0), (KernelConfig("cluster-mma", 2), 8, 5)],
    ids=lambda v: v.slug if isinstance(v, KernelConfig) else str(v),
)
def test_a_rank_that_never_runs_gives_nan_rows_and_errors(device, config, dcp, missing):
    """Rank ``missing`` never runs: every other rank's decode gives up on its query heads
    after the timeout, records (4, step, row 0, missing) and pushes nothing, so its merge
    times out too and writes NaN rows and LSEs. No hang. (The timeout leaves the ranks
    launched one after another by this process the time to arrive.)"""
    step = 9
    *_, merged = run_push_step(
        device, config, dcp=dcp, batch=1, heads=16, step=step,
        arriving=[r for r in range(dcp) if r != missing], timeout_ns=200_000_000,
    )  # fmt: skip
    for r, (rows_out, lse, record) in merged.items():
        assert np.isnan(rows_out).all() and np.isnan(lse).all(), r
        assert record.tolist() == [4, step, 0, missing], (r, record)
