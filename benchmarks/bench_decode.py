"""Sparse decode on the GPU: the kernel next to the jitted pure-jnp reference, in one run.

    python benchmarks/bench_decode.py --out benchmarks/results
    python benchmarks/bench_decode.py --configs s1 s2 s4    # also each kernel config, forced

For each case of DESIGN.md section 4 and sweeps of keys per row (B=5, H=96), rows (H=128,
2048 keys), heads (B=5, 256 keys) and, on request, rows at K = 128 (H=128), both paths run
through jax.jit on the same inputs: the kernel as the dispatch rule picks it for the case's
valid keys (valid_hint = keys, as dcp_decode passes a rank's share; and, with --configs, each
config forced) and the jnp reference. Kernel times come from JAX's profiler
(CUPTI kernel durations, split per call; see gpu_profile.py), median and p10/p90 over
--calls calls. The kernel path is
implementation="cute": it fails loudly rather than fall back to the reference. Where
peer_flashmla.py measured FlashMLA at the same shape (its SM90 sparse FP8 decode + combine, on
an H200, 2026-12-02: not this run), that anchor is printed next to the kernel with ours /
anchor.
Writes results.json, results.csv and latency_vs_keys.png into --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from gpu_profile import profile_calls

import jax_sparse_mla
from jax_sparse_mla.kernel.config import ALL_CONFIGS
from jax_sparse_mla.kernel.dispatch import choose_config
from jax_sparse_mla.validation import HEAD_TILE

HBM_BYTES_PER_S = 4.8e12  # H200 datasheet
FP8_DENSE_FLOPS = 1979e12  # H200 dense FP8 tensor-core peak
CACHE_ROWS = 131072  # local cache rows N (DESIGN.md section 4)
CASES = {  # name -> (batch B, query heads H, width K), DESIGN.md section 4
    "latency-h64": (5, 64, 2048),
    "latency-h96": (5, 96, 2048),
    "latency-h128": (5, 128, 2048),
    "rank-full": (5, 128, 2048),
    "throughput": (64, 128, 2048),
}
# FlashMLA's GPU time (us) by (B, H, valid keys), H=64..128 heads over 2048 index slots:
# benchmarks/peer_flashmla.py's defaults (H200, 2026-12-02, vLLM 0.26.0's FlashMLA, its SM90
# sparse FP8 decode + combine; H=96 padded to 128 as vLLM does).
FLASHMLA_US = {
    (5, 64, 256): 12.17,
    (5, 96, 256): 12.88,
    (5, 128, 256): 12.88,
    (1, 128, 256): 11.96,
    (5, 128, 2048): 22.43,
    (64, 128, 2048): 105.59,
    (128, 128, 2048): 205.51,
}
CASE_KEYS = {  # valid keys per row of each named case
    "latency-h64": 256,
    "latency-h96": 256,
    "latency-h128": 256,
    "rank-full": 2048,
    "throughput": 2048,
}


def flashmla_us(batch, heads, width, keys) -> float | None:
    """FlashMLA's time at this shape, None where peer_flashmla.py did not measure it."""
    return FLASHMLA_US.get((batch, heads, keys)) if width == 2048 else None


def make_inputs(batch, heads, width, keys, seed=0):
    rng = np.random.default_rng(seed)
    fp8 = jnp.float8_e4m3fn
    q = jnp.asarray(rng.standard_normal((batch, heads, 576)), fp8)
    kv = jnp.asarray(rng.standard_normal((CACHE_ROWS, 576)), fp8)
    rows = np.stack([rng.choice(CACHE_ROWS, width, replace=False) for _ in range(batch)])
    valid = np.full((batch,), keys, np.int32)
    unique = len(np.unique(rows[:, :keys]))
    return (q, kv, jnp.asarray(rows, jnp.int32), jnp.asarray(valid)), unique


def _max_diffs(got, want) -> tuple[float, float]:
    latent = jnp.abs(got[0].astype(jnp.float32) - want[0].astype(jnp.float32))
    return float(jnp.max(latent)), float(jnp.max(jnp.abs(got[1] - want[1])))


