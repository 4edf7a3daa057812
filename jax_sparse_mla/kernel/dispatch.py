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
    wgmma_margin: float  # wgmma's pick must be predicted at most this x cluster-mma's time


# Least-squares fits (relative error) to session 28's survey of every shipped config at 48
# all-valid shapes (tests/data/dispatch_survey_h200.json; `benchmarks/dispatch_fit.py`
# reproduces them; BENCHMARKS.md): median errors 2.8% (cluster-mma), 1.6% (wgmma). At 32-key
# steps a CTA's 32 keys (split 4, K = 128) cost less than its 64 (split 2): B=5, H=96, K=128
# measured 4.92 us at split 4, 5.33 at split 2. Every margin from 0.91 to 0.95 picks the
# fastest config (within 2%) at all 48 shapes; 0.90 misses four (up to 1.12x: B=3, H=96,
# K=2048 cluster-mma split 4 17.1 us vs wgmma split 8 15.3), 0.96 one (B=5, H=128, K=512:
# wgmma split 8 10.5 vs cluster-mma split 2 9.5).
H200_COSTS = Costs(
    mma_per_step=0.52,
    mma_per_chunk=1.55,
    mma_fixed={1: 3.65, 2: 2.59, 4: 2.63, 8: 2.80},
    wgmma_per_chunk=2.03,
    wgmma_fixed={1: 5.92, 2: 6.65, 4: 6.85, 8: 7.39},
    wgmma_margin=0.93,
)


def active_clusters(size: int, sm_count: int) -> int:
    """Clusters of ``size`` one-SM CTAs resident at once. A cluster's CTAs share a GPC, so
    clusters of 4, 8 and 16 leave SMs idle: cuOccupancyMaxActiveClusters on the H200 gives 132,
    66, 30, 15 and 7 for clusters of 1, 2, 4, 8 and 16 (every shipped decode config and the
    index top-k's clusters, one CTA per SM)."""
    if size <= 2:
        return sm_count // size
    return max(1, sm_count * 10 // 11 // size)


def waves(config: KernelConfig, batch: int, padded_heads: int, sm_count: int) -> int:
    """Waves of ``config``'s clusters for B = ``batch`` rows of Hp = ``padded_heads`` heads."""
    clusters = batch * -(-padded_heads // config.head_tile)
    return -(-clusters // active_clusters(config.cluster[0], sm_count))


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
    waves of clusters times one CTA's cost for its share of a row's K keys."""
    terms = cost_terms(config, width)
    if config.variant == "wgmma":
        per_cta = terms[0] * costs.wgmma_per_chunk + costs.wgmma_fixed[config.split]
    else:
        steps, chunks = terms
        per_cta = (
            steps * costs.mma_per_step
            + chunks * costs.mma_per_chunk
            + costs.mma_fixed[config.split]
        )
    return waves(config, batch, padded_heads, sm_count) * per_cta


def choose_config(
    batch: int,
    padded_heads: int,
    width: int,
    sm_count: int = H200_SMS,
    costs: Costs = H200_COSTS,
) -> KernelConfig:
    """The config for B = ``batch`` rows of ``padded_heads`` heads over ``width`` index
    slots per row (K) on ``sm_count`` SMs.

    Each variant's split with the smallest predicted time (``predicted_us``; ties to the
    smaller split: a cluster that saves no time only adds its merge), and wgmma's only where
    it is predicted 7% faster than cluster-mma's (``costs.wgmma_margin``). Measured (us, the
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
        timed = [(predicted_us(c, batch, padded_heads, width, sm_count, costs), c) for c in configs]
        return min(timed, key=lambda pair: pair[0])

    mma_us, mma = fastest("cluster-mma")
    wgmma_us, wgmma = fastest("wgmma")
    return wgmma if wgmma_us <= costs.wgmma_margin * mma_us else mma
