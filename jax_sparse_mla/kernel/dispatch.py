"""Which compiled kernel config runs a decode call: the dispatch rule, in one place.

The rule sees only static shapes (rows B, padded heads Hp, index width K) and the GPU's SM
count. It predicts each config's time from per-CTA costs fitted to
`benchmarks/bench_decode.py --configs ...` (BENCHMARKS.md, 2026-11-30, H200). Where every
index slot is valid it picks the fastest config: at all 25 all-valid shapes of session 26's
survey (B = 1-64, H = 16-128, K = 64-2048, every config timed; BENCHMARKS.md). Where the
valid counts are far below K (known only on the GPU) it can pick wgmma where cluster-mma
would be faster (B=5, H=96, 256 of 2048 keys valid: wgmma split 8 ~10 us, cluster-mma split
4 5.6): callers that know the counts pass ``valid_hint`` (``dcp_decode`` passes a rank's share).
"""

from __future__ import annotations

from jax_sparse_mla.kernel.config import ALL_CONFIGS, HEADS, WG_HEADS, WG_KEYS, KernelConfig

H200_SMS = 132  # assumed when lowering for CUDA without a local GPU (jax.export)

# Per-CTA costs in us, fitted to the H200 runs (sessions 6 and 7). cluster-mma: ~2.3 per 64
# keys of the CTA's share, plus a fixed part that grows with the merge (split 1: 12.5 at 256
# keys; split 2: 7.5-7.9 at 128 keys per CTA, 39.1 at 1024; split 4: 7.1-7.4 at 64, 21.8 at
# 512; split 8: 13.1 in two waves at 32). Split 4's fixed part sits above split 8's so that
# where both run one wave on one chunk (K = 256: split 4 pairs two head tiles) split 8 wins:
# B=1, H=128, K=256 measured 5.24 us at split 8, 5.61 at split 4 (session 25). Split 1's
# fixed part sits above split 2's so that a single chunk (K <= 64) goes to split 2: 4.8-5.2
# us vs split 1's 5.4-6.4 at 10 shapes, B = 1-24, H = 16-128, K = 8-64 (session 26).
# wgmma (session 8's, four loaders per cache row, split 1's output by bulk copies): ~2.17 per
# 64-key chunk plus a fixed part (B=5, H=96: split 1 14.2 at 256 keys; split 2 10.7 at 128
# keys per CTA, 40.7 at 1024; split 4 9.0 at 64, 23.9 at 512; split 8 9.9 at 32, 16.8 at 256).
_MMA_PER_64_KEYS_US = 2.3
_MMA_FIXED_US = {1: 3.3, 2: 3.0, 4: 4.4, 8: 4.3}
_WGMMA_CHUNK_US = 2.17
_WGMMA_FIXED_US = {1: 5.5, 2: 6.4, 4: 6.8, 8: 7.9}
# wgmma must be predicted 15% faster than cluster-mma: the fit above over-predicts the pairs'
# times (B=5, H=96, K=1024: cluster-mma split 4 13.6 predicted, 10.9 measured), and with all
# K valid this margin picks the fastest at the 25 shapes of session 26's survey (0.7 missed
# 16 of them, up to 1.46x slower: B=64, H=64, K=64 cluster-mma split 1 12.6 us vs wgmma
# split 1 8.6; 1.0 misses B=5, H=96, K=1024: wgmma split 8 12.2 vs cluster-mma split 4 10.9).
_WGMMA_MARGIN = 0.85


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
        per_cta = -(-keys // 64) * _MMA_PER_64_KEYS_US + _MMA_FIXED_US[split]
    return waves * per_cta


def choose_config(
    batch: int, padded_heads: int, width: int, sm_count: int = H200_SMS
) -> KernelConfig:
    """The config for B = ``batch`` rows of ``padded_heads`` heads over ``width`` index
    slots per row (K) on ``sm_count`` SMs.

    Each variant's split with the smallest predicted time (``predicted_us``; ties to the
    smaller split: a cluster that saves no time only adds its merge), and wgmma's only where
    it is predicted 15% faster than cluster-mma's (``_WGMMA_MARGIN``). Measured (us, the
    pick first; sessions 25-26, cluster-mma s2 / s4 as head-tile pairs): B=5, H=96, 2048 keys
    all valid wgmma s8 16.2 (cluster-mma s4 19.5); 1024 keys cluster-mma s4 10.9 (wgmma s8
    12.2); latency-h96 (256 of 2048 keys valid, valid_hint=256) cluster-mma s4 5.6;
    rank-full (B=5, H=128, 2048 keys) wgmma s8 16.6 (cluster-mma s8 35.2); B=16 wgmma s2 39.7
    (s4 46.6, cluster-mma s1 70.8); throughput (B=64) wgmma s1 77.8 (s2 87.2). K = 128,
    H = 128 (all valid): B=1 cluster-mma s2 5.7 (s4 5.2, s8 5.5); B=5 s2 5.9 (s1 8.1); B=16
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
