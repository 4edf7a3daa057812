"""Inline-PTX helpers of the indexer's kernels (sm_90a), beside the decode's ``kernel/ptx.py``
(whose conventions they follow: shared addresses Int32, global addresses Int64, volatile where
memory is touched)."""

from __future__ import annotations

from cutlass import Float32, Int32
from cutlass.cutlass_dsl import T, dsl_user_op

from jax_sparse_mla.kernel.ptx import _asm, _f32, _i32, _i64


@dsl_user_op
def cp_async_16(dst, src, size, *, loc=None, ip=None) -> None:
    """cp.async.cg of 16 bytes global -> shared; only ``size`` (0 or 16) bytes are read, the
    rest of the 16 is zero-filled."""
    code = "cp.async.cg.shared.global [$0], [$1], 16, $2;"
    operands = [_i32(dst, loc, ip), _i64(src, loc, ip), _i32(size, loc, ip)]
    _asm(None, operands, code, "r,l,r,~{memory}", True, loc, ip)


@dsl_user_op
def cp_async_4(dst, src, size, *, loc=None, ip=None) -> None:
    """cp.async.ca of 4 bytes global -> shared; ``size`` 0 zero-fills without reading."""
    code = "cp.async.ca.shared.global [$0], [$1], 4, $2;"
    operands = [_i32(dst, loc, ip), _i64(src, loc, ip), _i32(size, loc, ip)]
    _asm(None, operands, code, "r,l,r,~{memory}", True, loc, ip)


@dsl_user_op
def cp_async_commit(*, loc=None, ip=None) -> None:
    """Close this thread's group of cp.async."""
    _asm(None, [], "cp.async.commit_group;", "~{memory}", True, loc, ip)


@dsl_user_op
def cp_async_wait(pending: int, *, loc=None, ip=None) -> None:
    """Wait until at most ``pending`` of this thread's cp.async groups are in flight."""
    _asm(None, [], f"cp.async.wait_group {pending};", "~{memory}", True, loc, ip)


@dsl_user_op
def wgmma_e4m3_ss(acc, desc_a, desc_b, *, n=None, loc=None, ip=None) -> list:
    """wgmma m64nNk32 E4M3 x E4M3 + F32, both operands K-major in shared memory: acc + A B,
    or with ``acc`` None A B into ``n`` fresh accumulators (N = 2n; none read, so none need
    writing first)."""
    n = len(acc) if acc is not None else n
    outs = ",".join(f"${i}" for i in range(n))
    scale_d = 0 if acc is None else 1  # wgmma's predicate: add the accumulators or not
    code = (
        f"{{ .reg .pred p; setp.ne.b32 p, {scale_d}, 0; "
        f"wgmma.mma_async.sync.aligned.m64n{2 * n}k32.f32.e4m3.e4m3 "
        f"{{{outs}}}, ${n}, ${n + 1}, p, 1, 1; }}"
    )
    tied = [] if acc is None else [str(i) for i in range(n)]
    constraints = ",".join(["=f"] * n + ["l", "l"] + tied)
    operands = [_i64(desc_a, loc, ip), _i64(desc_b, loc, ip)]
    operands += [] if acc is None else [_f32(v, loc, ip) for v in acc]
    return [Float32(v) for v in _asm([T.f32()] * n, operands, code, constraints, True, loc, ip)]


@dsl_user_op
def float_bits(x, *, loc=None, ip=None) -> Int32:
    """The bits of a float."""
    return Int32(_asm(T.i32(), [_f32(x, loc, ip)], "mov.b32 $0, $1;", "=r,f", False, loc, ip))


@dsl_user_op
def bits_float(x, *, loc=None, ip=None) -> Float32:
    """The float of 32 bits."""
    return Float32(_asm(T.f32(), [_i32(x, loc, ip)], "mov.b32 $0, $1;", "=f,r", False, loc, ip))


@dsl_user_op
def shared_add_if(cond, addr, value, *, loc=None, ip=None) -> None:
    """red.shared.add.u32 of ``value`` to a shared word where ``cond`` (a predicated add in
    the PTX; ptxas may still place a short branch around the SASS atomic)."""
    code = "{ .reg .pred p; setp.ne.b32 p, $0, 0; @p red.shared.add.u32 [$1], $2; }"
    operands = [_i32(Int32(cond), loc, ip), _i32(addr, loc, ip), _i32(value, loc, ip)]
    _asm(None, operands, code, "r,r,r,~{memory}", True, loc, ip)


@dsl_user_op
def barrier_sync_id(barrier, threads: int, *, loc=None, ip=None) -> None:
    """barrier.sync on the named barrier of run-time id ``barrier`` for ``threads`` threads."""
    code = f"barrier.sync $0, {threads};"
    _asm(None, [_i32(barrier, loc, ip)], code, "r,~{memory}", True, loc, ip)


@dsl_user_op
def load_global_v4_if(cond, addr, *, loc=None, ip=None) -> tuple:
    """16 bytes from global memory when ``cond``, else four zero words."""
    code = (
        "{ .reg .pred p; setp.ne.b32 p, $4, 0; mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; "
        "mov.b32 $3, 0; @p ld.global.v4.b32 {$0, $1, $2, $3}, [$5]; }"
    )
    operands = [_i32(Int32(cond), loc, ip), _i64(addr, loc, ip)]
    words = _asm([T.i32()] * 4, operands, code, "=r,=r,=r,=r,r,l", True, loc, ip)
    return tuple(Int32(w) for w in words)


@dsl_user_op
def load_cluster_u32(addr, *, loc=None, ip=None) -> Int32:
    """A word of a cluster peer's shared memory (``addr`` from kernel/ptx.map_peer)."""
    code = "ld.shared::cluster.u32 $0, [$1];"
    return Int32(_asm(T.i32(), [_i32(addr, loc, ip)], code, "=r,r", True, loc, ip))


@dsl_user_op
def load_cluster_v4(addr, *, loc=None, ip=None) -> tuple:
    """Four words (16-byte aligned) of a cluster peer's shared memory."""
    code = "ld.shared::cluster.v4.b32 {$0, $1, $2, $3}, [$4];"
    words = _asm([T.i32()] * 4, [_i32(addr, loc, ip)], code, "=r,=r,=r,=r,r", True, loc, ip)
    return tuple(Int32(w) for w in words)


@dsl_user_op
def cluster_add(addr, value, *, loc=None, ip=None) -> None:
    """red.shared::cluster.add.u32: add ``value`` to a word of a cluster peer's shared memory
    (ordered for the peers by the next cluster barrier's release)."""
    code = "red.shared::cluster.add.u32 [$0], $1;"
    _asm(None, [_i32(addr, loc, ip), _i32(value, loc, ip)], code, "r,r,~{memory}", True, loc, ip)


@dsl_user_op
def relu_nan(x, *, loc=None, ip=None) -> Float32:
    """max(x, 0) that keeps NaN (max.NaN): a NaN query or key poisons the score."""
    code = "max.NaN.f32 $0, $1, 0f00000000;"
    return Float32(_asm(T.f32(), [_f32(x, loc, ip)], code, "=f,f", False, loc, ip))
