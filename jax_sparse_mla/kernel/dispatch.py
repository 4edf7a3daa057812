"""Which compiled kernel config runs a decode call: the dispatch rule, in one place.

The rule sees only static shapes (rows B, padded heads Hp, index width K) and the GPU's SM
count. It predicts each config's time from per-CTA costs fitted to every shipped config's
time at 48 shapes (`benchmarks/dispatch_survey.py`, BENCHMARKS.md session 33, H200). Where
every index slot is valid it picks the fastest config (within 2%) at all 48 (B = 1-64, H =
16-128, K = 8-2048) and at 16 shapes it was not fitted to (tests/data). Where the
valid counts are far below K (known only on the GPU) it can pick wgmma where cluster-mma
would be faster (B=5, H=96, 256 of 2048 keys valid: wgmma split 8 ~10 us, cluster-mma split
4 5.6): callers that know the counts pass ``valid_hint`` (``dcp_decode`` passes a rank's share).
"""

from __future__ import annotations

import dataclasses

from jax_sparse_mla.kernel.config import ALL_CONFIGS, CHUNK, HEADS, WG_HEADS, WG_KEYS, KernelConfig

H200_SMS = 132  # assumed when lowering for CUDA without a local GPU (jax.export)

MMA_KEY_STEP = 32  # cluster-mma's cost unit: P V's steps of 32 keys


@dataclasses.dataclass(frozen=True)
class Costs:
    """The rule's model (``predicted_us``): per-CTA costs in us and wgmma's margin."""

    mma_per_step: float  # cluster-mma, per MMA_KEY_STEP keys of the CTA's share
    mma_per_chunk: float  # cluster-mma, per CHUNK-key chunk (gather, barriers, Q K^T pass)
    mma_fixed: dict  # cluster-mma, by split (the merge grows with it)
    wgmma_per_chunk: float  # wgmma, per WG_KEYS-key chunk
    wgmma_fixed: dict  # wgmma, by split
    wgmma_crowded: float  # wgmma split 8, once two of its clusters share a GPC (``crowded``)
    wgmma_margin: float  # wgmma's pick must be predicted at most this x cluster-mma's time


# Least-squares fits (relative error) to session 33's survey of every shipped config at 48
# all-valid shapes (tests/data/dispatch_survey_h200.json; `benchmarks/dispatch_fit.py`
# reproduces them; BENCHMARKS.md): median errors 2.8% (cluster-mma), 1.1% (wgmma). Split 1
# costs least fixed (2.35 us: it merges nothing). wgmma split 8 takes ~1 us longer at any K
# once a launch holds more of its clusters than the GPU has GPCs (B=5, H=128: 10 clusters,
# 512 keys 10.1 us; B=8, H=64: 8 clusters, 9.1): without that term no margin picks within 2%
# at both. With it and SPLIT_TIE, margins 0.94-0.97 pick the fastest config (within 2%) at all
# 48 shapes: 0.93 misses B=16, H=128, K=384 (cluster-mma split 1 14.1 us vs wgmma split 2
# 12.9), 0.98 misses B=5, H=128, K=512 (wgmma split 8 10.1 vs cluster-mma split 2 9.5).
# Session 34's merge change made wgmma splits 2-8 0.03-0.6 us faster (split 8 the most where
# crowded); on its survey (tests/data/dispatch_shipped_h200.json) these costs still pick
# within 2% at all 48 shapes and 16 others, while a refit to it finds no such margin.
H200_COSTS = Costs(
    mma_per_step=0.52,
    mma_per_chunk=1.56,
    mma_fixed={1: 2.35, 2: 2.55, 4: 2.52, 8: 2.59},
    wgmma_per_chunk=2.04,
    wgmma_fixed={1: 5.89, 2: 6.24, 4: 6.51, 8: 6.59},
    wgmma_crowded=0.96,
    wgmma_margin=0.96,
)

# Within a variant, the smallest split predicted within this factor of its fastest: at <= 64
# keys splits 2 and 4 differ only in their fixed costs, and split 2 measured 5-6% faster
# (B=1, H=64, K=64: 4.64 vs 4.88 us; B=5, H=96: 4.76 vs 5.05) where the fit puts split 4 1%
# ahead.
SPLIT_TIE = 1.01


