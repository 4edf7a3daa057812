"""The compile-time entry shared by the decode kernels: the cubin ABI (PARAMS in config.py).

The FFI handler launches the compiled cubin with the grid of each call's shapes; the launch
here only serves compilation (it fixes the block, cluster and shared memory of the config).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from jax_sparse_mla.kernel import ptx
from jax_sparse_mla.kernel.config import (
    HEADER_HAS_LAST,
    HEADER_LAST_STEP,
    HEADER_OWN_DATA,
    HEADER_RANK,
    HEADER_TIMEOUT,
    LATENT,
    LN2,
    ROW,
    KernelConfig,
)
from jax_sparse_mla.kernel.exchange import ptx as xptx
from jax_sparse_mla.kernel.exchange.config import TIMEOUT_QUERIES, slot_and_flag

# Error codes of the exchange's record (ffi/dcp_exchange.cc).
REPEATED_PARITY = 2
WRONG_RANK = 3
QUERY_UNITS = ROW // 16  # 16-byte units of a query head
# Global tokens one pass of the push cubins' compaction covers (DSA's top-k: one pass there).
COMPACT_PASS = 2048


class Destination:
    """Where a CTA's results go, from the ABI's output and exchange parameters (runtime
    values, built by ``DecodeKernel.destination``): latent / lse, or with an exchange the
    owners' mailboxes (slot step & 1, row index ((slot * D + rank) * B + b) * H_own + h)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


