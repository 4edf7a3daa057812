"""The exact top-k of the indexer's scores: a radix select on their order keys (sm_90a), in
CuTe DSL.

One CTA of 1024 threads per verify row (grid: T, B) over the row's ``n = limits[b, t]`` order
keys (written by ``scores.py``; unsigned order = the selection's order, 0 = no candidate).
Where n > top_k, up to three histogram passes over the keys' 11, 11 and 10-bit digits (most
significant first; a warp's lanes with the same digit add once, through match.any) narrow
the threshold key K* down and count how many keys above it are taken; a pass stops early
once the threshold digit's keys are all taken. The last pass writes, in position order, every
key above K* and the first ``remaining`` keys equal to K* (the smaller positions: the tie
rule), each at its rank among the taken keys, from block-wide prefix counts: the output is
the selected positions in ascending order. Slots past the taken ones hold -1 (score -inf):
rows with fewer candidates than top_k. Any number of ties is exact: no candidate buffer.

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
    DIGITS,
    HIST_OFFSET,
    SCAN_OFFSET,
    STATE_OFFSET,
    STEP,
    TOPK_SMEM,
    TOPK_THREADS,
    VECTORS,
    WARPS,
)

SIGN = -(2**31)
BINS_EACH = BINS // TOPK_THREADS  # histogram bins per thread in the threshold search
ELEMENTS = VECTORS * 4  # order keys per thread and step
assert BINS_EACH == 2


def signed(value: int) -> int:
    """A 32-bit pattern as the Int32 constant of the same bits."""
    return value - (1 << 32) if value >= 1 << 31 else value


@cute.jit
def unsigned_greater(a, b):
    """a > b as unsigned 32-bit integers."""
    return (a ^ SIGN) > (b ^ SIGN)


@cute.jit
def key_score(key):
    """The score of an order key (the inverse of scores.order_key; NaN for key 1)."""
    return index_ptx.bits_float(ptx.where_i32(key < 0, key & 0x7FFFFFFF, key ^ -1))


class RadixTopk:
    """Exact top-k positions of every verify row (ABI: config.TOPK_PARAMS)."""

    @cute.jit
    def __call__(
        self,
        mOrder: cute.Pointer,
        mLimits: cute.Pointer,
        mTokens: cute.Pointer,
        mScores: cute.Pointer,
        steps: Int32,
        pitch: Int32,
        top_k: Int32,
    ):
        self.kernel(mOrder, mLimits, mTokens, mScores, steps, pitch, top_k).launch(
            grid=(1, 1, 1), block=(TOPK_THREADS, 1, 1), smem=TOPK_SMEM, use_pdl=True
        )

    @cute.kernel
    def kernel(
        self,
        mOrder: cute.Pointer,
        mLimits: cute.Pointer,
        mTokens: cute.Pointer,
        mScores: cute.Pointer,
        steps: Int32,
        pitch: Int32,
        top_k: Int32,
    ):
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate(TOPK_SMEM, 16).toint()
        sHist, sScan, sState = base + HIST_OFFSET, base + SCAN_OFFSET, base + STATE_OFFSET
        tid, _, _ = cute.arch.thread_idx()
        t, b, _ = cute.arch.block_idx()
        cute.arch.griddepcontrol_wait()

        row = Int64(b) * steps + t
        n = ptx.load_global_i32(mLimits.toint() + row * 4)
        keys = mOrder.toint() + row * pitch * 4
        tokens = mTokens.toint() + row * top_k * 4
        scores = mScores.toint() + row * top_k * 4
        # Every slot empty first; the taken keys overwrite theirs after the barriers below.
        for i in cutlass.range(tid, top_k, TOPK_THREADS, unroll=1):
            ptx.store_global_b32(tokens + Int64(i) * 4, -1)
            ptx.store_global_f32(scores + Int64(i) * 4, Float32(-math.inf))

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
                    self.histogram(sHist, keys, n, prefix, mask, shift, bits, tid)
                    digit, above, inside = self.threshold(sHist, sScan, sState, remaining, tid)
                    prefix = prefix | (digit << shift)
                    mask = mask | signed(((1 << bits) - 1) << shift)
                    remaining = remaining - above
                    settled = ptx.where_i32(inside == remaining, 1, 0)
        self.emit(sScan, keys, n, prefix, mask, remaining, tokens, scores, top_k, tid)

    @cute.jit
    def histogram(self, sHist, keys, n, prefix, mask, shift, bits, tid):
        """sHist[d] = how many of the first n candidate keys (not 0) with (key & mask) ==
        prefix have digit d (bits ``shift`` .. ``shift + bits``)."""
        for i in cutlass.range_constexpr(BINS_EACH):
            ptx.store_shared_u32(sHist + (tid + TOPK_THREADS * i) * 4, 0)
        cute.arch.sync_threads()
        for start in cutlass.range(0, n, STEP, unroll=1):
            words = self.load_step(keys, n, start, tid)
            for e in cutlass.range_constexpr(ELEMENTS):
                position = start + (tid + TOPK_THREADS * (e // 4)) * 4 + e % 4
                key = words[e]
                hit = (position < n) & (key != 0) & ((key & mask) == prefix)
                # Lanes that miss vote for bin -1, which nobody adds to.
                digit = ptx.where_i32(hit, (key >> shift) & ((1 << bits) - 1), -1)
                peers = index_ptx.match_any(digit)
                lane = tid % 32
                leader = (peers & ((1 << lane) - 1)) == 0  # the lowest lane of its group
                if hit & leader:
                    index_ptx.shared_add(sHist + digit * 4, cute.arch.popc(peers))
        cute.arch.sync_threads()

    @cute.jit
    def load_step(self, keys, n, start, tid):
        """This thread's ELEMENTS keys of a step (16-byte loads, VECTORS in flight; a vector
        wholly past n is not read: the row's pitch covers a partial one)."""
        words = []
        for v in cutlass.range_constexpr(VECTORS):
            first = start + (tid + TOPK_THREADS * v) * 4
            words.extend(index_ptx.load_global_v4_if(first < n, keys + Int64(first) * 4))
        return words

    @cute.jit
    def threshold(self, sHist, sScan, sState, remaining, tid):
        """(digit, above, inside): the digit whose keys hold the remaining-th largest, how
        many keys have a larger digit, and how many that digit (one thread finds it)."""
        warp, lane = tid // 32, tid % 32
        low = ptx.load_shared_u32(sHist + (2 * tid) * 4)
        high = ptx.load_shared_u32(sHist + (2 * tid + 1) * 4)
        mine = low + high
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
        higher = Int32(0)
        for w in cutlass.range_constexpr(WARPS):
            higher = higher + ptx.where_i32(w > warp, ptx.load_shared_u32(sScan + w * 4), 0)
        above_high = higher + suffix - mine  # keys in bins above 2 tid + 1
        above_low = above_high + high
        if (above_high < remaining) & (remaining <= above_high + high):
            self.store_state(sState, 2 * tid + 1, above_high, high)
        if (above_low < remaining) & (remaining <= above_low + low):
            self.store_state(sState, 2 * tid, above_low, low)
        cute.arch.sync_threads()
        state = [ptx.load_shared_u32(sState + i * 4) for i in range(3)]
        cute.arch.sync_threads()  # sScan and sState are free again
        return state[0], state[1], state[2]

    @cute.jit
    def store_state(self, sState, digit, above, inside):
        ptx.store_shared_u32(sState, digit)
        ptx.store_shared_u32(sState + 4, above)
        ptx.store_shared_u32(sState + 8, inside)

    @cute.jit
    def emit(self, sScan, keys, n, prefix, mask, remaining, tokens, scores, top_k, tid):
        """Writes the taken keys' positions and scores in position order: a key above the
        threshold at rank (above before it) + min(equal before it, remaining), an equal key
        (of the first ``remaining``) at (above before it) + (equal before it)."""
        warp, lane = tid // 32, tid % 32
        run_above, run_equal = Int32(0), Int32(0)
        parity = Int32(0)
        for start in cutlass.range(0, n, STEP, unroll=1):
            words = self.load_step(keys, n, start, tid)
            # Block-wide exclusive prefix counts of above / equal keys (packed in 16 bits
            # each: 4096 keys per scan) in position order: this thread's keys are (tid +
            # 1024 v) * 4 + j, so one scan per vector v.
            for v in cutlass.range_constexpr(VECTORS):
                mine = Int32(0)
                for j in cutlass.range_constexpr(4):
                    mine = mine + self.classify(words[4 * v + j], start, 4 * v + j, n, prefix,
                                                mask, tid)  # fmt: skip
                inclusive = mine
                for shift in cutlass.range_constexpr(5):
                    other = cute.arch.shuffle_sync_up(inclusive, offset=1 << shift)
                    inclusive = inclusive + ptx.where_i32(lane >= (1 << shift), other, 0)
                slot = sScan + (parity * WARPS + warp) * 4
                if lane == 31:
                    ptx.store_shared_u32(slot, inclusive)
                cute.arch.sync_threads()
                lower, total = Int32(0), Int32(0)
                for w in cutlass.range_constexpr(WARPS):
                    part = ptx.load_shared_u32(sScan + (parity * WARPS + w) * 4)
                    lower = lower + ptx.where_i32(w < warp, part, 0)
                    total = total + part
                before = lower + inclusive - mine
                above = run_above + (before >> 16)
                equal = run_equal + (before & 0xFFFF)
                for j in cutlass.range_constexpr(4):
                    key = words[4 * v + j]
                    position = start + (tid + TOPK_THREADS * v) * 4 + j
                    kind = self.classify(key, start, 4 * v + j, n, prefix, mask, tid)
                    is_above = kind >= (1 << 16)
                    is_equal = (kind == 1) & (equal < remaining)
                    rank = ptx.where_i32(is_above, above + min(equal, remaining), above + equal)
                    if (is_above | is_equal) & (rank < top_k):
                        ptx.store_global_b32(tokens + Int64(rank) * 4, position)
                        ptx.store_global_f32(scores + Int64(rank) * 4, key_score(key))
                    above = above + (kind >> 16)
                    equal = equal + (kind & 0xFFFF)
                run_above = run_above + (total >> 16)
                run_equal = run_equal + (total & 0xFFFF)
                parity = parity ^ 1

    @cute.jit
    def classify(self, key, start, e, n, prefix, mask, tid):
        """1 << 16 for a candidate key (not 0, inside the row) above the threshold, 1 for one
        equal to it under the mask, else 0."""
        position = start + (tid + TOPK_THREADS * (e // 4)) * 4 + e % 4
        masked = key & mask
        inside = (position < n) & (key != 0)
        above = inside & unsigned_greater(masked, prefix)
        equal = inside & (masked == prefix)
        return ptx.where_i32(above, 1 << 16, ptx.where_i32(equal, 1, 0))
