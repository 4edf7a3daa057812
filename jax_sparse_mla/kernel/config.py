"""Static configuration and layout constants of the sparse decode kernel (no DSL import).

A machine without nvidia-cutlass-dsl imports this module to name, cache and launch cubins.
"""

from __future__ import annotations

import dataclasses
import math

HEADS = 16  # query heads per cluster (the MMA's M)
# CTAs per cluster (a KernelConfig's split): each takes 1 / split of the row's keys and merges
# LATENT / split columns. More CTAs per row shorten each CTA; fewer keep a grid in one wave.
SPLITS = (1, 2, 4, 8)
MAX_SPLIT = max(SPLITS)  # 8: the largest portable cluster
THREADS = 512  # 16 warps
WARPS = THREADS // 32
ROW = 576  # bytes of a query or cache row (512 latent + 64 RoPE, FP8)
LATENT = 512  # V: the first LATENT bytes of a cache row
CHUNK = 128  # keys per chunk; QK warp w takes keys 8 w .. 8 w + 7
QK_WARPS = CHUNK // 8
SLOTS = CHUNK // WARPS  # key slots per warp: slot lane * WARPS + warp, for lane < SLOTS
QK_CHAINS = 2  # independent QK accumulator chains per warp
PITCH = ROW + 16  # smem row pitch: ldmatrix rows land on distinct banks
P_PITCH = CHUNK + 16  # smem pitch of the E4M3 P tile [HEADS, CHUNK]
LOG2_P_SCALE = math.log2(448.0)  # P is quantized at 448 (the E4M3 maximum) of the running max
LN2 = math.log(2.0)

STAGES = 2  # chunk buffers: chunk c + 1 is gathered while chunk c is computed

# Dynamic shared memory layout (byte offsets; every region 16-byte aligned).
KV_OFFSET = 0  # [STAGES, CHUNK, PITCH] u8: gathered cache rows
Q_OFFSET = KV_OFFSET + STAGES * CHUNK * PITCH  # [HEADS, PITCH] u8: the 16 query rows
P_OFFSET = Q_OFFSET + HEADS * PITCH  # [HEADS, P_PITCH] u8: E4M3 P
RED_OFFSET = P_OFFSET + HEADS * P_PITCH  # [2, QK_WARPS, HEADS] f32: chunk maxima, sums
LIVE_OFFSET = RED_OFFSET + 2 * QK_WARPS * HEADS * 4  # [STAGES, CHUNK] i32: key copied (1)
# [split, HEADS, LATENT / split] f32: the partials of this CTA's columns (same size any split)
INBOX_OFFSET = LIVE_OFFSET + STAGES * CHUNK * 4
STATS_OFFSET = INBOX_OFFSET + HEADS * LATENT * 4  # [split, 2, HEADS] f32: (max, sum)
BAR_OFFSET = STATS_OFFSET + MAX_SPLIT * 2 * HEADS * 4  # u64 mbarriers: STAGES chunks, inbound
SMEM_BYTES = BAR_OFFSET + 8 * (STAGES + 1)


def inbound_bytes(split: int) -> int:
    """Bytes the cluster's CTAs push to one CTA: its columns of every partial, and the stats."""
    return (HEADS * LATENT + split * 2 * HEADS) * 4


ARCH = "sm_90a"
# The ABI of every cubin: seven global pointers, then four i32 sizes. The batch B is the grid's
# y extent; nothing else about the shape is compiled in.
PARAMS = (
    "q",  # [B, Hp, ROW] u8
    "kv",  # [n_rows, row_bytes] u8, the first ROW bytes of each row read
    "rows",  # [B, width] i32
    "valid",  # [B] i32
    "scales",  # f32[2]: scale_log2, out_scale
    "latent",  # [B, Hp, LATENT] bf16
    "lse",  # [B, Hp] f32
    "n_rows",
    "width",
    "heads",
    "row_bytes",
)
PARAM_TYPES = ("u64",) * 7 + ("u32",) * 4
MAX_BATCH = 65535  # the grid's y extent


class KernelUnavailableError(RuntimeError):
    """No compiled cubin for a config: none shipped or cached, and the DSL is missing."""


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """A compiled kernel variant: its cubin serves every B, K, cache size and padded H.

    ``head_tile`` heads per cluster of ``split`` CTAs; the launch grid of a call with B rows
    and Hp padded heads is (Hp / head_tile * split, B, 1).
    """

    variant: str = "cluster-mma"
    split: int = 4  # the seed's cluster

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"KernelConfig.variant must be one of {VARIANTS}, {self.variant=}")
        if self.split not in SPLITS:
            raise ValueError(f"KernelConfig.split must be one of {SPLITS}, {self.split=}")

    @property
    def slug(self) -> str:
        """File-name stem of this config."""
        return f"{self.variant}-h{HEADS}-s{self.split}"

    @property
    def head_tile(self) -> int:
        return HEADS

    @property
    def block(self) -> tuple[int, int, int]:
        return (THREADS, 1, 1)

    @property
    def cluster(self) -> tuple[int, int, int]:
        return (self.split, 1, 1)


VARIANTS = ("cluster-mma",)
"""The seed's design: clusters of split CTAs per 16 heads, FP8 mma.sync, DSMEM merge."""

ALL_CONFIGS = tuple(KernelConfig(variant, split) for variant in VARIANTS for split in SPLITS)
"""Every config the package compiles and ships."""
