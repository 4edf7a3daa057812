"""The exact top-k of the indexer's scores: a radix select on their order keys (sm_90a), in
CuTe DSL.

A cluster of C CTAs per verify row (grid: C * T, B; C in TOPK_CLUSTERS, the largest whose grid
fits one wave: index_lowering.topk_cluster), CTA r taking the r-th slice of the row's ``n``
order keys (``scores.row_limit`` of the request's length) (written by ``scores.py``; unsigned
order = the selection's order, 0 = no candidate). Where n > top_k, up to three histogram passes
over the keys' 11, 11 and 10-bit digits (most significant first) narrow the threshold key K*
down: each CTA counts its slice into its own shared histogram (shared atomics), adds its non-
zero bins into the cluster-wide sums, which CTA r of the cluster holds for the r-th chunk of
the bins (distributed shared memory), and after a cluster barrier every CTA reads the sums (one
16-byte load per thread) and runs the same threshold search, so all hold the same state. A pass
stops early once the threshold digit's keys are all taken. Then every CTA counts its slice's
taken keys (above K*, equal to K*: from its own passes' histograms, or by a scan where no pass
ran), the CTAs exchange those counts, and each writes, in position order, every key above K*
and the first ``remaining`` keys equal to K* of the row (the smaller positions: the tie rule),
each at its rank among the taken keys, from block-wide prefix counts: the output is the
selected positions in ascending order. Slots past the taken ones hold -1 (score -inf): rows
with fewer candidates than top_k. Any number of ties is exact: no candidate buffer.

Nothing is read before griddepcontrol.wait (PDL: the scores kernel releases it).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from jax_sparse_mla.kernel import ptx
from jax_sparse_mla.kernel.index import ptx as index_ptx
from jax_sparse_mla.kernel.index.config import (
    BINS,
    COUNTS_OFFSET,
    DIGITS,
    ELEMENTS,
    HIST_OFFSET,
    REDUCED_OFFSET,
    SCAN_OFFSET,
    SEARCH_OFFSET,
    STASH_OFFSET,
    STASHED_STEPS,
    STATE_OFFSET,
    STEP,
    TOPK_SMEM,
    TOPK_THREADS,
    TOTALS_OFFSET,
    VECTORS,
    WARPS,
)
from jax_sparse_mla.kernel.index.scores import row_limit

SIGN = -(2**31)
BINS_EACH = BINS // TOPK_THREADS  # histogram bins per thread: one 16-byte vector
assert BINS_EACH == 4
assert VECTORS * WARPS == 2 * 32  # emit's block scan: two partials per lane of one warp


def signed(value: int) -> int:
    """A 32-bit pattern as the Int32 constant of the same bits."""
    return value - (1 << 32) if value >= 1 << 31 else value


def vector_position(start, v, thread):
    """The first key position of ``thread``'s vector v (4 keys) of the step at ``start``: the
    step's vectors go to the threads in turn (v * TOPK_THREADS + thread), so a warp's loads
    are consecutive and a short slice fills the first vector of every thread."""
    return start + (v * TOPK_THREADS + thread) * 4


@cute.jit
def unsigned_greater(a, b):
    """a > b as unsigned 32-bit integers."""
    return (a ^ SIGN) > (b ^ SIGN)


@cute.jit
def key_score(key):
    """The score of an order key (the inverse of scores.order_key; NaN for key 1)."""
    return index_ptx.bits_float(ptx.where_i32(key < 0, key & 0x7FFFFFFF, key ^ -1))


@cute.jit
def cluster_sync():
    """A cluster barrier (release / acquire: shared and global writes before it are seen by
    every CTA of the cluster after it)."""
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()


class RadixTopk:
    """Exact top-k positions of every verify row (ABI: config.TOPK_PARAMS), ``cluster``
    CTAs per row."""

    def __init__(self, cluster: int):
        self.cluster = cluster
        self.chunk = BINS // cluster  # bins whose cluster-wide sums each CTA holds

    @cute.jit
    def sync(self):
        """A barrier of the row's CTAs (the cluster's, or the CTA's for one CTA per row)."""
        if cutlass.const_expr(self.cluster > 1):
            cluster_sync()
        else:
            cute.arch.sync_threads()

    @cute.jit
    def __call__(
        self,
        mOrder: cute.Pointer,
        mLengths: cute.Pointer,
        mRank: cute.Pointer,
        mTokens: cute.Pointer,
        mScores: cute.Pointer,
        steps: Int32,
        pitch: Int32,
        top_k: Int32,
        capacity: Int32,
        dcp_size: Int32,
    ):
        self.kernel(
            mOrder, mLengths, mRank, mTokens, mScores, steps, pitch, top_k, capacity, dcp_size
        ).launch(
            grid=(self.cluster, 1, 1),
            block=(TOPK_THREADS, 1, 1),
            cluster=(self.cluster, 1, 1),
            smem=TOPK_SMEM,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(
        self,
        mOrder: cute.Pointer,
        mLengths: cute.Pointer,
        mRank: cute.Pointer,
        mTokens: cute.Pointer,
        mScores: cute.Pointer,
        steps: Int32,
        pitch: Int32,
        top_k: Int32,
        capacity: Int32,
        dcp_size: Int32,
    ):
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate(TOPK_SMEM, 16).toint()
        sHist, sReduced = base + HIST_OFFSET, base + REDUCED_OFFSET
        sScan, sCounts = base + SCAN_OFFSET, base + COUNTS_OFFSET
        sSearch, sState = base + SEARCH_OFFSET, base + STATE_OFFSET
        sTotals, sStash = base + TOTALS_OFFSET, base + STASH_OFFSET
        tid, _, _ = cute.arch.thread_idx()
        x, b, _ = cute.arch.block_idx()
        part, t = x % self.cluster, x // self.cluster
        # Every pass's histogram zero before its first add, while the scores kernel finishes.
        self.zero(sHist, len(DIGITS) * BINS, tid)
        if cutlass.const_expr(self.cluster > 1):
            # The peers add into the sums of every pass: zero before the cluster barrier
            # that the wait below completes.
            self.zero(sReduced, len(DIGITS) * self.chunk, tid)
            cute.arch.cluster_arrive()
        else:
            cute.arch.sync_threads()
        cute.arch.griddepcontrol_wait()

        row = Int64(b) * steps + t
        length = ptx.load_global_i32(mLengths.toint() + Int64(b) * 4)
        rank = ptx.load_global_i32(mRank.toint())
        n = row_limit(length, rank, t, steps, capacity, dcp_size)
        keys = mOrder.toint() + row * pitch * 4
        tokens = mTokens.toint() + row * top_k * 4
        scores = mScores.toint() + row * top_k * 4
        # This CTA's slice [lo, hi) of the row: whole 16-byte vectors of keys.
        width = (n + self.cluster * ELEMENTS - 1) // (self.cluster * ELEMENTS) * ELEMENTS
        lo = part * width
        hi = min(n, lo + width)
        held = cute.make_rmem_tensor((ELEMENTS,), Int32)  # the slice's first step
        first = self.load_step(keys, hi, lo, tid)
        for e in cutlass.range_constexpr(ELEMENTS):
            held[e] = first[e]
        if hi - lo > STEP:  # the next steps into shared memory, read from L2 once
            for s in cutlass.range_constexpr(STASHED_STEPS):
                if lo + (s + 1) * STEP < hi:  # a step past the slice is never read
                    self.stash_step(keys, hi, lo + (s + 1) * STEP, sStash + s * STEP * 4, tid)
            index_ptx.cp_async_commit()
        # Every slot empty first; the taken keys overwrite theirs after the cluster barriers
        # below (which order these stores before them).
        for i in cutlass.range(part * TOPK_THREADS + tid, top_k, TOPK_THREADS * self.cluster):
            ptx.store_global_b32(tokens + Int64(i) * 4, -1)
            ptx.store_global_f32(scores + Int64(i) * 4, Float32(-math.inf))
        if cutlass.const_expr(self.cluster > 1):
            cute.arch.cluster_wait()  # every peer's sums are zero
        index_ptx.cp_async_wait(0)  # this thread's stashed keys landed

        # Selection state: keys k with (k & mask) > prefix (unsigned) are taken, and of those
        # with (k & mask) == prefix the first `remaining` by position. n <= top_k: all.
        prefix, mask, remaining = Int32(0), Int32(-1), Int32(0)
        if n > top_k:
            remaining = top_k
            mask = Int32(0)
            settled = Int32(0)
            for d in cutlass.range_constexpr(len(DIGITS)):
                shift, bits = DIGITS[d]
                if settled == 0:
                    hist = sHist + d * BINS * 4
                    self.histogram(hist, keys, lo, hi, held, sStash, prefix, mask, shift, bits, tid)
                    counts = self.row_counts(hist, sReduced + d * self.chunk * 4, tid)
                    digit, above, inside = self.threshold(
                        counts, sSearch + d * WARPS * 4, sState + d * 16, remaining, tid
                    )
                    prefix = prefix | (digit << shift)
                    mask = mask | signed(((1 << bits) - 1) << shift)
                    remaining = remaining - above
                    settled = ptx.where_i32(inside == remaining, 1, 0)
        run_above, run_equal = self.offsets(
            sCounts, sTotals, sHist, n > top_k, keys, lo, hi, held, sStash, prefix, mask, part, tid
        )
        self.emit(
            sScan, keys, lo, hi, held, sStash, prefix, mask, remaining, run_above, run_equal,
            tokens, scores, top_k, tid,
        )  # fmt: skip
        if cutlass.const_expr(self.cluster > 1):
            cute.arch.cluster_wait()  # no CTA exits while a peer may still read its counts

    @cute.jit
    def zero(self, region, words: int, tid):
        """Zeroes ``words`` (a multiple of 4) u32 of shared memory from ``region``."""
        vectors = words // 4
        for i in cutlass.range_constexpr(-(-vectors // TOPK_THREADS)):
            if tid + i * TOPK_THREADS < vectors:
                ptx.store_shared_v4(region + (tid + i * TOPK_THREADS) * 16, 0, 0, 0, 0)

    @cute.jit
    def histogram(self, sHist, keys, lo, hi, held, sStash, prefix, mask, shift, bits, tid):
        """Adds to sHist[d] (zero before the pass) how many candidate keys (not 0) of [lo, hi)
        with (key & mask) == prefix have digit d (bits ``shift`` .. ``shift + bits``). Plain
        predicated atomics: the first pass's keys crowd into a few bins, yet aggregating a
        warp's equal digits by match.any cost more than the atomics' queueing (H200,
        64x1x32768: top-k 32.3 us with it, 21.7 without), and 8 copies of the histogram
        gained nothing."""
        warp = tid // 32
        for start in cutlass.range(lo, hi, STEP, unroll=1):
            words = self.step_keys(keys, lo, hi, start, held, sStash, tid)
            for v in cutlass.range_constexpr(VECTORS):
                # A warp whose vectors all lie past hi skips them (warp-uniform: the short
                # slices of large clusters fill only the first vectors).
                if vector_position(start, v, warp * 32) < hi:
                    for w in cutlass.range_constexpr(4):
                        key = words[4 * v + w]
                        hit = (key != 0) & ((key & mask) == prefix)
                        digit = (key >> shift) & ((1 << bits) - 1)
                        index_ptx.shared_add_if(hit, sHist + digit * 4, 1)

    @cute.jit
    def step_keys(self, keys, lo, hi, start, held, sStash, tid):
        """This thread's keys of the step at ``start``: the slice's first step from ``held``
        (read once, at the start: most slices are one step, so the passes re-read nothing),
        the next STASHED_STEPS from ``sStash`` (stash_step's), later ones from memory."""
        words = cute.make_rmem_tensor((ELEMENTS,), Int32)
        if start == lo:
            for e in cutlass.range_constexpr(ELEMENTS):
                words[e] = held[e]
        elif start - lo <= STASHED_STEPS * STEP:
            stash = sStash + ((start - lo) // STEP - 1) * STEP * 4 + tid * 16
            for v in cutlass.range_constexpr(VECTORS):
                vector = ptx.load_shared_v4(stash + v * TOPK_THREADS * 16)
                for w in cutlass.range_constexpr(4):
                    words[4 * v + w] = vector[w]
        else:
            loaded = self.load_step(keys, hi, start, tid)
            for e in cutlass.range_constexpr(ELEMENTS):
                words[e] = loaded[e]
        return words

    @cute.jit
    def stash_step(self, keys, hi, start, stash, tid):
        """cp.async of this thread's vectors of the step at ``start`` into ``stash``, vector v
        at v * TOPK_THREADS + tid (as in memory); zeros for the keys at hi and past it (not
        read)."""
        for v in cutlass.range_constexpr(VECTORS):
            first = vector_position(start, v, tid)
            index_ptx.cp_async_16(
                stash + (v * TOPK_THREADS + tid) * 16,
                keys + Int64(first) * 4,
                min(max(hi - first, 0), 4) * 4,
            )

    @cute.jit
    def load_step(self, keys, hi, start, tid):
        """This thread's ELEMENTS keys of a step: its VECTORS 16-byte vectors (vector_position;
        all in flight; one wholly past hi is not read: the row's pitch covers a partial
        one), with 0 (no candidate) for the keys at hi and past it, so that no pass checks
        positions."""
        words = []
        for v in cutlass.range_constexpr(VECTORS):
            first = vector_position(start, v, tid)
            vector = index_ptx.load_global_v4_if(first < hi, keys + Int64(first) * 4)
            room = hi - first
            words.extend(ptx.where_i32(w < room, vector[w], 0) for w in range(4))
        return words

    @cute.jit
    def row_counts(self, sHist, sReduced, tid):
        """The row's counts of bins BINS_EACH * tid ... (+ BINS_EACH): this CTA's histogram,
        or for a cluster the sums of every CTA's, which this thread adds into the CTA
        holding its chunk of the bins (``sReduced``: this pass's sums, zero) and reads back
        after a cluster barrier."""
        cute.arch.sync_threads()  # this CTA's histogram is complete
        mine = ptx.load_shared_v4(sHist + tid * BINS_EACH * 4)
        counts = mine
        if cutlass.const_expr(self.cluster > 1):
            bin_ = tid * BINS_EACH
            sums = ptx.map_peer(sReduced + bin_ % self.chunk * 4, bin_ // self.chunk)
            for i in cutlass.range_constexpr(BINS_EACH):
                if mine[i] != 0:
                    index_ptx.cluster_add(sums + i * 4, mine[i])
            cluster_sync()  # every CTA's counts are added
            counts = index_ptx.load_cluster_v4(sums)
        return counts

    @cute.jit
    def threshold(self, counts, sScan, sState, remaining, tid):
        """(digit, above, inside) from the row's histogram (``counts``: this thread's bins,
        see row_counts): the digit whose keys hold the remaining-th largest, how many keys
        have a larger digit, and how many that digit (one thread of each CTA finds it; every
        CTA the same). ``sScan`` and ``sState`` are this pass's own."""
        warp, lane = tid // 32, tid % 32
        mine = Int32(0)
        for i in cutlass.range_constexpr(BINS_EACH):
            mine = mine + counts[i]
        # Suffix sums: keys in the bins of this thread and of the warp's higher lanes.
        suffix = mine
        for shift in cutlass.range_constexpr(5):
            other = cute.arch.shuffle_sync_down(suffix, offset=1 << shift)
            suffix = suffix + ptx.where_i32(lane + (1 << shift) < 32, other, 0)
        if lane == 0:
            ptx.store_shared_u32(sScan + warp * 4, suffix)
        if tid == 0:
            # Fewer candidates than remaining: no digit holds the remaining-th; take all.
            self.store_state(sState, 0, 0, remaining)
        cute.arch.sync_threads()
        # Lane l (< WARPS) reads warp l's total; the warp sums those of the higher warps.
        partial = ptx.load_shared_u32(sScan + (lane % WARPS) * 4)
        higher = cute.arch.warp_redux_sync(
            ptx.where_i32((lane < WARPS) & (lane > warp), partial, 0), "add"
        )
        above = higher + suffix - mine  # keys in the bins above this thread's
        for i in cutlass.range_constexpr(BINS_EACH - 1, -1, -1):
            if (above < remaining) & (remaining <= above + counts[i]):
                self.store_state(sState, BINS_EACH * tid + i, above, counts[i])
            above = above + counts[i]
        cute.arch.sync_threads()
        state = [ptx.load_shared_u32(sState + i * 4) for i in range(3)]
        return state[0], state[1], state[2]

    @cute.jit
    def store_state(self, sState, digit, above, inside):
        ptx.store_shared_u32(sState, digit)
        ptx.store_shared_u32(sState + 4, above)
        ptx.store_shared_u32(sState + 8, inside)

    @cute.jit
    def offsets(
        self,
        sCounts,
        sTotals,
        sHist,
        selecting,
        keys,
        lo,
        hi,
        held,
        sStash,
        prefix,
        mask,
        part,
        tid,
    ):
        """(above, equal): how many candidate keys above / equal to the threshold the slices
        before this CTA's hold (its taken keys' ranks start there); with ``selecting`` (the
        passes ran) this CTA's own counts come from its pass histograms, which count exactly
        the keys ``classify`` would. Arrives on the cluster barrier that the kernel's last
        wait completes."""
        warp, lane = tid // 32, tid % 32
        above, equal = Int32(0), Int32(0)
        if selecting:
            # From this CTA's own histograms (untouched since their passes): a key is above
            # K* where its digits match the prefix up to pass d and its digit d is larger;
            # equal where all the passes' digits match: the last pass's threshold bin.
            for d in cutlass.range_constexpr(len(DIGITS)):
                shift, bits = DIGITS[d]
                if (mask & signed(((1 << bits) - 1) << shift)) != 0:  # pass d ran
                    digit = (prefix >> shift) & ((1 << bits) - 1)
                    local = ptx.load_shared_v4(sHist + d * BINS * 4 + tid * BINS_EACH * 4)
                    last = Int32(0)
                    for i in cutlass.range_constexpr(BINS_EACH):
                        above = above + ptx.where_i32(BINS_EACH * tid + i > digit, local[i], 0)
                        last = last + ptx.where_i32(BINS_EACH * tid + i == digit, local[i], 0)
                    equal = last
        else:
            for start in cutlass.range(lo, hi, STEP, unroll=1):
                words = self.step_keys(keys, lo, hi, start, held, sStash, tid)
                for e in cutlass.range_constexpr(ELEMENTS):
                    kind = self.classify(words[e], prefix, mask)
                    above = above + (kind >> 16)
                    equal = equal + (kind & 0xFFFF)
        above = cute.arch.warp_redux_sync(above, "add")
        equal = cute.arch.warp_redux_sync(equal, "add")
        if lane == 0:
            ptx.store_shared_u32(sCounts + warp * 4, above)
            ptx.store_shared_u32(sCounts + (WARPS + warp) * 4, equal)
        cute.arch.sync_threads()
        if tid == 0:
            above, equal = Int32(0), Int32(0)
            for w in cutlass.range_constexpr(WARPS):
                above = above + ptx.load_shared_u32(sCounts + w * 4)
                equal = equal + ptx.load_shared_u32(sCounts + (WARPS + w) * 4)
            ptx.store_shared_u32(sTotals, above)
            ptx.store_shared_u32(sTotals + 4, equal)
        self.sync()  # every CTA's counts are in place
        run_above, run_equal = Int32(0), Int32(0)
        if cutlass.const_expr(self.cluster > 1):
            # Lane p reads the counts of peer p if it comes before this CTA; the warp sums.
            if lane < part:
                counts = ptx.map_peer(sTotals, lane)
                run_above = index_ptx.load_cluster_u32(counts)
                run_equal = index_ptx.load_cluster_u32(counts + 4)
            run_above = cute.arch.warp_redux_sync(run_above, "add")
            run_equal = cute.arch.warp_redux_sync(run_equal, "add")
            cute.arch.cluster_arrive_relaxed()  # this CTA is done reading its peers' counts
        return run_above, run_equal

    @cute.jit
    def emit(
        self, sScan, keys, lo, hi, held, sStash, prefix, mask, remaining, run_above, run_equal,
        tokens, scores, top_k, tid,
    ):  # fmt: skip
        """Writes the slice's taken keys' positions and scores in position order: a key above
        the threshold at rank (above before it) + min(equal before it, remaining), an equal
        key (of the first ``remaining``) at (above before it) + (equal before it). A step
        wholly inside the slice runs emit_step unguarded; only a slice's last, partial step
        checks which of its vectors lie past hi (short slices fill only the first ones)."""
        parity = Int32(0)
        totals = cute.make_rmem_tensor((2,), Int32)  # the keys above / equal before the step
        totals[0], totals[1] = run_above, run_equal
        for start in cutlass.range(lo, hi, STEP, unroll=1):
            words = self.step_keys(keys, lo, hi, start, held, sStash, tid)
            sStep = sScan + parity * VECTORS * WARPS * 4
            if hi - start >= STEP:
                self.emit_step(sStep, totals, words, start, hi, prefix, mask, remaining, tokens,
                               scores, top_k, tid, True)  # fmt: skip
            else:
                self.emit_step(sStep, totals, words, start, hi, prefix, mask, remaining, tokens,
                               scores, top_k, tid, False)  # fmt: skip
            parity = parity ^ 1

    @cute.jit
    def emit_step(
        self, sStep, totals, words, start, hi, prefix, mask, remaining, tokens, scores, top_k,
        tid, full: cutlass.Constexpr,
    ):  # fmt: skip
        """emit's work on the keys ``words`` of the step at ``start``, the counts of taken
        keys before them in ``totals`` (advanced past them); with ``full`` every vector holds
        keys before hi, else a vector wholly past hi (CTA-uniform) skips its classify, scan
        and stores, and counts 0."""
        warp, lane = tid // 32, tid % 32
        positions = [vector_position(start, e // 4, tid) + e % 4 for e in range(ELEMENTS)]
        live = [True] * VECTORS
        if cutlass.const_expr(not full):
            live = [vector_position(start, v, 0) < hi for v in range(VECTORS)]
        kinds = cute.make_rmem_tensor((ELEMENTS,), Int32)
        mine = cute.make_rmem_tensor((VECTORS,), Int32)
        inclusive = cute.make_rmem_tensor((VECTORS,), Int32)
        kinds.fill(0)
        mine.fill(0)
        inclusive.fill(0)
        # Block-wide exclusive prefix of the above / equal counts (16 bits each: a step holds
        # STEP < 2**15 keys) in position order: vector by vector, and within a vector over the
        # threads (a warp scan, then the warps' totals in shared memory).
        for v in cutlass.range_constexpr(VECTORS):
            if live[v]:
                for w in cutlass.range_constexpr(4):
                    e = 4 * v + w
                    kinds[e] = self.classify(words[e], prefix, mask)
                count = kinds[4 * v] + kinds[4 * v + 1] + kinds[4 * v + 2] + kinds[4 * v + 3]
                running = count
                for shift in cutlass.range_constexpr(5):
                    other = cute.arch.shuffle_sync_up(running, offset=1 << shift)
                    running = running + ptx.where_i32(lane >= (1 << shift), other, 0)
                mine[v] = count
                inclusive[v] = running
            if lane == 31:
                ptx.store_shared_u32(sStep + (v * WARPS + warp) * 4, inclusive[v])
        cute.arch.sync_threads()  # one barrier per step: the two parities alternate
        # The VECTORS * WARPS partials in (v, warp) order: lane l holds entries 2l, 2l+1;
        # one warp-wide inclusive scan, then each thread fetches entry v * WARPS + warp.
        pa = ptx.load_shared_u32(sStep + lane * 8)
        pb = ptx.load_shared_u32(sStep + lane * 8 + 4)
        pair = pa + pb
        scan = pair
        for shift in cutlass.range_constexpr(5):
            other = cute.arch.shuffle_sync_up(scan, offset=1 << shift)
            scan = scan + ptx.where_i32(lane >= (1 << shift), other, 0)
        total = cute.arch.shuffle_sync(scan, 31)
        exclusive = ptx.where_i32(warp % 2 == 0, scan - pair, scan - pb)
        for v in cutlass.range_constexpr(VECTORS):
            lower = cute.arch.shuffle_sync(exclusive, v * (WARPS // 2) + warp // 2)
            if live[v]:
                before = lower + inclusive[v] - mine[v]
                above = totals[0] + (before >> 16)
                equal = totals[1] + (before & 0xFFFF)
                for w in cutlass.range_constexpr(4):
                    kind = kinds[4 * v + w]
                    # kind 1 << 16: taken; kind 1: taken while equal < remaining, and then
                    # min(equal, remaining) == equal: one rank formula for both.
                    taken = kind > ptx.where_i32(equal < remaining, 0, 1)
                    rank = above + min(equal, remaining)
                    if taken & (rank < top_k):
                        ptx.store_global_b32(tokens + Int64(rank) * 4, positions[4 * v + w])
                        ptx.store_global_f32(scores + Int64(rank) * 4, key_score(words[4 * v + w]))
                    above = above + (kind >> 16)
                    equal = equal + (kind & 0xFFFF)
        totals[0] = totals[0] + (total >> 16)
        totals[1] = totals[1] + (total & 0xFFFF)

    @cute.jit
    def classify(self, key, prefix, mask):
        """1 << 16 for a candidate key (not 0: the keys past the slice are 0 in step_keys)
        above the threshold, 1 for one equal to it under the mask, else 0. Above implies not
        0 (the masked key exceeds the prefix)."""
        masked = key & mask
        above = unsigned_greater(masked, prefix)
        equal = (key != 0) & (masked == prefix)
        return ptx.where_i32(above, 1 << 16, ptx.where_i32(equal, 1, 0))
