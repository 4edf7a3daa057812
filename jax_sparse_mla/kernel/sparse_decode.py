"""Sparse MLA decode on an FP8 E4M3 cache for Hopper (sm_90a), in CuTe DSL.

A port of SparseDcpDecode (see DESIGN.md): a cluster of ``split`` CTAs per (16 heads, row b),
each CTA taking 1 / split of the row's keys (the seed: split = 4; 1 and 2 keep larger grids in
one wave, 8 shortens each CTA of a small grid). Per chunk of up to CHUNK keys a CTA gathers the
cache rows with cp.async.bulk (one 576-byte row each, on the chunk's mbarrier; STAGES buffers,
so chunk c + 1 is in flight while chunk c is computed; beyond the seed), computes QK as F16
mma.sync m16n8k16 on the E4M3 bytes widened exactly (FP32 sums; groups of 16 keys, each A
fragment serving two 8-key tiles, the 36 k16 blocks split over 4 warps per group in a chunk of
<= 64 keys, 2 in a full one; then warp w holds keys 8 w .. 8 w + 7 x 16 heads), runs an online
softmax in log2 units with F16 P, 448 at the running max (FP32 sums of the unrounded P), and
accumulates PV with F16 mma.sync m16n8k16 (warp w: latent columns 32 w .. 32 w + 31; V
transposed in registers with byte permutes and widened exactly to F16). The cluster then merges
its partials over distributed shared memory: CTA s owns columns s * cols .. s * cols + cols - 1
(cols = 512 / split); every thread pushes its 16-byte F16 pieces of O / l straight into the
owners' inboxes with st.async (its own columns' pieces into its outbox in the free row
buffers), and the (max, sum) stats likewise, all completing on the receiver's mbarrier (no
outbox copy, proxy fence or CTA barrier before the sends); CTA s merges its columns in FP32 and
writes them (s = 0: and the LSE). With split = 1 there is nothing to merge: each thread
writes its columns straight from its accumulators.

At split 2 and 4 a cluster pairs two 16-head tiles (cluster rank = member * split + part):
the pair's CTAs of one part read the same rows, so in the first STAGES chunks each issues
every other row's copy with .multicast::cluster into both (the per-SM TMA issue, ~19 cycles
per row, was the gather's cost); from chunk STAGES on a stage is reused while the partner may
still read its copy of it, so each CTA gathers its own rows again. The pair's second tile
past the padded heads (Hp = 48: tile 3) still gathers and merges, on the last real tile's
query, and stores nothing.

Parameters are raw pointers and i32 sizes (the ABI: PARAMS in config.py). No size is
static: the batch is the grid's y extent, and the cache rows, index width K, padded heads and
cache row pitch arrive as parameters, so one cubin serves every shape. Nothing is read before
griddepcontrol.wait (PDL). The push exchange's cubin of a config (``KernelConfig.exchange``)
first exchanges the tile's query heads with the other ranks' decodes (``entry.py``'s
send_queries and await_queries).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from jax_sparse_mla.kernel import ptx
from jax_sparse_mla.kernel.config import (
    BAR_OFFSET,
    CHUNK,
    HEADS,
    INBOX_OFFSET,
    KV_OFFSET,
    LATENT,
    LIVE_OFFSET,
    LOG2_P_SCALE,
    P_OFFSET,
    P_PITCH,
    PART_OFFSET,
    PITCH,
    Q_OFFSET,
    QK_WARPS,
    RED_OFFSET,
    ROW,
    SLOTS,
    SMEM_BYTES,
    STAGES,
    STATS_OFFSET,
    THREADS,
    WARPS,
    KernelConfig,
)
from jax_sparse_mla.kernel.entry import DecodeKernel

assert QK_WARPS == WARPS == HEADS == 16 and CHUNK % 32 == 0 and SLOTS <= 32
QUERY_STEPS = -(-HEADS * (ROW // 16) // THREADS)  # 16-byte query pieces per thread
# Q K^T on groups of 16 keys (two 8-key tiles sharing each A fragment), the row's 36 k16 blocks
# of 16 bytes split over the group's warps: 4 groups x 4 slices for a chunk of <= CHUNK / 2 keys
# (all 16 warps busy at the latency shapes' 64 keys per CTA), 8 x 2 for a full chunk. Then warp
# w holds keys 8 w .. 8 w + 7 (the layout the maxima, P and P V use).
PAIRS = QK_WARPS // 2
BLOCKS = ROW // 16
SHORT_SLICES, LONG_SLICES = 4, 2
# Every warp works: groups x slices = QK_WARPS for either kind of chunk.
assert CHUNK // 2 // 16 * SHORT_SLICES == QK_WARPS == CHUNK // 16 * LONG_SLICES
assert BLOCKS % SHORT_SLICES == 0 and BLOCKS % LONG_SLICES == 0


def p_column(key):
    """Where key ``key`` (even; key + 1 follows it) of a chunk sits in the F16 P tile: within
    each 16 keys, the PV MMA's k index of the V byte a thread holds for it (keys 4 q + i, i < 4,
    are k indices 2 q + i % 2 + 8 (i // 2))."""
    within = key % 16
    return key - within + 2 * (within // 4) + 8 * ((within % 4) // 2)


def qk_role(warp, slices: int):
    """(16-key group, slice of the k16 blocks) of ``warp`` in a Q K^T over ``slices`` slices:
    a full chunk (2) gives group i to warps 2 i and 2 i + 1, a short chunk (4) also to warps
    2 i + 8 and 2 i + 9 (its 4 groups cover 64 keys)."""
    if slices == SHORT_SLICES:
        return (warp % PAIRS) // 2, warp % 2 + 2 * (warp // PAIRS)
    return warp // 2, warp % 2


def qk_sources(warp, slices: int) -> list:
    """The sPart entries ([2, QK_WARPS], slot-major) holding the other slices' partials of
    ``warp``'s tile (keys 8 warp ..): slot 0 of its partner warp ^ 1 (the tile that warp does
    not keep); in a short chunk also slot 1 of warp + 8 (the tile it keeps) and slot 0 of
    (warp + 8) ^ 1."""
    sources = [warp ^ 1]
    if slices == SHORT_SLICES:
        sources += [QK_WARPS + warp + PAIRS, (warp + PAIRS) ^ 1]
    return sources


def qk_block(partial, tile, a, b):
    """One k16 block of Q K^T (E4M3, widened) into tile ``tile``'s accumulator."""
    d = ptx.mma_e4m3_k16(a, b, tuple(partial[tile, e] for e in range(4)))
    for e in range(4):
        partial[tile, e] = d[e]


def red_index(r, low, high, group):
    """sRed's f32 index of warp 4 high + low's value for head group + 8 r. Laid out [r][low]
    [high][group] so that one load by a warp (8 groups x 4 quarters = high) touches 32 banks."""
    return ((r * 4 + low) * 4 + high) * 8 + group


def over_warps(sRed, r, group, quarter, combine):
    """Head group + 8 r's value over the 16 warps (combine: fmax or add): quarter q reads warps
    4 q .. 4 q + 3, the quad combines. 4 loads per head and thread, not 16 (all 16 warps' loads
    go through one shared-memory pipe: the sums' 512 warp loads took ~590 cycles)."""
    value = ptx.load_shared_f32(sRed + red_index(r, 0, quarter, group) * 4)
    for low in range(1, 4):
        value = combine(value, ptx.load_shared_f32(sRed + red_index(r, low, quarter, group) * 4))
    for shift in range(2):
        value = combine(value, cute.arch.shuffle_sync_bfly(value, offset=1 << shift))
    return value


def transpose4(w):
    """Bytes of four words -> four words of bytes: out[j] = (w0.j, w1.j, w2.j, w3.j)."""
    lo01, hi01 = ptx.prmt(w[0], w[1], 0x5140), ptx.prmt(w[0], w[1], 0x7362)
    lo23, hi23 = ptx.prmt(w[2], w[3], 0x5140), ptx.prmt(w[2], w[3], 0x7362)
    return (
        ptx.prmt(lo01, lo23, 0x5410),
        ptx.prmt(lo01, lo23, 0x7632),
        ptx.prmt(hi01, hi23, 0x5410),
        ptx.prmt(hi01, hi23, 0x7632),
    )


class SparseDecode(DecodeKernel):
    """Sparse decode of B rows x Hp heads over rows [B, K] (grid: Hp / HEADS * split, B)."""

    def __init__(self, config: KernelConfig):
        super().__init__(config)
        split = config.split
        # split 1 has no peers: its partial stays in its own shared memory (no DSMEM).
        self.clustered = split > 1
        self.tiles = config.tiles  # 2: the cluster pairs two head tiles (multicast gathers)
        self.merge_layout(HEADS)  # cols: latent columns each CTA merges

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
        base = smem.allocate(SMEM_BYTES, 1024).toint()
        sKV, sQ, sP = base + KV_OFFSET, base + Q_OFFSET, base + P_OFFSET
        sRed, sLive = base + RED_OFFSET, base + LIVE_OFFSET
        sInbox, sStats = base + INBOX_OFFSET, base + STATS_OFFSET
        bar, inbound = base + BAR_OFFSET, base + BAR_OFFSET + 8 * STAGES
        sPart = base + PART_OFFSET

        tid, _, _ = cute.arch.thread_idx()
        x, b, _ = cute.arch.block_idx()
        # Cluster rank = x % (tiles * split) = pair member * split + part.
        member = (x % (self.tiles * self.split)) // self.split
        tile = (x // (self.tiles * self.split)) * self.tiles + member
        part = x % self.split
        rank_base = member * self.split
        real = tile * HEADS < heads  # a pair's second tile past the padded heads: no output
        # Multicast targets: this part's CTA of each tile of the pair.
        mask = Int32(0)
        for t in cutlass.range_constexpr(self.tiles):
            mask = mask | (Int32(1) << (t * self.split + part))
        lane, warp = tid % 32, tid // 32
        group, quarter = lane // 4, lane % 4
        # Key slot of this thread in the gathers (lanes < SLOTS): spread over the warps, since
        # ptxas issues a warp's per-lane bulk copies one after another.
        slot = lane * WARPS + warp
        neg_inf = Float32(-math.inf)

        if tid == 0:
            for stage in cutlass.range_constexpr(STAGES):
                # One arrival per key slot: copying threads arrive with their row's bytes.
                ptx.mbarrier_init(bar + 8 * stage, CHUNK)
            if cutlass.const_expr(self.clustered):
                ptx.mbarrier_init(inbound, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if cutlass.const_expr(self.clustered):
            if tid == 0:
                ptx.mbarrier_arrive_expect_tx(inbound, self.inbound_bytes)
            # Every CTA's inbound barrier is armed before any peer pushes (cluster_wait below).
            cute.arch.cluster_arrive_relaxed()
        # Nothing above reads the inputs: the kernel before may still be running.
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.split == 8 and not self.config.exchange):
            # Split 8's CTAs hold few keys: its header reads overlap the inputs' here (session
            # 28: -0.11 us at B=1 x 128 heads x 256 keys; a pair's CTAs were 0.05 us slower).
            dest = self.destination(
                mLatent, mLse, mExchange, mRank, mStep, dcp, heads_own, latent_offset,
                lse_offset, b, Int32(1),
            )  # fmt: skip

        exchange = self.config.exchange
        q_tile = min(tile, heads // HEADS - 1)
        if cutlass.const_expr(exchange):
            # This CTA's share of this rank's query heads goes to the other ranks' decodes
            # first (sLate: sRed's first word); their release waits for the CTA barrier that
            # ends the compaction of the global tokens in mRows: this CTA's keys' rows listed,
            # chunk 0's in sP (free until the chunk loop), the rest in the scratch.
            q_own, q_mailbox, q_lo, q_hi, q_units = self.send_queries(
                mQ, mExchange, mRank, mStep, heads, dcp, heads_own, query_offset, b, sRed,
                part, q_tile * HEADS, HEADS, tid,
            )  # fmt: skip
            n, rows_base = self.compact_tokens(
                mRows, mValid, mRank, dcp, width, b, x, part, sRed + 16, sP, CHUNK, tid
            )
            mine = self.keys_of_cta(n, width, part)
            row = Int32(-1)
            if (lane < SLOTS) & (slot < mine):
                row = ptx.load_shared_u32(sP + slot * 4)
        else:
            # Keys are split interleaved (key i -> CTA i % split): where this CTA's row
            # indices lie does not depend on the count, so the first chunk's indices (and the
            # query) are read together with it; an index past the count is read (in bounds)
            # but never used.
            rows_base = mRows.toint() + (Int64(b) * width + part) * 4
            reach = (width - part + self.split - 1) // self.split  # its positions in rows[b]
            row = self.load_row(rows_base, min(reach, Int32(CHUNK)), 0, lane, slot)
        queries_ok = Int32(1)
        # What every chunk's gather shares: the cache's shape, this thread's slot, the pair.
        shared = (n_rows, row_bytes, lane, slot, member, mask)
        # A pair's push cubin gathers chunk 0 before it awaits the query heads: it needs no
        # query, so its rows land while the heads are released and polled (~1 us at D >= 2
        # with the peers' heads there already). Single tiles (splits 1, 8) measured slower so
        # (rank-full +0.3 / +1 us per launch, their query loads behind the copies; session 42).
        early = exchange and self.tiles > 1
        if cutlass.const_expr(early):
            cute.arch.cluster_wait()  # the pair's barriers are armed for its multicasts
            if mine > 0:
                self.gather(mKV, sKV, sLive, bar, row, mine, 0, *shared)
                row = self.load_row(rows_base, mine, 1, lane, slot)
        if cutlass.const_expr(exchange):
            # The other ranks' heads of the tile come from their decodes.
            queries_ok = self.await_queries(
                mExchange, mRank, mStep, dcp, heads_own, query_flags_offset, b, sRed, x, part,
                q_tile * HEADS, HEADS, q_units, tid,
            )  # fmt: skip
            query = self.load_exchanged_query(q_own, q_mailbox, q_lo, q_hi, tid)
            if cutlass.const_expr(self.split == 8):
                dest = self.destination(
                    mLatent, mLse, mExchange, mRank, mStep, dcp, heads_own, latent_offset,
                    lse_offset, b, queries_ok,
                )  # fmt: skip
        else:
            query = self.load_query(mQ, b, q_tile, heads, tid)
        scale_log2 = ptx.load_global_f32(mScales.toint())
        # Read now, used by the merge: a global load there put its latency on the critical path.
        out_scale = ptx.load_global_f32(mScales.toint() + 4)
        if cutlass.const_expr(not exchange):
            n = ptx.load_global_i32(mValid.toint() + Int64(b) * 4)
        self.store_query(sQ, query, tid)
        if cutlass.const_expr(not exchange):
            mine = self.keys_of_cta(n, width, part)

        m_run = cute.make_rmem_tensor((2,), Float32)  # rows group, group + 8 (log2 units)
        m_run.fill(neg_inf)
        # This thread's share of the FP32 sums of P (rescaled with the accumulators), summed
        # over the CTA once after the last chunk rather than every chunk.
        l_part = cute.make_rmem_tensor((2,), Float32)
        l_part.fill(0.0)
        acc = cute.make_rmem_tensor((4, 4), Float32)  # [n-tile j, c fragment]
        acc.fill(0.0)
        # ldmatrix lane addresses of A (16 heads x 2 k16 blocks).
        a_row = lane % 8 + 8 * ((lane // 8) % 2)
        a_col = 16 * (lane // 16)
        chunks = (mine + CHUNK - 1) // CHUNK
        if cutlass.const_expr(not early):
            if cutlass.const_expr(self.tiles > 1):
                # The pair's multicasts land in this CTA: every barrier of the cluster is armed.
                cute.arch.cluster_wait()
            # Slot t's row index is loaded a chunk ahead of its gather.
            if chunks > 0:
                self.gather(mKV, sKV, sLive, bar, row, mine, 0, *shared)
                row = self.load_row(rows_base, mine, 1, lane, slot)
        for c in cutlass.range(0, chunks, unroll=1):
            stage = c % STAGES
            cute.arch.sync_threads()  # chunk c - 1's readers are done; chunk c's V zeros, flags
            if c + 1 < chunks:
                nxt = (c + 1) % STAGES
                sKVn, sLiven = sKV + nxt * (CHUNK * PITCH), sLive + nxt * (CHUNK * 4)
                self.gather(mKV, sKVn, sLiven, bar + 8 * nxt, row, mine, c + 1, *shared)
                row = self.load_row(rows_base, mine, c + 2, lane, slot)
            count = min(mine - c * CHUNK, Int32(CHUNK))
            span = (count + 31) // 32 * 32  # keys the PV steps read
            ptx.mbarrier_wait(bar + 8 * stage, (c // STAGES) % 2)
            sKVc = sKV + stage * (CHUNK * PITCH)
            sLivec = sLive + stage * (CHUNK * 4)

            # ---- QK: warp w, keys 8 w .. 8 w + 7 -------------------------------------
            s = cute.make_rmem_tensor((4,), Float32)
            s.fill(0.0)
            if span <= CHUNK // 2:
                self.qk(sQ, sKVc, sPart, s, span, SHORT_SLICES, lane, warp, a_row, a_col)
            else:
                self.qk(sQ, sKVc, sPart, s, span, LONG_SLICES, lane, warp, a_row, a_col)
            top = cute.make_rmem_tensor((2,), Float32)
            top.fill(neg_inf)
            for e in cutlass.range_constexpr(4):
                key = 8 * warp + 2 * quarter + e % 2
                alive = ptx.load_shared_u32(sLivec + 4 * key) != 0
                value = ptx.where(alive, s[e] * scale_log2, neg_inf)
                s[e] = value
                top[e // 2] = cute.arch.fmax(top[e // 2], value)
            for r in cutlass.range_constexpr(2):
                for shift in cutlass.range_constexpr(2):
                    other = cute.arch.shuffle_sync_bfly(top[r], offset=1 << shift)
                    top[r] = cute.arch.fmax(top[r], other)
            if quarter == 0:
                for r in cutlass.range_constexpr(2):
                    entry = red_index(r, warp % 4, warp // 4, group)
                    ptx.store_shared_f32(sRed + entry * 4, top[r])
            cute.arch.sync_threads()
            alpha = cute.make_rmem_tensor((2,), Float32)
            m_new = cute.make_rmem_tensor((2,), Float32)
            for r in cutlass.range_constexpr(2):
                chunk_max = over_warps(sRed, r, group, quarter, cute.arch.fmax)
                m_new[r] = cute.arch.fmax(m_run[r], chunk_max)
                rise = cute.math.exp2(m_run[r] - m_new[r], fastmath=True)
                alpha[r] = ptx.where(m_run[r] != neg_inf, rise, 1.0)

            # ---- P (F16, 448 at the running max) and its FP32 sums --------------------
            sums = cute.make_rmem_tensor((2,), Float32)
            sums.fill(0.0)
            if 8 * warp < span:
                for r in cutlass.range_constexpr(2):
                    # (s - max) first: exactly <= 0, so P <= 448 however large |s| is
                    # (s - (max - log2 448) can round up by an ulp of s and overflow).
                    shift = Float32(LOG2_P_SCALE)
                    p0 = ptx.where(
                        s[2 * r] != neg_inf,
                        cute.math.exp2((s[2 * r] - m_new[r]) + shift, fastmath=True),
                        0.0,
                    )
                    p1 = ptx.where(
                        s[2 * r + 1] != neg_inf,
                        cute.math.exp2((s[2 * r + 1] - m_new[r]) + shift, fastmath=True),
                        0.0,
                    )
                    sums[r] = p0 + p1
                    # Keys 8 warp + 2 quarter, + 1 at their P V positions (p_column).
                    column = p_column(8 * warp + 2 * quarter)
                    ptx.store_shared_u32(
                        sP + (group + 8 * r) * P_PITCH + 2 * column, ptx.f16x2(p0, p1)
                    )
            cute.arch.sync_threads()  # P complete
            for r in cutlass.range_constexpr(2):
                l_part[r] = l_part[r] * alpha[r] + sums[r]
                m_run[r] = m_new[r]
                for j in cutlass.range_constexpr(4):
                    for e in cutlass.range_constexpr(2):
                        acc[j, 2 * r + e] = acc[j, 2 * r + e] * alpha[r]

            # ---- PV: warp w, latent columns 32 w .. 32 w + 31 ------------------------
            # F16 m16n8k16 per 16 keys: P (F16) x V (E4M3 widened exactly). This thread's V
            # words are keys 4 quarter .. + 3 of the 16; as the MMA's k indices 2 quarter,
            # + 1, + 8, + 9 they need P in the same order, which p_column stored it in.
            # A loop over the span's 32-key steps rather than every step of a chunk under a
            # predicate: predicated-off steps still take issue slots, 16 warps' worth (at 64
            # keys per CTA, half of P V's). Unrolled by 2 it measured slower.
            col = 32 * warp + 4 * group
            for ks in cutlass.range(0, span // 32, unroll=1):
                for half in cutlass.range_constexpr(2):
                    first = 32 * ks + 16 * half
                    a = ptx.ldmatrix_x4(sP + a_row * P_PITCH + 2 * first + a_col)
                    words = []
                    for i in cutlass.range_constexpr(4):
                        key = first + 4 * quarter + i
                        words.append(ptx.load_shared_u32(sKVc + key * PITCH + col))
                    v = transpose4(words)
                    for j in cutlass.range_constexpr(4):
                        prev = tuple(acc[j, e] for e in range(4))
                        d = ptx.mma_f16(a, ptx.e4m3x4_to_f16(v[j]), prev)
                        for e in cutlass.range_constexpr(4):
                            acc[j, e] = d[e]

        # The sums of P: over the quad, then over the warps (sRed's sum half: free by now).
        sRedSum = sRed + QK_WARPS * HEADS * 4
        for r in cutlass.range_constexpr(2):
            for shift in cutlass.range_constexpr(2):
                l_part[r] = l_part[r] + cute.arch.shuffle_sync_bfly(l_part[r], offset=1 << shift)
            if quarter == 0:
                entry = red_index(r, warp % 4, warp // 4, group)
                ptx.store_shared_f32(sRedSum + entry * 4, l_part[r])
        cute.arch.sync_threads()  # also: every warp is done with the last chunk's rows
        l_run = [over_warps(sRedSum, r, group, quarter, lambda a, b: a + b) for r in range(2)]
        if cutlass.const_expr(self.split != 8):
            dest = self.destination(
                mLatent, mLse, mExchange, mRank, mStep, dcp, heads_own, latent_offset,
                lse_offset, b, queries_ok,
            )  # fmt: skip
        if cutlass.const_expr(self.clustered):
            # O / l as F16 pieces straight into their column owners' inboxes (this CTA's own
            # columns into its outbox in the free row buffers), and every CTA the stats.
            sOutbox = base + KV_OFFSET
            if cutlass.const_expr(self.tiles == 1):
                cute.arch.cluster_wait()  # every peer's inbound barrier is armed
            self.push_partial(
                sOutbox, sInbox, inbound, acc, l_run, warp, group, quarter, part, rank_base
            )
            if (warp == 0) & (quarter == 0):
                for r in cutlass.range_constexpr(2):
                    head = group + 8 * r
                    self.push_stats(
                        sStats, inbound, part, head, HEADS, m_run[r], l_run[r], rank_base
                    )
            ptx.mbarrier_wait_cluster(inbound, 0)  # every source's block of these columns
            cute.arch.sync_threads()  # this CTA's own block is complete in its outbox
            cute.arch.cluster_arrive_relaxed()
            self.merge_blocks(out_scale, dest, sOutbox, sInbox, sStats, tile, part, real, tid)
            cute.arch.cluster_wait()  # no CTA exits while a peer may still address its DSMEM
        else:
            self.store_rows(out_scale, dest, acc, m_run, l_run, tile, warp, group, quarter)
        # The exchange's flags cover a cluster's head tile: a pair's 32 heads.
        self.finish_push(dest, x, tile // self.tiles, HEADS * self.tiles, tid)

    @cute.jit
    def qk(self, sQ, sKVc, sPart, s, span, slices: int, lane, warp, a_row, a_col):
        """Into s, the chunk's S of keys 8 warp .. 8 warp + 7 (this thread's 4 values). Warp w
        computes its 16-key group's two 8-key tiles over its slice of the 36 k16 blocks
        (qk_role), keeps the tile of keys 8 (w % 8) .. and leaves the other partials in sPart
        ([2, warps, 32 lanes] x 4 f32; slot 0: the tile it does not keep; slot 1, in a short
        chunk: the tile it keeps, for warps 8 .. a warp < 8's); after one CTA barrier each
        tile's warp adds them (qk_sources). Warps past the span keep a partial: their keys are
        dead in sLive, so it never counts."""
        keys16, kslice = qk_role(warp, slices)
        blocks = BLOCKS // slices
        computes = 16 * keys16 < span
        if computes:
            partial = self.qk_tiles(sQ, sKVc, keys16, kslice * blocks, blocks, lane, a_row, a_col)
            low = warp % 2 == 0  # selects, not a runtime index (that would spill partial)
            kept = [ptx.where(low, partial[0, e], partial[1, e]) for e in range(4)]
            passed = [ptx.where(low, partial[1, e], partial[0, e]) for e in range(4)]
            ptx.store_shared_v4_f32(sPart + (warp * 32 + lane) * 16, passed)
            if cutlass.const_expr(slices == SHORT_SLICES):
                # Slot 1: slices 2 and 3 (warps 8 ..) keep a tile of a warp < 8 (the slot 1
                # entries of warps < 8 are written too, and never read).
                ptx.store_shared_v4_f32(sPart + ((QK_WARPS + warp) * 32 + lane) * 16, kept)
            for e in cutlass.range_constexpr(4):
                s[e] = kept[e]
        cute.arch.sync_threads()  # every partial is in sPart
        if cutlass.const_expr(slices == SHORT_SLICES):
            computes = computes & (warp < PAIRS)  # warps 8 .. hold no keys of a short chunk
        if computes:
            for source in qk_sources(warp, slices):
                other = ptx.load_shared_v4_f32(sPart + (source * 32 + lane) * 16)
                for e in cutlass.range_constexpr(4):
                    s[e] = s[e] + other[e]

    @cute.jit
    def qk_tiles(self, sQ, sKVc, keys16, first, blocks: int, lane, a_row, a_col):
        """The partial S of keys 16 keys16 .. + 15 (tiles t = 0, 1: keys 16 keys16 + 8 t ..,
        this thread's 4 values each) over k16 blocks first .. first + blocks - 1 (row bytes
        16 first ..): one A fragment per block for both tiles, one accumulator chain per tile."""
        partial = cute.make_rmem_tensor((2, 4), Float32)
        partial.fill(0.0)
        key_row = 16 * keys16 + lane % 8
        for j in cutlass.range_constexpr(blocks // 4):
            kb = first + 4 * j
            # Per tile 4 blocks of its 8 keys (lanes 8 i ..: block kb + i).
            k = [
                ptx.ldmatrix_x4(sKVc + (key_row + 8 * t) * PITCH + 16 * (kb + lane // 8))
                for t in range(2)
            ]
            for i in cutlass.range_constexpr(2):
                a = ptx.ldmatrix_x4(sQ + a_row * PITCH + 16 * (kb + 2 * i) + a_col)
                for h in cutlass.range_constexpr(2):
                    for t in cutlass.range_constexpr(2):
                        qk_block(partial, t, (a[2 * h], a[2 * h + 1]), k[t][2 * i + h])
        kb = first + blocks // 4 * 4
        if cutlass.const_expr(blocks % 4 >= 2):
            k = [
                ptx.ldmatrix_x2(sKVc + (key_row + 8 * t) * PITCH + 16 * (kb + (lane // 8) % 2))
                for t in range(2)
            ]
            a = ptx.ldmatrix_x4(sQ + a_row * PITCH + 16 * kb + a_col)
            for h in cutlass.range_constexpr(2):
                for t in cutlass.range_constexpr(2):
                    qk_block(partial, t, (a[2 * h], a[2 * h + 1]), k[t][h])
            kb = kb + 2
        if cutlass.const_expr(blocks % 2 == 1):
            # The odd last block: lanes 0-7 address tile 0's keys, 8-15 tile 1's.
            k = ptx.ldmatrix_x2(sKVc + (key_row + 8 * ((lane // 8) % 2)) * PITCH + 16 * kb)
            a = ptx.ldmatrix_x2(sQ + a_row * PITCH + 16 * kb)
            for t in cutlass.range_constexpr(2):
                qk_block(partial, t, a, k[t])
        return partial

    @cute.jit
    def keys_of_cta(self, n, width, part):
        """How many of a row's keys this CTA holds (positions part + split j) when the row has
        ``n`` valid of ``width`` (n clamped to [0, width])."""
        n = max(min(n, width), Int32(0))
        return (max(n - part, Int32(0)) + self.split - 1) // self.split

    @cute.jit
    def load_row(self, rows_base, limit, c, lane, slot):
        """Slot ``slot``'s row index of chunk c: rows[b, part + split j] (a push cubin: entry
        j of the CTA's list) for j = c CHUNK + slot if j < limit, else -1 (nothing read)."""
        row = Int32(-1)
        j = c * CHUNK + slot
        if (lane < SLOTS) & (j < limit):
            row = ptx.load_global_i32(rows_base + Int64(j) * self.row_step)
        return row

    @cute.jit
    def gather(
        self,
        mKV: cute.Pointer,
        sKV,
        sLive,
        bar,
        row,
        mine,
        c,
        n_rows,
        row_bytes,
        lane,
        slot,
        member,
        mask,
    ):
        """Chunk c's cache rows into sKV (bulk copies on ``bar``; the thread of slot t: key t):
        the first ROW bytes of each row, rows ``row_bytes`` apart in the cache.

        Skipped keys (out of range) and key slots past the chunk's count up to a 32-key step
        get a zero V row; every slot arrives on ``bar`` (copies with their row's bytes)."""
        count = min(mine - c * CHUNK, Int32(CHUNK))
        span = (count + 31) // 32 * 32
        live = (slot < count) & (row >= 0) & (row < n_rows)
        if live:
            ptx.mbarrier_arrive_expect_tx(bar, ROW)
            src = mKV.toint() + Int64(row) * row_bytes
            if cutlass.const_expr(self.tiles > 1):
                # The pair's first STAGES chunks: each CTA copies every other row into both
                # (a stage is reused from chunk STAGES on, when a peer may still read it).
                if c >= STAGES:
                    ptx.copy_g2s(sKV + slot * PITCH, src, ROW, bar)
                elif slot % self.tiles == member:
                    ptx.copy_g2s_multicast(sKV + slot * PITCH, src, ROW, bar, mask)
            else:
                ptx.copy_g2s(sKV + slot * PITCH, src, ROW, bar)
        elif lane < SLOTS:
            if slot < span:
                # V of a skipped or absent key: zero (its P is zero; stale bytes may be NaN).
                for k in cutlass.range_constexpr(LATENT // 16):
                    ptx.store_shared_v4(sKV + slot * PITCH + 16 * k, 0, 0, 0, 0)
                ptx.fence_proxy_async_shared()  # before a later chunk's bulk copy here
            ptx.mbarrier_arrive(bar)
        if lane < SLOTS:
            ptx.store_shared_u32(sLive + 4 * slot, Int32(live))

    @cute.jit
    def load_query(self, mQ: cute.Pointer, b, tile, heads, tid):
        """This thread's 16-byte pieces of the tile's 16 query rows (generic loads)."""
        q_base = mQ.toint() + (Int64(b) * heads + tile * HEADS) * ROW
        words = []
        for i in cutlass.range_constexpr(QUERY_STEPS):
            flat = min(tid + THREADS * i, Int32(HEADS * (ROW // 16) - 1))
            words.append(ptx.load_global_v4(q_base + Int64(flat) * 16))
        return words

    @cute.jit
    def load_exchanged_query(self, own, mailbox, lo, hi, tid):
        """load_query after the query heads' exchange: piece f from (own if lo <= f < hi else
        mailbox) + 16 f (generic loads: where peers wrote them, its acquire invalidated this
        SM's L1)."""
        words = []
        for i in cutlass.range_constexpr(QUERY_STEPS):
            flat = min(tid + THREADS * i, Int32(HEADS * (ROW // 16) - 1))
            base = ptx.where_i64((flat >= lo) & (flat < hi), own, mailbox)
            words.append(ptx.load_global_v4(base + Int64(flat) * 16))
        return words

    @cute.jit
    def store_query(self, sQ, words, tid):
        """The pieces of load_query into shared memory (rows at PITCH)."""
        pieces = ROW // 16
        for i in cutlass.range_constexpr(QUERY_STEPS):
            flat = tid + THREADS * i
            if flat < HEADS * pieces:
                q_row, piece = flat // pieces, flat % pieces
                w = words[i]
                ptx.store_shared_v4(sQ + q_row * PITCH + 16 * piece, w[0], w[1], w[2], w[3])

    @cute.jit
    def push_partial(
        self, sOutbox, sInbox, inbound, acc, l_run, warp, group, quarter, part, rank_base
    ):
        """This CTA's O / l (0 for a head without live keys) as F16 pieces (each thread's 8
        consecutive columns 32 w + 8 q .. of heads group, group + 8): a piece of a peer's
        columns straight into slot ``part`` of that peer's inbox (st.async on its inbound
        barrier), one of this CTA's own columns into its outbox block ``part``."""
        for r in cutlass.range_constexpr(2):
            head = group + 8 * r
            _, inverse = self.normaliser(Float32(1.0), l_run[r])
            # acc[j, 2 r + e]: column 32 w + 8 q + 4 e + j
            words = [
                ptx.f16x2(acc[j, 2 * r + e] * inverse, acc[j + 1, 2 * r + e] * inverse)
                for e in range(2)
                for j in (0, 2)
            ]
            column = 32 * warp + 8 * quarter
            owner = column // self.cols
            if owner == part:
                ptx.store_shared_v4(self.piece_at(sOutbox, part, head, column % self.cols), *words)
            else:
                slot = self.piece_at(sInbox, part, head, column % self.cols)
                rank = rank_base + owner
                ptx.push_v4(ptx.map_peer(slot, rank), *words, ptx.map_peer(inbound, rank))

    @cute.jit
    def merge_blocks(
        self,
        out_scale,
        dest,
        sOutbox,
        sInbox,
        sStats,
        tile,
        part,
        real,
        tid,
    ):
        """Columns part * cols .. + cols of the 16 heads over the cluster's F16 blocks, weighted
        by each source's sum at the common max, as BF16 (times out_scale), and the LSE (part 0):
        thread t takes piece t % (cols / 8) (8 columns) of head t / (cols / 8)."""
        pieces = self.cols // 8
        if tid < HEADS * pieces:
            head, piece = tid // pieces, tid % pieces
            top, total, merged = self.merge_sources(
                sOutbox, sInbox, sStats, HEADS, head, part, [8 * piece]
            )
            nonempty, inverse = self.normaliser(out_scale, total)
            # A phantom tile's heads would name owners past the exchange's: use tile 0's (no
            # store follows).
            own_head = ptx.where_i32(real, tile * HEADS + head, head)
            latent, lse_at, keep = self.row_target(dest, own_head)
            col = part * self.cols + 8 * piece
            words = [
                ptx.bf16x2(merged[2 * e] * inverse, merged[2 * e + 1] * inverse) for e in range(4)
            ]
            if keep & real:
                ptx.store_global_v4(latent + col * 2, words)
                if (part == 0) & (piece == 0):
                    # P was scaled by 448 = 2^LOG2_P_SCALE: so were the sums.
                    lse2 = self.log2_lse(nonempty, top - Float32(LOG2_P_SCALE), total)
                    self.store_lse(lse_at, lse2)

    @cute.jit
    def store_rows(self, out_scale, dest, acc, m_run, l_run, tile, warp, group, quarter):
        """split 1: this thread's columns 32 w + 8 q .. + 7 of heads group, group + 8 as BF16
        (times out_scale) straight from its accumulators, and the LSE (warp 0, quarter 0).
        Without peers its sums (over_warps) are the rows' whole sums: no merge, no staging in
        shared memory."""
        for r in cutlass.range_constexpr(2):
            head = group + 8 * r
            nonempty, inverse = self.normaliser(out_scale, l_run[r])
            latent, lse_at, keep = self.row_target(dest, tile * HEADS + head)
            if keep:
                # acc[j, 2 r + e]: column 32 w + 8 q + 4 e + j
                words = [
                    ptx.bf16x2(acc[j, 2 * r + e] * inverse, acc[j + 1, 2 * r + e] * inverse)
                    for e in range(2)
                    for j in (0, 2)
                ]
                ptx.store_global_v4(latent + (32 * warp + 8 * quarter) * 2, words)
                if (warp == 0) & (quarter == 0):
                    # P was scaled by 448 = 2^LOG2_P_SCALE: so were the sums.
                    lse2 = self.log2_lse(nonempty, m_run[r] - Float32(LOG2_P_SCALE), l_run[r])
                    self.store_lse(lse_at, lse2)
