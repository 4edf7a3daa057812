"""Inline-PTX helpers of the exchange's kernels (sm_90a), beside the decode's ``kernel/ptx.py``
(same conventions: global addresses Int64, volatile where memory is touched). The mailboxes
live on other GPUs: flags are acquired and released at system scope, data written by peers
is read past L1 (``.cg``)."""

from __future__ import annotations

from cutlass import Float32, Int32, Int64
from cutlass.cutlass_dsl import T, dsl_user_op

from jax_sparse_mla.kernel.ptx import _asm, _f32, _i32, _i64


@dsl_user_op
def load_global_u64(addr, *, loc=None, ip=None) -> Int64:
    """ld.global.u64."""
    code = "ld.global.u64 $0, [$1];"
    return Int64(_asm(T.i64(), [_i64(addr, loc, ip)], code, "=l,l", True, loc, ip))


@dsl_user_op
def load_global_cg_f32(addr, *, loc=None, ip=None) -> Float32:
    """ld.global.cg.f32: a word a peer wrote (not cached in L1)."""
    code = "ld.global.cg.f32 $0, [$1];"
    return Float32(_asm(T.f32(), [_i64(addr, loc, ip)], code, "=f,l", True, loc, ip))


@dsl_user_op
def load_global_cg_v4(addr, *, loc=None, ip=None) -> tuple:
    """ld.global.cg.v4.u32: 16 bytes a peer wrote (not cached in L1)."""
    code = "ld.global.cg.v4.u32 {$0, $1, $2, $3}, [$4];"
    words = _asm([T.i32()] * 4, [_i64(addr, loc, ip)], code, "=r,=r,=r,=r,l", True, loc, ip)
    return tuple(Int32(w) for w in words)


@dsl_user_op
def store_global_u32(addr, word, *, loc=None, ip=None) -> None:
    """st.global.u32."""
    operands = [_i64(addr, loc, ip), _i32(word, loc, ip)]
    _asm(None, operands, "st.global.u32 [$0], $1;", "l,r,~{memory}", True, loc, ip)


@dsl_user_op
def store_global_splat_v4(addr, word, *, loc=None, ip=None) -> None:
    """16 bytes of one repeated word (NaN or zero fills)."""
    code = "st.global.v4.u32 [$0], {$1, $1, $1, $1};"
    operands = [_i64(addr, loc, ip), _i32(word, loc, ip)]
    _asm(None, operands, code, "l,r,~{memory}", True, loc, ip)


@dsl_user_op
def poll_flag_sys(addr, value, timeout_ns, *, loc=None, ip=None) -> Int32:
    """Acquire-polls (system scope) the flag at ``addr`` until it holds ``value`` (returns 0)
    or ``timeout_ns`` of %globaltimer have passed (returns 1), sleeping 32 ns between reads."""
    code = (
        "{ .reg .pred p; .reg .b32 seen; .reg .b64 start, now; "
        "mov.u32 $0, 0; mov.u64 start, %globaltimer; "
        "P${:uid}: ld.acquire.sys.global.u32 seen, [$1]; setp.eq.u32 p, seen, $2; "
        "@p bra D${:uid}; mov.u64 now, %globaltimer; sub.u64 now, now, start; "
        "setp.gt.u64 p, now, $3; @p bra T${:uid}; nanosleep.u32 32; bra P${:uid}; "
        "T${:uid}: mov.u32 $0, 1; D${:uid}: }"
    )
    operands = [_i64(addr, loc, ip), _i32(value, loc, ip), _i64(timeout_ns, loc, ip)]
    return Int32(_asm(T.i32(), operands, code, "=r,l,r,l,~{memory}", True, loc, ip))


@dsl_user_op
def wrapping_difference(a, b, *, loc=None, ip=None) -> Int32:
    """a - b, wrapping (sub.s32: no overflow assumption to fold into a comparison)."""
    operands = [_i32(a, loc, ip), _i32(b, loc, ip)]
    return Int32(_asm(T.i32(), operands, "sub.s32 $0, $1, $2;", "=r,r,r", False, loc, ip))


@dsl_user_op
def sync_threads_or(flag, *, loc=None, ip=None) -> Int32:
    """A CTA barrier that returns 1 to every thread if any thread's ``flag`` is non-zero."""
    code = (
        "{ .reg .pred p, q; setp.ne.u32 p, $1, 0; bar.red.or.pred q, 0, p; selp.u32 $0, 1, 0, q; }"
    )
    return Int32(_asm(T.i32(), [_i32(flag, loc, ip)], code, "=r,r,~{memory}", True, loc, ip))


# ---- FP32 arithmetic with the roundings spelled out (the merge's results do not depend on
# what the compiler contracts or approximates) ----------------------------------------------


def _f32_op(code, values, loc, ip) -> Float32:
    constraints = "=f," + ",".join("f" for _ in values)
    operands = [_f32(v, loc, ip) for v in values]
    return Float32(_asm(T.f32(), operands, code, constraints, False, loc, ip))


@dsl_user_op
def max_nan(a, b, *, loc=None, ip=None) -> Float32:
    """max.NaN.f32: NaN if either is."""
    return _f32_op("max.NaN.f32 $0, $1, $2;", (a, b), loc, ip)


@dsl_user_op
def add_rn(a, b, *, loc=None, ip=None) -> Float32:
    """a + b, one rounding."""
    return _f32_op("add.rn.f32 $0, $1, $2;", (a, b), loc, ip)


@dsl_user_op
def scaled_difference(a, b, c, *, loc=None, ip=None) -> Float32:
    """(a - b) * c, two roundings (not contracted into an FMA)."""
    code = "{ .reg .f32 t; sub.rn.f32 t, $1, $2; mul.rn.f32 $0, t, $3; }"
    return _f32_op(code, (a, b, c), loc, ip)


@dsl_user_op
def fma_rn(a, b, c, *, loc=None, ip=None) -> Float32:
    """a * b + c, one rounding."""
    return _f32_op("fma.rn.f32 $0, $1, $2, $3;", (a, b, c), loc, ip)


@dsl_user_op
def div_rn(a, b, *, loc=None, ip=None) -> Float32:
    """a / b, correctly rounded."""
    return _f32_op("div.rn.f32 $0, $1, $2;", (a, b), loc, ip)


@dsl_user_op
def exp2_approx(a, *, loc=None, ip=None) -> Float32:
    """ex2.approx.f32."""
    return _f32_op("ex2.approx.f32 $0, $1;", (a,), loc, ip)


@dsl_user_op
def log2_approx(a, *, loc=None, ip=None) -> Float32:
    """lg2.approx.f32."""
    return _f32_op("lg2.approx.f32 $0, $1;", (a,), loc, ip)


@dsl_user_op
def bf16_pair_to_f32(word, *, loc=None, ip=None) -> tuple:
    """The two BF16 halves of ``word`` as FP32 (low half first): exact."""
    code = (
        "{ .reg .b32 t; shl.b32 t, $2, 16; mov.b32 $0, t; and.b32 t, $2, -65536; mov.b32 $1, t; }"
    )
    values = _asm([T.f32(), T.f32()], [_i32(word, loc, ip)], code, "=f,=f,r", False, loc, ip)
    return tuple(Float32(v) for v in values)
