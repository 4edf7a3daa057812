"""The DSA indexer's top-k on the GPU: index_topk's kernel next to its jitted jnp reference.

    python benchmarks/bench_index_topk.py
    python benchmarks/bench_index_topk.py --cases 1x5x32768 64x1x32768 --calls 100
    python benchmarks/bench_index_topk.py --plot benchmarks/index_topk_vs_context.png
    python benchmarks/bench_index_topk.py --cache flat --cases 1x5x32784
    python benchmarks/bench_index_topk.py --cases 1x5x32768 --topk-cluster 16   # a forced size

Cases are B x T x context: B requests of T verify rows each over `context` cached tokens
(DESIGN.md section 5): 64 index heads of 128, top-k 2048, a paged FP8 index cache (blocks of 64
tokens: 64 x 128 FP8 bytes + 64 FP32 scales) in which every request owns its own blocks in
shuffled order (`--cache flat`: one flat cache of `context` keys, as the example's decode step
uses; no anchor there), lengths = context. Random FP8 queries and keys, random positive key
scales, head weights of both signs. Both paths run through jax.jit on the same inputs in one
run: ours (implementation="cute"; the compiled program must hold the kernel's custom call, else
the benchmark stops) and the jnp reference (implementation="reference"). GPU time per call
comes from JAX's profiler (CUPTI kernel records, the host waiting for each call; see
gpu_profile.py): the span from a call's first kernel start to its last kernel end, median and
p10/p90 over --calls calls. The HBM floor is the index keys read once per request, B * context
* 132 bytes at 4.8 TB/s. The anchors are DESIGN.md's (an H200, 2026-12-01: DeepGEMM
fp8_paged_mqa_logits + vLLM cooperative_topk, kernel time per call). Each case also compares
the two paths' tokens: differing tokens, and whether they are ties within FP32 rounding at a
row's k-th score (examples/token_agreement.py). --topk-cluster / --span force the lowering's
choices (the top-k's CTAs per row, the scores' key tiles per CTA) for sweeps, and say so in
the output. Exits with status 1 when a check fails, 2 without a CUDA GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "examples"))
import token_agreement
from gpu_profile import profile_calls

import jax_sparse_mla
from jax_sparse_mla import index_lowering
from jax_sparse_mla.kernel.index.config import TOPK_CLUSTERS

TARGET = "jax_sparse_mla_index_topk"  # the kernel's XLA custom call
# Its attributes name the kernels it launches (scores_kernel, topk_kernel).
STAGE_KERNEL = re.compile(r'\b\w+_kernel\s*=\s*"(?P<name>[^"]+)"')
HEADS = 64
DIM = 128
TOP_K = 2048
BLOCK = 64  # tokens per index cache block
KEY_BYTES = DIM + 4  # an FP8 key and its FP32 scale
HBM_BYTES_PER_S = 4.8e12  # H200 datasheet
CASES = [  # (B requests, T verify rows each, context tokens)
    (1, 5, 32768),
    (1, 5, 131072),
    (5, 1, 32768),
    (1, 1, 131072),
    (8, 1, 65536),
    (64, 1, 32768),
]
# DESIGN.md section 5, one H200, 2026-12-01: (fp8_paged_mqa_logits us, cooperative_topk us).
ANCHORS = {(1, 5, 32768): (6.9, 10.1), (1, 5, 131072): (25.8, 13.8), (64, 1, 32768): (73.5, 17.2)}
GOALS_US = {(1, 5, 32768): 10.0, (1, 5, 131072): 20.0, (64, 1, 32768): 80.0}
PLOT_CONTEXTS = [4096, 8192, 16384, 32768, 65536, 131072]  # at B=1, T=5


def case_name(case: tuple[int, int, int]) -> str:
    return "x".join(map(str, case))


def make_inputs(
    batch: int, steps: int, context: int, seed: int = 0, flat: bool = False
) -> tuple[jax.Array, ...]:
    """(q, weights, keys, scales, lengths, block_table) on the GPU for one case; with ``flat``
    one flat cache of ``context`` keys that every request reads, and block_table None."""
    blocks = -(-context // BLOCK)
    parts = jax.random.split(jax.random.key(seed), 5)
    fp8 = jnp.float8_e4m3fn
    q = jax.random.normal(parts[0], (batch, steps, HEADS, DIM), jnp.bfloat16).astype(fp8)
    weights = jax.random.normal(parts[1], (batch, steps, HEADS), jnp.float32)
    lengths = jnp.full((batch,), context, jnp.int32)
    if flat:
        keys = jax.random.normal(parts[2], (context, DIM), jnp.bfloat16).astype(fp8)
        scales = jax.random.uniform(parts[3], (context,), jnp.float32, 0.5, 1.0)
        return (*jax.block_until_ready((q, weights, keys, scales, lengths)), None)
    keys = jax.random.normal(parts[2], (batch * blocks, BLOCK, DIM), jnp.bfloat16).astype(fp8)
    scales = jax.random.uniform(parts[3], (batch * blocks, BLOCK), jnp.float32, 0.5, 1.0)
    table = jax.random.permutation(parts[4], batch * blocks).reshape(batch, blocks)
    return jax.block_until_ready((q, weights, keys, scales, lengths, table.astype(jnp.int32)))


def index_topk(implementation: str, q, weights, keys, scales, lengths, table) -> jax.Array:
    return jax_sparse_mla.index_topk(
        q,
        weights,
        keys,
        scales,
        lengths,
        top_k=TOP_K,
        block_table=table,
        implementation=implementation,
    )


class KernelNotUsed(RuntimeError):
    """implementation='cute' did not put the kernel into the compiled program."""


def compile_kernel_path(args: tuple[jax.Array, ...]) -> tuple[Callable[..., jax.Array], set]:
    """Ours, jitted, and the names of the kernels its custom call launches; raises
    KernelNotUsed unless the compiled program calls the kernel."""
    fn = jax.jit(partial(index_topk, "cute"))
    try:
        text = fn.lower(*args).compile().as_text()
    except NotImplementedError as failure:
        raise KernelNotUsed(f"implementation='cute' does not lower here: {failure}") from failure
    calls = [line for line in text.splitlines() if f'custom_call_target="{TARGET}"' in line]
    if not calls:
        raise KernelNotUsed(f"no {TARGET!r} custom call in the compiled program")
    return fn, {found["name"] for line in calls for found in STAGE_KERNEL.finditer(line)}


def request_scores(args: tuple[jax.Array, ...], batch: int, steps: int, context: int):
    """scores_of_row for token_agreement.compare: float64 scores of row b * T + t over its
    request's keys, fetched from the GPU only for rows whose tokens differ."""
    q, weights, keys, scales, _, table = args
    fetched = {}

    def of_row(row: int) -> token_agreement.RowScores:
        b, t = divmod(row, steps)
        if b not in fetched:
            blocks = np.asarray(table[b]) if table is not None else slice(None)
            fetched[b] = (
                np.asarray(keys[blocks], np.float32).reshape(-1, DIM)[:context],
                np.asarray(scales[blocks]).reshape(-1)[:context],
            )
        request_keys, request_scales = fetched[b]
        visible = context - steps + t + 1
        return token_agreement.row_scores(
            np.asarray(q[b, t], np.float32),
            np.asarray(weights[b, t]),
            request_keys[:visible],
            request_scales[:visible],
        )

    return of_row


