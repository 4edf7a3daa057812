"""Inline-PTX helpers of the sparse decode kernel (sm_90a).

Shared-memory operands are 32-bit shared-window addresses (Int32), global operands 64-bit
addresses (Int64). Every helper that touches memory is volatile, so LLVM neither hoists
it out of the chunk loop nor moves it across barriers.
"""

from __future__ import annotations

from cutlass import Boolean, Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import arith, llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from jax_sparse_mla.kernel.config import HEADER_CLAIMED, HEADER_ERROR_RECORD


def _asm(results, operands, code, constraints, volatile, loc, ip):
    """One llvm.inline_asm; ``results`` is None, one type or a list of types."""
    multiple = isinstance(results, list)
    result_type = llvm.StructType.get_literal(results) if multiple else results
    value = llvm.inline_asm(
        result_type,
        operands,
        code,
        constraints,
        has_side_effects=volatile,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
    if isinstance(results, list):
        return [
            llvm.extractvalue(kind, value, [i], loc=loc, ip=ip) for i, kind in enumerate(results)
        ]
    return value


def _i32(x, loc, ip) -> ir.Value:
    return Int32(x).ir_value(loc=loc, ip=ip)


def _i64(x, loc, ip) -> ir.Value:
    return Int64(x).ir_value(loc=loc, ip=ip)


def _f32(x, loc, ip) -> ir.Value:
    return Float32(x).ir_value(loc=loc, ip=ip)


# ---- selection ---------------------------------------------------------------------------


def _select(kind, cond, if_true, if_false, loc, ip):
    value = arith.select(
        Boolean(cond).ir_value(loc=loc, ip=ip),
        kind(if_true).ir_value(loc=loc, ip=ip),
        kind(if_false).ir_value(loc=loc, ip=ip),
        loc=loc,
        ip=ip,
    )
    return kind(value)


@dsl_user_op
def where(cond, if_true, if_false, *, loc=None, ip=None) -> Float32:
    """Float32 select (no branch)."""
    return _select(Float32, cond, if_true, if_false, loc, ip)


@dsl_user_op
def where_i32(cond, if_true, if_false, *, loc=None, ip=None) -> Int32:
    """Int32 select (no branch)."""
    return _select(Int32, cond, if_true, if_false, loc, ip)


@dsl_user_op
def where_i64(cond, if_true, if_false, *, loc=None, ip=None) -> Int64:
    """Int64 select (no branch)."""
    return _select(Int64, cond, if_true, if_false, loc, ip)


@dsl_user_op
def div_u32(a, b, *, loc=None, ip=None) -> Int32:
    """a / b of unsigned 32-bit values (div.u32: no sign fix-ups of a signed division)."""
    operands = [_i32(a, loc, ip), _i32(b, loc, ip)]
    return Int32(_asm(T.i32(), operands, "div.u32 $0, $1, $2;", "=r,r,r", False, loc, ip))


@dsl_user_op
def mul_hi_u32(a, b, *, loc=None, ip=None) -> Int32:
    """The high 32 bits of the unsigned 64-bit product a * b (mul.hi.u32)."""
    operands = [_i32(a, loc, ip), _i32(b, loc, ip)]
    return Int32(_asm(T.i32(), operands, "mul.hi.u32 $0, $1, $2;", "=r,r,r", False, loc, ip))


# ---- global memory -----------------------------------------------------------------------


@dsl_user_op
def load_global_i32(addr, *, loc=None, ip=None) -> Int32:
    """ld.global.s32."""
    code = "ld.global.s32 $0, [$1];"
    return Int32(_asm(T.i32(), [_i64(addr, loc, ip)], code, "=r,l", True, loc, ip))


@dsl_user_op
def load_global_i32_if(cond, addr, *, loc=None, ip=None) -> Int32:
    """ld.global.s32 where ``cond`` (``addr`` may be null otherwise, giving 0)."""
    code = "{ .reg .pred p; setp.ne.b32 p, $1, 0; mov.b32 $0, 0; @p ld.global.s32 $0, [$2]; }"
    operands = [_i32(Int32(cond), loc, ip), _i64(addr, loc, ip)]
    return Int32(_asm(T.i32(), operands, code, "=r,r,l", True, loc, ip))


@dsl_user_op
def load_global_u64_if(cond, addr, *, loc=None, ip=None) -> Int64:
    """ld.global.u64 where ``cond`` (``addr`` may be null otherwise, giving 0)."""
    code = "{ .reg .pred p; setp.ne.b32 p, $1, 0; mov.b64 $0, 0; @p ld.global.u64 $0, [$2]; }"
    operands = [_i32(Int32(cond), loc, ip), _i64(addr, loc, ip)]
    return Int64(_asm(T.i64(), operands, code, "=l,r,l", True, loc, ip))


@dsl_user_op
def load_global_f32(addr, *, loc=None, ip=None) -> Float32:
    """ld.global.f32."""
    code = "ld.global.f32 $0, [$1];"
    return Float32(_asm(T.f32(), [_i64(addr, loc, ip)], code, "=f,l", True, loc, ip))


@dsl_user_op
def load_global_v4(addr, *, loc=None, ip=None) -> tuple:
    """Four words of global memory (16-byte aligned)."""
    code = "ld.global.v4.u32 {$0, $1, $2, $3}, [$4];"
    words = _asm([T.i32()] * 4, [_i64(addr, loc, ip)], code, "=r,=r,=r,=r,l", True, loc, ip)
    return tuple(Int32(w) for w in words)


@dsl_user_op
def store_global_v2(addr, w0, w1, *, loc=None, ip=None) -> None:
    """Two words to global memory (8-byte aligned)."""
    code = "st.global.v2.b32 [$0], {$1, $2};"
    operands = [_i64(addr, loc, ip), _i32(w0, loc, ip), _i32(w1, loc, ip)]
    _asm(None, operands, code, "l,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def store_global_v4(addr, words, *, loc=None, ip=None) -> None:
    """Four words to global memory (16-byte aligned)."""
    code = "st.global.v4.b32 [$0], {$1, $2, $3, $4};"
    operands = [_i64(addr, loc, ip)] + [_i32(w, loc, ip) for w in words]
    _asm(None, operands, code, "l,r,r,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def store_global_b32(addr, word, *, loc=None, ip=None) -> None:
    """One word to global memory."""
    operands = [_i64(addr, loc, ip), _i32(word, loc, ip)]
    _asm(None, operands, "st.global.b32 [$0], $1;", "l,r,~{memory}", True, loc, ip)


@dsl_user_op
def store_global_f32(addr, value, *, loc=None, ip=None) -> None:
    """st.global.f32."""
    operands = [_i64(addr, loc, ip), _f32(value, loc, ip)]
    _asm(None, operands, "st.global.f32 [$0], $1;", "l,f,~{memory}", True, loc, ip)


# ---- shared memory -----------------------------------------------------------------------


@dsl_user_op
def load_shared_u32(addr, *, loc=None, ip=None) -> Int32:
    """One word of shared memory."""
    code = "ld.shared.u32 $0, [$1];"
    return Int32(_asm(T.i32(), [_i32(addr, loc, ip)], code, "=r,r", True, loc, ip))


@dsl_user_op
def load_shared_f32(addr, *, loc=None, ip=None) -> Float32:
    """ld.shared.f32."""
    code = "ld.shared.f32 $0, [$1];"
    return Float32(_asm(T.f32(), [_i32(addr, loc, ip)], code, "=f,r", True, loc, ip))


@dsl_user_op
def load_shared_v4(addr, *, loc=None, ip=None) -> tuple:
    """Four words from shared memory (16-byte aligned)."""
    code = "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];"
    words = _asm([T.i32()] * 4, [_i32(addr, loc, ip)], code, "=r,=r,=r,=r,r", True, loc, ip)
    return tuple(Int32(w) for w in words)


@dsl_user_op
def load_shared_v2_f32(addr, *, loc=None, ip=None) -> tuple:
    """Two floats of shared memory (8-byte aligned)."""
    code = "ld.shared.v2.f32 {$0, $1}, [$2];"
    values = _asm([T.f32()] * 2, [_i32(addr, loc, ip)], code, "=f,=f,r", True, loc, ip)
    return tuple(Float32(v) for v in values)


@dsl_user_op
def load_shared_v4_f32(addr, *, loc=None, ip=None) -> tuple:
    """Four floats of shared memory (16-byte aligned)."""
    code = "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];"
    values = _asm([T.f32()] * 4, [_i32(addr, loc, ip)], code, "=f,=f,=f,=f,r", True, loc, ip)
    return tuple(Float32(v) for v in values)


@dsl_user_op
def store_shared_v4(addr, w0, w1, w2, w3, *, loc=None, ip=None) -> None:
    """Four words to shared memory (16-byte aligned)."""
    code = "st.shared.v4.b32 [$0], {$1, $2, $3, $4};"
    operands = [_i32(addr, loc, ip)] + [_i32(w, loc, ip) for w in (w0, w1, w2, w3)]
    _asm(None, operands, code, "r,r,r,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def store_shared_v4_f32(addr, values, *, loc=None, ip=None) -> None:
    """Four floats to shared memory (16-byte aligned)."""
    code = "st.shared.v4.f32 [$0], {$1, $2, $3, $4};"
    operands = [_i32(addr, loc, ip)] + [_f32(v, loc, ip) for v in values]
    _asm(None, operands, code, "r,f,f,f,f,~{memory}", True, loc, ip)


@dsl_user_op
def store_shared_u32(addr, word, *, loc=None, ip=None) -> None:
    """One word to shared memory."""
    operands = [_i32(addr, loc, ip), _i32(word, loc, ip)]
    _asm(None, operands, "st.shared.b32 [$0], $1;", "r,r,~{memory}", True, loc, ip)


@dsl_user_op
def store_shared_v2_f32(addr, low, high, *, loc=None, ip=None) -> None:
    """Two floats to shared memory (8-byte aligned)."""
    operands = [_i32(addr, loc, ip), _f32(low, loc, ip), _f32(high, loc, ip)]
    _asm(None, operands, "st.shared.v2.f32 [$0], {$1, $2};", "r,f,f,~{memory}", True, loc, ip)


@dsl_user_op
def store_shared_f32(addr, value, *, loc=None, ip=None) -> None:
    """st.shared.f32."""
    operands = [_i32(addr, loc, ip), _f32(value, loc, ip)]
    _asm(None, operands, "st.shared.f32 [$0], $1;", "r,f,~{memory}", True, loc, ip)


@dsl_user_op
def ldmatrix_x4(addr, *, loc=None, ip=None) -> tuple:
    """ldmatrix x4 (b16): four 8x16-byte tiles, lanes 8 i .. 8 i + 7 address tile i's rows."""
    code = "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];"
    words = _asm([T.i32()] * 4, [_i32(addr, loc, ip)], code, "=r,=r,=r,=r,r", True, loc, ip)
    return tuple(Int32(w) for w in words)


@dsl_user_op
def stmatrix_x4(addr, words, *, loc=None, ip=None) -> None:
    """stmatrix x4 (b16): four 8x16-byte tiles from an MMA accumulator fragment layout (word
    i of lane t: row t / 4, halves 2 (t % 4), + 1 of tile i); lanes 8 i .. 8 i + 7 address
    tile i's rows."""
    code = "stmatrix.sync.aligned.m8n8.x4.shared.b16 [$0], {$1, $2, $3, $4};"
    operands = [_i32(addr, loc, ip)] + [_i32(w, loc, ip) for w in words]
    _asm(None, operands, code, "r,r,r,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def ldmatrix_x2(addr, *, loc=None, ip=None) -> tuple:
    """ldmatrix x2 (b16): two 8x16-byte tiles, lanes 8 i .. 8 i + 7 (i < 2) address tile i's
    rows (the other lanes' addresses are not used)."""
    code = "ldmatrix.sync.aligned.m8n8.x2.shared.b16 {$0, $1}, [$2];"
    words = _asm([T.i32()] * 2, [_i32(addr, loc, ip)], code, "=r,=r,r", True, loc, ip)
    return tuple(Int32(w) for w in words)


# ---- arithmetic --------------------------------------------------------------------------


def _mma_m16n8(shape_types: str, a, b, c, loc, ip) -> tuple:
    """mma.sync m16n8 with FP32 accumulators, ``shape_types`` the instruction's middle (e.g.
    "k32.row.col.f32.e4m3.e4m3"): a 4 words, b 2 words, c 4 floats -> 4 floats."""
    code = (
        f"mma.sync.aligned.m16n8{shape_types}.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
    )
    operands = [_i32(x, loc, ip) for x in (*a, *b)] + [_f32(x, loc, ip) for x in c]
    constraints = "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f"
    values = _asm([T.f32()] * 4, operands, code, constraints, False, loc, ip)
    return tuple(Float32(v) for v in values)


@dsl_user_op
def mma_e4m3_k16(a, b, c, *, loc=None, ip=None) -> tuple:
    """m16n8k16 E4M3 x E4M3 + FP32 as one F16 m16n8k16 on operands widened exactly: a 2 words
    (bytes 4 q .. 4 q + 3 of a 16-byte k block of rows g, g + 8), b 1 word (the same bytes of
    key g), c 4 floats -> 4 floats. Byte 4 q + i is k index 2 q + i % 2 + 8 (i // 2) in A and B
    alike. (Hopper has no FP8 mma.sync: ptxas widens an m16n8k32 E4M3 one the same way, with
    bit-identical results; written out, the widening schedules better.)"""
    low, high = e4m3x4_to_f16(a[0], loc=loc, ip=ip), e4m3x4_to_f16(a[1], loc=loc, ip=ip)
    wide_a = (low[0], high[0], low[1], high[1])
    return _mma_m16n8(
        "k16.row.col.f32.f16.f16", wide_a, e4m3x4_to_f16(b, loc=loc, ip=ip), c, loc, ip
    )


@dsl_user_op
def mma_f16(a, b, c, *, loc=None, ip=None) -> tuple:
    """mma.sync m16n8k16 F16 x F16 + FP32: a 4 words, b 2 words, c 4 floats -> 4 floats."""
    return _mma_m16n8("k16.row.col.f32.f16.f16", a, b, c, loc, ip)


@dsl_user_op
def prmt(a, b, selector: int, *, loc=None, ip=None) -> Int32:
    """Byte permute of (b:a) by a constant selector."""
    code = f"prmt.b32 $0, $1, $2, {selector:#x};"
    operands = [_i32(a, loc, ip), _i32(b, loc, ip)]
    return Int32(_asm(T.i32(), operands, code, "=r,r,r", False, loc, ip))


@dsl_user_op
def bf16x2(low, high, *, loc=None, ip=None) -> Int32:
    """BF16 (RN) of ``low``, ``high`` packed in one word, ``low`` in the low half."""
    code = "cvt.rn.bf16x2.f32 $0, $2, $1;"
    operands = [_f32(low, loc, ip), _f32(high, loc, ip)]
    return Int32(_asm(T.i32(), operands, code, "=r,f,f", False, loc, ip))


# ---- barriers and async copies -----------------------------------------------------------


@dsl_user_op
def barrier_sync(barrier: int, threads: int, *, loc=None, ip=None) -> None:
    """barrier.sync (not .aligned) on named barrier ``barrier`` for ``threads`` threads: the
    threads may reach it from different instructions (warp-specialised loops); bar.sync
    (__syncthreads) requires one instruction for the whole CTA."""
    _asm(None, [], f"barrier.sync {barrier}, {threads};", "~{memory}", True, loc, ip)


@dsl_user_op
def mbarrier_init(bar, count: int, *, loc=None, ip=None) -> None:
    """mbarrier.init of ``count`` arrivals."""
    code = f"mbarrier.init.shared::cta.b64 [$0], {count};"
    _asm(None, [_i32(bar, loc, ip)], code, "r,~{memory}", True, loc, ip)


@dsl_user_op
def mbarrier_arrive_expect_tx(bar, tx_bytes, *, loc=None, ip=None) -> None:
    """Arrive on ``bar`` expecting ``tx_bytes`` more bytes this phase."""
    code = "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;"
    operands = [_i32(bar, loc, ip), _i32(tx_bytes, loc, ip)]
    _asm(None, operands, code, "r,r,~{memory}", True, loc, ip)


@dsl_user_op
def mbarrier_arrive(bar, *, loc=None, ip=None) -> None:
    """Plain arrive on ``bar``."""
    code = "mbarrier.arrive.shared::cta.b64 _, [$0];"
    _asm(None, [_i32(bar, loc, ip)], code, "r,~{memory}", True, loc, ip)


@dsl_user_op
def mbarrier_wait(bar, phase, *, loc=None, ip=None) -> None:
    """Spin until phase ``phase`` of ``bar`` completes (CTA scope)."""
    code = (
        "{ .reg .pred p; W${:uid}: mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1; "
        "@!p bra W${:uid}; }"
    )
    operands = [_i32(bar, loc, ip), _i32(phase, loc, ip)]
    _asm(None, operands, code, "r,r,~{memory}", True, loc, ip)


@dsl_user_op
def mbarrier_wait_cluster(bar, phase, *, loc=None, ip=None) -> None:
    """Spin until phase ``phase`` of ``bar`` completes, acquiring the cluster's writes."""
    code = (
        "{ .reg .pred p; W${:uid}: "
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [$0], $1; "
        "@!p bra W${:uid}; }"
    )
    operands = [_i32(bar, loc, ip), _i32(phase, loc, ip)]
    _asm(None, operands, code, "r,r,~{memory}", True, loc, ip)


@dsl_user_op
def fence_proxy_async_shared(*, loc=None, ip=None) -> None:
    """Order this thread's generic shared-memory writes before later async-proxy writes."""
    _asm(None, [], "fence.proxy.async.shared::cta;", "~{memory}", True, loc, ip)


@dsl_user_op
def copy_g2s(dst, src, size: int, bar, *, loc=None, ip=None) -> None:
    """cp.async.bulk of ``size`` bytes global -> shared, completing tx bytes on ``bar``."""
    code = (
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
        f"[$0], [$1], {size}, [$2];"
    )
    operands = [_i32(dst, loc, ip), _i64(src, loc, ip), _i32(bar, loc, ip)]
    _asm(None, operands, code, "r,l,r,~{memory}", True, loc, ip)


@dsl_user_op
def copy_g2s_multicast(dst, src, size: int, bar, mask, *, loc=None, ip=None) -> None:
    """copy_g2s into the same offsets (``dst``, ``bar``) of every cluster CTA in ``mask``."""
    code = (
        "{ .reg .b16 m; cvt.u16.u32 m, $3; "
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
        f"[$0], [$1], {size}, [$2], m; }}"
    )
    operands = [_i32(dst, loc, ip), _i64(src, loc, ip), _i32(bar, loc, ip), _i32(mask, loc, ip)]
    _asm(None, operands, code, "r,l,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def copy_s2c(dst, src, size: int, bar, *, loc=None, ip=None) -> None:
    """cp.async.bulk of ``size`` bytes from this CTA's shared memory to a peer's (``dst`` and
    ``bar`` shared::cluster addresses), completing tx bytes on the peer's ``bar``."""
    code = (
        "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes "
        f"[$0], [$1], {size}, [$2];"
    )
    operands = [_i32(dst, loc, ip), _i32(src, loc, ip), _i32(bar, loc, ip)]
    _asm(None, operands, code, "r,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def copy_s2g(dst, src, size: int, *, loc=None, ip=None) -> None:
    """cp.async.bulk of ``size`` bytes from shared memory (``src``) to global memory
    (``dst``), in this thread's bulk group (commit with bulk_commit)."""
    code = f"cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], {size};"
    _asm(None, [_i64(dst, loc, ip), _i32(src, loc, ip)], code, "l,r,~{memory}", True, loc, ip)


@dsl_user_op
def bulk_commit(*, loc=None, ip=None) -> None:
    """cp.async.bulk.commit_group: close this thread's bulk group."""
    _asm(None, [], "cp.async.bulk.commit_group;", "~{memory}", True, loc, ip)


@dsl_user_op
def bulk_wait_read(*, loc=None, ip=None) -> None:
    """cp.async.bulk.wait_group.read 0: this thread's bulk copies have read their sources."""
    _asm(None, [], "cp.async.bulk.wait_group.read 0;", "~{memory}", True, loc, ip)


@dsl_user_op
def bulk_wait(*, loc=None, ip=None) -> None:
    """cp.async.bulk.wait_group 0, then a proxy fence: this thread's bulk copies to global
    memory are complete and ordered before its later generic accesses (a flag's release)."""
    code = "cp.async.bulk.wait_group 0; fence.proxy.async.global;"
    _asm(None, [], code, "~{memory}", True, loc, ip)


# ---- the push exchange (system scope: the owners are other GPUs) ---------------------------


@dsl_user_op
def release_flag_sys(addr, value, *, loc=None, ip=None) -> None:
    """st.release.sys of a mailbox flag: it orders every store this thread has seen (the
    CTA's, after a barrier; release is cumulative) before the flag, for any reader on any GPU
    that acquires it."""
    code = "st.release.sys.global.u32 [$0], $1;"
    operands = [_i64(addr, loc, ip), _i32(value, loc, ip)]
    _asm(None, operands, code, "l,r,~{memory}", True, loc, ip)


@dsl_user_op
def record_failure(header, code_value, step, row, source, *, loc=None, ip=None) -> None:
    """The exchange's error record (code, step, row, source) in host-mapped memory, written
    once per failure: the first thread to claim the header's error word writes it, the code
    last (a reader that sees the code sees the rest; layout: ffi/dcp_exchange.cc)."""
    code = (
        "{ .reg .pred p; .reg .b32 old; .reg .b64 record; "
        f"atom.global.cas.b32 old, [$0+{HEADER_CLAIMED}], 0, 1; setp.eq.u32 p, old, 0; "
        f"ld.global.u64 record, [$0+{HEADER_ERROR_RECORD}]; "
        "@p st.relaxed.sys.global.u32 [record+4], $2; "
        "@p st.relaxed.sys.global.u32 [record+8], $3; "
        "@p st.relaxed.sys.global.u32 [record+12], $4; "
        "@p fence.sc.sys; "
        "@p st.relaxed.sys.global.u32 [record], $1; }"
    )
    values = (code_value, step, row, source)
    operands = [_i64(header, loc, ip)] + [_i32(v, loc, ip) for v in values]
    _asm(None, operands, code, "l,r,r,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def map_peer(addr, rank, *, loc=None, ip=None) -> Int32:
    """The shared::cluster address of ``addr`` in CTA ``rank`` of the cluster."""
    code = "mapa.shared::cluster.u32 $0, $1, $2;"
    operands = [_i32(addr, loc, ip), _i32(rank, loc, ip)]
    return Int32(_asm(T.i32(), operands, code, "=r,r,r", False, loc, ip))


@dsl_user_op
def push_f32(remote, value, remote_bar, *, loc=None, ip=None) -> None:
    """st.async of one float into a peer's shared memory, completing 4 bytes on its bar."""
    code = "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [$0], $1, [$2];"
    operands = [_i32(remote, loc, ip), _f32(value, loc, ip), _i32(remote_bar, loc, ip)]
    _asm(None, operands, code, "r,f,r,~{memory}", True, loc, ip)


@dsl_user_op
def push_v4(remote, w0, w1, w2, w3, remote_bar, *, loc=None, ip=None) -> None:
    """st.async of four words (16-byte aligned) into a peer's shared memory, completing 16
    bytes on its bar."""
    code = (
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [$0], {$1, $2, $3, $4}, [$5];"
    )
    operands = [_i32(remote, loc, ip)] + [_i32(w, loc, ip) for w in (w0, w1, w2, w3)]
    operands.append(_i32(remote_bar, loc, ip))
    _asm(None, operands, code, "r,r,r,r,r,r,~{memory}", True, loc, ip)


# ---- the wgmma variant: FP8 widening, warpgroup MMA ---------------------------------------


@dsl_user_op
def e4m3x4_to_f16(word, *, loc=None, ip=None) -> tuple:
    """Four E4M3 bytes -> two f16x2 words (exact): bytes 0, 1 in the first, 2, 3 in the second."""
    code = (
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
        "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }"
    )
    words = _asm([T.i32()] * 2, [_i32(word, loc, ip)], code, "=r,=r,r", False, loc, ip)
    return tuple(Int32(w) for w in words)


@dsl_user_op
def f16x2(low, high, *, loc=None, ip=None) -> Int32:
    """F16 (RN) of ``low``, ``high`` packed in one word, ``low`` in the low half."""
    code = "cvt.rn.f16x2.f32 $0, $2, $1;"
    operands = [_f32(low, loc, ip), _f32(high, loc, ip)]
    return Int32(_asm(T.i32(), operands, code, "=r,f,f", False, loc, ip))


@dsl_user_op
def f16x2_to_f32(word, *, loc=None, ip=None) -> tuple:
    """The two F16 halves of ``word`` as floats (low half first)."""
    code = "{ .reg .f16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }"
    values = _asm([T.f32()] * 2, [_i32(word, loc, ip)], code, "=f,=f,r", False, loc, ip)
    return tuple(Float32(v) for v in values)


def smem_descriptor(addr, lbo: int, sbo: int, swizzle: int) -> Int64:
    """A wgmma shared-memory matrix descriptor: start, leading and stride byte offsets (16-byte
    units) and the swizzle code (1: 128 B)."""
    start = Int64((addr & 0x3FFFF) >> 4)
    return start | Int64(((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (swizzle << 62))


@dsl_user_op
def wgmma_fence(*, loc=None, ip=None) -> None:
    """Order earlier register and shared-memory accesses before the next wgmma."""
    _asm(None, [], "wgmma.fence.sync.aligned;", "~{memory}", True, loc, ip)


@dsl_user_op
def wgmma_commit(*, loc=None, ip=None) -> None:
    """Close the warpgroup's current group of wgmma."""
    _asm(None, [], "wgmma.commit_group.sync.aligned;", "~{memory}", True, loc, ip)


@dsl_user_op
def wgmma_wait(pending: int, *, loc=None, ip=None) -> None:
    """Wait until at most ``pending`` wgmma groups are in flight."""
    _asm(None, [], f"wgmma.wait_group.sync.aligned {pending};", "~{memory}", True, loc, ip)


@dsl_user_op
def pin_f32(values, *, loc=None, ip=None) -> list:
    """The same floats, through an empty volatile asm: reads after a wgmma_wait and writes
    before a wgmma_fence stay on their side of it."""
    n = len(values)
    constraints = ",".join(["=f"] * n + [str(i) for i in range(n)])
    operands = [_f32(v, loc, ip) for v in values]
    return [Float32(v) for v in _asm([T.f32()] * n, operands, "", constraints, True, loc, ip)]


@dsl_user_op
def wgmma_f16_ss(
    acc, desc_a, desc_b, accumulate: bool, *, transpose_b: bool = False, loc=None, ip=None
) -> list:
    """wgmma m64nNk16 F16 x F16 + F32 (N = 2 len(acc)), both operands in shared memory: A
    K-major, B K-major or (``transpose_b``) MN-major; ``accumulate`` False zeroes acc first."""
    n = len(acc)
    outs = ",".join(f"${i}" for i in range(n))
    code = (
        f"{{ .reg .pred p; .reg .b32 t; mov.b32 t, {int(accumulate)}; setp.ne.b32 p, t, 0; "
        f"wgmma.mma_async.sync.aligned.m64n{2 * n}k16.f32.f16.f16 "
        f"{{{outs}}}, ${n}, ${n + 1}, p, 1, 1, 0, {int(transpose_b)}; }}"
    )
    constraints = ",".join(["=f"] * n + ["l", "l"] + [str(i) for i in range(n)])
    operands = [_i64(desc_a, loc, ip), _i64(desc_b, loc, ip)] + [_f32(v, loc, ip) for v in acc]
    return [Float32(v) for v in _asm([T.f32()] * n, operands, code, constraints, True, loc, ip)]
