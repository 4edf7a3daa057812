"""Sparse MLA decode on warpgroup MMA (wgmma) for Hopper (sm_90a), in CuTe DSL.

The throughput variant: one CTA per (64 heads, row b) at split 1, three warpgroups with
different jobs and register budgets (setmaxnreg). Warpgroup 2, the producer, loads the cache
rows of chunk c + 1 (WG_KEYS keys; four threads per row, so that one warp's 16-byte loads
read 64 contiguous bytes of each of 8 rows) into registers and widens chunk c to F16 (exact:
E4M3 is a subset of F16) into one of WG_STAGES 128-byte-swizzled K-major tiles, as soon as
both consumers are done with the tile's previous chunk (per-stage mbarriers: "widened",
"consumed"). Warpgroup 0 computes S = Q K^T of chunk c for all 64 heads and keys (wgmma
m64n64k16 F16 -> FP32, both operands in shared memory, Q widened once and read once per
chunk), runs the online softmax over whole rows (log2 units, FP32) and writes P as F16 (448 at
the running max, as cluster-mma: P at 1 would leave keys below 2^-14 of the max to F16's
subnormals) and each head's rescale factor into shared memory (mbarriers "P ready" / "P free" with
warpgroup 1). Then warpgroup g < 2 accumulates O's latent columns 256 g .. 256 g + 255 over
the chunk's keys: wgmma m64n256k16, A = P, B = the F16 tile's first 512 columns read MN-major
(V). Dead keys (past the count, rows outside [0, n_rows)) get S = -inf and a zero row. An
earlier design let warpgroup 1 load and widen between its P V steps (two CTA barriers per
chunk): with no loads and no widening at all that kernel ran 63.1 us instead of 85.1 (B=64,
H=128, 2048 keys; BENCHMARKS, issue #28's E1), the room this split aims at. A first build
had both warpgroups widen and each compute S for 32 keys (m64n32, exchanging row maxima): Q
was read from shared memory twice per chunk and the widening stalled the warps that issue
the MMAs (115.7 us vs 105.9 for the two-warpgroup design, H200, same run).

Split > 1 (KernelConfig("wgmma", split)): a cluster of split CTAs per (64 heads, row b), CTA
``part`` taking keys part, part + split, ... of the row. After the chunk loop each CTA writes
its O / l as F16 into an outbox in its (now free) K tiles, one block of LATENT / split columns
per CTA of the cluster; a cluster barrier; one bulk copy (cp.async.bulk shared::cta ->
shared::cluster) per peer moves block r into peer r's inbox, and st.async its (max, sum) per
head (split 8: the stats follow each block, in the same copy), all completing on the receiver's
mbarrier. Each CTA then merges its columns over the split partials, weighted by sum x 2^(max -
common max), and writes them as BF16 (part 0 the LSE). F16 suffices for a normalised partial
(|O / l| <= max |V|; 11 mantissa bits before the BF16 output's 8), and halves the DSMEM
traffic: a first build pushed FP32 partials with 8-byte st.async and ran rank-full (B=5, H=128,
2048 keys, split 8) in 32.3 us; this one in 19.9. Pulling the peers' blocks by
ld.shared::cluster instead of pushing them was slower (rank-full 16.0 -> 17.5 us, session 34).

Why F16 and not FP8 wgmma for QK: Hopper's FP8 wgmma accumulates with reduced precision
(measured: LSE off by ~1e-3 against float64 at K = 2048, 50x the FP32 tolerance this package
holds every kernel to); F16 products of E4M3 values are exact and accumulate in FP32.

Same ABI as the cluster-mma variant (PARAMS in config.py): raw pointers and i32 sizes, the
batch as the grid's y extent, the padded heads Hp any multiple of 16 (grid x: ceil(Hp /
WG_HEADS) * split; the heads missing from a last partial tile are neither read nor written).
Nothing is read before griddepcontrol.wait (PDL). The push exchange's cubin
(``KernelConfig.exchange``) exchanges the tile's query heads first, as cluster-mma's does.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from jax_sparse_mla.kernel import ptx
from jax_sparse_mla.kernel.config import (
    LATENT,
    LOG2_P_SCALE,
    ROW,
    WG_ATOM,
    WG_BAR_OFFSET,
    WG_CONSUMERS,
    WG_F16_TILE,
    WG_HEADS,
    WG_INBOX_OFFSET,
    WG_K_OFFSET,
    WG_KEYS,
    WG_LIVE_OFFSET,
    WG_OUT_PITCH,
    WG_OUTBOX_OFFSET,
    WG_P_OFFSET,
    WG_Q_OFFSET,
    WG_QUERIES_LATE_OFFSET,
    WG_RED_OFFSET,
    WG_SMEM_BYTES,
    WG_STAGES,
    WG_STATS_OFFSET,
    WG_THREADS,
)
from jax_sparse_mla.kernel.entry import DecodeKernel

PIECES = ROW // 16  # 16-byte pieces of an FP8 row
K_STEPS = ROW // 16  # QK's k16 steps
WG_COLS = LATENT // 2  # latent columns per warpgroup
S_VALUES = WG_KEYS // 2  # S accumulators per thread of warpgroup 0 (m64n64)
LOADERS = WG_THREADS - WG_CONSUMERS  # warpgroup 2 loads and widens the cache rows
# Four loaders per cache row, each piece sub + 4 i (i < 9): one warp's load reads 64 bytes
# of 8 rows, two 32-byte sectors per L1 request, not 32 bytes of 16 rows (two loaders per
# row: the gather's L1 requests were a quarter of the chunk's time).
COPIERS = 4
ROW_KEYS = LOADERS // COPIERS  # keys loaded at once: a loader's keys are key, key + ROW_KEYS
KEYS_EACH = WG_KEYS // ROW_KEYS  # keys per loader and chunk
MINE = PIECES // COPIERS  # 16-byte pieces per loader and key
O_VALUES = WG_COLS // 2  # O accumulators per thread (m64n256)
ATOM_SPAN = WG_KEYS * WG_ATOM  # bytes between column atoms of a tile
SWIZZLE_128B = 1
# All three warpgroups past their loops, before they set their budgets back to the shared
# one: the PTX ISA asks a warpgroup's warps to synchronise between two setmaxnreg, and
# warpgroup 0's increase must come before 1's and 2's (with no chunks they could otherwise
# take their registers back first, and 0 would wait for them forever).
LOOPS_DONE = 3
# Registers per thread while the warpgroups run their loops (setmaxnreg; the launch gives each
# 65,536 / 384 -> 168 and the three sum to 3 x 168), and in the shared code after them.
S_REGISTERS, O_REGISTERS, LOAD_REGISTERS, SHARED_REGISTERS = 232, 160, 112, 168
assert S_REGISTERS + O_REGISTERS + LOAD_REGISTERS == 3 * SHARED_REGISTERS
assert LOADERS == 128 and WG_CONSUMERS == 256
assert PIECES == COPIERS * MINE and COPIERS * 16 == 64  # piece sub + 4 i: F16 atom i
assert WG_KEYS % ROW_KEYS == 0 and WG_HEADS * PIECES % WG_THREADS == 0


def f16_offset(row, column):
    """Offset of column ``column`` (a multiple of 8) of row ``row`` in an F16 tile of 64 rows,
    K-major with wgmma's 128-byte swizzle: atoms of 8 rows x 64 columns (128 bytes), their
    16-byte pieces XOR-swizzled by the row; column atoms ATOM_SPAN bytes apart."""
    piece = (column % 64) // 8
    return (
        (column // 64) * ATOM_SPAN
        + (row // 8) * (8 * WG_ATOM)
        + (row % 8) * WG_ATOM
        + (piece ^ (row % 8)) * 16
    )


def store_fragments(acc, inverse, pack, address, tid):
    """A consumer thread's O accumulators times ``inverse[r]`` (row r), packed in pairs by
    ``pack``, into shared memory by stmatrix: 16-byte pieces of head rows at ``address(head in
    tile, column)``. acc[4 g + 2 r + e]: head 16 warp + lane / 4 + 8 r, column 8 g + 2 quad +
    e. One stmatrix stores column groups g, g + 1 of rows r = 0, 1 (its tile i: g + i / 2, r =
    i % 2); lane 8 i + j addresses row j of tile i."""
    group = tid // 128
    warp, lane = (tid % 128) // 32, tid % 32
    tile_of_lane, row_of_lane = lane // 8, lane % 8
    head = 16 * warp + row_of_lane + 8 * (tile_of_lane % 2)
    for g in range(0, WG_COLS // 8, 2):
        words = []
        for i in range(4):
            v, r = 4 * (g + i // 2) + 2 * (i % 2), i % 2
            words.append(pack(acc[v] * inverse[r], acc[v + 1] * inverse[r]))
        column = group * WG_COLS + 8 * (g + tile_of_lane // 2)
        ptx.stmatrix_x4(address(head, column), words)


class WgmmaDecode(DecodeKernel):
    """Sparse decode of B rows x Hp heads over rows [B, K] (grid: ceil(Hp / WG_HEADS) * split,
    B; clusters of split CTAs)."""

    def __init__(self, config):
        super().__init__(config)
        # split 1 normalises in its own epilogue; split > 1 merges over the cluster (DSMEM).
        self.clustered = self.split > 1
        # Split 8 sends each peer its (max, sum) per head after the block, in the same bulk
        # copy: 64 heads x 8 peers x 2 st.async of 4 bytes per CTA cost more than 512 bytes
        # more per copy (rank-full 16.00 -> 15.66 us); at splits 2 and 4 the st.async were
        # 0.1-0.2 us faster (session 34).
        self.merge_layout(WG_HEADS, stats_in_blocks=self.split == 8)
        # A dead key's staged registers are zeroed at the fetch (splits 1 and 8) or each word
        # selected at the widening (splits 2 and 4): the same result, scheduled differently by
        # ptxas; each split has the spelling faster at the shapes the dispatch gives it
        # (session 36: split 1 -1.8 / -2.9 us at B = 64 / 128, split 8 -0.13 at rank-full;
        # zeroing at the fetch, split 2 is up to 1.7 slower, split 1 at B <= 16 up to 4.2).
        self.zero_dead_at_fetch = self.split in (1, 8)
        assert self.cols // 8 >= 8  # 8+ pieces per head row: the swizzle by head % 8
        assert self.split * 2 * WG_HEADS * 4 <= WG_HEADS * WG_KEYS * 2  # stats in the P tile

    @cute.kernel
    def kernel(
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
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate(WG_SMEM_BYTES, 1024).toint()
        sQ, sK, sLive = base + WG_Q_OFFSET, base + WG_K_OFFSET, base + WG_LIVE_OFFSET
        sP, sRed = base + WG_P_OFFSET, base + WG_RED_OFFSET
        sAlpha, sTotals = sRed, sRed + WG_HEADS * 4  # [WG_HEADS] f32 each
        inbound = base + WG_BAR_OFFSET
        widened = inbound + 8  # [WG_STAGES] mbarriers: the stage's tile is in place
        consumed = widened + 8 * WG_STAGES  # [WG_STAGES]: both warpgroups are done with it
        # P and the rescale factors of a chunk written (warpgroup 0 arrives, 1 waits) and read
        # (1 arrives, 0 waits). mbarriers, not named barriers: racecheck does not see the
        # ordering of a barrier.arrive / barrier.sync pair and would flag every chunk.
        p_ready = consumed + 8 * WG_STAGES
        p_free = p_ready + 8

        tid, _, _ = cute.arch.thread_idx()
        x, b, _ = cute.arch.block_idx()
        tile, part = x // self.split, x % self.split
        group = tid // 128  # 0: S, softmax, P; 1: O columns 256 group ..; 2: loads, widening
        warp, lane = (tid % 128) // 32, tid % 32
        quad = lane % 4
        loader = tid - WG_CONSUMERS  # warpgroup 2's thread index
        neg_inf = Float32(-math.inf)
        if tid == 0:
            for stage in cutlass.range_constexpr(WG_STAGES):
                ptx.mbarrier_init(widened + 8 * stage, LOADERS)
                ptx.mbarrier_init(consumed + 8 * stage, WG_CONSUMERS)
            ptx.mbarrier_init(p_ready, 128)
            ptx.mbarrier_init(p_free, 128)
            if cutlass.const_expr(self.clustered):
                # Armed now; peers push only after the cluster barrier that ends the loop.
                ptx.mbarrier_init(inbound, 1)
            cute.arch.mbarrier_init_fence()
            if cutlass.const_expr(self.clustered):
                ptx.mbarrier_arrive_expect_tx(inbound, self.inbound_bytes)
        cute.arch.sync_threads()
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        rows = cute.make_rmem_tensor((KEYS_EACH,), Int32)  # this loader's rows of a chunk
        rows.fill(-1)
        rows_next = cute.make_rmem_tensor((KEYS_EACH,), Int32)
        rows_next.fill(-1)
        exchange = self.config.exchange
        sLate = base + WG_QUERIES_LATE_OFFSET  # read again by the destination, at the end
        if cutlass.const_expr(exchange):
            # This CTA's share of this rank's query heads goes to the other ranks' decodes
            # first; their release waits for the CTA barrier that ends the compaction of the
            # global tokens in mRows: this CTA's keys' rows listed, chunks 0 and 1's in sP
            # (free until the chunk loop, after the CTA barrier below), the rest in the
            # scratch.
            q_own, q_mailbox, q_lo, q_hi, q_units = self.send_queries(
                mQ, mExchange, mRank, mStep, heads, dcp, heads_own, query_offset, b, sLate,
                part, tile * WG_HEADS, WG_HEADS, tid,
            )  # fmt: skip
            n, rows_base = self.compact_tokens(
                mRows, mValid, mRank, dcp, width, b, x, part, sRed, sP, 2 * WG_KEYS, tid
            )
            mine = (n - part + self.split - 1) // self.split
            if group == 2:
                self.load_rows(sP, mine, 0, loader, rows, shared=True)
                self.load_rows(sP, mine, 1, loader, rows_next, shared=True)
        else:
            # Chunk 0's and 1's row indices are read together with the count (in bounds of
            # rows[b]) and masked once it has arrived; the consumers read none (row -1).
            rows_base = mRows.toint() + (Int64(b) * width + part) * 4
            reach = (width - part + self.split - 1) // self.split  # its positions in rows[b]
            if group == 2:
                self.load_rows(rows_base, reach, 0, loader, rows)
                self.load_rows(rows_base, reach, 1, loader, rows_next)
            n = ptx.load_global_i32(mValid.toint() + Int64(b) * 4)
            n = max(min(n, width), Int32(0))
            mine = (n - part + self.split - 1) // self.split
            for k in cutlass.range_constexpr(KEYS_EACH):
                key = loader // COPIERS + ROW_KEYS * k  # this loader's key k of chunk 0
                rows[k] = ptx.where_i32(key < mine, rows[k], -1)
                rows_next[k] = ptx.where_i32(WG_KEYS + key < mine, rows_next[k], -1)
        chunks = (mine + WG_KEYS - 1) // WG_KEYS
        if cutlass.const_expr(exchange):
            # The other ranks' heads of the tile come from their decodes. Before chunk 0's
            # fetch: its registers held through the wait spilled (split 1).
            self.await_queries(
                mExchange, mRank, mStep, dcp, heads_own, query_flags_offset, b, sLate, x, part,
                tile * WG_HEADS, WG_HEADS, q_units, tid,
            )  # fmt: skip
        staged = cute.make_rmem_tensor((KEYS_EACH * MINE * 4,), Int32)
        live = cute.make_rmem_tensor((KEYS_EACH,), Int32)  # the staged keys' flags
        for k in cutlass.range_constexpr(KEYS_EACH):  # the consumers fetch none
            self.fetch(mKV, rows, n_rows, row_bytes, staged, live, loader, k)
        # The last tile may be partial (Hp a multiple of 16): missing heads get a zero Q row
        # (their S is 0, their output is not written).
        q_words = []
        if cutlass.const_expr(exchange):
            # Piece f from send_queries' own or mailbox rows (generic loads: where peers
            # wrote them, its acquire invalidated this SM's L1).
            last = (heads - tile * WG_HEADS) * PIECES - 1  # the tile's last piece within Hp
            for i in cutlass.range_constexpr(WG_HEADS * PIECES // WG_THREADS):
                piece = min(tid + WG_THREADS * i, last)
                source = ptx.where_i64((piece >= q_lo) & (piece < q_hi), q_own, q_mailbox)
                q_words.append(ptx.load_global_v4(source + Int64(piece) * 16))
        else:
            q_base = mQ.toint() + Int64(b) * heads * ROW
            for i in cutlass.range_constexpr(WG_HEADS * PIECES // WG_THREADS):
                flat = tid + WG_THREADS * i
                head = tile * WG_HEADS + flat // PIECES
                src = q_base + (Int64(min(head, heads - 1)) * PIECES + flat % PIECES) * 16
                q_words.append(ptx.load_global_v4(src))
        for i in cutlass.range_constexpr(WG_HEADS * PIECES // WG_THREADS):
            flat = tid + WG_THREADS * i
            head = tile * WG_HEADS + flat // PIECES
            self.widen_piece(q_words[i], head < heads, sQ, flat // PIECES, flat % PIECES)
        ptx.fence_proxy_async_shared()  # Q is read by wgmma
        cute.arch.sync_threads()
        scale_log2 = ptx.load_global_f32(mScales.toint())

        m_run = cute.make_rmem_tensor((2,), Float32)  # rows 16 warp + lane / 4 (+ 8)
        l_part = cute.make_rmem_tensor((2,), Float32)  # this thread's share of the P sums
        acc = cute.make_rmem_tensor((O_VALUES,), Float32)
        # The warpgroups run separate loops, synchronised by the stages' mbarriers (producer ->
        # consumers: tile widened; consumers -> producer: tile free) and P's two (warpgroup 0
        # <-> 1), each with its own register budget; the consumers' accumulators are set only
        # in their branches, so that nothing of theirs is live in the producer's.
        if group == 0:
            cute.arch.warpgroup_reg_alloc(S_REGISTERS)
            m_run.fill(neg_inf)
            l_part.fill(0.0)
            acc.fill(0.0)
            for c in cutlass.range(0, chunks, unroll=1):
                stage = c % WG_STAGES
                sKc, sLivec = sK + stage * WG_F16_TILE, sLive + stage * (WG_KEYS * 4)
                ptx.mbarrier_wait(widened + 8 * stage, (c // WG_STAGES) % 2)
                self.softmax_chunk(
                    sQ,
                    sKc,
                    sLivec,
                    sP,
                    sAlpha,
                    p_ready,
                    p_free,
                    scale_log2,
                    m_run,
                    l_part,
                    acc,
                    warp,
                    lane,
                    c,
                )
                self.accumulate(acc, sP, sKc, 0)
                ptx.mbarrier_arrive(consumed + 8 * stage)
            ptx.barrier_sync(LOOPS_DONE, WG_THREADS)
            cute.arch.warpgroup_reg_dealloc(SHARED_REGISTERS)
        elif group == 1:
            cute.arch.warpgroup_reg_dealloc(O_REGISTERS)
            acc.fill(0.0)
            for c in cutlass.range(0, chunks, unroll=1):
                stage = c % WG_STAGES
                sKc = sK + stage * WG_F16_TILE
                ptx.mbarrier_wait(widened + 8 * stage, (c // WG_STAGES) % 2)
                ptx.mbarrier_wait(p_ready, c % 2)  # P and the factors of chunk c
                for r in cutlass.range_constexpr(2):
                    alpha = ptx.load_shared_f32(sAlpha + (16 * warp + lane // 4 + 8 * r) * 4)
                    for v in cutlass.range_constexpr(r * 2, O_VALUES, 4):
                        acc[v] = acc[v] * alpha
                        acc[v + 1] = acc[v + 1] * alpha
                self.accumulate(acc, sP, sKc, 1)
                ptx.mbarrier_arrive(consumed + 8 * stage)
                if c + 1 < chunks:
                    ptx.mbarrier_arrive(p_free)  # chunk c's P and factors read
            ptx.barrier_sync(LOOPS_DONE, WG_THREADS)
            cute.arch.warpgroup_reg_alloc(SHARED_REGISTERS)
        else:
            cute.arch.warpgroup_reg_dealloc(LOAD_REGISTERS)
            for c in cutlass.range(0, chunks, unroll=1):
                stage = c % WG_STAGES
                if c >= WG_STAGES:  # chunk c - WG_STAGES has left the stage's tile
                    ptx.mbarrier_wait(consumed + 8 * stage, (c // WG_STAGES - 1) % 2)
                # At split 1 (many chunks per CTA) key k of chunk c + 1 is fetched into key k's
                # registers as soon as they are widened, before the arrive (B=64: -1.7 us; ptxas
                # issues those loads after most of the other key's stores, session 36); the
                # other splits fetch after the arrive (interleaved, split 8 was 0.15 us slower
                # at rank-full).
                sKs, sLives = sK + stage * WG_F16_TILE, sLive + stage * (WG_KEYS * 4)
                early = KEYS_EACH - 1 if self.split == 1 else 0  # keys fetched before the arrive
                for k in cutlass.range_constexpr(early):
                    self.widen(staged, live, sKs, sLives, loader, k)
                    if c + 1 < chunks:
                        self.fetch(mKV, rows_next, n_rows, row_bytes, staged, live, loader, k)
                for k in cutlass.range_constexpr(early, KEYS_EACH):
                    self.widen(staged, live, sKs, sLives, loader, k)
                ptx.fence_proxy_async_shared()  # the tile is read by wgmma
                ptx.mbarrier_arrive(widened + 8 * stage)
                if c + 1 < chunks:
                    for k in cutlass.range_constexpr(early, KEYS_EACH):
                        self.fetch(mKV, rows_next, n_rows, row_bytes, staged, live, loader, k)
                    self.load_rows(rows_base, mine, c + 2, loader, rows_next)
            ptx.barrier_sync(LOOPS_DONE, WG_THREADS)
            cute.arch.warpgroup_reg_alloc(SHARED_REGISTERS)

        if cutlass.const_expr(self.clustered):
            # This CTA is done with its tiles, where the peers' blocks and stats will land: the
            # cluster barrier's arrive now and its wait once the outbox is filled, so that the
            # barrier's latency hides behind the sums and the outbox (0.03-0.5 us, session
            # 34). Relaxed: the tiles' last accesses (wgmma, waited for; stores, before
            # LOOPS_DONE) are done; a release arrive compiled to a GPU-scope MEMBAR (0.10-0.26
            # us, session 32). The outbox reaches this CTA's own copies through the proxy
            # fence and the CTA barrier after the wait.
            cute.arch.cluster_arrive_relaxed()
        # Read now, used by the merge or epilogue: its latency hides behind the sums' barrier
        # (not in the prologue: it would hold a register through every warpgroup's loop).
        out_scale = ptx.load_global_f32(mScales.toint() + 4)
        # The row sums (warpgroup 0's) to both warpgroups, through sTotals (sAlpha may still
        # be read by warpgroup 1 for the last chunk).
        if group == 0:
            for r in cutlass.range_constexpr(2):
                total = l_part[r]
                for shift in cutlass.range_constexpr(2):
                    total = total + cute.arch.shuffle_sync_bfly(total, offset=1 << shift)
                if quad == 0:
                    ptx.store_shared_f32(sTotals + (16 * warp + lane // 4 + 8 * r) * 4, total)
        cute.arch.sync_threads()
        totals = [
            ptx.load_shared_f32(sTotals + (16 * warp + lane // 4 + 8 * r) * 4) for r in range(2)
        ]
        queries_ok = Int32(1)
        if cutlass.const_expr(exchange):
            queries_ok = 1 - ptx.load_shared_u32(sLate)
        dest = self.destination(
            mLatent, mLse, mExchange, mRank, mStep, dcp, heads_own, latent_offset, lse_offset, b,
            queries_ok,
        )  # fmt: skip
        if cutlass.const_expr(self.clustered):
            sOutbox, sInbox = base + WG_OUTBOX_OFFSET, base + WG_INBOX_OFFSET
            sStats = base + WG_STATS_OFFSET
            if tid < WG_CONSUMERS:
                self.fill_outbox(sOutbox, acc, m_run, totals, tid)
            ptx.fence_proxy_async_shared()  # the outbox is read by bulk copies
            cute.arch.cluster_wait()  # every CTA of the cluster is done with its tiles
            # Also a CTA barrier (the cluster barrier is one already): racecheck models only
            # CTA barriers, and the merge reads this CTA's own block from the outbox.
            cute.arch.sync_threads()
            self.push(sOutbox, sInbox, sStats, inbound, m_run, totals, part, tid)
            ptx.mbarrier_wait_cluster(inbound, 0)  # every source's block of these columns
            # Every CTA has received everything: no outbox is read after this barrier.
            cute.arch.cluster_arrive_relaxed()
            if tid < WG_CONSUMERS:
                self.merge(out_scale, dest, sOutbox, sInbox, sStats, tile, part, heads, tid)
            cute.arch.cluster_wait()  # no CTA exits while a copy still reads its outbox
        else:
            sOut = base + WG_K_OFFSET
            self.epilogue(out_scale, dest, sOut, acc, m_run, totals, tile, heads, tid)
        self.finish_push(dest, x, tile, WG_HEADS, tid)

    @cute.jit
    def accumulate(self, acc, sP, sKc, group: cutlass.Constexpr[int]):
        """O += P V for warpgroup ``group``'s 256 columns: P (sP) x V (the F16 tile sKc,
        MN-major)."""
        o = ptx.pin_f32([acc[v] for v in range(O_VALUES)])
        ptx.wgmma_fence()
        for j in cutlass.range_constexpr(WG_KEYS // 16):
            v_tile = sKc + group * (WG_COLS // 64) * ATOM_SPAN + j * 16 * WG_ATOM
            o = ptx.wgmma_f16_ss(
                o,
                ptx.smem_descriptor(sP + 32 * j, 16, 8 * WG_ATOM, SWIZZLE_128B),
                ptx.smem_descriptor(v_tile, ATOM_SPAN, 8 * WG_ATOM, SWIZZLE_128B),
                True,
                transpose_b=True,
            )
        ptx.wgmma_commit()
        ptx.wgmma_wait(0)
        o = ptx.pin_f32(o)
        for v in cutlass.range_constexpr(O_VALUES):
            acc[v] = o[v]

    @cute.jit
    def softmax_chunk(
        self,
        sQ,
        sKc,
        sLivec,
        sP,
        sAlpha,
        p_ready,
        p_free,
        scale_log2,
        m_run,
        l_part,
        acc,
        warp,
        lane,
        c,
    ):
        """Warpgroup 0's part of chunk c: S over its 64 keys, the online softmax (log2
        units), this warpgroup's O rescaled, P as F16 into sP and the rescale factors into
        sAlpha for warpgroup 1 (once it has read chunk c - 1's: p_free), then p_ready."""
        quad = lane % 4
        neg_inf = Float32(-math.inf)
        # S value v belongs to key 8 (v / 4) + 2 quad + v % 2: bit 2 (v / 4) + v % 2.
        live_bits = Int32(0)
        for i in cutlass.range_constexpr(S_VALUES // 2):
            key = 8 * (i // 2) + 2 * quad + i % 2
            live_bits = live_bits | (ptx.load_shared_u32(sLivec + 4 * key) << i)
        ptx.wgmma_fence()
        s = [Float32(0.0)] * S_VALUES
        for k in cutlass.range_constexpr(K_STEPS):
            offset = (k // 4) * ATOM_SPAN + (k % 4) * 32
            s = ptx.wgmma_f16_ss(
                s,
                ptx.smem_descriptor(sQ + offset, 16, 8 * WG_ATOM, SWIZZLE_128B),
                ptx.smem_descriptor(sKc + offset, 16, 8 * WG_ATOM, SWIZZLE_128B),
                k > 0,
            )
        ptx.wgmma_commit()
        ptx.wgmma_wait(0)
        s = ptx.pin_f32(s)
        # S value v: head 16 warp + lane / 4 + 8 r (r = (v / 2) % 2), key as live_bits.
        for v in cutlass.range_constexpr(S_VALUES):
            alive = (live_bits & (1 << (2 * (v // 4) + v % 2))) != 0
            s[v] = ptx.where(alive, s[v] * scale_log2, neg_inf)
        alpha = []
        for r in cutlass.range_constexpr(2):
            top = neg_inf
            for v in cutlass.range_constexpr(r * 2, S_VALUES, 4):
                top = cute.arch.fmax(top, cute.arch.fmax(s[v], s[v + 1]))
            for shift in cutlass.range_constexpr(2):
                top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=1 << shift))
            m_new = cute.arch.fmax(m_run[r], top)
            # A row with no live key so far keeps max -inf; subtract 0 instead (no NaN).
            m_use = ptx.where(m_new == neg_inf, 0.0, m_new)
            alpha.append(cute.math.exp2(m_run[r] - m_use, fastmath=True))
            total = Float32(0.0)
            for v in cutlass.range_constexpr(S_VALUES):
                if cutlass.const_expr((v // 2) % 2 == r):
                    s[v] = cute.math.exp2((s[v] - m_use) + LOG2_P_SCALE, fastmath=True)
                    total = total + s[v]
            l_part[r] = l_part[r] * alpha[r] + total
            m_run[r] = m_new
        for v in cutlass.range_constexpr(O_VALUES):
            acc[v] = acc[v] * alpha[(v // 2) % 2]
        if c > 0:
            ptx.mbarrier_wait(p_free, (c - 1) % 2)  # warpgroup 1 is done with chunk c - 1's
        if quad == 0:
            for r in cutlass.range_constexpr(2):
                ptx.store_shared_f32(sAlpha + (16 * warp + lane // 4 + 8 * r) * 4, alpha[r])
        for v in cutlass.range_constexpr(0, S_VALUES, 2):
            head = 16 * warp + lane // 4 + 8 * ((v // 2) % 2)
            dst = sP + f16_offset(head, 8 * (v // 4)) + 4 * quad
            ptx.store_shared_u32(dst, ptx.f16x2(s[v], s[v + 1]))
        ptx.fence_proxy_async_shared()  # P is read by wgmma
        ptx.mbarrier_arrive(p_ready)

    @cute.jit
    def load_rows(self, rows_base, mine, c, loader, rows, shared: cutlass.Constexpr[bool] = False):
        """Into ``rows``, the row indices of loader ``loader``'s keys in chunk c:
        rows[b, part + split j] (a push cubin: entry j of the CTA's list) for j = c WG_KEYS +
        loader / COPIERS + ROW_KEYS k, or -1 from ``mine`` on (nothing read). ``shared``: the
        list's head in shared memory at ``rows_base`` (compact_tokens)."""
        for k in cutlass.range_constexpr(KEYS_EACH):
            j = c * WG_KEYS + loader // COPIERS + ROW_KEYS * k
            row = Int32(-1)
            if j < mine:
                if cutlass.const_expr(shared):
                    row = ptx.load_shared_u32(rows_base + j * 4)
                else:
                    row = ptx.load_global_i32(rows_base + Int64(j) * self.row_step)
            rows[k] = row

    @cute.jit
    def fetch(
        self,
        mKV: cute.Pointer,
        rows,
        n_rows,
        row_bytes,
        staged,
        live,
        loader,
        k: cutlass.Constexpr[int],
    ):
        """Start loading loader ``loader``'s MINE pieces of cache row ``rows[k]`` into key k's
        part of ``staged`` (nothing for a row outside [0, n_rows), or zeros with
        ``zero_dead_at_fetch``); ``live[k]`` gets whether it is."""
        row = rows[k]
        alive = (row >= 0) & (row < n_rows)
        live[k] = Int32(alive)
        if alive:
            # One address per key, the pieces at immediate offsets from it: an address per
            # piece cost two 64-bit adds per load (0.1-1.5 us per launch at the dispatched
            # configs, session 35).
            src = mKV.toint() + Int64(row) * row_bytes + 16 * (loader % COPIERS)
            for i in cutlass.range_constexpr(MINE):
                words = ptx.load_global_v4(src + 16 * COPIERS * i)
                for e in cutlass.range_constexpr(4):
                    staged[4 * (MINE * k + i) + e] = words[e]
        elif cutlass.const_expr(self.zero_dead_at_fetch):
            for j in cutlass.range_constexpr(MINE * 4):
                staged[MINE * 4 * k + j] = Int32(0)

    @cute.jit
    def widen(self, staged, live, sKc, sLivec, loader, k: cutlass.Constexpr[int]):
        """Key k's staged pieces as F16 into the K tile sKc (zeros for a dead key: P = 0 must
        not meet a stale NaN; zeroed at the fetch or here, ``zero_dead_at_fetch``), and its live
        flag into sLivec.

        Piece sub + 4 i lands i column atoms after piece sub: two store addresses per key
        and immediates (ptxas kept one address per store across the loop and spilled)."""
        sub = loader % COPIERS
        key = loader // COPIERS + ROW_KEYS * k
        first = [sKc + f16_offset(key, 16 * sub + 8 * e) for e in range(2)]
        if cutlass.const_expr(not self.zero_dead_at_fetch):
            keep = live[k] != 0
        for i in cutlass.range_constexpr(MINE):
            halves = []
            for e in cutlass.range_constexpr(4):
                word = staged[4 * (MINE * k + i) + e]
                if cutlass.const_expr(not self.zero_dead_at_fetch):
                    word = ptx.where_i32(keep, word, 0)
                halves.extend(ptx.e4m3x4_to_f16(word))
            for e in cutlass.range_constexpr(2):
                dst = first[e] + i * ATOM_SPAN
                ptx.store_shared_v4(dst, *halves[4 * e : 4 * e + 4])
        if sub == 0:
            ptx.store_shared_u32(sLivec + 4 * key, live[k])

    @cute.jit
    def widen_piece(self, raw, keep, tile16, row, piece):
        """16 E4M3 bytes (piece ``piece`` of row ``row``) as 16 F16 values into an F16 tile;
        zeros unless ``keep``."""
        halves = []
        for e in cutlass.range_constexpr(4):
            halves.extend(ptx.e4m3x4_to_f16(ptx.where_i32(keep, raw[e], 0)))
        for e in cutlass.range_constexpr(2):
            dst = tile16 + f16_offset(row, 16 * piece + 8 * e)
            ptx.store_shared_v4(dst, *halves[4 * e : 4 * e + 4])

    @cute.jit
    def epilogue(self, out_scale, dest, sOut, acc, m_run, totals, tile, heads, tid):
        """O / l as BF16 (times out_scale) and the natural-log LSE; -inf and zeros for a row
        without live keys. The rows go through shared memory (sOut, the free K tiles) and
        out by one bulk copy each: the fragments' 4-byte global stores wrote half sectors
        and took ~4 us of a CTA's time (clock probes, 2026-11-30)."""
        group = tid // 128
        warp, lane = (tid % 128) // 32, tid % 32
        quad = lane % 4
        if tid < WG_CONSUMERS:  # the producer warpgroup holds no accumulators
            norms = [self.normaliser(out_scale, totals[r]) for r in range(2)]
            store_fragments(
                acc,
                [norm[1] for norm in norms],
                ptx.bf16x2,
                lambda row, column: sOut + row * WG_OUT_PITCH + column * 2,
                tid,
            )
            for r in cutlass.range_constexpr(2):
                nonempty = norms[r][0]
                head = tile * WG_HEADS + 16 * warp + lane // 4 + 8 * r
                if (group == 0) & (quad == 0) & (head < heads):
                    _, lse_at, keep = self.row_target(dest, head)
                    if keep:
                        # P was scaled by 448 = 2^LOG2_P_SCALE: so were the sums.
                        top = m_run[r] - Float32(LOG2_P_SCALE)
                        self.store_lse(lse_at, self.log2_lse(nonempty, top, totals[r]))
        ptx.fence_proxy_async_shared()  # the rows are read by bulk copies
        cute.arch.sync_threads()
        head = tile * WG_HEADS + tid
        if (tid < WG_HEADS) & (head < heads):
            latent, _, keep = self.row_target(dest, head)
            if keep:
                ptx.copy_s2g(latent, sOut + tid * WG_OUT_PITCH, LATENT * 2)
                ptx.bulk_commit()
                ptx.bulk_wait_read()  # the CTA's shared memory outlives the copy's reads
                if dest.push:
                    ptx.bulk_wait()  # the rows have landed before the flag's release

    def piece_flip(self, head):
        """4 (head % 2), on top of the swizzle by head % 8: stmatrix's eight rows (heads h0 ..
        h0 + 7) still hit eight bank groups, and so do the merge's 16-byte loads, whose eight
        lanes per phase read pieces 4 k + q (q < 4) of heads h and h + 1 (swizzled by h % 8
        alone, two heads shared four bank groups: twice the ideal wavefronts, Nsight Compute)."""
        return 4 * (head % 2)

    @cute.jit
    def fill_outbox(self, sOutbox, acc, m_run, totals, tid):
        """This CTA's partial O / l as F16 into the outbox (0 for a head without live keys),
        block ``owner`` holding the columns CTA ``owner`` merges; with ``stats_in_blocks``
        also its (max, sum) per head after each block (warpgroup 0's, whose quads hold them:
        lane q of a quad writes every fourth block)."""
        if cutlass.const_expr(self.stats_in_blocks):
            warp, lane = (tid % 128) // 32, tid % 32
            if tid < 128:
                for r in cutlass.range_constexpr(2):
                    head = 16 * warp + lane // 4 + 8 * r
                    for owner in cutlass.range_constexpr(self.split):
                        if owner % 4 == lane % 4:
                            tail = self.stats_at(sOutbox, owner, head)
                            ptx.store_shared_v2_f32(tail, m_run[r], totals[r])
        inverse = [self.normaliser(Float32(1.0), totals[r])[1] for r in range(2)]
        store_fragments(
            acc,
            inverse,
            ptx.f16x2,
            lambda head, column: self.piece_at(
                sOutbox, column // self.cols, head, column % self.cols
            ),
            tid,
        )

    @cute.jit
    def push(self, sOutbox, sInbox, sStats, inbound, m_run, totals, part, tid):
        """Outbox block r into slot ``part`` of peer r's inbox (one bulk copy each, issued by
        one thread; block ``part`` stays), and, unless they travel in the blocks, this CTA's
        (max, sum) per head into every CTA's stats (st.async); all complete on the receiver's
        inbound barrier."""
        group = tid // 128
        warp, lane = (tid % 128) // 32, tid % 32
        if tid == 0:
            self.send_blocks(sOutbox, sInbox, inbound, part)
        if (group == 0) & (lane % 4 == 0) & cutlass.const_expr(not self.stats_in_blocks):
            for r in cutlass.range_constexpr(2):
                head = 16 * warp + lane // 4 + 8 * r
                self.push_stats(sStats, inbound, part, head, WG_HEADS, m_run[r], totals[r])

    @cute.jit
    def merge(
        self,
        out_scale,
        dest,
        sOutbox,
        sInbox,
        sStats,
        tile,
        part,
        heads,
        tid,
    ):
        """Columns part * cols .. + cols of the tile's heads over the cluster's partials,
        weighted by each source's sum at the common max, as BF16 (times out_scale), and the
        LSE (part 0): thread t takes head t / 4 and pieces t % 4, t % 4 + 4, ... (8 columns
        each) of every source's block."""
        head_in_tile, quarter = tid // 4, tid % 4
        pieces = self.cols // 8 // 4  # per thread
        columns = [8 * (quarter + 4 * k) for k in range(pieces)]
        top, total, merged = self.merge_sources(
            sOutbox, sInbox, sStats, WG_HEADS, head_in_tile, part, columns
        )
        nonempty, inverse = self.normaliser(out_scale, total)
        head = tile * WG_HEADS + head_in_tile
        if head < heads:
            latent, lse_at, keep = self.row_target(dest, head)
            if keep:
                for k in cutlass.range_constexpr(pieces):
                    col = part * self.cols + 8 * (quarter + 4 * k)
                    words = [
                        ptx.bf16x2(
                            merged[8 * k + 2 * e] * inverse, merged[8 * k + 2 * e + 1] * inverse
                        )
                        for e in range(4)
                    ]
                    ptx.store_global_v4(latent + col * 2, words)
                if (part == 0) & (quarter == 0):
                    lse2 = self.log2_lse(nonempty, top - Float32(LOG2_P_SCALE), total)
                    self.store_lse(lse_at, lse2)
