"""benchmarks/ab_cubins.py on CPU: which cubins it compares, in which order."""


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
