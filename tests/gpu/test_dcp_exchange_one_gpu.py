"""The push exchange's kernels (the pushing decodes and the merge) on ONE GPU.

The exchange's kernels only see addresses: every rank's data region is listed in each rank's
header. Here the D ranks' headers and data regions are plain allocations on one device. The
merge: the decode CTAs' pushes are simulated by writing partials and flags into a rank's
mailbox, that rank's merge runs alone and is compared with a numpy LSE merge. The whole step:
the D ranks' decodes (each pushing its query heads to the others and waiting for theirs, then
pushing its partials to the owners) and merges run at once on D streams, and every rank's
merged rows must equal the plain decodes merged in numpy, for one step and over 10,000
steps with the ranks running apart. Both also with a rank that never arrives (the timeout:
NaN rows and the error record). So the kernels, their flag protocol (slot by step parity,
flag = (step & 0x7fffffff) + 1), their timeouts and the merge's refusal of a step that does
not advance are tested without the two-GPU machine that test_dcp_push_gpu.py needs (the D
ranks' grids must fit the one GPU at once: small B).

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
    MAX_ADVANCE,
    QUERY_ROW,
    STEP_BEHIND,
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
              timeout_ns=2_000_000_000, last_step=None):  # fmt: skip
    """Rank ``rank``'s mailbox holds every source's partials for ``step``, the flags of the
    (source, row) pairs in ``flagged`` set (the others hold an older step's), its header the
    ``last_step`` merged (None: none since the setup); runs its merge and returns (rows as
    f32, lse, row bits, the error record, the header's words)."""
    flags_per_row = -(-dcp * heads // tile) * split  # the decode's CTAs per row
    places = layout(dcp, batch, heads, flags_per_row)
    regions, headers, errors = mailboxes(device, dcp, places, timeout_ns)
    if last_step is not None:  # has_last, last_step
        device.upload(headers[rank] + HAS_LAST_OFFSET, np.array([1, last_step % 2**32], np.uint32))
    slot, flag = step & 1, (step & 0x7FFFFFFF) + 1
    mine = regions[rank]
    flags = np.full((2, dcp, batch, flags_per_row), (flag - 2) % 2**32, np.uint32)
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


@pytest.mark.parametrize(
    "last, step, refused",
    [
        (5, 5, True),
        (6, 5, True),
        (-(2**31), 2**31 - 1, True),  # int32: -1
        (5, 5 + MAX_ADVANCE, True),
        (5, 5 + MAX_ADVANCE - 1, False),
        (2**31 - 1, -(2**31), False),  # int32: +1
    ],
)
def test_merge_refuses_a_step_that_does_not_advance(device, last, step, refused):
    """The header's last merged step ``last``; every flag of the step's slot holds its value
    (as an earlier exchange of the same step left them). A step that does not advance past
    ``last`` by 1 to MAX_ADVANCE - 1 (int32, wrapping) is refused before any poll: NaN rows
    and LSEs, the record (STEP_BEHIND, step, 0, 0), ``last`` kept. Within the bound the rows
    merge and the step is recorded."""
    dcp, rank, batch, heads = 2, 0, 3, 16
    latents, lses = partials(np.random.default_rng(5), dcp, batch, heads)
    flagged = [(s, b) for s in range(dcp) for b in range(batch)]
    rows, lse, _, record, words = run_merge(
        device, dcp=dcp, rank=rank, batch=batch, heads=heads, tile=16, split=2, step=step,
        latents=latents, lses=lses, flagged=flagged, last_step=last,
    )  # fmt: skip
    if refused:
        assert np.isnan(rows).all() and np.isnan(lse).all()
        assert record.tolist() == [STEP_BEHIND, step % 2**32, 0, 0]
        assert words[LAST_STEP_OFFSET // 4] == last % 2**32
    else:
        assert np.isfinite(rows).all() and record[0] == 0
        assert words[LAST_STEP_OFFSET // 4] == step % 2**32


# ---- the whole push step: pushing decodes (query heads, then partials), merges ------------


class PushGroup:
    """D ranks' push steps on one GPU with one set of mailboxes for all their steps (as
    dcp_setup's). Rank r's step runs on stream r: its decode of all D * ``heads`` heads on
    its own cache (its exchange parameters as the FFI's push target passes them: it pushes
    its own query heads to the other ranks' decodes and waits for theirs, then pushes its
    partials into the owners' mailboxes), then its merge. Every rank's decode takes the same
    global tokens [B, 512] and compacts its own; its queries are one of ``variants`` sets
    (``queries`` [variants, D, B, H, 576] fp8). ``rows[r]``, ``valid[r]``: rank r's local
    rows (``local_rows``); the decode is ``config``'s push cubin."""

    def __init__(self, device, config, *, dcp, batch, heads, timeout_ns, variants=1):
        from cubin_launch import CubinKernel, grid_columns

        from jax_sparse_mla.kernel.compile import get_kernel

        self.device, self.config = device, config
        self.dcp, self.batch, self.heads = dcp, batch, heads
        self.n_rows, self.width = 600, 512
        self.padded = padded_heads(dcp, heads)
        self.compiled = get_kernel(dataclasses.replace(config, exchange=True))
        self.kernel = CubinKernel(self.compiled.cubin, self.compiled.meta)
        self.flags_per_row = grid_columns(self.kernel, self.padded)
        self.places = layout(dcp, batch, heads, self.flags_per_row)
        _, self.headers, self.errors = mailboxes(device, dcp, self.places, timeout_ns)
        rng = np.random.default_rng(5)
        self.queries = rng.uniform(-2, 2, (variants, dcp, batch, heads, QUERY_ROW)).astype(
            ml_dtypes.float8_e4m3fn
        )
        self.caches = rng.uniform(-2, 2, (dcp, self.n_rows, QUERY_ROW)).astype(
            ml_dtypes.float8_e4m3fn
        )
        # Global tokens: some negative (none), some past the ranks' caches (skipped keys); row
        # 0 all of rank 0's; a random share of row 1's for each rank, and none of rank 0's.
        tokens = rng.integers(-8 * dcp, (self.n_rows + 4) * dcp, (batch, self.width))
        tokens = tokens.astype(np.int32)
        tokens[0] = tokens[0] - tokens[0] % dcp
        if batch > 1 and dcp > 1:
            tokens[1] = np.where(tokens[1] % dcp == 0, tokens[1] + 1, tokens[1])
        per_rank = [local_rows_numpy(tokens, r, dcp) for r in range(dcp)]
        self.rows = np.stack([p[0] for p in per_rank])
        self.valid = np.stack([p[1] for p in per_rank])
        self.scales = np.array([576**-0.5 * 1.44269504, 1.25], np.float32)
        scratch = scratch_rows(batch, self.flags_per_row, self.width, config.split)
        self.inputs = []  # per rank: ([q of each variant], kv, tokens, scratch, scales, rank)
        for r in range(dcp):
            # The scratch zeroed: an entry read before its CTA wrote it would add cache row 0.
            own = [self.put(self.queries[v, r].view(np.uint8)) for v in range(variants)]
            arrays = (self.caches[r].view(np.uint8), tokens, np.zeros(scratch, np.int32),
                      self.scales)  # fmt: skip
            self.inputs.append((own, *(self.put(a) for a in arrays), scalar(device, r)))

    def put(self, array: np.ndarray) -> int:
        ptr = self.device.alloc(array.nbytes)
        self.device.upload(ptr, array)
        return ptr

    def outputs(self, steps: int = 1) -> tuple[int, int]:
        """Room for ``steps`` merged results of a rank: latent [steps, B, H, 512] bf16 and
        lse [steps, B, H] f32, filled with NaN bytes."""
        rows = steps * self.batch * self.heads
        return self.device.alloc(rows * LATENT * 2, 0xFF), self.device.alloc(rows * 4, 0xFF)

    def launch(self, r: int, step_ptr: int, variant: int, out: tuple[int, int]) -> None:
        """Rank r's step (the step value at ``step_ptr``, queries of ``variant``) on stream r:
        its decode, then its merge into ``out`` (latent, lse pointers)."""
        own, kv, tokens, scratch, scales, rank_ptr = self.inputs[r]
        places = self.places
        exchange = (self.headers[r], rank_ptr, step_ptr, self.dcp, self.heads,
                    places["latent"], places["lse"], places["queries"],
                    places["query_flags"])  # fmt: skip
        self.kernel.launch(
            self.device.stream(r), [own[variant], kv, tokens, scratch, scales, 0, 0],
            (self.n_rows, self.width, self.padded, QUERY_ROW), self.batch, pdl=False,
            exchange=exchange,
        )  # fmt: skip
        meta = self.compiled.meta
        sizes = (self.batch, self.heads, self.dcp, meta["head_tile"], meta["cluster"][0],
                 self.flags_per_row)  # fmt: skip
        self.device.launch_merge(
            (-(-self.heads // CHUNK_HEADS), self.batch, 1), out, step_ptr, self.headers[r],
            places, sizes, stream=r,
        )  # fmt: skip

    def read(self, out: tuple[int, int], steps: int = 1):
        """(latent bits uint16 [steps, B, H, 512], lse [steps, B, H]) from ``outputs``."""
        shape = (steps, self.batch, self.heads)
        bits = self.device.download(out[0], (*shape, LATENT), np.uint16)
        return bits, self.device.download(out[1], shape, np.float32)

    def record(self, r: int) -> np.ndarray:
        return self.device.download(self.errors[r], (4,), np.uint32)

    def check_against_plain_decodes(self, r: int, variant: int, bits, lse) -> None:
        """Rank r's merged rows (bits [B, H, 512]) and lse for queries ``variant`` must match
        the plain decodes (the config's plain cubin) of all the ranks' queries on every rank's
        cache, merged by LSE in numpy (a rank without keys for a row included): so every
        decode got every rank's query heads."""
        from cubin_launch import CubinKernel, run_decode

        from jax_sparse_mla.kernel.compile import get_kernel

        dcp, batch, heads = self.dcp, self.batch, self.heads
        plain = get_kernel(self.config)
        kernel = CubinKernel(plain.cubin, plain.meta)
        q_all = np.zeros((batch, self.padded, QUERY_ROW), ml_dtypes.float8_e4m3fn)
        queries = self.queries[variant].transpose(1, 0, 2, 3).reshape(batch, dcp * heads, -1)
        q_all[:, : dcp * heads] = queries
        context, caches, rows, valid = self.device.context, self.caches, self.rows, self.valid
        partials = [
            run_decode(context, kernel, q_all, caches[s], rows[s], valid[s], self.scales)
            for s in range(dcp)
        ]
        own = slice(r * heads, (r + 1) * heads)
        latents = np.stack([(p[:, own].astype(np.uint32) << 16).view(np.float32)
                            for p, _ in partials])  # fmt: skip
        lses = np.stack([p_lse[:, own] for _, p_lse in partials])
        want_rows, want_lse = reference_merge(latents, lses)
        rows = (bits.astype(np.uint32) << 16).view(np.float32)
        atol = 1e-5 * np.abs(want_rows).max()
        np.testing.assert_allclose(rows, want_rows, rtol=2**-7, atol=atol)
        finite = np.isfinite(want_lse)
        assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse)), r
        lse_err = np.abs(lse[finite] - want_lse[finite])
        assert (lse_err <= 1e-5 * (1 + np.abs(want_lse[finite]))).all(), lse_err.max()


def run_push_step(device, config, *, dcp, batch, heads, step, arriving, timeout_ns):
    """The ranks in ``arriving`` of a new PushGroup run one push step at once. Returns the
    group and {rank: (merged latent bits uint16 [B, H, 512], lse [B, H], error record)}."""
    group = PushGroup(device, config, dcp=dcp, batch=batch, heads=heads, timeout_ns=timeout_ns)
    step_ptr = scalar(device, step)
    outs = {}
    for r in arriving:
        outs[r] = group.outputs()
        group.launch(r, step_ptr, 0, outs[r])
    device.synchronize()
    merged = {}
    for r, out in outs.items():
        bits, lse = group.read(out)
        merged[r] = (bits[0], lse[0], group.record(r))
    return group, merged


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
    """D ranks' whole push step on one GPU, each on its own stream: each rank's merged rows
    match the plain decodes merged in numpy (PushGroup.check_against_plain_decodes). The
    flags of a decode tile cover 1 owner (cluster-mma s1's 16 heads at D = 8), 2
    (cluster-mma s4's 32 heads; wgmma's 64 at D = 2) or 4 (wgmma at D = 4 and 8)."""
    heads, step = (24, 2**31 + 4) if dcp == 3 else (16, 7)
    group, merged = run_push_step(
        device, config, dcp=dcp, batch=batch, heads=heads, step=step, arriving=range(dcp),
        timeout_ns=2_000_000_000,
    )  # fmt: skip
    for r, (bits, lse, record) in merged.items():
        assert record[0] == 0, (r, record)
        group.check_against_plain_decodes(r, 0, bits, lse)


# Steps launched per rank before the results are read back (the output ring).
SOAK_RING = 100


@pytest.mark.parametrize(
    "config, dcp",
    [(CLUSTER_MMA_S4, 2), (WGMMA_S1, 4), (KernelConfig("cluster-mma", 1), 8)],
    ids=lambda v: v.slug if isinstance(v, KernelConfig) else str(v),
)
def test_soak_10000_steps_with_the_ranks_apart(device, config, dcp):
    """10,000 consecutive push steps of D ranks on one GPU, one set of mailboxes, each rank's
    steps on its own stream with nothing ordering the ranks but the exchange itself: a rank
    may start its next decode while the others still merge, so each slot is reused every
    other step while peers may still be reading the other. The queries cycle
    through three sets (a stale slot would give another set's rows) and the step counter
    wraps around int32 halfway. Every step's merged rows equal, bit for bit, the first step's
    of its query set, which match the plain decodes merged in numpy; no error recorded."""
    steps, variants = 10_000, 3
    group = PushGroup(device, config, dcp=dcp, batch=1, heads=16, timeout_ns=1_000_000_000,
                      variants=variants)  # fmt: skip
    first = 2**31 - steps // 2
    values = ((first + np.arange(steps)) % 2**32).astype(np.uint32)  # int32 bits, wrapping
    step_ptrs = group.put(values)
    rings = [group.outputs(SOAK_RING) for _ in range(dcp)]
    expected = {}  # (rank, variant) -> the first step's (bits, lse)
    mismatched = []
    for start in range(0, steps, SOAK_RING):
        count = min(SOAK_RING, steps - start)
        for i in range(start, start + count):
            for r in range(dcp):
                slot = i - start
                heads = slot * group.batch * group.heads  # the slot's first (row, head)
                out = (rings[r][0] + heads * LATENT * 2, rings[r][1] + heads * 4)
                group.launch(r, step_ptrs + 4 * i, i % variants, out)
        device.synchronize()
        for r in range(dcp):
            record = group.record(r)
            assert record[0] == 0, (start, r, record.tolist())
            bits, lse = group.read(rings[r], count)
            for k in range(count):
                want = expected.setdefault((r, (start + k) % variants), (bits[k], lse[k]))
                if not (np.array_equal(bits[k], want[0]) and np.array_equal(lse[k], want[1])):
                    mismatched.append((start + k, r))
    assert not mismatched, f"{len(mismatched)} mismatched steps, first {mismatched[:5]}"
    for (r, variant), (bits, lse) in expected.items():
        group.check_against_plain_decodes(r, variant, bits, lse)


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
    _, merged = run_push_step(
        device, config, dcp=dcp, batch=1, heads=16, step=step,
        arriving=[r for r in range(dcp) if r != missing], timeout_ns=200_000_000,
    )  # fmt: skip
    for r, (bits, lse, record) in merged.items():
        rows_out = (bits.astype(np.uint32) << 16).view(np.float32)
        assert np.isnan(rows_out).all() and np.isnan(lse).all(), r
        assert record.tolist() == [4, step, 0, missing], (r, record)
