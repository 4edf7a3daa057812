"""Sparse MLA decode on warpgroup MMA (wgmma) for Hopper (sm_90a), in CuTe DSL.

The throughput variant: one CTA per (64 heads, row b), two warpgroups. Per chunk of WG_KEYS
keys the 256 threads load the cache rows with 16-byte loads into registers a chunk ahead,
and widen them to F16 (exact: E4M3 is a subset of F16) into one of WG_STAGES 128-byte-
swizzled K-major tiles while the tensor cores compute S of the chunk before. Warpgroup g computes
S = Q K^T for all 64 heads and keys 32 g .. 32 g + 31 (wgmma m64n32k16 F16 -> FP32, both
operands in shared memory, Q widened once); the two exchange their row maxima through shared
memory, so both scale P by the same running max (online softmax in log2 units, FP32), and
write P as F16 into a shared tile. Then warpgroup g accumulates O's latent columns
256 g .. 256 g + 255 over all the chunk's keys: wgmma m64n256k16, A = P, B = the F16 tile's
first 512 columns read MN-major (V). Dead keys (past the count, rows outside [0, n_rows)) get
S = -inf and a zero row.

Why F16 and not FP8 wgmma for QK: Hopper's FP8 wgmma accumulates with reduced precision
(measured: LSE off by ~1e-3 against float64 at K = 2048, 50x the FP32 tolerance this package
holds every kernel to); F16 products of E4M3 values are exact and accumulate in FP32.

Same ABI as the cluster-mma variant (PARAMS in config.py): raw pointers and i32 sizes, the
batch as the grid's y extent, the padded heads Hp any multiple of 16 (grid x: ceil(Hp /
WG_HEADS); the heads missing from a last partial tile are neither read nor written). Nothing
is read before griddepcontrol.wait (PDL).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from jax_sparse_mla.kernel import ptx
from jax_sparse_mla.kernel.config import (
    LATENT,
    LN2,
    ROW,
    WG_ATOM,
    WG_F16_TILE,
    WG_HEADS,
    WG_K_OFFSET,
    WG_KEYS,
    WG_LIVE_OFFSET,
    WG_P_OFFSET,
    WG_Q_OFFSET,
    WG_RED_OFFSET,
    WG_SMEM_BYTES,
    WG_STAGES,
    WG_THREADS,
)
from jax_sparse_mla.kernel.entry import DecodeKernel

PIECES = ROW // 16  # 16-byte pieces of an FP8 row
K_STEPS = ROW // 16  # QK's k16 steps
COPIERS = WG_THREADS // WG_KEYS  # threads per gathered row
MINE = PIECES // COPIERS  # 16-byte pieces per thread and chunk: piece sub + COPIERS i
WG_COLS = LATENT // 2  # latent columns per warpgroup
WG_SPAN = WG_KEYS // 2  # keys of S per warpgroup
S_VALUES = WG_SPAN // 2  # S accumulators per thread (m64n32)
O_VALUES = WG_COLS // 2  # O accumulators per thread (m64n256)
ATOM_SPAN = WG_KEYS * WG_ATOM  # bytes between column atoms of a tile
SWIZZLE_128B = 1
assert PIECES % COPIERS == 0 and WG_HEADS * PIECES % WG_THREADS == 0


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


class WgmmaDecode(DecodeKernel):
    """Sparse decode of B rows x Hp heads over rows [B, K] (grid: ceil(Hp / WG_HEADS), B)."""

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
    ):
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate(WG_SMEM_BYTES, 1024).toint()
        sQ, sK, sLive = base + WG_Q_OFFSET, base + WG_K_OFFSET, base + WG_LIVE_OFFSET
        sP, sRed = base + WG_P_OFFSET, base + WG_RED_OFFSET

        tid, _, _ = cute.arch.thread_idx()
        tile, b, _ = cute.arch.block_idx()
        group = tid // 128  # the warpgroup: keys 32 group .. of S, columns 256 group .. of O
        warp, lane = (tid % 128) // 32, tid % 32
        quad = lane % 4
        neg_inf = Float32(-math.inf)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        rows_base = mRows.toint() + Int64(b) * width * 4
        n = ptx.load_global_i32(mValid.toint() + Int64(b) * 4)
        n = max(min(n, width), Int32(0))
        chunks = (n + WG_KEYS - 1) // WG_KEYS
        # This thread's pieces of its key of the next chunk, loaded a chunk ahead of their
        # widening; row indices are loaded a chunk ahead of those loads.
        staged = cute.make_rmem_tensor((MINE * 4,), Int32)
        row = self.load_row(rows_base, n, 0, tid)
        live = self.fetch(mKV, row, n_rows, row_bytes, staged, tid)
        row = self.load_row(rows_base, n, 1, tid)
        # The last tile may be partial (Hp a multiple of 16): missing heads get a zero Q row
        # (their S is 0, their output is not written).
        q_base = mQ.toint() + Int64(b) * heads * ROW
        q_words = []
        for i in cutlass.range_constexpr(WG_HEADS * PIECES // WG_THREADS):
            flat = tid + WG_THREADS * i
            head = tile * WG_HEADS + flat // PIECES
            src = q_base + (Int64(min(head, heads - 1)) * PIECES + flat % PIECES) * 16
            q_words.append(ptx.load_global_v4(src))
        for i in cutlass.range_constexpr(WG_HEADS * PIECES // WG_THREADS):
            flat = tid + WG_THREADS * i
            head = tile * WG_HEADS + flat // PIECES
            self.widen_piece(q_words[i], head < heads, sQ, flat // PIECES, flat % PIECES)
        self.widen(staged, live, sK, sLive, tid)  # chunk 0
        live = self.fetch(mKV, row, n_rows, row_bytes, staged, tid)  # chunk 1
        row = self.load_row(rows_base, n, 2, tid)
        ptx.fence_proxy_async_shared()  # Q and chunk 0 are read by wgmma
        scale_log2 = ptx.load_global_f32(mScales.toint())

        m_run = cute.make_rmem_tensor((2,), Float32)  # rows 16 warp + lane / 4 (+ 8)
        m_run.fill(neg_inf)
        l_part = cute.make_rmem_tensor((2,), Float32)  # this thread's share of the P sums
        l_part.fill(0.0)
        acc = cute.make_rmem_tensor((O_VALUES,), Float32)
        acc.fill(0.0)
        for c in cutlass.range(0, chunks, unroll=1):
            stage = c % WG_STAGES
            sKc, sLivec = sK + stage * WG_F16_TILE, sLive + stage * (WG_KEYS * 4)
            # Chunk c widened by all threads; chunk c - 1's wgmmas are done with the other tile.
            cute.arch.sync_threads()
            # S value v belongs to key 32 group + 8 (v / 4) + 2 quad + v % 2: bit 2 (v / 4) + v % 2.
            live_bits = Int32(0)
            for i in cutlass.range_constexpr(S_VALUES // 2):
                key = WG_SPAN * group + 8 * (i // 2) + 2 * quad + i % 2
                live_bits = live_bits | (ptx.load_shared_u32(sLivec + 4 * key) << i)

            # ---- S = Q K^T for this warpgroup's keys (async), while chunk c + 1 is widened --
            ptx.wgmma_fence()
            s = [Float32(0.0)] * S_VALUES
            keys16 = sKc + group * (WG_SPAN // 8) * (8 * WG_ATOM)
            for k in cutlass.range_constexpr(K_STEPS):
                offset = (k // 4) * ATOM_SPAN + (k % 4) * 32
                s = ptx.wgmma_f16_ss(
                    s,
                    ptx.smem_descriptor(sQ + offset, 16, 8 * WG_ATOM, SWIZZLE_128B),
                    ptx.smem_descriptor(keys16 + offset, 16, 8 * WG_ATOM, SWIZZLE_128B),
                    k > 0,
                )
            ptx.wgmma_commit()
            if c + 1 < chunks:
                other = (c + 1) % WG_STAGES
                self.widen(
                    staged, live, sK + other * WG_F16_TILE, sLive + other * (WG_KEYS * 4), tid
                )
                ptx.fence_proxy_async_shared()  # chunk c + 1 is read by wgmma
                live = self.fetch(mKV, row, n_rows, row_bytes, staged, tid)  # chunk c + 2
                row = self.load_row(rows_base, n, c + 3, tid)
            ptx.wgmma_wait(0)
            s = ptx.pin_f32(s)

            # ---- online softmax (log2 units) ---------------------------------------------
            # S value v: head 16 warp + lane / 4 + 8 r (r = (v / 2) % 2), key as live_bits.
            for v in cutlass.range_constexpr(S_VALUES):
                alive = (live_bits & (1 << (2 * (v // 4) + v % 2))) != 0
                s[v] = ptx.where(alive, s[v] * scale_log2, neg_inf)
            for r in cutlass.range_constexpr(2):
                top = neg_inf
                for v in cutlass.range_constexpr(r * 2, S_VALUES, 4):
                    top = cute.arch.fmax(top, cute.arch.fmax(s[v], s[v + 1]))
                for shift in cutlass.range_constexpr(2):
                    top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=1 << shift))
                if quad == 0:
                    head = 16 * warp + lane // 4 + 8 * r
                    ptx.store_shared_f32(sRed + (group * WG_HEADS + head) * 4, top)
            cute.arch.sync_threads()  # both warpgroups' row maxima
            alpha = cute.make_rmem_tensor((2,), Float32)
            for r in cutlass.range_constexpr(2):
                head = 16 * warp + lane // 4 + 8 * r
                top = cute.arch.fmax(
                    ptx.load_shared_f32(sRed + head * 4),
                    ptx.load_shared_f32(sRed + (WG_HEADS + head) * 4),
                )
                m_new = cute.arch.fmax(m_run[r], top)
                # A row with no live key so far keeps max -inf; subtract 0 instead (no NaN).
                m_use = ptx.where(m_new == neg_inf, 0.0, m_new)
                alpha[r] = cute.math.exp2(m_run[r] - m_use, fastmath=True)
                total = Float32(0.0)
                for v in cutlass.range_constexpr(S_VALUES):
                    if cutlass.const_expr((v // 2) % 2 == r):
                        s[v] = cute.math.exp2(s[v] - m_use, fastmath=True)
                        total = total + s[v]
                l_part[r] = l_part[r] * alpha[r] + total
                m_run[r] = m_new
            for v in cutlass.range_constexpr(O_VALUES):
                acc[v] = acc[v] * alpha[(v // 2) % 2]

            # P as F16 into sP (row head, this warpgroup's keys): value pairs v, v + 1.
            for v in cutlass.range_constexpr(0, S_VALUES, 2):
                head = 16 * warp + lane // 4 + 8 * ((v // 2) % 2)
                key = WG_SPAN * group + 8 * (v // 4)
                dst = sP + f16_offset(head, key) + 4 * quad
                ptx.store_shared_u32(dst, ptx.f16x2(s[v], s[v + 1]))
            ptx.fence_proxy_async_shared()  # P is read by wgmma
            cute.arch.sync_threads()  # P complete; row maxima read (sRed reusable)

            # ---- O += P V: P (sP) x V (the F16 tile, MN-major) -----------------------------
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

        self.epilogue(mScales, mLatent, mLse, sRed, acc, m_run, l_part, tile, b, heads, tid)

    @cute.jit
    def load_row(self, rows_base, n, c, tid):
        """The row index of this thread's key in chunk c: rows[b, c WG_KEYS + tid / COPIERS],
        or -1 past the count (nothing read)."""
        j = c * WG_KEYS + tid // COPIERS
        row = Int32(-1)
        if j < n:
            row = ptx.load_global_i32(rows_base + Int64(j) * 4)
        return row

    @cute.jit
    def fetch(self, mKV: cute.Pointer, row, n_rows, row_bytes, staged, tid):
        """Start loading this thread's MINE pieces of cache row ``row`` into ``staged``
        (nothing for a row outside [0, n_rows)); returns whether the row is live."""
        live = (row >= 0) & (row < n_rows)
        if live:
            src = mKV.toint() + Int64(row) * row_bytes
            for i in cutlass.range_constexpr(MINE):
                piece = tid % COPIERS + COPIERS * i
                words = ptx.load_global_v4(src + 16 * piece)
                for e in cutlass.range_constexpr(4):
                    staged[4 * i + e] = words[e]
        return live

    @cute.jit
    def widen(self, staged, live, sKc, sLivec, tid):
        """The staged pieces as F16 into the K tile sKc (zeros for a dead key: its registers
        are stale, and P = 0 must not meet a NaN), and the key's live flag into sLivec."""
        key, sub = tid // COPIERS, tid % COPIERS
        for i in cutlass.range_constexpr(MINE):
            words = tuple(staged[4 * i + e] for e in range(4))
            self.widen_piece(words, live, sKc, key, sub + COPIERS * i)
        if sub == 0:
            ptx.store_shared_u32(sLivec + 4 * key, Int32(live))

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
    def epilogue(
        self, mScales: cute.Pointer, mLatent, mLse, sRed, acc, m_run, l_part, tile, b, heads, tid
    ):
        """O / l as BF16 (times out_scale) and the natural-log LSE; -inf and zeros for a row
        without live keys. l sums both warpgroups' keys (through sRed)."""
        out_scale = ptx.load_global_f32(mScales.toint() + 4)
        neg_inf = Float32(-math.inf)
        group = tid // 128
        warp, lane = (tid % 128) // 32, tid % 32
        quad = lane % 4
        for r in cutlass.range_constexpr(2):
            total = l_part[r]
            for shift in cutlass.range_constexpr(2):
                total = total + cute.arch.shuffle_sync_bfly(total, offset=1 << shift)
            if quad == 0:
                head = 16 * warp + lane // 4 + 8 * r
                ptx.store_shared_f32(sRed + (group * WG_HEADS + head) * 4, total)
        cute.arch.sync_threads()
        for r in cutlass.range_constexpr(2):
            head_in_tile = 16 * warp + lane // 4 + 8 * r
            total = ptx.load_shared_f32(sRed + head_in_tile * 4) + ptx.load_shared_f32(
                sRed + (WG_HEADS + head_in_tile) * 4
            )
            # != rather than >: a NaN total (a NaN logit) must poison the LSE, not empty the row.
            nonempty = total != Float32(0.0)
            inverse = ptx.where(nonempty, out_scale / total, 0.0)
            head = tile * WG_HEADS + head_in_tile
            gh = Int64(b) * heads + head
            row_out = mLatent.toint() + (gh * LATENT + group * WG_COLS + 2 * quad) * 2
            if head < heads:
                for v in cutlass.range_constexpr(r * 2, O_VALUES, 4):
                    word = ptx.bf16x2(acc[v] * inverse, acc[v + 1] * inverse)
                    ptx.store_global_b32(row_out + 8 * (v // 4) * 2, word)
            if (group == 0) & (quad == 0) & (head < heads):
                lse2 = ptx.where(
                    nonempty, m_run[r] + cute.math.log2(total, fastmath=False), neg_inf
                )
                ptx.store_global_f32(mLse.toint() + gh * 4, lse2 * Float32(LN2))
