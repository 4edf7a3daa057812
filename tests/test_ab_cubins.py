"""benchmarks/ab_cubins.py on CPU: which cubins it compares, in which order; its argument
checks."""

import pytest


def test_variants_keep_the_dirs_order_and_stay_apart(tmp_path, load_script):
    # The same cubin name in two DIRs (an unchanged config) must stay two variants, and the
    # first DIR given holds the output check's reference.
    for folder, stems in {"b": ["k-2", "k-1"], "a": ["k-1", "k-3"]}.items():
        (tmp_path / folder).mkdir()
        for stem in stems:
            (tmp_path / folder / f"{stem}.cubin").write_bytes(b"")
    with load_script("benchmarks/ab_cubins.py") as ab_cubins:
        names = [name for name, _ in ab_cubins.variant_paths([tmp_path / "b", tmp_path / "a"])]
    assert names == [
        f"{tmp_path}/{d}/{stem}"
        for d, stem in (("b", "k-1"), ("b", "k-2"), ("a", "k-1"), ("a", "k-3"))
    ]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--dcp", "2"], "--dcp needs --push"),
        (["--push", "--dcp", "0"], "--dcp must be in [1, 16]"),
        (["--push", "--dcp", "17"], "--dcp must be in [1, 16]"),
        (["--push", "--dcp", "5", "--shape", "5,96,256"], "must divide every shape's"),
        (["--push", "--dcp", "3"], "must divide every shape's"),  # a default shape has H = 128
    ],
)
def test_dcp_needs_push_and_must_divide_the_heads(
    tmp_path, load_script, monkeypatch, capsys, extra, message
):
    # Refused before any CUDA call: a simulated rank holds H / D of the gathered heads.
    monkeypatch.setattr("sys.argv", ["ab_cubins.py", str(tmp_path), *extra])
    with load_script("benchmarks/ab_cubins.py") as ab_cubins, pytest.raises(SystemExit) as exit:
        ab_cubins.main()
    assert exit.value.code == 2
    assert message in capsys.readouterr().err
