"""Static configuration of the indexer's kernels (no DSL import): tiles, shared-memory
layouts and the cubins' parameter ABIs.

A machine without nvidia-cutlass-dsl imports this module to name, cache and launch cubins.
"""

from __future__ import annotations

import dataclasses

ARCH = "sm_90a"
DIM = 128  # bytes of an index key or query head (FP8 E4M3): one 128-byte swizzle row
TOKENS = 64  # key tile: the MMA's M (tokens)
HEADS = 64  # head tile: the MMA's N (index heads of one verify row)
K_STEPS = DIM // 32  # wgmma k32 steps per tile
TILE_BYTES = TOKENS * DIM  # a key tile or a query tile (HEADS == TOKENS rows of DIM bytes)
assert HEADS == TOKENS

# ---- scores (scores.py) -------------------------------------------------------------------
SCORE_WARPGROUPS = 2  # per CTA, each its own key tiles and ring; the staged queries shared
SCORE_THREADS = 128 * SCORE_WARPGROUPS  # loads by cp.async, MMAs, epilogue
STAGES = 4  # key tiles in flight per warpgroup (cp.async ring)
MAX_QUERY_TILES = 16  # T * ceil(Hi / HEADS) query tiles staged per CTA
# Dynamic shared memory: [SCORE_WARPGROUPS, STAGES] key tiles (swizzled), [.., TOKENS] f32 key
# scales, [.., TOKENS] i32 live flags, [T * G] query tiles (swizzled), [T, G * HEADS] f32
# weights (each head tile's 64 in scores.weight_slot's order).
RING = SCORE_WARPGROUPS * STAGES  # key tile buffers
KEYS_OFFSET = 0
SCALES_OFFSET = KEYS_OFFSET + RING * TILE_BYTES
LIVE_OFFSET = SCALES_OFFSET + RING * TOKENS * 4
QUERY_OFFSET = LIVE_OFFSET + RING * TOKENS * 4  # a multiple of 1024 (swizzle atoms)
assert QUERY_OFFSET % 1024 == 0
SCORE_SMEM_FIXED = QUERY_OFFSET
SCORE_SMEM_PER_QUERY_TILE = TILE_BYTES + HEADS * 4
SCORE_SMEM_MAX = SCORE_SMEM_FIXED + MAX_QUERY_TILES * SCORE_SMEM_PER_QUERY_TILE

# ---- top-k (topk.py) ----------------------------------------------------------------------
TOPK_THREADS = 512  # per CTA (128 registers per thread: no spills)
TOPK_CLUSTERS = (1, 2, 4, 8, 16)  # CTAs per verify row (a cluster), each taking a slice of its keys
WARPS = TOPK_THREADS // 32
BINS = 2048  # radix digits of 11, 11 and 10 bits of the order key
DIGITS = ((21, 11), (10, 11), (0, 10))  # (shift, bits) of each pass, most significant first
VECTORS = 4  # 16-byte loads in flight per thread and pass step
ELEMENTS = VECTORS * 4  # order keys per thread and step (topk.vector_position)
STEP = TOPK_THREADS * ELEMENTS  # order keys per pass step (< 2**15: the scan's packing)
assert STEP < 2**15
STASHED_STEPS = 3  # pass steps after a CTA's first that stay in shared memory (96 KiB)
# Bins whose cluster-wide sums one CTA of a cluster holds: BINS / cluster, at most MAX_CHUNK.
MAX_CHUNK = BINS // min(c for c in TOPK_CLUSTERS if c > 1)
# Static layout: [len(DIGITS), BINS] u32 this CTA's histogram, one per pass (all zeroed before
# the PDL wait, so no pass waits for a clear); [len(DIGITS), chunk] u32 the cluster-wide sums
# of this CTA's chunk of bins, one buffer per pass (the peers add into them, so none is
# reused); [2, VECTORS, WARPS] u32 the write pass's scan partials; [2, WARPS] u32 the
# warps' counts of taken keys; [len(DIGITS), WARPS] u32 the threshold search's partials
# and [len(DIGITS), 4] i32 its selection state, one of each per pass (no barrier frees them
# for the next); [4] u32 this CTA's counts of taken keys (above, equal), read by the
# cluster's later CTAs; [STASHED_STEPS, VECTORS, TOPK_THREADS, 4] u32 the slice's steps
# after its first (each thread's own vectors: read back by the thread that copied them).
HIST_OFFSET = 0
REDUCED_OFFSET = HIST_OFFSET + len(DIGITS) * BINS * 4
SCAN_OFFSET = REDUCED_OFFSET + len(DIGITS) * MAX_CHUNK * 4
COUNTS_OFFSET = SCAN_OFFSET + 2 * VECTORS * WARPS * 4
SEARCH_OFFSET = COUNTS_OFFSET + 2 * WARPS * 4
STATE_OFFSET = SEARCH_OFFSET + len(DIGITS) * WARPS * 4
TOTALS_OFFSET = STATE_OFFSET + len(DIGITS) * 16
STASH_OFFSET = TOTALS_OFFSET + 16
TOPK_SMEM = STASH_OFFSET + STASHED_STEPS * STEP * 4

