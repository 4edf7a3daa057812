"""Refit the dispatch rule's costs (`kernel/dispatch.py`) to dispatch_survey.py timings. CPU only.

    python benchmarks/dispatch_fit.py [SURVEY.json ...] [--tie 0.02]

Reads the JSON that `dispatch_survey.py --out` writes (default: the checked-in H200 survey,
`tests/data/dispatch_survey_h200.json`). The model is the rule's own (`dispatch.waves`,
`dispatch.cost_terms`, `dispatch.predicted_us`): a config's time is its waves of clusters times
one CTA's cost, cluster-mma's per 32-key step and per chunk, wgmma's per chunk, plus a fixed
part by split (and wgmma split 8's crowding, `dispatch.crowded`). Each variant's costs come
from a least-squares fit on relative error over every config and shape; then the margins
(wgmma's pick must be predicted at most that fraction of cluster-mma's time) are scanned for
those at which the rule picks a config within ``--tie`` of the fastest at every shape. Prints
the fitted Costs (rounded as dispatch.py keeps them), each variant's median and worst relative
error, the margin window, and a leave-one-out check (each shape's pick from costs fitted to the
others: a guide to unsurveyed shapes); paste the costs into `dispatch.H200_COSTS` with a margin
from the window's middle.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
# This checkout's rule (not an installed copy's) and the survey's verdict.
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from dispatch_survey import compare  # noqa: E402

from jax_sparse_mla.kernel import dispatch  # noqa: E402
from jax_sparse_mla.kernel.config import ALL_CONFIGS, SPLITS  # noqa: E402

DEFAULT_SURVEY = ROOT / "tests" / "data" / "dispatch_survey_h200.json"
MARGINS = [round(0.80 + 0.01 * i, 2) for i in range(41)]  # 0.80 .. 1.20


def load(paths: list[pathlib.Path]) -> tuple[list[tuple[tuple[int, int, int], dict]], int]:
    """(shape, us by config slug) rows of the surveys, and their common SM count."""
    rows, counts = [], set()
    for path in paths:
        data = json.loads(path.read_text())
        counts.add(data["sm_count"])
        rows += [(tuple(row["shape"]), row["us"]) for row in data["shapes"]]
    if len(counts) != 1:
        raise SystemExit(f"surveys from GPUs with different SM counts: {sorted(counts)}")
    return rows, counts.pop()


def fit_variant(variant: str, rows, sm_count: int) -> tuple[list[float], dict, list[float]]:
    """Least squares on relative error: (variable costs, fixed cost by split, relative errors);
    wgmma's variable costs end with its crowding cost (``dispatch.crowded``)."""
    configs = [c for c in ALL_CONFIGS if c.variant == variant]
    design, times = [], []
    for (batch, heads, width), us in rows:
        for config in configs:
            waves = dispatch.waves(config, batch, heads, sm_count)
            terms = list(dispatch.cost_terms(config, width))
            fixed = [float(config.split == split) for split in SPLITS]
            crowding = [dispatch.crowded(config, batch, heads, sm_count)] * (variant == "wgmma")
            design.append([waves * t for t in terms] + crowding + [waves * f for f in fixed])
            times.append(us[config.slug])
    design, times = np.array(design), np.array(times)
    solution, *_ = np.linalg.lstsq(design / times[:, None], np.ones_like(times), rcond=None)
    errors = list(design @ solution / times - 1)
    variable = [float(x) for x in solution[: -len(SPLITS)]]
    fixed = {split: float(x) for split, x in zip(SPLITS, solution[-len(SPLITS) :], strict=True)}
    return variable, fixed, errors


def fit(rows, sm_count: int) -> tuple[dispatch.Costs, dict]:
    """The fitted Costs (margin 1.0: scan it with margin_window) and each variant's errors."""
    (step, chunk), mma_fixed, mma_errors = fit_variant("cluster-mma", rows, sm_count)
    (wg_chunk, wg_crowded), wg_fixed, wg_errors = fit_variant("wgmma", rows, sm_count)
    costs = dispatch.Costs(step, chunk, mma_fixed, wg_chunk, wg_fixed, wg_crowded, 1.0)
    return costs, {"cluster-mma": mma_errors, "wgmma": wg_errors}