_CONFIG_NAMES = {
    (f"s{c.split}" if c.variant == "cluster-mma" else f"wgmma{c.split}"): c for c in ALL_CONFIGS
}


def measure(name, batch, heads, width, keys, calls, configs, sm_count):
    args, unique_rows = make_inputs(batch, heads, width, keys)
    scale = 192**-0.5
    decode = partial(jax_sparse_mla.decode, softmax_scale=scale)
    kernel = jax.jit(partial(decode, implementation="cute", valid_hint=keys))
    baseline = jax.jit(partial(decode, implementation="reference"))
    want = baseline(*args)
    err, lse_err = _max_diffs(kernel(*args), want)
    k_times = profile_calls(kernel, args, calls)
    b_times = profile_calls(baseline, args, calls)
    k = k_times.summary(k_times.kernel_us)
    by_config = {}
    for config in configs:
        forced = jax.jit(partial(decode, implementation="cute", kernel_config=config))
        times = profile_calls(forced, args, calls)
        diff, lse_diff = _max_diffs(forced(*args), want)
        by_config[config.slug] = {
            "kernel_us": times.summary(times.kernel_us),
            "max_abs_diff_vs_reference": diff,
            "max_lse_diff_vs_reference": lse_diff,
        }
    b = b_times.summary(b_times.kernel_us)
    b_span = b_times.summary(b_times.span_us)
    kv_bytes = unique_rows * 576
    flops = 2 * batch * heads * keys * (576 + 512)
    floor_us = (kv_bytes + batch * heads * (576 + 1024 + 4)) / HBM_BYTES_PER_S * 1e6
    return {
        "case": name,
        "B": batch,
        "H": heads,
        "K": width,
        "keys": keys,
        "dispatch": choose_config(
            batch, -(-heads // HEAD_TILE) * HEAD_TILE, min(width, keys), sm_count
        ).slug,
        "kernel_us": k,
        "by_config": by_config,
        "baseline_us": b,
        "baseline_span_us": b_span,
        "kernel_names": k_times.names,
        "baseline_kernels": len(b_times.names),
        "speedup": b["median"] / k["median"],
        "kernel_GBps": kv_bytes / (k["median"] * 1e-6) / 1e9,
        "kernel_TFLOPs": flops / (k["median"] * 1e-6) / 1e12,
        "baseline_TFLOPs": flops / (b["median"] * 1e-6) / 1e12,
        "bandwidth_floor_us": floor_us,
        "flashmla_us": flashmla_us(batch, heads, width, keys),
        "max_abs_diff_vs_reference": err,
        "max_lse_diff_vs_reference": lse_err,
    }


def plan(args):
    jobs = [(name, *CASES[name], CASE_KEYS[name]) for name in args.cases]
    jobs += [(f"keys-{n}", 5, 96, 2048, n) for n in args.sweep_keys]
    jobs += [(f"rows-{b}", b, 128, 2048, 2048) for b in args.sweep_rows]
    jobs += [(f"heads-{h}", 5, h, 2048, 256) for h in args.sweep_heads]
    jobs += [(f"short-{b}", b, 128, 128, 128) for b in args.sweep_short]
    return jobs


def write_outputs(results, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "method": "JAX profiler (CUPTI) kernel durations per call, median/p10/p90",
    }
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    fields = [
        "case",
        "B",
        "H",
        "K",
        "keys",
        "dispatch",
        "kernel_us",
        "baseline_us",
        "speedup",
        "kernel_GBps",
        "kernel_TFLOPs",
        "bandwidth_floor_us",
        "flashmla_us",
    ]
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(fields)
        for r in results:
            row = [r[k]["median"] if isinstance(r[k], dict) else r[k] for k in fields]
            writer.writerow(
                ["" if v is None else f"{v:.4g}" if isinstance(v, float) else v for v in row]
            )
    sweep = [r for r in results if r["case"].startswith("keys-")]
    if not sweep:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        return
    keys = [r["keys"] for r in sweep]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(keys, [r["kernel_us"]["median"] for r in sweep], "o-", label="kernel (cute)")
    ax.plot(keys, [r["baseline_us"]["median"] for r in sweep], "s-", label="jnp reference")
    ax.plot(keys, [r["bandwidth_floor_us"] for r in sweep], "k--", label="HBM floor (4.8 TB/s)")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="keys per row",
        ylabel="GPU time per call (us)",
        title=f"B=5, H=96 sparse decode, {meta['device']}",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "latency_vs_keys.png"), dpi=120)


