"""benchmarks/peer_flashmla.py on CPU: its arguments and its refusals (it needs torch + CUDA)."""

import argparse
import sys

import pytest


@pytest.fixture(scope="module")
def peer(load_script):
    with load_script("benchmarks/peer_flashmla.py") as module:
        yield module


def test_shapes_parse_and_bad_ones_name_the_shape(peer):
    assert peer.parse_shape("5,96,256") == (5, 96, 256)
    for bad in ("5,96", "a,b,c", "0,64,256", "5,129,256", "5,64,200000"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad):
            peer.parse_shape(bad)
    assert len({peer.parse_shape(s) for s in peer.SHAPES}) == 7  # all valid, all distinct


def test_heads_are_padded_as_vllm_does(peer):
    assert [peer.padded_heads(h) for h in (16, 64, 65, 96, 128)] == [64, 64, 128, 128, 128]


def test_token_layout_is_deepseek_v32s(peer):
    assert peer.TOKEN_BYTES == 656  # 512 E4M3 + 4 FP32 scales + 64 BF16


def test_without_torch_it_says_so_and_exits_2(peer, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    assert peer.main(["--library", "/nonexistent.so"]) == 2
    assert "PyTorch" in capsys.readouterr().err


def test_library_is_required(peer):
    with pytest.raises(SystemExit) as exit_info:
        peer.main([])
    assert exit_info.value.code == 2
