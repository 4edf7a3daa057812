"""The indexer's two kernels compile on a CPU-only machine to sm_90a cubins with their ABIs.

Both cubins (scores, top-k) are compiled with nvidia-cutlass-dsl into a fresh disk cache. The
cubin's own parameter table (cuobjdump's EIATTR_KPARAM_INFO) matches ``IndexKernel``'s ABI;
the SASS: the scores kernel's FP8 warpgroup MMAs (QGMMA E4M3 x E4M3 into F32, of the
config's tile shape, whole k32 chains), none in the top-k kernel; no local memory (LDL/STL,
stack) in either, registers within one CTA per SM. A second lookup in the same cache loads
from disk, with or without the DSL.
"""

from __future__ import annotations

import pathlib
import re

import pytest

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")

from cubin_tools import abi_table, cuobjdump, opcode_counts, param_table

from jax_sparse_mla import index_lowering
from jax_sparse_mla.kernel import compile as kernel_compile
from jax_sparse_mla.kernel.config import KernelUnavailableError
from jax_sparse_mla.kernel.index import compile as index_compile
from jax_sparse_mla.kernel.index.config import HEADS, INDEX_KERNELS, K_STEPS, TOKENS, IndexKernel

_real_fingerprint = index_compile.source_fingerprint


@pytest.fixture(scope="module", autouse=True)
def fingerprint():
    """One fingerprint for the module: the kernel sources may be edited while it runs, and
    its cache entries must stay keyed alike between the compile and the lookups."""
    value = _real_fingerprint()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(index_compile, "source_fingerprint", lambda: value)
        yield value


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("index-cubins")


@pytest.fixture(scope="module", params=INDEX_KERNELS, ids=lambda k: k.slug)
def kernel(request):
    return request.param


@pytest.fixture(scope="module")
def compiled(cache_dir, kernel):
    """The cubin compiled by the DSL here (the cache is empty: exactly one compile)."""
    compiles = []

    def recording(*args):
        compiles.append(args[0])
        return compile_kernel(*args)

    compile_kernel = index_compile.compile_kernel
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(index_compile, "compile_kernel", recording)
        result = index_compile.get_kernel(kernel, cache_dir=cache_dir)
    assert compiles == [kernel]
    return result


@pytest.fixture(scope="module")
def cubin_path(compiled, cache_dir, kernel):
    path = cache_dir / f"{kernel.slug}-test.cubin"
    path.write_bytes(compiled.cubin)
    return path


def test_meta_matches_the_abi(compiled, kernel, fingerprint):
    meta = compiled.meta
    assert meta["params"] == list(kernel.params)
    assert len(kernel.params) == len(kernel.param_types)
    assert meta["threads"] == kernel.threads and kernel.threads % 128 == 0
    assert meta["smem_bytes"] == kernel.smem_bytes <= 227 * 1024
    assert meta["arch"] == "sm_90a"
    assert meta["index_kernel"] == {"stage": kernel.stage, "cluster": kernel.cluster}
    assert meta["fingerprint"] == fingerprint
    assert meta["dsl_version"] == kernel_compile.dsl_version()
    assert compiled.cubin[:4] == b"\x7fELF"
    assert meta["kernel_name"].encode() in compiled.cubin


def test_entry_params_match_the_abi(cubin_path, compiled, kernel):
    """The cubin's own parameter table: one entry per ABI parameter, in order, 8 bytes for
    a pointer and 4 for a size."""
    table = param_table(cubin_path, compiled.meta["kernel_name"])
    assert table == abi_table(kernel.param_types), table


