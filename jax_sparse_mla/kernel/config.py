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
CHUNK = 128  # keys per chunk; after Q K^T warp w holds keys 8 w .. 8 w + 7
QK_WARPS = CHUNK // 8
SLOTS = CHUNK // WARPS  # key slots per warp: slot lane * WARPS + warp, for lane < SLOTS
PITCH = ROW + 16  # smem row pitch: ldmatrix rows land on distinct banks
P_PITCH = 2 * CHUNK + 16  # smem pitch (bytes) of the F16 P tile [HEADS, CHUNK]
LOG2_P_SCALE = math.log2(448.0)  # P is scaled to 448 at the running max (F16 P: any scale fits)
LN2 = math.log(2.0)

STAGES = 2  # chunk buffers: chunk c + 1 is gathered while chunk c is computed

# Dynamic shared memory layout (byte offsets; every region 16-byte aligned).
KV_OFFSET = 0  # [STAGES, CHUNK, PITCH] u8: gathered cache rows
Q_OFFSET = KV_OFFSET + STAGES * CHUNK * PITCH  # [HEADS, PITCH] u8: the 16 query rows
P_OFFSET = Q_OFFSET + HEADS * PITCH  # [HEADS, P_PITCH] u8: F16 P, keys permuted (sparse_decode)
RED_OFFSET = P_OFFSET + HEADS * P_PITCH  # [2, QK_WARPS * HEADS] f32: chunk maxima, sums
LIVE_OFFSET = RED_OFFSET + 2 * QK_WARPS * HEADS * 4  # [STAGES, CHUNK] i32: key copied (1)
# split > 1: [split, HEADS, LATENT / split] F16, every source's block of this CTA's columns
# (normalised partials); split 1 merges nothing
INBOX_OFFSET = LIVE_OFFSET + STAGES * CHUNK * 4
STATS_OFFSET = INBOX_OFFSET + HEADS * LATENT * 4  # [split, 2, HEADS] f32: (max, sum)
BAR_OFFSET = STATS_OFFSET + MAX_SPLIT * 2 * HEADS * 4  # u64 mbarriers: STAGES chunks, inbound
# [2, QK_WARPS, 32 lanes, 4] f32: QK partials passed between the warps of a 16-key group
# (sparse_decode's split of the k16 blocks over a group's warps).
PART_OFFSET = (BAR_OFFSET + 8 * (STAGES + 1) + 15) // 16 * 16
SMEM_BYTES = PART_OFFSET + 2 * QK_WARPS * 32 * 4 * 4


ARCH = "sm_90a"
# The ABI of every cubin: global pointers and u32 sizes. The batch B is the grid's y extent;
# nothing else about the shape is compiled in.
PARAMS = (
    "q",  # [B, Hp, ROW] u8; with an exchange this rank's own heads [B, heads_own, ROW]
    "kv",  # [n_rows, row_bytes] u8, the first ROW bytes of each row read
    # [B, width] i32 local rows; the push cubins take the GLOBAL top-k tokens here instead
    # (token t >= 0 with t % dcp == rank is local row t // dcp) and compact them themselves.
    "rows",
    # [B] i32 valid rows; the push cubins take an i32 scratch [B, grid x, ceil(width / split)]
    # here instead (each CTA's list of its keys' rows, written and read by that CTA).
    "valid",
    "scales",  # f32[2]: scale_log2, out_scale
    "latent",  # [B, Hp, LATENT] bf16 (null with an exchange)
    "lse",  # [B, Hp] f32 (null with an exchange)
    "n_rows",
    "width",
    "heads",
    "row_bytes",
    # The push exchange (dcp_decode(exchange="push")): null, or the device's mailbox header
    # (ffi/dcp_exchange.cc), and then head h of row b goes to rank h // heads_own's mailbox.
    "exchange",
    "rank",  # s32[]: this rank (read only with an exchange)
    "step",  # s32[]: the decode step (read only with an exchange)
    "dcp",  # D (1 without an exchange)
    "heads_own",  # H_own, heads per rank (Hp without an exchange)
    "latent_offset",  # byte offsets of the latents and LSEs in every mailbox (0 without)
    "lse_offset",
    # ... and of the query rows [2][B][Hp][ROW] and their flags u32[2][D][B][F] (0 without):
    # each rank's decode pushes its own heads there and reads the others' (entry.py).
    "query_offset",
    "query_flags_offset",
)
PARAM_TYPES = ("u64",) * 7 + ("u32",) * 4 + ("u64",) * 3 + ("u32",) * 6
# The mailbox header's fields the kernels read (byte offsets; ffi/dcp_exchange.cc owns them).
HEADER_RANK = 128  # u32 this device's rank
HEADER_HAS_LAST = 132  # u32 an exchange ran since dcp_setup
HEADER_LAST_STEP = 136  # u32 its step
HEADER_CLAIMED = 140  # u32 elects the writer of the error record
HEADER_TIMEOUT = 144  # u64 ns a wait may take
HEADER_ERROR_RECORD = 152  # u64 the host-mapped error record's device address
HEADER_OWN_DATA = 160  # u64 this device's data region (data[rank], without waiting for rank)
MAX_BATCH = 65535  # the grid's y extent