def anchor_text(result) -> str:
    """The FlashMLA anchor's line for a result, or "" where there is no anchor."""
    anchor = result["flashmla_us"]
    if anchor is None:
        return ""
    ours = result["kernel_us"]["median"]
    return (
        f"    FlashMLA {anchor:.2f} us (H200, 2026-12-02, peer_flashmla.py; not this run): "
        f"ours / FlashMLA {ours / anchor:.2f}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for the results")
    parser.add_argument(
        "--cases",
        nargs="*",
        default=list(CASE_KEYS),
        choices=list(CASE_KEYS),
        help="named cases (default: all)",
    )
    parser.add_argument(
        "--sweep-keys",
        nargs="*",
        type=int,
        default=[32, 64, 128, 256, 512, 1024, 2048],
        help="keys per row for the sweep at B=5, H=96 (empty: none)",
    )
    parser.add_argument(
        "--sweep-rows",
        nargs="*",
        type=int,
        default=[1, 5, 16, 64, 128, 256],
        help="rows B for the sweep at H=128, 2048 keys (empty: none; 128 is issue #28's "
        ">= 600 TFLOP/s case)",
    )
    parser.add_argument(
        "--sweep-heads",
        nargs="*",
        type=int,
        default=[16, 32, 64, 96, 128],
        help="heads H for the sweep at B=5, 256 keys (empty: none)",
    )
    parser.add_argument(
        "--sweep-short",
        nargs="*",
        type=int,
        default=[],
        help="rows B for a sweep at H=128 over K = 128 index slots, all valid (the dispatch "
        "rule's one-chunk case; default: none)",
    )
    parser.add_argument(
        "--configs",
        nargs="*",
        default=[],
        choices=sorted(_CONFIG_NAMES),
        help="also time each of these kernel configs forced (s<split>: cluster-mma at that "
        "cluster split; wgmma<split>: the warpgroup-MMA variant at that cluster split)",
    )
    parser.add_argument("--calls", type=int, default=200, help="profiled calls per path")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("bench_decode needs a GPU: the kernel path does not run on", jax.default_backend())
        return 2
    sm_count = jax.devices()[0].core_count
    configs = [_CONFIG_NAMES[c] for c in args.configs]
    results = []
    jobs = plan(args)
    for i, (name, batch, heads, width, keys) in enumerate(jobs):
        print(
            f"[{i + 1}/{len(jobs)}] {name}: B={batch} H={heads} K={width} keys={keys}", flush=True
        )
        r = measure(name, batch, heads, width, keys, args.calls, configs, sm_count)
        results.append(r)
        k, b = r["kernel_us"], r["baseline_us"]
        print(
            f"    kernel {k['median']:.2f} us [{k['p10']:.2f}, {k['p90']:.2f}]  "
            f"reference {b['median']:.2f} us ({r['baseline_kernels']} kernels)  "
            f"x{r['speedup']:.1f}  {r['kernel_GBps']:.0f} GB/s  "
            f"{r['kernel_TFLOPs']:.1f} TFLOP/s  floor {r['bandwidth_floor_us']:.2f} us  "
            f"(dispatch: {r['dispatch']})",
            flush=True,
        )
        if anchor_text(r):
            print(anchor_text(r), flush=True)
        for slug, c in r["by_config"].items():
            t = c["kernel_us"]
            print(
                f"      {slug}: {t['median']:.2f} us [{t['p10']:.2f}, {t['p90']:.2f}]  "
                f"max diff vs reference {c['max_abs_diff_vs_reference']:.3g}",
                flush=True,
            )
        write_outputs(results, args.out)
    print(
        f"wrote {args.out}/results.json, results.csv"
        + (", latency_vs_keys.png" if args.sweep_keys else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
