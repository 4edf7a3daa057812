"""Which compiled kernel config runs a decode call: the dispatch rule, in one place.

The rule sees only static shapes (rows B, padded heads Hp, index width K) and the GPU's SM
count. It predicts each config's time from per-CTA costs fitted to every shipped config's
time at 48 shapes (`benchmarks/dispatch_survey.py`, BENCHMARKS.md session 28, H200). Where
every index slot is valid it picks the fastest config (within 2%) at all 48 (B = 1-64, H =
16-128, K = 8-2048). Where the
valid counts are far below K (known only on the GPU) it can pick wgmma where cluster-mma
would be faster (B=5, H=96, 256 of 2048 keys valid: wgmma split 8 ~10 us, cluster-mma split
4 5.6): callers that know the counts pass ``valid_hint`` (``dcp_decode`` passes a rank's share).
"""

from __future__ import annotations

from jax_sparse_mla.kernel.config import ALL_CONFIGS, CHUNK, HEADS, WG_HEADS, WG_KEYS, KernelConfig

H200_SMS = 132  # assumed when lowering for CUDA without a local GPU (jax.export)

# Per-CTA costs in us, least-squares fits (relative error) to session 28's survey of every
# shipped config at 48 all-valid shapes (`benchmarks/dispatch_survey.py`, BENCHMARKS.md; B =
# 1-64, H = 16-128, K = 8-2048). cluster-mma: 0.52 per 32 keys of the CTA's share (P V's steps)
# plus 1.55 per 128-key chunk (a chunk's gather, barriers and Q K^T pass), plus a fixed part
# by split (median error 2.8%); at 32-key granularity a CTA's 32 keys (split 4, K = 128) cost
# less than its 64 (split 2): B=5, H=96, K=128 measured 4.92 us at split 4, 5.33 at split 2.
# wgmma: 2.03 per 64-key chunk plus a fixed part by split (median error 1.6%).
_MMA_PER_32_KEYS_US = 0.52
_MMA_PER_CHUNK_US = 1.55
_MMA_FIXED_US = {1: 3.65, 2: 2.59, 4: 2.63, 8: 2.80}
_WGMMA_CHUNK_US = 2.03
_WGMMA_FIXED_US = {1: 5.92, 2: 6.65, 4: 6.85, 8: 7.39}
# wgmma must be predicted 7% faster than cluster-mma (the fits' errors differ by variant):
# every margin from 0.91 to 0.95 picks the fastest config (within 2%) at all 48 shapes of
# the survey; 0.90 misses four (up to 1.12x: B=3, H=96, K=2048 cluster-mma split 4 17.1 us
# vs wgmma split 8 15.3), 0.96 one (B=5, H=128, K=512: wgmma split 8 10.5 vs cluster-mma
# split 2 9.5).
_WGMMA_MARGIN = 0.93


def active_clusters(size: int, sm_count: int) -> int:
    """Clusters of ``size`` one-SM CTAs resident at once. A cluster's CTAs share a GPC, so
    clusters of 4, 8 and 16 leave SMs idle: cuOccupancyMaxActiveClusters on the H200 gives 132,
    66, 30, 15 and 7 for clusters of 1, 2, 4, 8 and 16 (every shipped decode config and the
    index top-k's clusters, one CTA per SM)."""
    if size <= 2:
        return sm_count // size
    return max(1, sm_count * 10 // 11 // size)


def predicted_us(config: KernelConfig, batch: int, padded_heads: int, width: int, sm_count: int):
    """The fitted time of ``config`` for B = ``batch``, Hp = ``padded_heads``, K = ``width``:
    waves of clusters times one CTA's cost for its share of a row's K keys."""
    split = config.split
    clusters = batch * -(-padded_heads // config.head_tile)
    waves = -(-clusters // active_clusters(config.cluster[0], sm_count))
    keys = -(-width // split)
    if config.variant == "wgmma":
        per_cta = -(-keys // WG_KEYS) * _WGMMA_CHUNK_US + _WGMMA_FIXED_US[split]
    else:
        per_cta = (
            -(-keys // 32) * _MMA_PER_32_KEYS_US
            + -(-keys // CHUNK) * _MMA_PER_CHUNK_US
            + _MMA_FIXED_US[split]
        )
    return waves * per_cta


def choose_config(
    batch: int, padded_heads: int, width: int, sm_count: int = H200_SMS
) -> KernelConfig:
    """The config for B = ``batch`` rows of ``padded_heads`` heads over ``width`` index
    slots per row (K) on ``sm_count`` SMs.

    Each variant's split with the smallest predicted time (``predicted_us``; ties to the
    smaller split: a cluster that saves no time only adds its merge), and wgmma's only where
    it is predicted 7% faster than cluster-mma's (``_WGMMA_MARGIN``). Measured (us, the
    pick first; session 28's survey unless noted, cluster-mma s2 / s4 as head-tile pairs):
    B=5, H=96, 2048 keys all valid wgmma s8 16.2 (cluster-mma s4 17.2); 1024 keys
    cluster-mma s4 9.7 (wgmma s8 12.1); latency-h96 (256 keys) cluster-mma s4 5.5 (s2 6.4);
    B=5, H=128, 512 keys cluster-mma s2 9.5 (wgmma s8 10.5); rank-full (B=5, H=128, 2048
    keys) wgmma s8 16.4 (wgmma s4 23.1, cluster-mma s8 31.5); B=16 wgmma s2 39.0 (s4 45.8,
    cluster-mma s1 61.1); throughput (B=64) wgmma s1 74.6 (s2 83.8). K = 128, H = 128 (all
    valid; session 26): B=1 cluster-mma s4 5.2 (s8 5.5, s2 5.7); B=5 s2 5.9 (s1 8.1); B=16
    s1 9.1 (wgmma s2 9.5); B=64 wgmma s1 12.2 (cluster-mma s1 31.2).
    """
    assert padded_heads % HEADS == 0 and WG_HEADS % HEADS == 0

    def fastest(variant: str) -> tuple[float, KernelConfig]:
        configs = sorted((c for c in ALL_CONFIGS if c.variant == variant), key=lambda c: c.split)
        timed = [(predicted_us(c, batch, padded_heads, width, sm_count), c) for c in configs]
        return min(timed, key=lambda pair: pair[0])

    mma_us, mma = fastest("cluster-mma")
    wgmma_us, wgmma = fastest("wgmma")
    return wgmma if wgmma_us <= _WGMMA_MARGIN * mma_us else mma
