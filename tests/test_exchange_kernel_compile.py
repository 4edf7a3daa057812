"""The push exchange's own kernel, the merge (kernel/exchange), compiles on a CPU-only machine
to an sm_90a cubin with its ABI, and the layout constants mirror ffi/dcp_exchange.cc's.

The cubin is compiled with nvidia-cutlass-dsl into a fresh disk cache. Its own parameter table
(cuobjdump's EIATTR_KPARAM_INFO) matches ``ExchangeKernel``'s ABI, the order the FFI handler
passes; the SASS: bounded system-scope polls (acquire loads, the timer, a sleep), the CTA-wide
OR that turns one waiter's timeout into everyone's, the PDL wait before its stores, no local
memory. Its behaviour on a GPU:
tests/gpu/test_dcp_exchange_one_gpu.py (the decodes' part of the exchange there too).
"""

from __future__ import annotations

import pathlib
import re

import pytest

from jax_sparse_mla.kernel.exchange import config

FFI = pathlib.Path(__file__).resolve().parents[1] / "ffi" / "dcp_exchange.cc"


def _ffi_constant(name: str) -> int:
    match = re.search(rf"constexpr\s+[\w:\s]+?\b{name}\s*=\s*(\d+);", FFI.read_text())
    assert match, name
    return int(match.group(1))


def test_layout_mirrors_the_ffi():
    assert _ffi_constant("kRankOffset") == config.RANK_OFFSET
    assert _ffi_constant("kTimeoutOffset") == config.TIMEOUT_OFFSET
    assert _ffi_constant("kOwnDataOffset") == config.OWN_DATA_OFFSET
    assert _ffi_constant("kThreads") == config.THREADS
    assert _ffi_constant("kChunkHeads") == config.CHUNK_HEADS
    assert _ffi_constant("kLatent") == config.LATENT
    assert _ffi_constant("kQueryRow") == config.QUERY_ROW
    assert _ffi_constant("kTimeout") == config.TIMEOUT_PARTIALS
    assert _ffi_constant("kQueryTimeout") == config.TIMEOUT_QUERIES
    assert _ffi_constant("kStepBehind") == config.STEP_BEHIND
    assert config.MAX_ADVANCE == 1 << 30 and "by 1 to 2^30 - 1" in FFI.read_text()
    # rank, has_last, last_step, claimed: consecutive words before the timeout
    words = (config.RANK_OFFSET, config.HAS_LAST_OFFSET, config.LAST_STEP_OFFSET)
    assert (*words, config.CLAIMED_OFFSET) == tuple(range(128, 144, 4))


def test_unknown_stage():
    with pytest.raises(ValueError, match="stage"):
        config.ExchangeKernel("scatter")


cutlass = pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")

from cubin_tools import abi_table, cuobjdump, param_table  # noqa: E402

from jax_sparse_mla.kernel import compile as kernel_compile  # noqa: E402
from jax_sparse_mla.kernel.exchange import compile as exchange_compile  # noqa: E402


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("exchange-cubins")


@pytest.fixture(scope="module", params=config.EXCHANGE_KERNELS, ids=lambda k: k.slug)
def kernel(request):
    return request.param


@pytest.fixture(scope="module")
def compiled(cache_dir, kernel):
    return exchange_compile.get_kernel(kernel, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def cubin_path(compiled, cache_dir, kernel):
    path = cache_dir / f"{kernel.slug}-test.cubin"
    path.write_bytes(compiled.cubin)
    return path


def test_meta_matches_the_abi(compiled, kernel):
    meta = compiled.meta
    assert meta["params"] == list(kernel.params)
    assert len(kernel.params) == len(kernel.param_types)
    assert meta["threads"] == config.THREADS and meta["smem_bytes"] == 0
    assert meta["arch"] == "sm_90a"
    assert meta["exchange_kernel"] == {"stage": kernel.stage}
    assert meta["fingerprint"] == exchange_compile.source_fingerprint()
    assert meta["dsl_version"] == kernel_compile.dsl_version()
    assert compiled.cubin[:4] == b"\x7fELF"
    assert meta["kernel_name"].encode() in compiled.cubin


def test_entry_params_match_the_abi(cubin_path, compiled, kernel):
    table = param_table(cubin_path, compiled.meta["kernel_name"])
    assert table == abi_table(kernel.param_types), table


def test_sass(cubin_path, kernel):
    sass = cuobjdump("--dump-sass", cubin_path)
    assert "sm_90a" in sass
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory"
    assert re.search(r"\bLDG\.E\.STRONG\.SYS\b", sass), "the polls' system-scope acquire loads"
    assert "NANOSLEEP" in sass and "BAR.RED.OR" in sass
    assert "ACQBULK" in sass, "griddepcontrol.wait (launched under PDL)"
    assert re.search(r"\bATOMG\.E\.CAS\b", sass), "the error record's claim"
    assert "MUFU.EX2" in sass and "MUFU.LG2" in sass and "FMNMX.NAN" in sass