def rounded(costs: dispatch.Costs) -> dispatch.Costs:
    """``costs`` to the hundredths dispatch.py keeps."""

    def r(x):
        return round(x, 2)

    return dispatch.Costs(
        r(costs.mma_per_step),
        r(costs.mma_per_chunk),
        {s: r(v) for s, v in costs.mma_fixed.items()},
        r(costs.wgmma_per_chunk),
        {s: r(v) for s, v in costs.wgmma_fixed.items()},
        r(costs.wgmma_crowded),
        r(costs.wgmma_margin),
    )


def misses(costs: dispatch.Costs, rows, sm_count: int, tie: float) -> list[tuple]:
    """(shape, pick, pick / fastest) where the rule under ``costs`` misses by more than tie."""
    verdicts = [
        (shape, compare(us, dispatch.choose_config(*shape, sm_count, costs).slug, tie))
        for shape, us in rows
    ]
    return [(shape, v["pick"], v["ratio"]) for shape, v in verdicts if not v["ok"]]


def margin_window(costs: dispatch.Costs, rows, sm_count: int, tie: float) -> list[float]:
    """The margins (of MARGINS) at which ``costs`` miss no shape."""
    return [
        m
        for m in MARGINS
        if not misses(dataclasses.replace(costs, wgmma_margin=m), rows, sm_count, tie)
    ]


def leave_one_out(rows, sm_count: int, margin: float, tie: float) -> list[tuple]:
    """The misses (as ``misses``) of each shape's pick under costs fitted to the other shapes:
    how the rule may do at shapes the survey does not hold."""
    held_out = []
    for i in range(len(rows)):
        costs, _ = fit(rows[:i] + rows[i + 1 :], sm_count)
        costs = dataclasses.replace(rounded(costs), wgmma_margin=margin)
        held_out += misses(costs, rows[i : i + 1], sm_count, tie)
    return held_out


def listed(missed: list[tuple]) -> str:
    """``misses``' rows as one line."""
    return "; ".join(f"{shape} {pick} {ratio:.2f}x" for shape, pick, ratio in missed)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("surveys", nargs="*", type=pathlib.Path, default=[DEFAULT_SURVEY])
    parser.add_argument("--tie", type=float, default=0.02, help="pick / fastest - 1 still ok")
    args = parser.parse_args()
    rows, sm_count = load(args.surveys)
    costs, errors = fit(rows, sm_count)
    costs = rounded(costs)
    print(f"{len(rows)} shapes x {len(ALL_CONFIGS)} configs, {sm_count} SMs")
    for variant, errs in errors.items():
        worst = max(abs(e) for e in errs)
        median = statistics.median(abs(e) for e in errs)
        print(f"{variant}: relative error median {median:.1%}, worst {worst:.1%}")
    window = margin_window(costs, rows, sm_count, args.tie)
    if window:
        print(f"margins with no miss beyond {args.tie:.0%}: {window[0]:.2f} .. {window[-1]:.2f}")
        margin = window[len(window) // 2]
    else:
        missed = {
            m: misses(dataclasses.replace(costs, wgmma_margin=m), rows, sm_count, args.tie)
            for m in MARGINS
        }
        margin = min(MARGINS, key=lambda m: len(missed[m]))
        print(
            f"no margin hits every shape; {margin:.2f} misses {len(missed[margin])}: "
            f"{listed(missed[margin])}"
        )
    print(dataclasses.replace(costs, wgmma_margin=margin))
    held_out = leave_one_out(rows, sm_count, margin, args.tie)
    print(
        f"leave-one-out at margin {margin:.2f}: {len(rows) - len(held_out)} of {len(rows)} "
        f"within {args.tie:.0%}" + (f"; misses {listed(held_out)}" if held_out else "")
    )


if __name__ == "__main__":
    main()
