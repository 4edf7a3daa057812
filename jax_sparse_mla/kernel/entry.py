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
    def exchange_queries(
        self,
        mQ,
        mExchange,
        mRank,
        mStep,
        heads,
        dcp,
        heads_own,
        query_offset,
        query_flags_offset,
        b,
        sLate,
        x,
        part,
        first_head,
        tile_heads: int,
        tid,
    ):
        """Where row b's query heads first_head .. first_head + tile_heads (shared by the
        tile's ``split`` CTAs x - part ..) are read from, after their exchange.

        Returns (ok, own, mailbox, lo, hi): 16-byte piece f (of the tile's tile_heads * 36,
        head by head) lies at (own if lo <= f < hi else mailbox) + 16 f. Without an exchange
        all of q [B, Hp, ROW] (own). With one, this rank's heads from q [B, H_own, ROW] (own)
        and the others' from this device's query rows of the slot ([2][B][Hp][ROW] at
        query_offset in the data region), where the other ranks' decodes pushed them: first
        this CTA's share of this rank's heads among the tile's is stored into the slot's query
        rows of every other rank and flag [slot, rank, b, x] released there (one system-scope
        release per rank, thread p for rank p, at once; release is cumulative over the CTA's
        stores), while flags [slot, s, b, x - part .. x - part + split) here are acquire-polled
        (by threads of warp 1 on) for every other rank s whose heads the tile holds, bounded by
        the header's timeout.
        ok is 1 when they all arrived (always without an exchange), else 0 with the error
        (TIMEOUT_QUERIES, step, b, s) recorded. A padded head past the D ranks' reads the
        mailbox (its result is never kept).

        Only the push exchange's cubins (``KernelConfig.exchange``) call this; all the CTA's
        threads take part. ``sLate``, a shared u32, ends as 1 - ok until the CTA writes it
        again: it is the CTA-wide OR of the timeouts (bar.red.or here faulted with an illegal
        address in cluster-mma, session 40, though every sanitizer passed)."""
        if tid == 0:
            ptx.store_shared_u32(sLate, 0)
        ok = Int32(1)
        own = mQ.toint() + Int64(b * heads + first_head) * ROW
        mailbox = own
        lo = Int32(0)
        hi = Int32(tile_heads * QUERY_UNITS)
        header = mExchange.toint()
        if header != 0:
            rank = ptx.load_global_i32(mRank.toint())
            step = ptx.load_global_i32(mStep.toint())
            slot, flag = slot_and_flag(step)
            width, batch, _ = cute.arch.grid_dim()
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
            if dcp > 1:  # a group of one (tests, bench_dcp --loopback) has no one to wait for
                threads = self.config.block[0]
                units = min(tile_heads * QUERY_UNITS, hi) - max(lo, Int32(0))
                units = max(units, Int32(0))
                share = (units + self.split - 1) // self.split
                start = max(lo, Int32(0)) + part * share  # this CTA's pieces: start ..
                end = max(lo, Int32(0)) + min(units, (part + 1) * share)
                for f in cutlass.range(start + tid, end, threads, unroll=1):
                    words = ptx.load_global_v4(own + Int64(f) * 16)
                    for peer in cutlass.range(dcp, unroll=1):
                        if peer != rank:
                            to = xptx.load_global_u64(header + Int64(peer) * 8)
                            ptx.store_global_v4(to + row_at + Int64(f) * 16, words)
                cute.arch.sync_threads()
                if (units > 0) & (tid < dcp) & (tid != rank):
                    to = xptx.load_global_u64(header + Int64(tid) * 8)
                    at = ((slot * dcp + rank) * Int32(batch) + b) * Int32(width) + x
                    ptx.release_flag_sys(to + Int64(query_flags_offset) + Int64(at) * 4, flag)
                real = dcp * heads_own
                first_source = first_head // heads_own
                last_source = (min(first_head + tile_heads, real) - 1) // heads_own
                # Polled from warp 1 on: warp 0's releases wait for a system-scope fence.
                poller = tid - 32
                source = first_source + poller // self.split
                late = Int32(0)
                if (poller >= 0) & (source <= last_source) & (source != rank):
                    at = ((slot * dcp + source) * Int32(batch) + b) * Int32(width) + x - part
                    at = at + poller % self.split
                    flag_at = region + Int64(query_flags_offset) + Int64(at) * 4
                    timeout = xptx.load_global_u64(header + HEADER_TIMEOUT)
                    late = xptx.poll_flag_sys(flag_at, flag, timeout)
                if late != 0:
                    ptx.store_shared_u32(sLate, 1)
                    ptx.record_failure(header, TIMEOUT_QUERIES, step, b, source)
                cute.arch.sync_threads()
                ok = 1 - ptx.load_shared_u32(sLate)
        return ok, own, mailbox, lo, hi

    def destination(
        self, mLatent, mLse, mExchange, mRank, mStep, dcp, heads_own, latent_offset, lse_offset,
        b, queries_ok,
    ) -> Destination:  # fmt: skip
        """Row b's Destination. With an exchange it also checks the call against the
        mailbox header: a rank other than dcp_setup's, or the previous exchange's step parity
        (its slot may still be merged), pushes nothing (``ok`` false; see finish_push); so
        does a CTA whose peers' query heads did not arrive (``queries_ok`` 0: its error is
        recorded already, see exchange_queries)."""
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
