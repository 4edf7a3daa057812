"""benchmarks/bench_index_topk.py on CPU: its options (the forced lowering choices for sweeps)
and its refusal to measure without a GPU."""

import jax
import pytest

from jax_sparse_mla import index_lowering


@pytest.fixture(scope="module")
def bench(load_script):
    with load_script("benchmarks/bench_index_topk.py") as module:
        yield module


def test_forced_choices_replace_the_rules_loudly(bench, monkeypatch, capsys):
    monkeypatch.setattr(index_lowering, "topk_cluster", index_lowering.topk_cluster)
    monkeypatch.setattr(index_lowering, "span", index_lowering.span)
    assert index_lowering.topk_cluster(1, 32768, 132) == 8  # the rule, before
    forced = bench.force_choices(16, 3)
    assert index_lowering.topk_cluster(1, 32768, 132) == 16
    assert index_lowering.span(1, 5, 1, 32768, 132) == 3
    out = capsys.readouterr().out
    assert "FORCED: top-k clusters of 16" in out and "FORCED: 3 key tiles" in out
    assert len(forced) == 2 and all(line in out for line in forced)  # and for the Method line


@pytest.mark.parametrize("flags", [["--topk-cluster", "3"], ["--span", "0"], ["--calls", "0"]])
def test_bad_options_are_refused(bench, flags):
    with pytest.raises(SystemExit) as exit_:
        bench.main(flags)
    assert exit_.value.code == 2


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="a GPU is here: it would measure")
def test_without_a_gpu_nothing_is_measured(bench, capsys):
    assert bench.main(["--calls", "1"]) == 2
    assert "Nothing was measured" in capsys.readouterr().err
