"""Static configuration of the push exchange's kernel (no DSL import): the mailbox header's
layout, shared with ffi/dcp_exchange.cc and the decode kernels, and the merge cubin's
parameter ABI (the order the FFI handler passes them in).

The layout of a data region (offsets computed per call by dcp_exchange.cc's MakeLayout and
passed as parameters): flags u32[2][D][B][F], partial latents bf16[2][D][B][H][512], partial
LSEs f32[2][D][B][H] (``[slot][source][row]``), query flags u32[2][D][B][F] (``[slot][source]
[row][decode CTA]``), query rows fp8[2][B][Hp][576] (``[slot][row][gathered head]``), with
slot = step & 1, F the decode's CTAs per row and Hp = D * H padded to 16.
"""

from __future__ import annotations

import dataclasses

from jax_sparse_mla.kernel import config as decode

# The decode's config owns what the decode kernels also use: the arch, the latent width, the
# query row and the header words they read.
ARCH, LATENT, QUERY_ROW = decode.ARCH, decode.LATENT, decode.ROW
RANK_OFFSET = decode.HEADER_RANK
HAS_LAST_OFFSET = decode.HEADER_HAS_LAST
LAST_STEP_OFFSET = decode.HEADER_LAST_STEP

THREADS = 256  # per CTA
CHUNK_HEADS = 4  # heads per merge CTA (dcp_exchange.cc's kChunkHeads): one per 64 threads

# Header (bytes): u64 data[16] (every rank's data region, by rank), then the words at
# RANK_OFFSET, HAS_LAST_OFFSET, LAST_STEP_OFFSET, CLAIMED_OFFSET (128 .. 140: kernel/config.py)
# and these.
CLAIMED_OFFSET = decode.HEADER_CLAIMED  # u32 elects the writer of the error record
TIMEOUT_OFFSET = decode.HEADER_TIMEOUT  # u64 ns a wait may take
OWN_DATA_OFFSET = decode.HEADER_OWN_DATA  # u64 this device's data region


def slot_and_flag(step):
    """The mailbox slot of ``step`` (its parity) and the value its flags hold: (step &
    0x7fffffff) + 1, never 0 (the zeroed value). Plain arithmetic on the kernels' Int32."""
    return step & 1, (step & 0x7FFFFFFF) + 1


# A step must advance past the last one merged by 1 to MAX_ADVANCE - 1 (int32, wrapping):
# see kernels.py (why the bound) and dcp_exchange.cc's kStepBehind.
MAX_ADVANCE = 1 << 30

# Error codes (kept in sync with dcp_exchange.cc and the decode kernels).
TIMEOUT_PARTIALS = 1
TIMEOUT_QUERIES = 4
STEP_BEHIND = 5  # the merge refused a step that does not advance past the last one

MERGE_PARAMS = (
    "latent", "lse", "step", "header", "latent_offset", "lse_offset",
    "batch", "heads", "dcp", "tile", "split", "flags",
)  # fmt: skip
MERGE_PARAM_TYPES = ("u64",) * 6 + ("u32",) * 6


@dataclasses.dataclass(frozen=True)
class ExchangeKernel:
    """The exchange's cubin: ``stage`` "merge" (dcp_merge: grid (ceil(H / chunk), B), THREADS
    threads per CTA)."""

    stage: str

    def __post_init__(self) -> None:
        if self.stage not in _ABI:
            raise ValueError(f"ExchangeKernel.stage must be one of {tuple(_ABI)}, {self.stage=}")

    @property
    def slug(self) -> str:
        return f"exchange-{self.stage}"

    @property
    def threads(self) -> int:
        return THREADS

    @property
    def params(self) -> tuple[str, ...]:
        return _ABI[self.stage][0]

    @property
    def param_types(self) -> tuple[str, ...]:
        return _ABI[self.stage][1]


_ABI = {
    "merge": (MERGE_PARAMS, MERGE_PARAM_TYPES),
}
EXCHANGE_KERNELS = (ExchangeKernel("merge"),)