def test_sass(cubin_path, kernel):
    sass = cuobjdump("--dump-sass", cubin_path)
    assert "sm_90a" in sass
    counts = opcode_counts(sass)
    assert "LDL" not in counts and "STL" not in counts, "local-memory spills"
    gmmas = re.findall(r"\b[A-Z]*GMMA\.\S+", sass)
    if kernel.stage == "scores":
        # Tokens as M, heads as N (one head tile, or a pair of units), k32 steps of FP8 E4M3 x
        # E4M3 into F32, from shared memory; a tile's dot products are whole chains of K_STEPS
        # MMAs.
        shapes = {f"QGMMA.{TOKENS}x{n}x32.F32.E4M3.E4M3" for n in (HEADS, 2 * HEADS)}
        assert gmmas and set(gmmas) == shapes, counts
        assert all(gmmas.count(shape) % K_STEPS == 0 for shape in shapes), gmmas
        assert all(re.search(rf"{re.escape(s)} R\d+, gdesc\[UR\d+\]", sass) for s in shapes)
        assert counts.get("WARPGROUP", 0) >= 2, counts  # arrive, then wait on the group
        assert "HMMA" not in counts and "HGMMA" not in counts, counts
    else:
        assert not gmmas and "WARPGROUP" not in counts, counts
        assert "HMMA" not in counts and "QMMA" not in counts, counts
    usage = cuobjdump("--dump-resource-usage", cubin_path)
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    assert registers <= 65536 // kernel.threads, usage  # one CTA's threads fit an SM
    if kernel.stage == "scores":  # the grid rule's resident CTAs fit the register file
        allocated = -(-registers // 8) * 8
        assert allocated * kernel.threads * index_lowering.MAX_CTAS_PER_SM <= 65536, usage
    assert "STACK:0" in usage and "LOCAL:0" in usage, usage


def test_disk_cache_hit(compiled, cache_dir, kernel, monkeypatch):
    def fail(*args):
        raise AssertionError("compiled again despite a disk cache entry")

    monkeypatch.setattr(index_compile, "compile_kernel", fail)
    again = index_compile.get_kernel(kernel, cache_dir=cache_dir)
    assert again.cubin == compiled.cubin and again.meta == compiled.meta
    # Without the DSL, an entry of any DSL version is accepted.
    monkeypatch.setattr(kernel_compile, "dsl_version", lambda: None)
    assert index_compile.get_kernel(kernel, cache_dir=cache_dir).cubin == compiled.cubin


def test_cache_entry_is_checked_against_its_kernel(compiled, cache_dir, kernel, monkeypatch):
    """An entry is read only for the kernel its metadata names, whatever its file name."""
    other = next(k for k in INDEX_KERNELS if k != kernel)
    tail = f"{compiled.meta['fingerprint']}-{compiled.meta['dsl_version']}"
    misfiled = cache_dir / "misfiled"
    misfiled.mkdir(exist_ok=True)
    for suffix in (".cubin", ".json"):
        data = (cache_dir / f"{kernel.slug}-{tail}{suffix}").read_bytes()
        (misfiled / f"{other.slug}-{tail}{suffix}").write_bytes(data)

    def compile_instead(*args):
        raise LookupError("no usable entry: compiling")

    monkeypatch.setattr(index_compile, "compile_kernel", compile_instead)
    with pytest.raises(LookupError, match="compiling"):
        index_compile.get_kernel(other, cache_dir=misfiled)


def test_unavailable_without_dsl(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_compile, "dsl_version", lambda: None)
    with pytest.raises(KernelUnavailableError, match=r"no cubin for index-scores.*kernel-dev"):
        index_compile.get_kernel(IndexKernel("scores"), cache_dir=tmp_path)


def test_fingerprints_of_the_two_families_are_separate(tmp_path, monkeypatch):
    """Editing any index source, or the PTX helpers both families share, changes the
    index fingerprint; editing an index source leaves the decode kernels' fingerprint (and
    their cubins) as they were."""
    kernel_dir = tmp_path / "kernel"
    (kernel_dir / "index").mkdir(parents=True)
    for path in kernel_compile._KERNEL_DIR.glob("*.py"):
        (kernel_dir / path.name).write_bytes(path.read_bytes())
    (kernel_dir / "exchange").mkdir()  # the decodes' fingerprint covers its PTX and config
    for path in (kernel_compile._KERNEL_DIR / "exchange").glob("*.py"):
        (kernel_dir / "exchange" / path.name).write_bytes(path.read_bytes())
    index_dir = pathlib.Path(index_compile.__file__).resolve().parent
    for path in index_dir.glob("*.py"):
        (kernel_dir / "index" / path.name).write_bytes(path.read_bytes())
    sources = [
        kernel_dir / "index" / p.name for p in index_compile._SOURCES if p.parent == index_dir
    ]
    assert {p.name for p in sources} >= {"scores.py", "topk.py", "config.py"}
    sources.append(kernel_dir / "ptx.py")
    assert len(sources) == len(index_compile._SOURCES)
    monkeypatch.setattr(index_compile, "_SOURCES", tuple(sources))
    monkeypatch.setattr(kernel_compile, "_KERNEL_DIR", kernel_dir)
    decode = kernel_compile.source_fingerprint()
    seen = {_real_fingerprint()}
    for path in sources:
        with open(path, "a") as f:
            f.write("# an edit\n")
        seen.add(_real_fingerprint())
        if path.parent.name == "index":
            assert kernel_compile.source_fingerprint() == decode, path.name
    assert len(seen) == len(sources) + 1


def test_unknown_stage():
    with pytest.raises(ValueError, match="stage"):
        IndexKernel("merge")