def measure(case: tuple[int, int, int], calls: int, flat: bool = False) -> dict:
    batch, steps, context = case
    args = make_inputs(batch, steps, context, flat=flat)
    kernel, own_kernels = compile_kernel_path(args)
    reference = jax.jit(partial(index_topk, "reference"))
    got, want = np.asarray(kernel(*args)), np.asarray(reference(*args))
    agreement = token_agreement.compare(
        got.reshape(-1, TOP_K), want.reshape(-1, TOP_K), request_scores(args, *case)
    )
    ours = profile_calls(kernel, args, calls)
    baseline = profile_calls(reference, args, calls)
    own_us = ours.named_us(own_kernels)
    return {
        "case": case,
        "ours": ours.summary(ours.span_us),
        # The custom call's own kernels (the anchors' measure); None where their names did
        # not show up among the profiled kernels.
        "ours_own": ours.summary(own_us) if own_kernels and min(own_us) > 0 else None,
        # The scoring stage alone (its first kernel).
        "ours_scores": stage_summary(ours, own_kernels, "IndexScores"),
        "ours_kernels": ours.names,
        "reference": baseline.summary(baseline.span_us),
        "reference_kernels": len(baseline.names),
        "floor_us": batch * context * KEY_BYTES / HBM_BYTES_PER_S * 1e6,
        "agreement": agreement,
        "flat": flat,
    }


