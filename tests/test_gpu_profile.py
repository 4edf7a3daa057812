"""benchmarks/gpu_profile.py on CPU: calls split at the idle gaps, and a trace that does not
split into one group per call recorded again (then refused), never guessed at."""

import pytest


@pytest.fixture(scope="module")
def gpu_profile(load_script):
    with load_script("benchmarks/gpu_profile.py") as module:
        yield module


def _trace(gpu_profile, calls: int, extra: bool):
    """Per call two kernels 1 us apart, calls 10 gap lengths apart; ``extra``: a stray event
    far after the last call."""
    gap = gpu_profile.GAP_NS
    events = []
    for i in range(calls):
        start = i * 10 * gap
        events += [(start, start + 5_000, "scores"), (start + 6_000, start + 9_000, "topk")]
    if extra:
        events.append((calls * 10 * gap, calls * 10 * gap + 1_000, "memset"))
    return {"/device:GPU:0": events}


def test_calls_split_at_idle_gaps(gpu_profile, monkeypatch):
    monkeypatch.setattr(gpu_profile, "record", lambda *a, **k: _trace(gpu_profile, 3, False))
    times = gpu_profile.profile_calls(lambda: 0, (), 3)
    assert times.kernel_us == [8.0] * 3
    assert times.span_us == [9.0] * 3
    assert times.names == ["scores", "topk"]
    assert times.named_us({"topk"}) == [3.0] * 3


def test_a_trace_that_does_not_split_is_recorded_again(gpu_profile, monkeypatch, capsys):
    traces = iter([_trace(gpu_profile, 3, True), _trace(gpu_profile, 3, False)])
    monkeypatch.setattr(gpu_profile, "record", lambda *a, **k: next(traces))
    assert gpu_profile.profile_calls(lambda: 0, (), 3).kernel_us == [8.0] * 3
    assert "trace 1 of 3 split into 4 groups for 3 calls" in capsys.readouterr().err


def test_a_trace_that_never_splits_is_refused(gpu_profile, monkeypatch):
    monkeypatch.setattr(gpu_profile, "record", lambda *a, **k: _trace(gpu_profile, 3, True))
    with pytest.raises(RuntimeError, match="found 4 in each of 3 traces"):
        gpu_profile.profile_calls(lambda: 0, (), 3)