class KernelUnavailableError(RuntimeError):
    """No compiled cubin for a config: none shipped or cached, and the DSL is missing."""


# ---- the wgmma variant (wgmma_decode.py) -------------------------------------------------
WG_HEADS = 64  # query heads per CTA: wgmma's M
WG_THREADS = 384  # warpgroups 0: S, softmax and O columns 0-255, 1: O 256-511, 2: loads, widening
WG_CONSUMERS = 256  # warpgroups 0 and 1 (the MMAs)
WG_KEYS = 64  # keys per chunk
WG_ATOM = 128  # bytes per row of a 128-byte-swizzle atom (8 rows)
WG_STAGES = 2  # F16 K tiles: chunk c + 1 is widened in while chunk c is computed
WG_F16_TILE = WG_KEYS * ROW * 2  # WG_KEYS (or WG_HEADS) rows as F16: 9 atoms of 64 columns
assert WG_HEADS == WG_KEYS  # the Q tile and the K tiles share one layout
WG_Q_OFFSET = 0  # Q as F16, swizzled K-major
WG_K_OFFSET = WG_Q_OFFSET + WG_F16_TILE  # [WG_STAGES] K as F16, swizzled K-major; the first
# LATENT columns, read MN-major, are V
WG_P_OFFSET = WG_K_OFFSET + WG_STAGES * WG_F16_TILE  # P [WG_HEADS, WG_KEYS] F16, K-major
WG_RED_OFFSET = WG_P_OFFSET + WG_HEADS * WG_KEYS * 2  # [2, WG_HEADS] f32: each chunk's
# rescale factors, then (the end) the row sums, from warpgroup 0 to warpgroup 1
WG_LIVE_OFFSET = WG_RED_OFFSET + 2 * WG_HEADS * 4  # [WG_STAGES, WG_KEYS] i32: key read (1)
# u64 mbarriers: the merge's inbound, then per stage "tile widened" (the producer's 128
# threads arrive) and "tile consumed" (the 256 consumer threads arrive), then "P ready" and
# "P free" (warpgroup 0's and 1's 128 threads)
WG_BAR_OFFSET = WG_LIVE_OFFSET + WG_STAGES * WG_KEYS * 4
# u32: 1 where the push exchange's query heads of a rank did not arrive
# (DecodeKernel.await_queries), kept here through the chunk loop: a register held across
# the warpgroups' register reallocation spilled to local memory (split 1).
WG_QUERIES_LATE_OFFSET = WG_BAR_OFFSET + 8 * (3 + 2 * WG_STAGES)
WG_SMEM_BYTES = WG_QUERIES_LATE_OFFSET + 8
# The cluster merge (split > 1) reuses the regions the chunk loop is done with. Each CTA
# writes its normalised partial as F16 into an outbox in the K tiles, one block per owner
# ([split, WG_HEADS, LATENT / split]; 16-byte pieces of a head row swizzled: piece_at),
# and bulk-copies block r into slot ``part`` of CTA r's inbox (same layout, one block per
# source); the (max, sum) stats of every source land in the P tile ([split, 2, WG_HEADS] f32),
# except at split 8, where each block is followed by its sender's ([WG_HEADS, 2] f32), so that
# one bulk copy carries both.
WG_OUTBOX_OFFSET = WG_K_OFFSET
# Split 1 stages its BF16 output in the K tiles, one head row per WG_OUT_PITCH bytes (16 bytes
# of padding: stmatrix's 8 rows of 16 bytes hit 32 banks), for one bulk copy per row.
WG_OUT_PITCH = LATENT * 2 + 16
assert WG_HEADS * WG_OUT_PITCH <= WG_STAGES * WG_F16_TILE
WG_MERGE_BYTES = WG_HEADS * LATENT * 2 + MAX_SPLIT * WG_HEADS * 8  # an outbox or inbox, at most
WG_INBOX_OFFSET = WG_OUTBOX_OFFSET + WG_MERGE_BYTES
WG_STATS_OFFSET = WG_P_OFFSET
assert WG_INBOX_OFFSET + WG_MERGE_BYTES <= WG_P_OFFSET


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """A compiled kernel variant: its cubin serves every B, K, cache size and padded H (a
    multiple of head_tile).

    ``head_tile`` heads per cluster of ``cluster[0]`` CTAs (``split`` per 16-head tile;
    cluster-mma's s2 and s4 pair two tiles); the launch grid of a call with B rows and Hp
    padded heads is (ceil(Hp / head_tile) * cluster[0], B, 1).

    ``exchange``: the cubin of dcp_decode(exchange="push"), whose CTAs exchange the query
    heads with the other ranks' decodes before they read them (``entry.send_queries``);
    the plain cubin (False) has none of that code (in the shared cubins, skipped, it cost the
    plain decode 0.06-0.4 us at B = 5, session 40). Both push partials when given a mailbox.
    """

    variant: str = "cluster-mma"
    split: int | None = None  # None: the variant's default (cluster-mma: 4, the seed's; wgmma: 1)
    exchange: bool = False

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(
                f"KernelConfig.variant must be one of {tuple(VARIANTS)}, {self.variant=}"
            )
        if self.split is None:
            object.__setattr__(self, "split", DEFAULT_SPLITS[self.variant])
        if self.split not in VARIANTS[self.variant]:
            raise ValueError(
                f"KernelConfig.split of {self.variant} must be one of "
                f"{VARIANTS[self.variant]}, {self.split=}"
            )

    @property
    def slug(self) -> str:
        """File-name stem of this config."""
        return f"{self.variant}-h{self.head_tile}-s{self.split}" + (
            "-push" if self.exchange else ""
        )

    @property
    def tiles(self) -> int:
        """16-head tiles per cluster: cluster-mma's s2 and s4 pair two, whose CTAs of a split
        part gather the same rows once, by multicast (session 24: 0.1-0.5 us faster)."""
        return 2 if self.variant == "cluster-mma" and self.split in PAIR_SPLITS else 1

    @property
    def head_tile(self) -> int:
        return _LAUNCH[self.variant][0] * self.tiles

    @property
    def block(self) -> tuple[int, int, int]:
        return (_LAUNCH[self.variant][1], 1, 1)

    @property
    def cluster(self) -> tuple[int, int, int]:
        return (self.split * self.tiles, 1, 1)

    @property
    def smem_bytes(self) -> int:
        return _LAUNCH[self.variant][2]


