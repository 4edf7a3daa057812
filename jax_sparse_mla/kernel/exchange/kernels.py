"""The push exchange's kernels (sm_90a), in CuTe DSL: the query gather before the decode and
the owners' merge after it. The producers of the partials are the decode kernels themselves
(``kernel/sparse_decode.py``, "exchange" parameters): each decode CTA stores its rows into
the owners' mailboxes and releases one flag per owner. Layouts: ``exchange/config.py``.

DcpGather, grid (C, B), C = ceil(H * 36 / THREADS): one 16-byte unit of a rank's query heads
of a row per thread. CTA (c, b) stores its units of this rank's row b into every peer's query
slot [slot, rank, b] and into its own output, releases flag [slot, rank, b, c] in each peer,
acquire-polls the peers' flags [slot, source, b, c] here (bounded by the header's timeout)
and copies their units into the output [B, Hp, 576] (heads D * H .. Hp zero). On a timeout:
NaN bytes for every peer's heads and the error record (4, step, b, source).

DcpMerge, grid (S, B), S = ceil(H / chunk): CTA (s, b) polls, for each source, the flags of
the decode CTAs whose tiles hold the chunk's heads (acquire, system scope, bounded), merges
the D partials by LSE (FP32) into BF16 rows and FP32 natural-log LSEs; CTA (0, 0) records
the step (the next decode refuses a step of the same parity). On a timeout: NaN rows and
LSEs for the chunk and the error record (1, step, b, source).

A flag holds (step & 0x7fffffff) + 1 (never 0, the zeroed value) and stays after use: the
next use of a slot waits for a different value.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from jax_sparse_mla.kernel import ptx
from jax_sparse_mla.kernel.exchange import ptx as xptx
from jax_sparse_mla.kernel.exchange.config import (
    HAS_LAST_OFFSET,
    LAST_STEP_OFFSET,
    LATENT,
    QUERY_ROW,
    QUERY_UNITS,
    RANK_OFFSET,
    THREADS,
    TIMEOUT_OFFSET,
    TIMEOUT_PARTIALS,
    TIMEOUT_QUERIES,
)

ROW_UNITS = LATENT * 2 // 16  # 16-byte units of a merged BF16 row
HEADS_PER_PASS = THREADS // ROW_UNITS
NAN_BF16X2 = 0x7FC07FC0
NAN_F32 = 0x7FC00000
NAN_E4M3X4 = 0x7F7F7F7F
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


@cute.jit
def mailbox(step):
    """The slot and the flag value of ``step``."""
    return step & 1, (step & 0x7FFFFFFF) + 1


class DcpMerge:
    """The owners' merge (ABI: config.MERGE_PARAMS)."""

    @cute.jit
    def __call__(
        self,
        mLatent: cute.Pointer,
        mLse: cute.Pointer,
        mStep: cute.Pointer,
        mHeader: cute.Pointer,
        mError: cute.Pointer,
        latent_offset: Int64,
        lse_offset: Int64,
        batch: Int32,
        heads: Int32,
        dcp: Int32,
        chunk: Int32,
        tile: Int32,
        split: Int32,
        flags: Int32,
    ):
        self.kernel(
            mLatent, mLse, mStep, mHeader, mError, latent_offset, lse_offset, batch, heads,
            dcp, chunk, tile, split, flags,
        ).launch(grid=(1, 1, 1), block=(THREADS, 1, 1))  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mLatent: cute.Pointer,
        mLse: cute.Pointer,
        mStep: cute.Pointer,
        mHeader: cute.Pointer,
        mError: cute.Pointer,
        latent_offset: Int64,
        lse_offset: Int64,
        batch: Int32,
        heads: Int32,
        dcp: Int32,
        chunk: Int32,
        tile: Int32,
        split: Int32,
        flags: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        s, b, _ = cute.arch.block_idx()
        header = mHeader.toint()
        rank = ptx.load_global_i32(header + RANK_OFFSET)
        data = xptx.load_global_u64(header + Int64(rank) * 8)  # this device's data region
        timeout = xptx.load_global_u64(header + TIMEOUT_OFFSET)
        step = ptx.load_global_i32(mStep.toint())
        slot, flag = mailbox(step)
        h0 = s * chunk
        h_end = h0 + min(heads - h0, chunk)
        # Thread t < D * n waits for flag [slot, t / n, b, x0 + t % n]: the n decode CTAs (of
        # each source) whose tiles hold this chunk's gathered heads.
        first = (rank * heads + h0) // tile
        last = (rank * heads + h_end - 1) // tile
        n = (last - first + 1) * split
        source = tid // n
        late = Int32(0)
        if tid < dcp * n:
            x = first * split + tid % n
            at = ((slot * dcp + source) * batch + b) * flags + x
            late = xptx.poll_flag_sys(data + Int64(at) * 4, flag, timeout)
        if xptx.sync_threads_or(late) == 0:
            partials = (data, latent_offset, lse_offset, slot * dcp, batch, heads, dcp)
            # The loops over the sources unrolled, so that their loads overlap: by 4 where D
            # is a multiple of 4, else by 2 (D = 2 through a by-4 loop's remainder is slower).
            if dcp % 4 == 0:
                for h in cutlass.range(h0 + tid // ROW_UNITS, h_end, HEADS_PER_PASS, unroll=1):
                    self.merge_head(mLatent, mLse, partials, b, h, tid % ROW_UNITS, 4)
            else:
                for h in cutlass.range(h0 + tid // ROW_UNITS, h_end, HEADS_PER_PASS, unroll=1):
                    self.merge_head(mLatent, mLse, partials, b, h, tid % ROW_UNITS, 2)
            if (tid | b | s) == 0:
                xptx.store_global_u32(header + LAST_STEP_OFFSET, step)
                xptx.store_global_u32(header + HAS_LAST_OFFSET, 1)
        else:
            units = (h_end - h0) * ROW_UNITS
            rows = mLatent.toint() + Int64(b * heads + h0) * (ROW_UNITS * 16)
            for u in cutlass.range(tid, units, THREADS, unroll=1):
                xptx.store_global_splat_v4(rows + Int64(u) * 16, NAN_BF16X2)
            for h in cutlass.range(h0 + tid, h_end, THREADS, unroll=1):
                xptx.store_global_u32(mLse.toint() + Int64(b * heads + h) * 4, NAN_F32)
            if late != 0:
                xptx.record_error(header, mError.toint(), TIMEOUT_PARTIALS, step, b, source)

    @cute.jit
    def merge_head(self, mLatent, mLse, partials, b, h, unit, unroll: cutlass.Constexpr[int]):
        """Head h of row b, 16-byte unit ``unit`` of its row (and its LSE, unit 0): the
        sources' partials weighted by exp(lse - top), top the largest LSE (0 if all -inf);
        the loops over the sources unrolled by ``unroll``."""
        data, latent_offset, lse_offset, first_source, batch, heads, dcp = partials
        neg_inf = Float32(-math.inf)
        top = neg_inf
        for k in cutlass.range(dcp, unroll=unroll):
            at = ((first_source + k) * batch + b) * heads + h
            top = xptx.max_nan(top, xptx.load_global_cg_f32(data + lse_offset + Int64(at) * 4))
        top = ptx.where(top == neg_inf, 0.0, top)
        total = Float32(0.0)
        acc = cute.make_rmem_tensor((8,), Float32)
        acc.fill(0.0)
        for k in cutlass.range(dcp, unroll=unroll):
            at = ((first_source + k) * batch + b) * heads + h
            lse = xptx.load_global_cg_f32(data + lse_offset + Int64(at) * 4)
            weight = xptx.exp2_approx(xptx.scaled_difference(lse, top, LOG2_E))
            total = xptx.add_rn(total, weight)
            row = data + latent_offset + Int64(at) * (ROW_UNITS * 16) + unit * 16
            words = xptx.load_global_cg_v4(row)
            for e in cutlass.range_constexpr(4):
                low, high = xptx.bf16_pair_to_f32(words[e])
                acc[2 * e] = xptx.fma_rn(weight, low, acc[2 * e])
                acc[2 * e + 1] = xptx.fma_rn(weight, high, acc[2 * e + 1])
        # A head with no keys anywhere (total 0): zeros and -inf.
        empty = total == 0.0
        divisor = ptx.where(empty, 1.0, total)
        # One division per thread, not eight (a second rounding, within the merge's bound).
        inverse = xptx.div_rn(Float32(1.0), divisor)
        words = []
        for e in cutlass.range_constexpr(4):
            low = ptx.where(empty, 0.0, acc[2 * e] * inverse)
            high = ptx.where(empty, 0.0, acc[2 * e + 1] * inverse)
            words.append(ptx.bf16x2(low, high))
        row_out = mLatent.toint() + Int64(b * heads + h) * (ROW_UNITS * 16) + unit * 16
        ptx.store_global_v4(row_out, words)
        if unit == 0:
            lse = xptx.fma_rn(xptx.log2_approx(divisor), LN_2, top)
            ptx.store_global_f32(
                mLse.toint() + Int64(b * heads + h) * 4, ptx.where(empty, neg_inf, lse)
            )


class DcpGather:
    """The queries' exchange before the decode (ABI: config.GATHER_PARAMS)."""

    @cute.jit
    def __call__(
        self,
        mOut: cute.Pointer,
        mQueries: cute.Pointer,
        mRank: cute.Pointer,
        mStep: cute.Pointer,
        mHeader: cute.Pointer,
        mError: cute.Pointer,
        flags_offset: Int64,
        rows_offset: Int64,
        batch: Int32,
        heads: Int32,
        dcp: Int32,
        padded: Int32,
    ):
        self.kernel(
            mOut, mQueries, mRank, mStep, mHeader, mError, flags_offset, rows_offset, batch,
            heads, dcp, padded,
        ).launch(grid=(1, 1, 1), block=(THREADS, 1, 1))  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mOut: cute.Pointer,
        mQueries: cute.Pointer,
        mRank: cute.Pointer,
        mStep: cute.Pointer,
        mHeader: cute.Pointer,
        mError: cute.Pointer,
        flags_offset: Int64,
        rows_offset: Int64,
        batch: Int32,
        heads: Int32,
        dcp: Int32,
        padded: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        c, b, _ = cute.arch.block_idx()
        chunks, _, _ = cute.arch.grid_dim()
        header = mHeader.toint()
        rank = ptx.load_global_i32(mRank.toint())
        step = ptx.load_global_i32(mStep.toint())
        data = xptx.load_global_u64(header + Int64(rank) * 8)  # this device's data region
        timeout = xptx.load_global_u64(header + TIMEOUT_OFFSET)
        slot, flag = mailbox(step)
        units = heads * QUERY_UNITS  # 16-byte units of a rank's heads of a row
        u = c * THREADS + tid  # this thread's unit
        out_row = mOut.toint() + Int64(b * padded) * QUERY_ROW
        mine = (slot * dcp + rank) * batch + b
        # Unit u of slot ``mine`` and flag [slot, rank, b, c], as offsets into any data region.
        slot_unit = rows_offset + Int64(mine * heads) * QUERY_ROW + Int64(u) * 16
        flag_at = flags_offset + Int64(mine * chunks + c) * 4
        # Unit u of this rank's heads of row b: into the output and into every peer's slot.
        # The loops over the peers are unrolled (by 4 where D is a multiple of 4, else 2, as
        # the merge's), so that their loads overlap.
        if u < units:
            own = mQueries.toint() + Int64(b * heads) * QUERY_ROW + Int64(u) * 16
            words = xptx.load_global_nc_v4(own)
            ptx.store_global_v4(out_row + Int64(rank * units + u) * 16, words)
            if dcp % 4 == 0:
                self.push_unit(words, header, slot_unit, rank, dcp, 4)
            else:
                self.push_unit(words, header, slot_unit, rank, dcp, 2)
        # Heads D * H .. Hp of row b (the decode's padding): zeros, spread over the row's CTAs.
        pad_units = (padded - dcp * heads) * QUERY_UNITS
        for z in cutlass.range(u, pad_units, chunks * THREADS, unroll=1):
            xptx.store_global_splat_v4(out_row + Int64(dcp * units + z) * 16, 0)
        # Every thread's stores, then thread p < D (p != rank) releases flag [slot, rank, b, c]
        # in peer p's mailbox (the D - 1 system-scope releases at once, not one after another;
        # each covers the whole CTA's stores: release is cumulative) and waits for flag
        # [slot, p, b, c] of this device.
        cute.arch.sync_threads()
        late = Int32(0)
        if (tid < dcp) & (tid != rank):
            region = xptx.load_global_u64(header + Int64(tid) * 8)
            ptx.release_flag_sys(region + flag_at, flag)
            at = ((slot * dcp + tid) * batch + b) * chunks + c
            late = xptx.poll_flag_sys(data + flags_offset + Int64(at) * 4, flag, timeout)
        failed = xptx.sync_threads_or(late)
        # Unit u of every peer's heads of row b, from this device's slots, into the output
        # (NaN bytes, E4M3's 0x7F, for all of them on a timeout).
        if u < units:
            theirs = (slot * dcp * batch + b) * heads  # source 0's row b in this slot
            first = data + rows_offset + Int64(theirs) * QUERY_ROW + Int64(u) * 16
            out_unit = out_row + Int64(u) * 16
            if failed != 0:
                for source in cutlass.range(dcp, unroll=1):
                    if source != rank:
                        dst = out_unit + Int64(source * units) * 16
                        xptx.store_global_splat_v4(dst, NAN_E4M3X4)
            elif dcp % 4 == 0:
                self.copy_peers(out_unit, first, batch * heads, units, rank, dcp, 4)
            else:
                self.copy_peers(out_unit, first, batch * heads, units, rank, dcp, 2)
        if late != 0:
            xptx.record_error(header, mError.toint(), TIMEOUT_QUERIES, step, b, tid)

    @cute.jit
    def push_unit(self, words, header, slot_unit, rank, dcp, unroll: cutlass.Constexpr[int]):
        """16 bytes of this rank's queries into the same place (``slot_unit``, an offset) of
        every peer's data region; the loop over the peers unrolled by ``unroll``."""
        for peer in cutlass.range(dcp, unroll=unroll):
            if peer != rank:
                region = xptx.load_global_u64(header + Int64(peer) * 8)
                ptx.store_global_v4(region + slot_unit, words)

    @cute.jit
    def copy_peers(
        self, out_unit, first, source_stride, units, rank, dcp, unroll: cutlass.Constexpr[int]
    ):
        """Unit u of every peer's heads of the row into the output: source s's from
        ``first`` + s * ``source_stride`` query rows, to ``out_unit`` + s * ``units`` units;
        the loop over the sources unrolled by ``unroll``."""
        for source in cutlass.range(dcp, unroll=unroll):
            if source != rank:
                src = first + Int64(source * source_stride) * QUERY_ROW
                dst = out_unit + Int64(source * units) * 16
                ptx.store_global_v4(dst, xptx.load_global_cg_v4(src))
