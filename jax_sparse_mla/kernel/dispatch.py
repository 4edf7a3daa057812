"""Which compiled kernel config runs a decode call: the dispatch rule, in one place.

The rule sees only static shapes (rows B, padded heads Hp, index width K) and the GPU's SM
count. It is backed by `benchmarks/bench_decode.py --configs s1 s2 s4 s8 wgmma`
(BENCHMARKS.md, 2026-11-30, H200): at every benchmarked shape it picks the config that
measured fastest or one within 0.7 us of it, except where the valid counts are far below K
(32-128 keys of K = 2048: split 1 would be 0.6-1.8 us faster, but the counts are only known
on the GPU).
"""

from __future__ import annotations

from jax_sparse_mla.kernel.config import CHUNK, HEADS, SPLITS, WG_HEADS, WG_KEYS, KernelConfig

WGMMA = KernelConfig("wgmma")

H200_SMS = 132  # assumed when lowering for CUDA without a local GPU (jax.export)

# Per-CTA costs fitted to the H200 runs (BENCHMARKS.md, session 5), in us: a cluster-mma CTA
# at split 1 spends ~4.6 per 128-key chunk (B = 16, H = 128, 2048 keys: 73.7 = 16 x 4.6);
# a wgmma CTA ~3.1 per 64-key chunk plus ~6 (18.6 at 256 keys, 104.4 at 2048).
_MMA_CHUNK_US = 4.6
_WGMMA_CHUNK_US, _WGMMA_FIXED_US = 3.1, 6.0


def _waves(ctas: int, sm_count: int) -> int:
    return -(-ctas // sm_count)


def _fits_one_wave(clusters: int, split: int, width: int, sm_count: int) -> bool:
    if split == 8:
        # A cluster of 8 needs 8 free SMs of one GPC: fewer such clusters fit at once than
        # sm_count / 8 (B = 2, H = 128: 16 clusters of 8 took two waves, 26.0 us vs 22.1 at
        # split 4), so only grids up to half the SMs; and only for K >= 8 chunks (at 256
        # keys split 8 is 0.2 us slower than 4).
        return clusters * split <= sm_count // 2 and width >= split * CHUNK
    return clusters * split <= sm_count


def choose_config(
    batch: int, padded_heads: int, width: int, sm_count: int = H200_SMS
) -> KernelConfig:
    """The config for B = ``batch`` rows of ``padded_heads`` heads over ``width`` index
    slots per row (K) on ``sm_count`` SMs.

    - K <= CHUNK (128): split 1. A row's keys fit one chunk of one CTA, and a cluster would
      only add its merge (B=5, H=96, 32-128 keys: 6.8-7.7 us at split 1, 8.3-8.5 at 4).
    - Else one CTA fits per SM, so a grid of B * Hp / 16 * split CTAs runs in waves: the
      largest split whose grid fits one wave (more CTAs per row, each shorter: B=1, H=128,
      2048 keys 13.1 us at split 8, 21.8 at 4; latency-h96 8.8 us at split 4, 12.2 at 1;
      latency-h128 9.5 us at split 2, 15.9 at 4).
    - When even split 1 needs several waves: wgmma if its waves of 64-head CTAs (a quarter
      of the CTAs, each ~1.3x as long per key) take less time than split 1's, by the fitted
      per-CTA costs above (H = 128, 2048 keys: B = 32 114.4 us vs 147.3 at split 1,
      throughput 117.4 vs 292.3; at B = 16, one wave of split 1, 73.7 vs 106.0). Small H
      pads a 64-head tile: B = 133, H = 16 stays on split 1 (two waves either way).
    """
    if width <= CHUNK:
        return KernelConfig(split=min(SPLITS))
    clusters = batch * (padded_heads // HEADS)
    if clusters > sm_count:
        split1_us = _waves(clusters, sm_count) * -(-width // CHUNK) * _MMA_CHUNK_US
        tiles = batch * -(-padded_heads // WG_HEADS)
        per_cta = -(-width // WG_KEYS) * _WGMMA_CHUNK_US + _WGMMA_FIXED_US
        if _waves(tiles, sm_count) * per_cta < split1_us:
            return WGMMA
        return KernelConfig(split=min(SPLITS))
    for split in sorted(SPLITS, reverse=True)[:-1]:
        if _fits_one_wave(clusters, split, width, sm_count):
            return KernelConfig(split=split)
    return KernelConfig(split=min(SPLITS))
