"""The push exchange's own kernel (sm_90a), in CuTe DSL: the owners' merge after the decode.
The rest of the exchange lives in the decode kernels themselves (``kernel/entry.py``,
"exchange" parameters): each decode CTA pushes its share of this rank's query heads to the
other ranks and waits for theirs before it reads its tile's queries, and after its keys it
stores its rows into the owners' mailboxes and releases one flag per owner. Layouts:
``exchange/config.py``.

DcpMerge, grid (S, B), S = ceil(H / CHUNK_HEADS), launched under PDL right behind the
decode: CTA (s, b) polls, for each source, the flags of the decode CTAs whose tiles hold the
chunk's heads (acquire, system scope, bounded) while the decode still runs, merges the D
partials by LSE (FP32) into BF16 rows and FP32 natural-log LSEs, and stores them once the
decode has finished (griddepcontrol.wait: XLA may give the merge's results the memory of a
buffer the decode reads); CTA (0, 0) records the step (the next decode refuses a step of the
same parity). On a timeout: NaN rows and LSEs for the chunk and the error record (1, step, b,
source).

A flag holds (step & 0x7fffffff) + 1 (never 0, the zeroed value) and stays after use, so a
step must advance past the last one merged by 1 to MAX_ADVANCE - 1 (int32, wrapping): one
that does not (4, 5, 4; 4, 4; a restarted counter) could find its slot's flags set by an
earlier exchange of the same step and merge that exchange's rows. Each CTA refuses it before
it polls: NaN rows and LSEs, the error record (STEP_BEHIND, step, 0, 0), nothing recorded as
merged. Within the bound a flag value comes back on its slot only after four or more
exchanges (2^31 of them at +1 each), the slot's flags of their layouts rewritten in between.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from jax_sparse_mla.kernel import ptx
from jax_sparse_mla.kernel.exchange import ptx as xptx
from jax_sparse_mla.kernel.exchange.config import (
    CHUNK_HEADS,
    HAS_LAST_OFFSET,
    LAST_STEP_OFFSET,
    LATENT,
    MAX_ADVANCE,
    OWN_DATA_OFFSET,
    RANK_OFFSET,
    STEP_BEHIND,
    THREADS,
    TIMEOUT_OFFSET,
    TIMEOUT_PARTIALS,
    slot_and_flag,
)

ROW_UNITS = LATENT * 2 // 16  # 16-byte units of a merged BF16 row
assert THREADS // ROW_UNITS == CHUNK_HEADS  # one head per ROW_UNITS threads, one pass
NAN_BF16X2 = 0x7FC07FC0
NAN_F32 = 0x7FC00000
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


class DcpMerge:
    """The owners' merge (ABI: config.MERGE_PARAMS)."""

    @cute.jit
    def __call__(
        self,
        mLatent: cute.Pointer,
        mLse: cute.Pointer,
        mStep: cute.Pointer,
        mHeader: cute.Pointer,
        latent_offset: Int64,
        lse_offset: Int64,
        batch: Int32,
        heads: Int32,
        dcp: Int32,
        tile: Int32,
        split: Int32,
        flags: Int32,
    ):
        self.kernel(
            mLatent, mLse, mStep, mHeader, latent_offset, lse_offset, batch, heads, dcp, tile,
            split, flags,
        ).launch(grid=(1, 1, 1), block=(THREADS, 1, 1), use_pdl=True)  # fmt: skip

    @cute.kernel
    def kernel(
        self,
        mLatent: cute.Pointer,
        mLse: cute.Pointer,
        mStep: cute.Pointer,
        mHeader: cute.Pointer,
        latent_offset: Int64,
        lse_offset: Int64,
        batch: Int32,
        heads: Int32,
        dcp: Int32,
        tile: Int32,
        split: Int32,
        flags: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        s, b, _ = cute.arch.block_idx()
        # Under PDL the decode before may still run: until griddepcontrol.wait this reads only
        # the header, the step (its producer finished before the decode, which let this grid
        # launch only after its own wait) and what the flags release. That wait also waited
        # for the last merge: the header's last step is that merge's.
        cute.arch.griddepcontrol_launch_dependents()
        header = mHeader.toint()
        rank = ptx.load_global_i32(header + RANK_OFFSET)
        data = xptx.load_global_u64(header + OWN_DATA_OFFSET)  # this device's data region
        timeout = xptx.load_global_u64(header + TIMEOUT_OFFSET)
        step = ptx.load_global_i32(mStep.toint())
        slot, flag = slot_and_flag(step)
        has_last = ptx.load_global_i32(header + HAS_LAST_OFFSET)
        advance = xptx.wrapping_difference(step, ptx.load_global_i32(header + LAST_STEP_OFFSET))
        behind = ptx.where_i32((has_last != 0) & ((advance < 1) | (advance >= MAX_ADVANCE)), 1, 0)
        h0 = s * CHUNK_HEADS
        h_end = h0 + min(heads - h0, CHUNK_HEADS)
        # Thread t < D * n waits for flag [slot, t / n, b, x0 + t % n]: the n decode CTAs (of
        # each source) whose tiles hold this chunk's gathered heads.
        first = (rank * heads + h0) // tile
        last = (rank * heads + h_end - 1) // tile
        n = (last - first + 1) * split
        source = tid // n
        late = behind  # refused: NaN rows and the record, as after a timeout
        if (tid < dcp * n) & (behind == 0):
            x = first * split + tid % n
            at = ((slot * dcp + source) * batch + b) * flags + x
            late = xptx.poll_flag_sys(data + Int64(at) * 4, flag, timeout)
        head = h0 + tid // ROW_UNITS
        if xptx.sync_threads_or(late) == 0:
            partials = (data, latent_offset, lse_offset, slot * dcp, batch, heads, dcp)
            # The loops over the sources unrolled, so that their loads overlap: by 4 where D
            # is a multiple of 4, else by 2 (D = 2 through a by-4 loop's remainder is slower).
            if head < h_end:
                if dcp % 4 == 0:
                    self.merge_head(mLatent, mLse, partials, b, head, tid % ROW_UNITS, 4)
                else:
                    self.merge_head(mLatent, mLse, partials, b, head, tid % ROW_UNITS, 2)
            if (tid | b | s) == 0:
                cute.arch.griddepcontrol_wait()  # the decode has read the header's step
                xptx.store_global_u32(header + LAST_STEP_OFFSET, step)
                xptx.store_global_u32(header + HAS_LAST_OFFSET, 1)
        else:
            cute.arch.griddepcontrol_wait()
            units = (h_end - h0) * ROW_UNITS
            rows = mLatent.toint() + Int64(b * heads + h0) * (ROW_UNITS * 16)
            for u in cutlass.range(tid, units, THREADS, unroll=1):
                xptx.store_global_splat_v4(rows + Int64(u) * 16, NAN_BF16X2)
            for h in cutlass.range(h0 + tid, h_end, THREADS, unroll=1):
                xptx.store_global_u32(mLse.toint() + Int64(b * heads + h) * 4, NAN_F32)
        # Not inside the branch above: there, every launch of this cubin failed on the H200
        # with CUDA_ERROR_ILLEGAL_ADDRESS though no thread reached it and compute-sanitizer
        # passed (session 41; not understood, like the decode's bar.red.or in session 40).
        # One call for both failures: two call sites faulted every launch natively (session 45).
        if late != 0:
            code = ptx.where_i32(behind != 0, STEP_BEHIND, TIMEOUT_PARTIALS)
            ptx.record_failure(header, code, step, b * (1 - behind), source * (1 - behind))

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
        cute.arch.griddepcontrol_wait()  # the decode is done with every buffer it reads
        ptx.store_global_v4(row_out, words)
        if unit == 0:
            lse = xptx.fma_rn(xptx.log2_approx(divisor), LN_2, top)
            ptx.store_global_f32(
                mLse.toint() + Int64(b * heads + h) * 4, ptx.where(empty, neg_inf, lse)
            )