# The ABIs: global pointers, then u32 sizes.
SCORE_PARAMS = (
    "q",  # [B, T, Hp, DIM] u8 (E4M3), Hp = G * HEADS
    "weights",  # [B, T, Hp] f32
    "keys",  # [num_blocks, block_size, DIM] u8 (E4M3)
    "key_scales",  # [num_blocks, block_size] f32
    "block_table",  # [B, max_blocks] i32
    "lengths",  # [B] i32 global context lengths, any value (row_limits' clamps in-kernel)
    "rank",  # [1] i32 this rank of dcp_size (0 without DCP)
    "order_keys",  # [B, T, pitch] u32 out: the scores' order keys (0: not a candidate)
    "steps",  # T
    "head_tiles",  # G
    "block_size",
    "num_blocks",
    "max_blocks",
    "pitch",  # ceil(max_blocks * block_size / TOKENS) * TOKENS
    "span",  # key tiles per CTA
    "dcp_size",  # D: the cache is one rank's shard of D (1: no DCP)
)
SCORE_PARAM_TYPES = ("u64",) * 8 + ("u32",) * 8
TOPK_PARAMS = (
    "order_keys",  # [B, T, pitch] u32
    "lengths",  # [B] i32, as for the scores
    "rank",  # [1] i32
    "tokens",  # [B, T, top_k] i32 out
    "scores",  # [B, T, top_k] f32 out
    "steps",  # T
    "pitch",
    "top_k",
    "capacity",  # max_blocks * block_size (this rank's)
    "dcp_size",
)
TOPK_PARAM_TYPES = ("u64",) * 5 + ("u32",) * 5


@dataclasses.dataclass(frozen=True)
class IndexKernel:
    """One of the indexer's cubins: ``stage`` "scores", or "topk" with ``cluster`` CTAs per
    verify row (one of TOPK_CLUSTERS)."""

    stage: str
    cluster: int = 1

    def __post_init__(self) -> None:
        if self.stage not in _LAUNCH:
            raise ValueError(f"IndexKernel.stage must be one of {tuple(_LAUNCH)}, {self.stage=}")
        clusters = TOPK_CLUSTERS if self.stage == "topk" else (1,)
        if self.cluster not in clusters:
            raise ValueError(f"IndexKernel.cluster of {self.stage} must be in {clusters}")

    @property
    def slug(self) -> str:
        return f"index-{self.stage}" + (f"-c{self.cluster}" if self.stage == "topk" else "")

    @property
    def threads(self) -> int:
        return _LAUNCH[self.stage][0]

    @property
    def smem_bytes(self) -> int:
        """The most dynamic shared memory a launch may ask for."""
        return _LAUNCH[self.stage][1]

    @property
    def params(self) -> tuple[str, ...]:
        return _LAUNCH[self.stage][2]

    @property
    def param_types(self) -> tuple[str, ...]:
        return _LAUNCH[self.stage][3]


_LAUNCH = {
    "scores": (SCORE_THREADS, SCORE_SMEM_MAX, SCORE_PARAMS, SCORE_PARAM_TYPES),
    "topk": (TOPK_THREADS, TOPK_SMEM, TOPK_PARAMS, TOPK_PARAM_TYPES),
}
INDEX_KERNELS = (IndexKernel("scores"), *(IndexKernel("topk", c) for c in TOPK_CLUSTERS))