def stage_summary(times, own_kernels: set, marker: str) -> dict | None:
    """Summary of the custom call's kernels whose name holds ``marker``, None if not seen."""
    names = {name for name in own_kernels if marker in name}
    values = times.named_us(names)
    return times.summary(values) if names and min(values) > 0 else None


def spread(times: dict[str, float] | None) -> str:
    if times is None:
        return "n/a"
    return f"{times['median']:.1f} [{times['p10']:.1f}, {times['p90']:.1f}]"


def table(results: list[dict], calls: int, forced: list[str]) -> list[str]:
    lines = [
        "| case B x T x context | ours (cute) us | ours, its kernels us | ours, scores kernel us "
        "| jnp reference us | HBM floor us | anchor us (DeepGEMM + vLLM) | goal us | "
        "ours / anchor | tokens differing |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        case, ours = r["case"], r["ours"]["median"]
        anchor = None if r["flat"] else ANCHORS.get(case)  # the anchors read a paged cache
        anchor_text = f"{anchor[0]} + {anchor[1]} = {sum(anchor):.1f}" if anchor else "not measured"
        ratio = f"{ours / sum(anchor):.2f}" if anchor else "-"
        goal = f"<= {GOALS_US[case]:.0f}" if case in GOALS_US and not r["flat"] else "-"
        agreement = r["agreement"]
        differing = f"{agreement.differing}" + (
            "" if agreement.agrees else f" ({agreement.unexplained} beyond FP32 ties: FAIL)"
        )
        lines.append(
            f"| {case_name(case)} | {spread(r['ours'])} | {spread(r['ours_own'])} | "
            f"{spread(r['ours_scores'])} | "
            f"{spread(r['reference'])} | "
            f"{r['floor_us']:.2f} | {anchor_text} | {goal} | {ratio} | {differing} |"
        )
    lines.append(
        f"\nMethod: {jax.devices()[0].device_kind}, jax {jax.__version__}; GPU time per call = "
        f"span of the jitted call's kernels (first start to last end, XLA's small fusions "
        f"around the op included) from JAX profiler CUPTI records, calls synced one by one, "
        f"median [p10, p90] over {calls} calls; 'its kernels' = the summed durations of the "
        f"kernels the {TARGET} custom call launches (checked in the compiled program of "
        f"index_topk(implementation='cute')); same inputs, one run; HBM floor = B * context * "
        f"{KEY_BYTES} B / 4.8 TB/s (keys read once per request, whatever T); anchors are "
        f"kernel-time sums measured on an H200 2026-12-01 (DESIGN.md section 5); ours / anchor "
        f"uses the span." + "".join(f" {line}" for line in forced)
    )
    return lines


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}", flush=True)
        return
    contexts = [r["case"][2] for r in results]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.plot(contexts, [r["ours"]["median"] for r in results], "o-", label="ours (cute)")
    ax.plot(contexts, [r["reference"]["median"] for r in results], "s-", label="jnp reference")
    ax.plot(contexts, [r["floor_us"] for r in results], "k--", label="HBM floor (4.8 TB/s)")
    anchored = [(c[2], sum(a)) for c, a in ANCHORS.items() if c[:2] == (1, 5)]
    ax.plot(*zip(*anchored, strict=True), "r^", label="DeepGEMM + vLLM top-k (2026-12-01)")
    goals = [(c[2], g) for c, g in GOALS_US.items() if c[:2] == (1, 5)]
    ax.plot(*zip(*goals, strict=True), "gv", label="goal")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="context tokens",
        ylabel="GPU time per call (us)",
        title=f"index_topk, B=1, T=5, 64 heads, top-k {TOP_K}, {jax.devices()[0].device_kind}",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)