class DecodeKernel:
    """Base of a kernel variant: subclasses define ``kernel`` with the ABI's parameters."""

    def __init__(self, config: KernelConfig):
        self.config = config
        self.split = config.split
        # Bytes between a CTA's row indices: its interleaved share of rows[b], or the push
        # cubins' list of them (compact_tokens).
        self.row_step = 4 if config.exchange else 4 * config.split

    def merge_layout(self, tile_heads: int, stats_in_blocks: bool = False) -> None:
        """The cluster merge's sizes for ``tile_heads`` heads per cluster: ``cols`` latent
        columns per CTA, ``block`` bytes of one F16 partial block (an owner's columns),
        ``stride`` bytes between blocks (``stats_in_blocks``: each block followed by the
        sender's (max, sum) per head, [tile_heads, 2] f32, so that one bulk copy carries
        both; else the stats travel apart, ``push_stats``), and ``inbound_bytes`` each CTA
        receives (its columns of every peer's block, its own stays in its outbox, and every
        source's stats)."""
        self.cols = LATENT // self.split
        self.block = tile_heads * self.cols * 2
        self.stats_in_blocks = stats_in_blocks
        self.stride = self.block + (tile_heads * 8 if stats_in_blocks else 0)
        self.inbound_bytes = (self.split - 1) * self.stride + (
            0 if stats_in_blocks else self.split * 2 * tile_heads * 4
        )

    @cute.jit
    def __call__(
        self,
        mQ: cute.Pointer,
        mKV: cute.Pointer,
        mRows: cute.Pointer,
        mValid: cute.Pointer,
        mScales: cute.Pointer,
        mLatent: cute.Pointer,
        mLse: cute.Pointer,
        n_rows: Int32,
        width: Int32,
        heads: Int32,
        row_bytes: Int32,
        mExchange: cute.Pointer,
        mRank: cute.Pointer,
        mStep: cute.Pointer,
        dcp: Int32,
        heads_own: Int32,
        latent_offset: Int32,
        lse_offset: Int32,
        query_offset: Int32,
        query_flags_offset: Int32,
    ):
        config = self.config
        tiles = (heads + config.head_tile - 1) // config.head_tile
        self.kernel(
            mQ,
            mKV,
            mRows,
            mValid,
            mScales,
            mLatent,
            mLse,
            n_rows,
            width,
            heads,
            row_bytes,
            mExchange,
            mRank,
            mStep,
            dcp,
            heads_own,
            latent_offset,
            lse_offset,
            query_offset,
            query_flags_offset,
        ).launch(
            grid=(tiles * config.split, 1, 1),
            block=config.block,
            cluster=config.cluster,
            smem=config.smem_bytes,
            use_pdl=True,
        )

    @cute.jit
    def push_stats(self, sStats, inbound, part, head, tile_heads: int, maximum, total, rank_base=0):
        """This CTA's (max, sum) of ``head`` into every cluster CTA's stats
        ([split, 2, tile_heads] f32, slot ``part``): st.async on each receiver's inbound
        barrier, for the cluster merge."""
        m_dst = sStats + ((part * 2 + 0) * tile_heads + head) * 4
        l_dst = sStats + ((part * 2 + 1) * tile_heads + head) * 4
        for peer in cutlass.range_constexpr(self.split):
            rank = rank_base + peer
            peer_inbound = ptx.map_peer(inbound, rank)
            ptx.push_f32(ptx.map_peer(m_dst, rank), maximum, peer_inbound)
            ptx.push_f32(ptx.map_peer(l_dst, rank), total, peer_inbound)

    @cute.jit
    def send_blocks(self, sOutbox, sInbox, inbound, part):
        """Outbox block r into slot ``part`` of peer r's inbox, one bulk copy each (block
        ``part`` stays), completing on the peer's inbound barrier; one thread issues them."""
        for step in cutlass.range_constexpr(1, self.split):
            peer = (part + step) % self.split
            ptx.copy_s2c(
                ptx.map_peer(sInbox + part * self.stride, peer),
                sOutbox + peer * self.stride,
                self.stride,
                ptx.map_peer(inbound, peer),
            )

    def piece_at(self, region, block, head, column):
        """Address of the 16-byte piece holding ``column`` (of a block's ``self.cols``) of
        ``head`` in block ``block`` of an outbox or inbox ([split, tile heads, cols] F16;
        the pieces of a head row XOR-swizzled by head % 8 and ``piece_flip`` against bank
        conflicts; blocks ``self.stride`` bytes apart)."""
        piece = (column // 8) ^ (head % 8) ^ self.piece_flip(head)
        return region + block * self.stride + head * (self.cols * 2) + piece * 16

    def piece_flip(self, head):
        """A variant's further XOR of a head row's piece indices: none here."""
        return 0

    def stats_at(self, region, block, head):
        """Address of ``head``'s (max, sum) f32 pair after block ``block`` of an outbox or
        inbox (``stats_in_blocks``)."""
        return region + block * self.stride + self.block + head * 8

    @cute.jit
    def normaliser(self, out_scale, total):
        """(nonempty, out_scale / total) of a row's sum; a row without live keys gets 0.
        != rather than >: a NaN total (a NaN logit) must poison the LSE, not empty the row.
        1 / total as rcp.approx and one Newton step (within an ulp of the division): the
        IEEE division sat on the merge tail's chain (session 28: 0.08-0.12 us per launch at
        the latency shapes)."""
        nonempty = total != Float32(0.0)
        inverse = cute.arch.rcp_approx(total)
        inverse = inverse * (Float32(2.0) - total * inverse)
        return nonempty, ptx.where(nonempty, out_scale * inverse, 0.0)

    @cute.jit
    def log2_lse(self, nonempty, top, total):
        """A row's LSE in log2 units (``top``: its max, ``total``: its sum at that max); -inf
        for a row without live keys (store_lse writes it)."""
        return ptx.where(nonempty, top + cute.math.log2(total, fastmath=False), -math.inf)

    @cute.jit
    def store_lse(self, address, lse2):
        """The natural-log LSE at ``address`` from its log2-unit ``lse2``."""
        ptx.store_global_f32(address, lse2 * Float32(LN2))

    @cute.jit
    def compact_tokens(
        self, mTokens, mScratch, mRank, dcp, width, b, x, part, sCounts, sHead, head: int, tid
    ):
        """This rank's keys of row b, from the row's global top-k tokens (the push cubins take
        them in place of ``local_rows``' rows and valid): token t >= 0 with t % dcp == rank is
        local row t // dcp (vLLM's interleaved layout), the others are not this rank's. In
        token order they are the row's keys 0 .. n - 1, and key part + split j, this CTA's
        j-th, goes to entry j of the CTA's list: the keys and their order of ``local_rows`` +
        the plain decode. Entries j < ``head`` (the first chunks', read at once) go to
        ``sHead`` (i32, shared: no round trip through memory on the prologue's critical
        path), the others to the scratch [B, grid x, ceil(width / split)] i32 at (b, x).

        Passes of COMPACT_PASS tokens, each thread a run of them: ballots of the runs' tokens
        and a sum of the warps' counts (``sCounts``: 2 x warps u32, alternating) give each
        token its key. Every warp issues all of it, so it is written for few instructions (a
        shuffle scan and divisions took ~1 us per launch: ~330 instructions x 4 warps per
        scheduler, session 43). All threads take part; ends with a CTA barrier (the list's
        entries are read by other threads). Returns (n, the address of the list in the
        scratch)."""
        threads = self.config.block[0]
        warps = threads // 32
        each = -(-COMPACT_PASS // threads)
        lane, warp = tid % 32, tid // 32
        rank = ptx.load_global_i32(mRank.toint())
        columns, _, _ = cute.arch.grid_dim()
        entries = (width + self.split - 1) // self.split
        listed = mScratch.toint() + (Int64(b) * Int32(columns) + x) * entries * 4
        tokens_at = mTokens.toint() + Int64(b) * width * 4
        shift = self.split.bit_length() - 1  # split is a power of two
        # t // dcp as mul.hi(t, floor((2**32 - 1) / dcp)), low by at most 1 for t < 2**32,
        # then one correction (div.u32 per token: ~10 instructions and a reciprocal per pass).
        magic = ptx.div_u32(Int32(-1), dcp)
        rows = cute.make_rmem_tensor((each,), Int32)
        ballots = cute.make_rmem_tensor((each,), Int32)
        lanes_below = Int32(cute.arch.lanemask_lt())
        n = Int32(0)
        parity = Int32(0)
        for start in cutlass.range(0, width, threads * each, unroll=1):
            first = start + tid * each
            run_at = tokens_at + Int64(first) * 4  # the run's loads at immediate offsets
            below = Int32(0)  # this warp's tokens of this rank before this thread's run
            for e in cutlass.range_constexpr(each):
                inside = first + e < width
                token = ptx.load_global_i32_if(inside, run_at + 4 * e)
                position = ptx.mul_hi_u32(token, magic)
                low = token - position * dcp
                over = low >= dcp  # signed: 0 <= low < 2 dcp for a token >= 0
                ours = inside & (token >= 0) & (low - ptx.where_i32(over, dcp, 0) == rank)
                rows[e] = ptx.where_i32(ours, position + Int32(over), -1)
                ballots[e] = cute.arch.vote_ballot_sync(ours)
                below = below + cute.arch.popc(ballots[e] & lanes_below)
            counts = sCounts + parity * (warps * 4)
            if lane == 0:
                in_warp = Int32(0)
                for e in cutlass.range_constexpr(each):
                    in_warp = in_warp + cute.arch.popc(ballots[e])
                ptx.store_shared_u32(counts + warp * 4, in_warp)
            cute.arch.sync_threads()
            # Lane l holds warp l's count: the warps before this one, and all of them.
            total = ptx.where_i32(lane < warps, ptx.load_shared_u32(counts + lane % warps * 4), 0)
            key = n + cute.arch.warp_redux_sync(ptx.where_i32(lane < warp, total, 0), "add")
            key = key + below
            n = n + cute.arch.warp_redux_sync(total, "add")
            for e in cutlass.range_constexpr(each):
                row = rows[e]
                take = (row >= 0) & ((key & (self.split - 1)) == part)
                j = key >> shift
                if take & (j < head):
                    ptx.store_shared_u32(sHead + j * 4, row)
                if take & (j >= head):
                    ptx.store_global_b32(listed + Int64(j) * 4, row)
                key = key + Int32(row >= 0)
            parity = 1 - parity
        cute.arch.sync_threads()
        return n, listed

    @cute.jit
    def send_queries(
        self, mQ, mExchange, mRank, mStep, heads, dcp, heads_own, query_offset, b, sLate, part,
        first_head, tile_heads: int, tid,
    ):  # fmt: skip
        """The query heads' exchange, first half: where row b's query heads first_head ..
        first_head + tile_heads (shared by the tile's ``split`` CTAs) are read from once
        exchanged, and this CTA's share of this rank's heads among them stored into the slot's
        query rows of every other rank (plain stores; await_queries releases them after a CTA
        barrier, so that they drain meanwhile: the push cubins compact their tokens between).

        Returns (own, mailbox, lo, hi, units): 16-byte piece f (of the tile's tile_heads * 36,
        head by head) lies at (own if lo <= f < hi else mailbox) + 16 f, ``units`` this rank's
        pieces in the tile. Without an exchange all of q [B, Hp, ROW] (own). With one, this
        rank's heads from q [B, H_own, ROW] (own) and the others' from this device's query
        rows of the slot ([2][B][Hp][ROW] at query_offset in the data region), where the other
        ranks' decodes push them. A padded head past the D ranks' reads the mailbox (its
        result is never kept).

        Only the push exchange's cubins (``KernelConfig.exchange``) call this; all the CTA's
        threads take part. ``sLate``, a shared u32, is set to 0 here (await_queries' OR of the
        timeouts)."""
        if tid == 0:
            ptx.store_shared_u32(sLate, 0)
        own = mQ.toint() + Int64(b * heads + first_head) * ROW
        mailbox = own
        lo = Int32(0)
        hi = Int32(tile_heads * QUERY_UNITS)
        units = Int32(0)
        header = mExchange.toint()
        if header != 0:
            rank = ptx.load_global_i32(mRank.toint())
            step = ptx.load_global_i32(mStep.toint())
            slot, _ = slot_and_flag(step)
            _, batch, _ = cute.arch.grid_dim()
            region = xptx.load_global_u64(header + HEADER_OWN_DATA)  # not after the rank's
            own_first = rank * heads_own
            # Offset (in any rank's data region) of the tile's first head of row b in the slot.
            row_at = (
                Int64(query_offset) + (Int64(slot * Int32(batch) + b) * heads + first_head) * ROW
            )
            own = mQ.toint() + Int64(b * heads_own - own_first + first_head) * ROW
            mailbox = region + row_at
            lo = (own_first - first_head) * QUERY_UNITS
            hi = lo + heads_own * QUERY_UNITS
            units = max(min(tile_heads * QUERY_UNITS, hi) - max(lo, Int32(0)), Int32(0))
            if dcp > 1:  # a group of one (tests, bench_dcp --loopback) has no one to wait for
                threads = self.config.block[0]
                share = (units + self.split - 1) // self.split
                start = max(lo, Int32(0)) + part * share  # this CTA's pieces: start ..
                end = max(lo, Int32(0)) + min(units, (part + 1) * share)
                for f in cutlass.range(start + tid, end, threads, unroll=1):
                    words = ptx.load_global_v4(own + Int64(f) * 16)
                    for peer in cutlass.range(dcp, unroll=1):
                        if peer != rank:
                            to = xptx.load_global_u64(header + Int64(peer) * 8)
                            ptx.store_global_v4(to + row_at + Int64(f) * 16, words)
        return own, mailbox, lo, hi, units

    @cute.jit
    def await_queries(
        self, mExchange, mRank, mStep, dcp, heads_own, query_flags_offset, b, sLate, x, part,
        first_head, tile_heads: int, units, tid,
    ):  # fmt: skip
        """The query heads' exchange, second half, after a CTA barrier behind send_queries'
        stores: flag [slot, rank, b, x] released in every other rank's mailbox (one
        system-scope release per rank, threads of the last warp, at once; release is
        cumulative over the CTA's stores), while flags [slot, s, b, x - part .. x - part +
        split) here are acquire-polled (by threads of warp 0 on) for every other rank s whose
        heads the tile holds, bounded by the header's timeout. Returns ok: 1 when they all
        arrived (always without an exchange), else 0 with the error (TIMEOUT_QUERIES, step, b,
        s) recorded. All threads take part; with an exchange of D > 1 it ends with a CTA
        barrier. (bar.red.or for the CTA-wide OR of the timeouts
        faulted with an illegal address in cluster-mma, session 40, though every sanitizer
        passed: hence ``sLate``.)"""
        ok = Int32(1)
        header = mExchange.toint()
        if (header != 0) & (dcp > 1):
            rank = ptx.load_global_i32(mRank.toint())
            step = ptx.load_global_i32(mStep.toint())
            slot, flag = slot_and_flag(step)
            width, batch, _ = cute.arch.grid_dim()
            region = xptx.load_global_u64(header + HEADER_OWN_DATA)
            threads = self.config.block[0]
            # Released by the last warp: warp 0's gather slots must not wait for the fence.
            releaser = tid - (threads - 32)
            if (units > 0) & (releaser >= 0) & (releaser < dcp) & (releaser != rank):
                to = xptx.load_global_u64(header + Int64(releaser) * 8)
                at = ((slot * dcp + rank) * Int32(batch) + b) * Int32(width) + x
                ptx.release_flag_sys(to + Int64(query_flags_offset) + Int64(at) * 4, flag)
            real = dcp * heads_own
            first_source = first_head // heads_own
            last_source = (min(first_head + tile_heads, real) - 1) // heads_own
            source = first_source + tid // self.split
            late = Int32(0)
            if (source <= last_source) & (source != rank):
                at = ((slot * dcp + source) * Int32(batch) + b) * Int32(width) + x - part
                at = at + tid % self.split
                flag_at = region + Int64(query_flags_offset) + Int64(at) * 4
                timeout = xptx.load_global_u64(header + HEADER_TIMEOUT)
                late = xptx.poll_flag_sys(flag_at, flag, timeout)
            if late != 0:
                ptx.store_shared_u32(sLate, 1)
                ptx.record_failure(header, TIMEOUT_QUERIES, step, b, source)
            cute.arch.sync_threads()
            ok = 1 - ptx.load_shared_u32(sLate)
        return ok

    def destination(
        self, mLatent, mLse, mExchange, mRank, mStep, dcp, heads_own, latent_offset, lse_offset,
        b, queries_ok,
    ) -> Destination:  # fmt: skip
        """Row b's Destination. With an exchange it also checks the call against the
        mailbox header: a rank other than dcp_setup's, or the previous exchange's step parity
        (its slot may still be merged), pushes nothing (``ok`` false; see finish_push); so
        does a CTA whose peers' query heads did not arrive (``queries_ok`` 0: its error is
        recorded already, see await_queries)."""
        header = mExchange.toint()
        push = header != 0
        rank = ptx.load_global_i32_if(push, mRank.toint())
        step = ptx.load_global_i32_if(push, mStep.toint())
        own_rank = ptx.load_global_i32_if(push, header + HEADER_RANK)
        has_last = ptx.load_global_i32_if(push, header + HEADER_HAS_LAST)
        last_step = ptx.load_global_i32_if(push, header + HEADER_LAST_STEP)
        alternated = (has_last == 0) | (((last_step ^ step) & 1) != 0)
        # exchange.config.slot_and_flag, spelled out here: through the helper, ptxas scheduled
        # the plain cluster-mma s2 / s4 / s8 cubins differently (session 41); these keep them.
        slot = step & 1
        _, batch, _ = cute.arch.grid_dim()
        return Destination(
            push=push,
            plain=header == 0,
            ok=(rank == own_rank) & alternated & (queries_ok != 0),
            unrecorded=queries_ok != 0,  # a query timeout is recorded already
            error=ptx.where_i32(rank != own_rank, WRONG_RANK, REPEATED_PARITY),
            header=header,
            rank=rank,
            step=step,
            flag=(step & 0x7FFFFFFF) + 1,  # never 0, the cleared value
            dcp=dcp,
            heads_own=heads_own,
            b=b,
            row_index=(slot * dcp + rank) * Int32(batch) + b,
            latent=ptx.where_i64(push, Int64(latent_offset), mLatent.toint()),
            lse=ptx.where_i64(push, Int64(lse_offset), mLse.toint()),
        )

    def row_target(self, dest: Destination, head):
        """(latent row address, LSE address, keep) of ``head`` (of the Hp) of the CTA's row:
        keep is false for a padded head past the D ranks' heads or a refused exchange."""
        owner = head // dest.heads_own
        index = Int64(dest.row_index) * dest.heads_own + (head - owner * dest.heads_own)
        region = ptx.load_global_u64_if(dest.push, dest.header + Int64(owner) * 8)  # 0 without
        latent = region + dest.latent + index * (LATENT * 2)
        lse = region + dest.lse + index * 4
        keep = dest.plain | (dest.ok & (owner < dest.dcp))
        return latent, lse, keep

    @cute.jit
    def finish_push(self, dest: Destination, x, tile, tile_heads: int, tid):
        """With an exchange, after every result store of the CTA: one system-scope release of
        this CTA's flag (value step + 1, index [slot, rank, b, x]) in the mailbox of each
        owner of the tile's heads, thread i for the tile's i-th owner (the releases at once,
        not one after another; each covers the CTA's stores: release is cumulative); the
        owners' merge acquires them. A refused call releases nothing (the owners time out)
        and records why."""
        if dest.push:
            cute.arch.sync_threads()  # every thread's stores (bulk copies waited for)
            if dest.ok:
                width, _, _ = cute.arch.grid_dim()
                flag_at = (Int64(dest.row_index) * Int32(width) + x) * 4
                first = tile * tile_heads
                end = min(first + tile_heads, dest.dcp * dest.heads_own)
                owner = first // dest.heads_own + tid
                if owner <= (end - 1) // dest.heads_own:
                    region = ptx.load_global_u64_if(dest.push, dest.header + Int64(owner) * 8)
                    ptx.release_flag_sys(region + flag_at, dest.flag)
            elif (tid == 0) & (x == 0) & (dest.b == 0) & dest.unrecorded:
                ptx.record_failure(dest.header, dest.error, dest.step, 0, dest.rank)

    @cute.jit
    def merge_sources(self, sOutbox, sInbox, sStats, tile_heads: int, head, part, columns):
        """The cluster merge of ``head``'s 8-column pieces at ``columns`` (of this CTA's
        block) over the split sources: the common max, the sum of the weights (each
        source's sum x 2^(max - common max)) and the weighted sums of the sources'
        normalised F16 partials (8 per column piece, FP32). Source c's block is slot c of
        the inbox, this CTA's own (c = part) its outbox block ``part``; its stats follow the
        block (``stats_in_blocks``) or sit in sStats ([split, 2, tile_heads] f32)."""
        neg_inf = Float32(-math.inf)

        def source(c):
            return ptx.where_i32(c == part, sOutbox + (part - c) * self.stride, sInbox)

        maxima = [
            self.stats_at(source(c), c, head)
            if self.stats_in_blocks
            else sStats + (c * 2 * tile_heads + head) * 4
            for c in range(self.split)
        ]
        sum_offset = 4 if self.stats_in_blocks else tile_heads * 4
        top = neg_inf
        for c in cutlass.range_constexpr(self.split):
            top = cute.arch.fmax(top, ptx.load_shared_f32(maxima[c]))
        total = Float32(0.0)
        merged = cute.make_rmem_tensor((len(columns) * 8,), Float32)
        merged.fill(0.0)
        for c in cutlass.range_constexpr(self.split):
            maximum = ptx.load_shared_f32(maxima[c])
            partial_sum = ptx.load_shared_f32(maxima[c] + sum_offset)
            rise = cute.math.exp2(maximum - top, fastmath=True)
            # A source without live keys weighs 0 (a NaN sum still poisons the total).
            weight = ptx.where(maximum != neg_inf, rise, 0.0) * partial_sum
            total = total + weight
            for k in cutlass.range_constexpr(len(columns)):
                halves = ptx.load_shared_v4(self.piece_at(source(c), c, head, columns[k]))
                for e in cutlass.range_constexpr(4):
                    low, high = ptx.f16x2_to_f32(halves[e])
                    merged[8 * k + 2 * e] = merged[8 * k + 2 * e] + weight * low
                    merged[8 * k + 2 * e + 1] = merged[8 * k + 2 * e + 1] + weight * high
        return top, total, merged
