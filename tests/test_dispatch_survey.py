"""benchmarks/dispatch_survey.py on CPU: its verdicts on given timings and its default grid."""

import argparse
import dataclasses
import json
import pathlib

import pytest

from jax_sparse_mla.kernel import dispatch
from jax_sparse_mla.kernel.config import ALL_CONFIGS, KernelConfig

# The timings the rule's costs are fitted to (session 33), and those of the shipped kernels
# (session 36: the 48 fitted shapes and 16 others), which the rule's picks are checked on.
H200_SURVEY = pathlib.Path(__file__).parent / "data" / "dispatch_survey_h200.json"
H200_SHIPPED = pathlib.Path(__file__).parent / "data" / "dispatch_shipped_h200.json"


@pytest.fixture(scope="module")
def survey(load_script):
    with load_script("benchmarks/dispatch_survey.py") as module:
        yield module


def test_verdict_names_the_fastest_and_the_picks_ratio(survey):
    times = {"cluster-mma-h32-s4": 5.5, "wgmma-h64-s8": 10.0, "cluster-mma-h16-s8": 5.0}
    verdict = survey.compare(times, "cluster-mma-h32-s4", tie=0.02)
    assert verdict["fastest"] == "cluster-mma-h16-s8" and verdict["ratio"] == pytest.approx(1.1)
    assert not verdict["ok"]
    assert survey.compare(times, "cluster-mma-h32-s4", tie=0.1)["ok"]
    assert survey.compare(times, "cluster-mma-h16-s8", tie=0.0)["ok"]


def test_summary_counts_the_hits_and_names_the_worst_miss(survey):
    verdicts = [
        ((5, 96, 256), survey.compare({"a": 1.0, "b": 2.0}, "a", 0.02)),
        ((64, 64, 64), survey.compare({"a": 1.0, "b": 1.5}, "b", 0.02)),
        ((1, 16, 8), survey.compare({"a": 1.0, "b": 1.01}, "b", 0.02)),
    ]
    line = survey.summary(verdicts, 0.02)
    assert "at 2 of 3 shapes" in line and "64,64,64, b 1.50x the fastest (a)" in line


def test_default_grid_is_valid_and_the_rule_answers_every_shape(survey):
    assert len(set(survey.SHAPES)) == len(survey.SHAPES) == 48
    slugs = {config.slug for config in ALL_CONFIGS}
    for shape in survey.SHAPES:
        assert survey.shape_arg(",".join(map(str, shape))) == shape
        assert dispatch.choose_config(*shape).slug in slugs


@pytest.mark.parametrize("text", ["5,96", "5,40,256", "5,96,4096", "0,96,256", "a,b,c"])
def test_bad_shapes_are_refused_by_name(survey, text):
    with pytest.raises(argparse.ArgumentTypeError, match="--shape"):
        survey.shape_arg(text)


@pytest.mark.parametrize("subset", ["fitted", "held-out"])
def test_the_rule_picks_the_fastest_at_every_surveyed_shape(survey, subset):
    """The H200 timings of session 36's kernels (every config): the rule's pick is within 2%
    of the fastest config at every shape of the default grid it is fitted to and at 16 shapes
    it is not. A refit that moves a pick shows here; a kernel change shows only once the
    surveys are re-run (--out) on the GPU."""
    data = json.loads(H200_SHIPPED.read_text())
    rows = [row for row in data["shapes"] if row["set"] == subset]
    shapes = [tuple(row["shape"]) for row in rows]
    if subset == "fitted":
        assert sorted(shapes) == sorted(survey.SHAPES)
    else:
        assert len(shapes) == 16 and not set(shapes) & set(survey.SHAPES)
    verdicts = []
    for row in rows:
        batch, heads, keys = row["shape"]
        pick = dispatch.choose_config(batch, heads, keys, data["sm_count"]).slug
        verdicts.append((tuple(row["shape"]), survey.compare(row["us"], pick, tie=0.02)))
    misses = [(shape, v["ratio"], v["fastest"]) for shape, v in verdicts if not v["ok"]]
    assert not misses, survey.summary(verdicts, 0.02)


@pytest.fixture(scope="module")
def refit(load_script):
    with load_script("benchmarks/dispatch_fit.py") as module:
        yield module


def test_the_refit_reproduces_the_rules_costs(refit):
    """dispatch_fit.py on the checked-in survey gives dispatch.H200_COSTS (as rounded there)
    and a margin window holding the rule's margin: the constants are the data's, not typed."""
    rows, sm_count = refit.load([H200_SURVEY])
    costs, errors = refit.fit(rows, sm_count)
    expected = dataclasses.replace(dispatch.H200_COSTS, wgmma_margin=1.0)
    assert refit.rounded(costs) == expected
    assert all(abs(e) < 0.2 for variant in errors.values() for e in variant)
    window = refit.margin_window(dispatch.H200_COSTS, rows, sm_count, tie=0.02)
    assert window == [0.94, 0.95, 0.96, 0.97]
    assert dispatch.H200_COSTS.wgmma_margin == window[len(window) // 2]


def test_leave_one_out_misses_no_shape(refit):
    """Each shape's pick from costs fitted to the other 47 is within 2% of its fastest config:
    no shape's pick rests on its own timing alone. (On session 31's survey, before the
    crowding term, the two 64-key shapes that show split 2 ahead of split 4 missed.)"""
    rows, sm_count = refit.load([H200_SURVEY])
    held_out = refit.leave_one_out(rows, sm_count, dispatch.H200_COSTS.wgmma_margin, tie=0.02)
    assert held_out == []


def test_crowding_is_wgmma_split_8_with_more_clusters_than_gpcs():
    """dispatch.crowded: rank-full (B=5, H=128: 10 clusters of 8) is crowded on 132 SMs (8
    GPCs), B=8, H=64 (8 clusters) is not, nor is any other config."""
    wgmma8, wgmma4 = (KernelConfig("wgmma", s) for s in (8, 4))
    assert dispatch.gpc_count(132) == 8
    assert dispatch.crowded(wgmma8, 5, 128, 132) == 1
    assert dispatch.crowded(wgmma8, 8, 64, 132) == 0
    assert dispatch.crowded(wgmma8, 64, 128, 132) == 1  # many waves: the first is full
    assert dispatch.crowded(wgmma4, 5, 128, 132) == 0
    assert all(
        dispatch.crowded(config, 5, 128, 132) == 0
        for config in ALL_CONFIGS
        if config.variant != "wgmma"
    )