def active_clusters(size: int, sm_count: int) -> int:
    """Clusters of ``size`` one-SM CTAs resident at once. A cluster's CTAs share a GPC, so
    clusters of 4, 8 and 16 leave SMs idle: cuOccupancyMaxActiveClusters on the H200 gives 132,
    66, 30, 15 and 7 for clusters of 1, 2, 4, 8 and 16 (every shipped decode config and the
    index top-k's clusters, one CTA per SM)."""
    if size <= 2:
        return sm_count // size
    return max(1, sm_count * 10 // 11 // size)


def clusters(config: KernelConfig, batch: int, padded_heads: int) -> int:
    """``config``'s clusters for B = ``batch`` rows of Hp = ``padded_heads`` heads."""
    return batch * -(-padded_heads // config.head_tile)


def waves(config: KernelConfig, batch: int, padded_heads: int, sm_count: int) -> int:
    """Waves of ``config``'s clusters for B = ``batch`` rows of Hp = ``padded_heads`` heads."""
    return -(-clusters(config, batch, padded_heads) // active_clusters(config.cluster[0], sm_count))


def gpc_count(sm_count: int) -> int:
    """Graphics processing clusters (GPCs) of a GPU with ``sm_count`` SMs: 16-18 SMs each
    (the H100 / H200 SXM's 132 SMs are in 8)."""
    return max(1, sm_count // 16)


def crowded(config: KernelConfig, batch: int, padded_heads: int, sm_count: int) -> int:
    """1 where ``config`` is wgmma split 8 and its first wave holds more clusters than the
    GPU has GPCs, so that two clusters' merges (56 KB per CTA over DSMEM) share a GPC; else 0.
    Measured on the H200 at K = 64-2048: 10-12 clusters ~1.0 us slower than 1-8 (BENCHMARKS,
    session 33)."""
    if config.variant != "wgmma" or config.cluster[0] != 8:
        return 0
    first_wave = min(clusters(config, batch, padded_heads), active_clusters(8, sm_count))
    return int(first_wave > gpc_count(sm_count))


def cost_terms(config: KernelConfig, width: int) -> tuple[int, ...]:
    """What one CTA's variable costs multiply for a row of K = ``width`` keys (its share,
    1 / split of them): wgmma's chunks; cluster-mma's key steps and chunks."""
    keys = -(-width // config.split)
    if config.variant == "wgmma":
        return (-(-keys // WG_KEYS),)
    return (-(-keys // MMA_KEY_STEP), -(-keys // CHUNK))


def predicted_us(
    config: KernelConfig,
    batch: int,
    padded_heads: int,
    width: int,
    sm_count: int,
    costs: Costs = H200_COSTS,
) -> float:
    """The fitted time of ``config`` for B = ``batch``, Hp = ``padded_heads``, K = ``width``:
    waves of clusters times one CTA's cost for its share of a row's K keys (plus wgmma split
    8's crowding, ``crowded``)."""
    terms = cost_terms(config, width)
    if config.variant == "wgmma":
        per_cta = terms[0] * costs.wgmma_per_chunk + costs.wgmma_fixed[config.split]
        extra = crowded(config, batch, padded_heads, sm_count) * costs.wgmma_crowded
    else:
        steps, chunks = terms
        per_cta = (
            steps * costs.mma_per_step
            + chunks * costs.mma_per_chunk
            + costs.mma_fixed[config.split]
        )
        extra = 0.0
    return waves(config, batch, padded_heads, sm_count) * per_cta + extra


def choose_config(
    batch: int,
    padded_heads: int,
    width: int,
    sm_count: int = H200_SMS,
    costs: Costs = H200_COSTS,
) -> KernelConfig:
    """The config for B = ``batch`` rows of ``padded_heads`` heads over ``width`` index
    slots per row (K) on ``sm_count`` SMs.

    Each variant's split with the smallest predicted time (``predicted_us``; splits within
    SPLIT_TIE of it go to the smallest: a cluster that saves no time only adds its merge), and
    wgmma's only where it is predicted 4% faster than cluster-mma's (``costs.wgmma_margin``).
    Measured (us, the pick first; session 33's survey on the H200, cluster-mma s2 / s4 as
    head-tile pairs): B=5, H=96, 2048 keys all valid wgmma s8 15.9 (cluster-mma s4 17.0);
    1024 keys cluster-mma s4 9.6 (wgmma s8 11.8); latency-h96 (256 keys) cluster-mma s4 5.4
    (s2 6.4); B=5, H=128, 512 keys cluster-mma s2 9.5 (wgmma s8 10.1, crowded); B=8, H=64,
    512 keys wgmma s8 9.1 (cluster-mma s2 9.4); rank-full (B=5, H=128, 2048 keys) wgmma s8
    15.9 (wgmma s4 22.8, cluster-mma s8 30.6); B=16 wgmma s2 38.7 (s4 45.1, cluster-mma s1
    60.5); throughput (B=64) wgmma s1 74.9 (s2 83.5); B=1, H=128, 32 keys cluster-mma s1 4.2
    (s2 5.0); B=5, H=96, 64 keys s2 4.7 (s1 4.9, s4 5.0).
    """
    assert padded_heads % HEADS == 0 and WG_HEADS % HEADS == 0

    def fastest(variant: str) -> tuple[float, KernelConfig]:
        configs = sorted((c for c in ALL_CONFIGS if c.variant == variant), key=lambda c: c.split)
        timed = [(predicted_us(c, batch, padded_heads, width, sm_count, costs), c) for c in configs]
        best = min(us for us, _ in timed)
        return next(pair for pair in timed if pair[0] <= SPLIT_TIE * best)

    mma_us, mma = fastest("cluster-mma")
    wgmma_us, wgmma = fastest("wgmma")
    return wgmma if wgmma_us <= costs.wgmma_margin * mma_us else mma