def parse_case(text: str) -> tuple[int, int, int]:
    try:
        batch, steps, context = (int(part) for part in text.split("x"))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected BxTxCONTEXT, got {text!r}") from error
    if min(batch, steps, context) < 1 or steps > context:
        raise argparse.ArgumentTypeError(f"need B, T >= 1 and context >= T, got {text!r}")
    return batch, steps, context


def force_choices(cluster: int | None, span: int | None) -> list[str]:
    """Replaces the lowering's rules for the top-k cluster and the scores span by constants
    (for sweeps; every cubin is shipped and tested), loudly: returns the FORCED lines, printed
    here and again under the table."""
    forced = []
    if cluster is not None:
        forced.append(
            f"FORCED: top-k clusters of {cluster} CTAs per row (not index_lowering's rule)."
        )
        index_lowering.topk_cluster = lambda rows, capacity, sm_count: cluster
    if span is not None:
        forced.append(f"FORCED: {span} key tiles per scores CTA (not index_lowering's rule).")
        index_lowering.span = lambda batch, steps, head_tiles, capacity, sm_count: span
    for line in forced:
        print(line)
    return forced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cases",
        nargs="*",
        type=parse_case,
        default=CASES,
        metavar="BxTxCONTEXT",
        help=f"cases to run (default: {' '.join(map(case_name, CASES))})",
    )
    parser.add_argument(
        "--calls", type=int, default=200, help="profiled calls per path and case (default 200)"
    )
    parser.add_argument(
        "--cache",
        choices=["paged", "flat"],
        default="paged",
        help="paged (default: blocks of 64 tokens, each request its own, as the anchors) or "
        "flat (one [context, 128] cache that every request reads, block_table=None)",
    )
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help=f"also time B=1, T=5 at contexts {PLOT_CONTEXTS} and write a PNG of GPU time vs "
        f"context there (needs matplotlib; skipped with a message without it)",
    )
    parser.add_argument(
        "--topk-cluster",
        type=int,
        choices=TOPK_CLUSTERS,
        help="force the top-k's CTAs per verify row for every case (default: the lowering's "
        "rule, index_lowering.topk_cluster)",
    )
    parser.add_argument(
        "--span",
        type=int,
        help="force the scores kernel's key tiles per CTA for every case (default: the "
        "lowering's rule, index_lowering.span)",
    )
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error("--calls must be positive")
    if args.span is not None and args.span < 1:
        parser.error("--span must be positive")
    if jax.default_backend() != "gpu":
        print(
            f"bench_index_topk needs a CUDA GPU (a Hopper one for the kernel); JAX's backend "
            f"here is {jax.default_backend()!r}. Nothing was measured.",
            file=sys.stderr,
        )
        return 2
    forced = force_choices(args.topk_cluster, args.span)
    cases = list(dict.fromkeys(args.cases))
    sweep = [(1, 5, context) for context in PLOT_CONTEXTS] if args.plot else []
    jobs = cases + [case for case in sweep if case not in cases]
    measured = {}
    for index, case in enumerate(jobs):
        print(f"[{index + 1}/{len(jobs)}] {case_name(case)}: compiling, checking, profiling ...")
        try:
            measured[case] = r = measure(case, args.calls, flat=args.cache == "flat")
        except KernelNotUsed as failure:
            rule = "!" * 88
            print(f"{rule}\n!!! THE KERNEL IS NOT USED: {failure}\n!!! stopping\n{rule}")
            return 1
        print(
            f"    ours {spread(r['ours'])} us (its kernels {spread(r['ours_own'])}; all "
            f"kernels seen: {', '.join(r['ours_kernels'])}), reference "
            f"{spread(r['reference'])} us ({r['reference_kernels']} kernels), floor "
            f"{r['floor_us']:.2f} us; tokens vs reference: {r['agreement'].summary()}",
            flush=True,
        )
    print("\n".join(table([measured[case] for case in cases], args.calls, forced)), flush=True)
    if args.plot:
        plot([measured[case] for case in sweep], args.plot)
    failed = [case_name(c) for c, r in measured.items() if not r["agreement"].agrees]
    print(f"RESULT: {'FAIL (tokens: ' + ', '.join(failed) + ')' if failed else 'PASS'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
