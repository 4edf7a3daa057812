"""Every shipped decode config at a grid of shapes, next to the dispatch rule's pick.

    python benchmarks/dispatch_survey.py [--cubins DIR] [--shape B,H,K ...]
        [--launches 200] [--repeats 3] [--tie 0.02] [--out survey.json]

What it answers: does `kernel/dispatch.py` pick the fastest shipped config, and by how much
does it miss where it does not? For each shape (B rows, H heads, all K index slots valid) every
decode cubin in DIR (default: the installed package's shipped cubins) is timed the way
`ab_cubins.py` times variants: the same inputs (N = 131072 cache rows, 2048 slots per row of
which K valid), ``--launches`` launches captured into a CUDA graph per config and replayed, one
untimed round, then the configs interleaved over ``--repeats`` rounds; the median us per
launch. Each row of the table gives every config's time, the fastest, the rule's pick
(``choose_config(B, H, K)`` with this GPU's SM count; H a multiple of 16) and pick / fastest;
the summary counts the shapes where the pick is within ``--tie`` of the fastest and names the
worst miss. ``--out`` writes every timing as JSON (the data for refitting the rule's costs).
The default grid is the 48 shapes the rule is fitted to: session 26's 25 all-valid shapes and 11
with K <= 128, and session 28's 12 (the benchmark's cases among them; BENCHMARKS.md). Their
session-33 H200 timings, which the rule's costs are fitted to, are
`tests/data/dispatch_survey_h200.json` (`dispatch_fit.py` refits the costs to such a file);
the shipped kernels' timings at those 48 shapes and 16 others (session 36), which a CPU test
holds the rule's picks to, are `tests/data/dispatch_shipped_h200.json`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

SHAPES = [  # (B, H, K): session 26's survey (25) and small-K survey (11), session 28's 12
    (1, 96, 2048), (2, 96, 2048), (2, 128, 2048), (3, 96, 2048), (4, 64, 1536),
    (5, 64, 1024), (5, 64, 2048), (5, 96, 512), (5, 96, 1024), (5, 96, 1536),
    (5, 96, 2048), (5, 128, 512), (5, 128, 768), (6, 96, 768), (8, 64, 512),
    (8, 96, 1024), (8, 128, 256), (12, 96, 256), (16, 32, 1024), (16, 96, 512),
    (16, 128, 384), (24, 96, 64), (32, 64, 512), (48, 16, 2048), (64, 64, 64),
    (1, 16, 8), (1, 128, 32), (1, 64, 64), (5, 96, 32), (5, 96, 64), (5, 128, 64),
    (8, 96, 64), (12, 64, 64), (16, 32, 64), (24, 32, 64), (5, 96, 128),
    (5, 64, 256), (5, 96, 256), (1, 128, 256), (5, 128, 256), (5, 128, 2048),
    (64, 128, 2048), (1, 128, 2048), (16, 128, 2048), (5, 128, 1024), (2, 128, 512),
    (10, 128, 2048), (32, 64, 2048),
]  # fmt: skip


def shape_arg(text: str) -> tuple[int, int, int]:
    try:
        batch, heads, keys = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape wants B,H,K, got {text!r}") from None
    if batch < 1 or heads < 16 or heads % 16 or not 0 < keys <= 2048:
        raise argparse.ArgumentTypeError(
            f"--shape needs B >= 1, H % 16 == 0, 0 < K <= 2048: {text!r}"
        )
    return batch, heads, keys


def compare(times: dict[str, float], pick: str, tie: float) -> dict:
    """One shape's verdict from its configs' times (us, by config slug) and the rule's pick:
    the fastest config, pick / fastest, and whether that is within ``tie`` (a fraction)."""
    fastest = min(times, key=times.get)
    ratio = times[pick] / times[fastest]
    return {"fastest": fastest, "pick": pick, "ratio": ratio, "ok": ratio <= 1 + tie}


def summary(verdicts: list[tuple[tuple[int, int, int], dict]], tie: float) -> str:
    """The survey's last line: shapes whose pick is within the tie, and the worst miss."""
    good = sum(v["ok"] for _, v in verdicts)
    shape, worst = max(verdicts, key=lambda item: item[1]["ratio"])
    return (
        f"the rule's pick is within {tie:.0%} of the fastest at {good} of {len(verdicts)} "
        f"shapes; worst: B,H,K = {','.join(map(str, shape))}, {worst['pick']} "
        f"{worst['ratio']:.2f}x the fastest ({worst['fastest']})"
    )


def installed_cubins() -> pathlib.Path:
    import jax_sparse_mla

    return pathlib.Path(jax_sparse_mla.__file__).parent / "_cubins"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cubins", type=pathlib.Path, help="folder of decode cubins (+ .json)")
    parser.add_argument("--shape", action="append", type=shape_arg, help="B,H,K (repeatable)")
    parser.add_argument("--launches", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tie", type=float, default=0.02, help="pick / fastest - 1 still ok")
    parser.add_argument("--out", type=pathlib.Path, help="JSON file for every timing")
    args = parser.parse_args()

    # The GPU side (ab_cubins' launcher and graphs; cuda-python) only when measuring.
    from ab_cubins import CACHE_ROWS, WIDTH, inputs, time_interleaved
    from cubin_launch import Context, CubinKernel, check
    from cuda.bindings import driver as cu

    from jax_sparse_mla.kernel import dispatch
    from jax_sparse_mla.kernel.config import KernelConfig

    folder = args.cubins or installed_cubins()
    context = Context()  # before loading modules: cuModuleLoadData needs the initialised driver
    kernels = {}
    for path in sorted(folder.glob("*.cubin")):
        meta = json.loads(path.with_suffix(".json").read_text())
        config = meta.get("config") or {}  # the indexer's and the exchange's: none
        if config.get("variant") in ("cluster-mma", "wgmma"):
            slug = KernelConfig(**config).slug
            kernels[slug] = CubinKernel(path.read_bytes(), meta)
    if not kernels:
        raise SystemExit(f"no decode cubins in {folder}")
    attribute = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    sm_count = check(cu.cuDeviceGetAttribute(attribute, context.device))
    print(
        f"{len(kernels)} configs from {folder}; {args.launches} launches x {args.repeats} "
        f"rounds per config and shape (CUDA graph replay, median); {sm_count} SMs"
    )
    results, verdicts = [], []
    for batch, heads, keys in args.shape or SHAPES:
        buffers = inputs(batch, heads, keys)
        launch_args = ([b.address for b in buffers], (CACHE_ROWS, WIDTH, heads, 576), batch)
        samples = time_interleaved(context, kernels, launch_args, args.launches, args.repeats)
        for buffer in buffers:
            buffer.free()
        times = {slug: statistics.median(values) for slug, values in samples.items()}
        pick = dispatch.choose_config(batch, heads, keys, sm_count).slug
        verdict = compare(times, pick, args.tie)
        verdicts.append(((batch, heads, keys), verdict))
        results.append({"shape": [batch, heads, keys], "us": times, **verdict})
        cells = "  ".join(f"{slug} {us:.2f}" for slug, us in times.items())
        print(
            f"B={batch} H={heads} K={keys}: {cells}  | pick {pick} {verdict['ratio']:.2f}x "
            f"the fastest ({verdict['fastest']})" + ("" if verdict["ok"] else "  MISS")
        )
    print(summary(verdicts, args.tie))
    if args.out:
        args.out.write_text(json.dumps({"sm_count": sm_count, "shapes": results}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
