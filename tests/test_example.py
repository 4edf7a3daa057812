"""examples/kimi_decode_step.py end to end on CPU, smallest preset: the layer output matches a
dense float32 attention over the same selected keys, on one device and under DCP."""

import importlib.util
import sys
from pathlib import Path

import jax
import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "kimi_decode_step.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("kimi_decode_step", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


# Context 60 < top-k 64: the verify rows at positions 60..64 see 61..65 tokens, so the first
# rows attend fewer than K keys (-1 padding in the top-k, short `valid` counts).
SMALL = ["--small", "--context", "60", "--iters", "1", "--warmup", "0"]


@pytest.mark.parametrize("dcp", [1, 2])
def test_small_layer_passes_dense_check(example, capsys, dcp):
    if len(jax.devices()) < dcp:
        pytest.skip(f"needs {dcp} devices (tests/conftest.py forces 8 on CPU)")
    result = example.main([*SMALL, "--dcp", str(dcp)])
    out = capsys.readouterr().out
    assert result["passed"], out
    assert result["paths"], out
    assert "RESULT: PASS" in out
    assert "keys attended per row: [61, 62, 63, 64, 64]" in out
    for error in result["rel_error"].values():
        assert 0.0 < error <= example.TOLERANCE, out


def test_help_documents_every_flag(example, capsys):
    with pytest.raises(SystemExit) as exit_info:
        example.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ["--small", "--context", "--verify-rows", "--dcp", "--iters", "--warmup", "--seed"]:
        assert flag in text
    for name in example.SIZE_FLAGS:
        assert "--" + name.replace("_", "-") in text
