"""The one-sided DCP exchange (``dcp_decode(exchange="push")``) on CUDA GPUs of one process.

One custom call per exchange that launches two kernels, no collective and no copy kernel. The
decode kernel itself pushes: each CTA first stores its share of this rank's query heads of its
tile into the other ranks' mailboxes and releases a flag there, then acquire-polls (bounded)
the flags of the other ranks' heads its tile holds and reads them from its own mailbox; after
its keys it stores its result rows straight into the owners' mailboxes on the owners' GPUs
(plain stores over NVLink) and releases one flag per owner at system scope. The owner's merge
kernel, launched behind it under PDL (its CTAs start while the decode runs), acquire-polls the
flags of the CTAs that hold its heads with a bounded wait and merges by LSE into the final
rows. The mailboxes belong to the FFI library (``ffi/dcp_exchange.cc``): ``dcp_setup``
allocates, zeroes and peer-maps them eagerly, once, before the first call; nothing is allocated
while a program runs.

The caller's ``step`` (a traced int32) picks the mailbox slot ``step & 1`` and the flag value
``(step & 0x7fffffff) + 1``, which stays in the slot after use. So each push exchange on a mesh
must advance the step past the previous one's by an odd amount below 2^30 (int32, wrapping: a
decode loop's counter; with several exchanges per decode step, e.g. one per layer, ``step *
num_layers + layer``); never restart it (call ``dcp_setup`` to start again from any step). The
decode refuses a repeated parity (it pushes nothing: the owners then time out with NaN rows
and a recorded error rather than read a slot still being merged); the merge refuses at once a
step that does not advance by 1 to 2^30 - 1 (e.g. 4, 5, 4 or a restarted counter, which would
find its slot's flags already set by the earlier exchange of that step and merge its rows).

Failures (a rank whose query heads or partials never arrive within the timeout, a repeated
parity, a step that does not advance, a rank that disagrees with ``dcp_setup``'s device order)
give NaN rows for the affected rows and an error record per device (a decode that misses a
rank's query heads pushes nothing, so the owners' merges time out too): the next exchange on
that device raises it, ``dcp_check()`` raises it on demand, and ``dcp_setup`` again resets the
exchange.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import threading
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import dispatch
from jax.core import ShapedArray
from jax.extend import core
from jax.interpreters import mlir

from jax_sparse_mla import cuda_lowering
from jax_sparse_mla.kernel.compile import KernelUnavailableError
from jax_sparse_mla.kernel.config import KernelConfig
from jax_sparse_mla.kernel.exchange.compile import get_kernel as get_exchange_kernel
from jax_sparse_mla.kernel.exchange.config import EXCHANGE_KERNELS
from jax_sparse_mla.ops import kernel_operands
from jax_sparse_mla.validation import HEAD_TILE, LATENT

__all__ = [
    "DEFAULT_CAPACITY_BYTES",
    "DEFAULT_TIMEOUT_S",
    "dcp_check",
    "dcp_setup",
    "decode_and_exchange",
    "decode_and_exchange_tokens",
]

DEFAULT_CAPACITY_BYTES = 64 << 20
"""Mailbox bytes per device: about ``2 * D * B * H_own * 1604`` are needed (two slots; D
sources' bf16 rows and f32 LSEs; every rank's FP8 query heads; a few flags per row), so the
default holds e.g. D=8, B=160, H_own=16 (B=256 needs about 100 MiB: pass ``capacity_bytes``;
a call that does not fit raises an error naming it). At most 2**31 - 1."""
MAX_CAPACITY_BYTES = 2**31 - 1
DEFAULT_TIMEOUT_S = 5.0
"""How long a decode waits for a rank's query heads, or a merge for a rank's partials, before
it gives up (NaN rows and an error)."""


log = logging.getLogger("jax_sparse_mla")
_LOCK = threading.Lock()
_library: ctypes.CDLL | None = None
_ready_ordinals: set[int] = set()  # CUDA devices with a mailbox, for dcp_check


def _load_library() -> ctypes.CDLL:
    """The handler library with the exchange's setup and status entries typed (once; its
    custom call target, the pushing decode, is registered by ``cuda_lowering``)."""
    global _library
    with _LOCK:
        if _library is None:
            library = ctypes.CDLL(str(cuda_lowering.find_library()))
            library.JaxSparseMlaDcpSetup.argtypes = [
                ctypes.POINTER(ctypes.c_int32),
                ctypes.c_int32,
                ctypes.c_int64,
                ctypes.c_int64,
                ctypes.c_char_p,  # the merge's cubin
                ctypes.c_char_p,  # its kernel name
                ctypes.c_char_p,
                ctypes.c_int64,
            ]
            library.JaxSparseMlaDcpErrorText.argtypes = [ctypes.c_uint32]
            library.JaxSparseMlaDcpErrorText.restype = ctypes.c_char_p
            library.JaxSparseMlaDcpStatus.argtypes = [
                ctypes.c_int32,
                ctypes.POINTER(ctypes.c_uint32),
            ]
            _library = library
        return _library


def _groups(mesh: jax.sharding.Mesh, axis_name) -> list[list[jax.Device]]:
    """The device groups along ``axis_name`` (one per index of the other axes), in rank order
    (``lax.axis_index``: row-major over the named axes)."""
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    missing = [name for name in names if name not in mesh.axis_names]
    if missing:
        raise ValueError(f"axis_name {missing} not in the mesh's axes {mesh.axis_names}")
    order = [mesh.axis_names.index(n) for n in mesh.axis_names if n not in names]
    order += [mesh.axis_names.index(n) for n in names]
    devices = np.transpose(mesh.devices, order)
    size = int(np.prod([mesh.shape[n] for n in names]))
    return [list(group) for group in devices.reshape(-1, size)]


def dcp_setup(
    mesh: jax.sharding.Mesh,
    axis_name: Hashable | Sequence[Hashable],
    *,
    capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> bool:
    """Prepares ``dcp_decode(exchange="push")`` on the CUDA devices of ``mesh``; call it once,
    eagerly (outside jit), before the first call.

    For each group of devices along ``axis_name`` it allocates one mailbox of
    ``capacity_bytes`` per device, zeroes it, enables peer access within the group and loads
    the merge kernel (the package's cubin, as for ``decode``). Calling it again resets the
    exchange (zeroed mailboxes, cleared error records, the new capacity and timeout); do so only
    while no exchange is running. Programs compiled before stay valid (their kernels find the
    mailboxes through a per-device header that lives as long as the process).

    Returns True when mailboxes were set up, False when there is nothing to set up: the mesh
    is not on CUDA GPUs (there ``exchange="push"`` runs as collectives) or the axis has one
    device (``dcp_decode`` is then a plain decode). Raises ValueError for an axis not in the
    mesh or bad sizes, NotImplementedError for devices of other processes
    (multi-process needs CUDA IPC handles; not built), RuntimeError when the driver refuses
    (e.g. no peer access between two devices) or no cubin of the merge is found.
    """
    groups = _groups(mesh, axis_name)
    if not isinstance(capacity_bytes, int) or not 4096 <= capacity_bytes <= MAX_CAPACITY_BYTES:
        raise ValueError(
            f"capacity_bytes must be an int in [4096, {MAX_CAPACITY_BYTES}], got {capacity_bytes!r}"
        )
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if any(d.platform != "gpu" for group in groups for d in group):
        log.info("jax_sparse_mla.dcp_setup: not a CUDA mesh; exchange='push' uses collectives")
        return False
    if len(groups[0]) < 2:
        return False  # D = 1: dcp_decode is a plain decode, nothing is exchanged
    if any(d.process_index != jax.process_index() for group in groups for d in group):
        raise NotImplementedError(
            "dcp_setup: the push exchange drives the GPUs of one process; this mesh spans "
            "several processes (use exchange='collectives')"
        )
    for group in groups:
        setup_group([d.local_hardware_id for d in group], capacity_bytes, timeout_s)
    return True


def setup_group(ordinals: Sequence[int], capacity_bytes: int, timeout_s: float) -> None:
    """Sets up the exchange of one group of CUDA devices (rank r on ``ordinals[r]``; sizes
    checked by ``dcp_setup``). A group of one device exchanges with itself: ``dcp_decode``
    never does (at D = 1 it is a plain decode); the one-GPU tests of the whole exchange and
    ``bench_dcp.py --loopback`` do."""
    library = _load_library()
    try:
        (merge,) = (get_exchange_kernel(kernel) for kernel in EXCHANGE_KERNELS)
    except (KernelUnavailableError, ImportError) as err:
        raise RuntimeError(f"jax_sparse_mla.dcp_setup: no cubin of the merge: {err}") from err
    array = (ctypes.c_int32 * len(ordinals))(*ordinals)
    message = ctypes.create_string_buffer(1024)
    status = library.JaxSparseMlaDcpSetup(
        array,
        len(ordinals),
        capacity_bytes,
        int(timeout_s * 1e9),
        merge.cubin,
        merge.meta["kernel_name"].encode(),
        message,
        len(message),
    )
    if status != 0:
        raise RuntimeError(
            f"jax_sparse_mla.dcp_setup on CUDA devices {list(ordinals)}: {message.value.decode()}"
        )
    _ready_ordinals.update(ordinals)


def dcp_check() -> None:
    """Raises RuntimeError if a push exchange on any set-up device has failed (timeout,
    repeated step parity, a step that does not advance, rank mismatch): those rows came back
    NaN. Call it after the results are ready (``block_until_ready``); ``dcp_setup`` resets
    the error records."""
    if not _ready_ordinals:
        return
    library = _load_library()
    failures = []
    for ordinal in sorted(_ready_ordinals):
        record = (ctypes.c_uint32 * 4)()
        if library.JaxSparseMlaDcpStatus(ordinal, record) != 0 or record[0] == 0:
            continue
        code, step, row, source = record
        what = library.JaxSparseMlaDcpErrorText(code).decode()
        step = int(np.uint32(step).view(np.int32))
        failures.append(f"CUDA device {ordinal} {what} (step {step}, row {row}, source {source})")
    if failures:
        raise RuntimeError(
            "jax_sparse_mla push exchange failed; the affected rows are NaN: "
            + "; ".join(failures)
            + ". Call jax_sparse_mla.dcp_setup again to reset it."
        )


# ---- primitives ---------------------------------------------------------------------------

# The whole exchange: the pushing decode and the owners' merge, one custom call.
decode_push_p = core.Primitive("sparse_mla_decode_push")
decode_push_p.multiple_results = True
decode_push_p.def_impl(functools.partial(dispatch.apply_primitive, decode_push_p))


def _decode_push_abstract_eval(q, kv, tokens, scales, rank, step, *, scratch_rows, **params):
    del kv, tokens, scales, rank, step, params
    batch, heads_own, _ = q.shape
    return (
        ShapedArray((batch, heads_own, LATENT), jnp.bfloat16),
        ShapedArray((batch, heads_own), jnp.float32),
        ShapedArray((scratch_rows,), jnp.int32),  # the kernel's lists of its CTAs' keys
    )


decode_push_p.def_abstract_eval(_decode_push_abstract_eval)


def _require_setup() -> None:
    _load_library()
    if not _ready_ordinals:
        raise RuntimeError(
            "dcp_decode(exchange='push') on CUDA needs jax_sparse_mla.dcp_setup(mesh, "
            "axis_name) once, eagerly, before the first call"
        )


def _decode_push_lowering(ctx, *operands, dcp_size, heads_own, config, scratch_rows):
    del scratch_rows  # the result's shape
    _require_setup()
    kernel, reason = cuda_lowering.kernel_or_reason(ctx.avals_in, config, None)
    if kernel is None:
        raise NotImplementedError(
            f"dcp_decode(exchange='push') needs the decode kernel: {reason}; use "
            "exchange='collectives'"
        )
    rule = jax.ffi.ffi_lowering(cuda_lowering.PUSH_FFI_TARGET, has_side_effect=True)
    return rule(
        ctx,
        *operands,
        **cuda_lowering.kernel_attributes(kernel),
        dcp_size=np.int64(dcp_size),
        heads_own=np.int64(heads_own),
        split=np.int64(config.split),
    )


mlir.register_lowering(decode_push_p, _decode_push_lowering, platform="cuda")


def decode_and_exchange_tokens(
    queries,
    kv,
    tokens,
    *,
    rank,
    step,
    dcp_size: int,
    softmax_scale,
    q_scale,
    kv_scale,
    valid_hint: int | None,
    kernel_config: KernelConfig | None,
):
    """``decode_and_exchange`` from ``decode``'s arguments: queries [B, H_own, 576], kv (a
    flat [N, 576] or paged [blocks, block_size, 576] cache) and the scales checked and made
    the kernel's as ``decode`` does (``ops.kernel_operands``; errors name the argument);
    tokens [B, K] int32 the global top-k tokens. dcp_decode's push path, and at D = 1 the
    whole exchange on one GPU (the loopback of the tests and ``bench_dcp.py``)."""
    valid = jnp.zeros(tokens.shape[:1], jnp.int32)  # checked for its shape: the kernel counts
    _, (_, kv, _, _, scales) = kernel_operands(
        queries, kv, tokens, valid, softmax_scale=softmax_scale, q_scale=q_scale,
        kv_scale=kv_scale, implementation="cute", kernel_config=kernel_config,
        valid_hint=valid_hint,
    )  # fmt: skip
    return decode_and_exchange(
        queries, kv, tokens, scales, rank=rank, step=step, dcp_size=dcp_size,
        valid_hint=valid_hint, kernel_config=kernel_config,
    )  # fmt: skip


def decode_and_exchange(
    queries,
    kv,
    tokens,
    scales,
    *,
    rank,
    step,
    dcp_size: int,
    valid_hint: int | None,
    kernel_config: KernelConfig | None,
):
    """The whole push exchange of one dcp_decode, one custom call of two kernels: the decode
    of every rank's query heads on this rank's keys (compacting them from the global tokens
    and exchanging the query heads with the other ranks' decodes first) pushed to the heads'
    owners, and the merge of what this rank owns (under PDL behind the decode). No
    collective.

    queries [B, H_own, 576] float8_e4m3fn are this rank's heads (gathered head ``r * H_own +
    h`` is head h of rank r); kv [N, W] and scales f32[2] as ``ops.kernel_operands`` makes
    them; tokens [B, K] int32 the global top-k tokens (t >= 0 with t % D == rank is this
    rank's local row t // D, in that order its keys); rank and step int32 scalars.
    ``kernel_config`` forces the decode's config (else the dispatch rule's, as for
    ``decode``). Returns the merged latent [B, H_own, 512] bf16 and lse [B, H_own] f32 of
    this rank's heads. CUDA only (``dcp_decode`` and ``dcp_decode_tokens`` route other
    platforms to the collectives).
    """
    batch, heads_own, _ = queries.shape
    padded = -(-dcp_size * heads_own // HEAD_TILE) * HEAD_TILE
    # Chosen here, not at lowering: the rule needs the gathered heads (Hp), q holds H_own.
    width = tokens.shape[1]
    config = kernel_config or cuda_lowering.dispatched_config(batch, padded, width, valid_hint)
    config = dataclasses.replace(config, exchange=True)  # the cubin that exchanges the queries
    ctas_per_row = -(-padded // config.head_tile) * config.cluster[0]
    # The barriers keep XLA:GPU's dynamic-slice fusion from folding a slice of the operands or
    # an update of the results (e.g. a scan stacking the rows) into a clone of these calls: it
    # keeps the original too (it has side effects), so the exchange would run twice per step
    # (seen on the H200 with the first exchange design: the second merge timed out).
    queries, kv, tokens, scales, rank, step = lax.optimization_barrier(
        (queries, kv, tokens, scales, rank, step)
    )
    latent, lse, _ = decode_push_p.bind(
        queries,
        kv,
        tokens,
        scales,
        rank,
        step,
        dcp_size=dcp_size,
        heads_own=heads_own,
        config=config,
        scratch_rows=batch * ctas_per_row * -(-width // config.split),
    )
    latent, lse = lax.optimization_barrier((latent, lse))
    return latent, lse