PAIR_SPLITS = (2, 4)  # cluster-mma splits whose clusters pair two head tiles (<= 8 CTAs)

VARIANTS = {
    # The seed's design: clusters of split CTAs per 16 heads, FP8 mma.sync, DSMEM merge.
    "cluster-mma": SPLITS,
    # 64 heads per CTA on warpgroup MMA (F16 on K widened in shared memory, FP32 accumulate);
    # clusters of split CTAs per 64 heads split a row's keys and merge as cluster-mma does.
    "wgmma": (1, 2, 4, 8),
}
"""Each variant and the splits it compiles."""

DEFAULT_SPLITS = {"cluster-mma": 4, "wgmma": 1}

# Each variant's launch: heads per cluster, threads, shared memory.
_LAUNCH = {
    "cluster-mma": (HEADS, THREADS, SMEM_BYTES),
    "wgmma": (WG_HEADS, WG_THREADS, WG_SMEM_BYTES),
}

ALL_CONFIGS = tuple(
    KernelConfig(variant, split) for variant, splits in VARIANTS.items() for split in splits
)
"""Every plain config (what ``decode`` dispatches among)."""
PUSH_CONFIGS = tuple(dataclasses.replace(config, exchange=True) for config in ALL_CONFIGS)
"""Their dcp_decode(exchange="push") cubins; the package compiles and ships both."""
