"""benchmarks/bench_decode.py on CPU: the FlashMLA anchor it prints next to the kernel, and
its refusal to measure without a GPU."""

import jax
import pytest


@pytest.fixture(scope="module")
def bench(load_script):
    with load_script("benchmarks/bench_decode.py") as module:
        yield module


def test_named_cases_get_the_peer_scripts_flashmla_anchor(bench, load_script):
    args = bench.argparse.Namespace(
        cases=list(bench.CASES), sweep_keys=[], sweep_rows=[128], sweep_heads=[], sweep_short=[]
    )
    anchors = {name: bench.flashmla_us(*shape) for name, *shape in bench.plan(args)}
    assert anchors == {
        "latency-h64": 12.17,
        "latency-h96": 12.88,
        "latency-h128": 12.88,
        "rank-full": 22.43,
        "throughput": 105.59,
        "rows-128": 205.51,
    }
    with load_script("benchmarks/peer_flashmla.py") as peer:  # the anchors' source
        assert set(bench.FLASHMLA_US) == {peer.parse_shape(s) for s in peer.SHAPES}
    assert bench.flashmla_us(5, 64, 128, 256) is None  # another index width: not that shape


def test_anchor_line_states_source_and_ratio(bench):
    result = {"flashmla_us": 12.0, "kernel_us": {"median": 6.0}}
    line = bench.anchor_text(result)
    assert "FlashMLA 12.00 us" in line and "not this run" in line and "0.50" in line
    assert bench.anchor_text({"flashmla_us": None, "kernel_us": {"median": 6.0}}) == ""


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="a GPU is here: it would measure")
def test_without_a_gpu_nothing_is_measured(bench, capsys):
    assert bench.main(["--calls", "1"]) == 2
    assert "needs a GPU" in capsys.readouterr().out


def test_results_csv_has_the_anchor_column(bench, tmp_path):
    result = {
        "case": "latency-h128", "B": 5, "H": 128, "K": 2048, "keys": 256,
        "dispatch": "wgmma-h64-s8", "kernel_us": {"median": 10.0}, "baseline_us": {"median": 80.0},
        "speedup": 8.0, "kernel_GBps": 70.0, "kernel_TFLOPs": 34.0, "bandwidth_floor_us": 0.4,
        "flashmla_us": None,
    }  # fmt: skip
    anchored = dict(result, case="latency-h64", H=64, flashmla_us=12.13)
    bench.write_outputs([result, anchored], str(tmp_path))
    header, *rows = (tmp_path / "results.csv").read_text().splitlines()
    assert header.endswith(",flashmla_us")
    assert rows[0].endswith(",") and rows[1].endswith(",12.13")
