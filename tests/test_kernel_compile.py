"""The kernel compiles on a CPU-only machine to an sm_90a cubin with the contract's ABI.

Every shipped config (each cluster split of cluster-mma and of wgmma) is compiled. Checks the
SASS (cuobjdump from the nvidia-cuda-cuobjdump wheel): cluster-mma's tensor-core MMAs (HMMA,
E4M3 widened by F2FP), bulk copies (UBLKCP), cluster stores (STAS, none at split 1), registers
within 128 (512 threads); wgmma's F16 HGMMA (QK and PV from shared memory, V read
transposed), issued back to back (one warpgroup arrive per group, not one per MMA),
16-byte register gathers (LDG.E.128), DSMEM pushes only where split > 1; no local-memory
spills (LDL/STL) anywhere; and the disk cache / AOT command.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")

from cubin_tools import cuobjdump, opcode_counts

from jax_sparse_mla import aot
from jax_sparse_mla.kernel import KernelConfig, KernelUnavailableError, compile
from jax_sparse_mla.kernel.config import (
    ALL_CONFIGS,
    PARAMS,
    PUSH_CONFIGS,
    SMEM_BYTES,
    SPLITS,
    WG_SMEM_BYTES,
)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cubins")


@pytest.fixture(scope="module", params=ALL_CONFIGS, ids=lambda c: c.slug)
def config(request):
    return request.param


@pytest.fixture(scope="module")
def compiled(cache_dir, config):
    return compile.get_kernel(config, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def cubin_path(compiled, cache_dir, config):
    path = cache_dir / f"{config.slug}-kernel.cubin"
    path.write_bytes(compiled.cubin)
    return path


def test_configs_cover_every_split():
    mma = sorted(c.split for c in ALL_CONFIGS if c.variant == "cluster-mma")
    assert mma == sorted(SPLITS) == [1, 2, 4, 8]
    wgmma = sorted(c.split for c in ALL_CONFIGS if c.variant == "wgmma")
    assert wgmma == [1, 2, 4, 8]
    assert KernelConfig().split == 4  # the seed's cluster
    assert KernelConfig("wgmma") == KernelConfig("wgmma", 1)
    assert len({c.slug for c in ALL_CONFIGS}) == len(ALL_CONFIGS)
    # One cubin per config for dcp_decode(exchange="push") too, named apart.
    assert [c.slug for c in PUSH_CONFIGS] == [c.slug + "-push" for c in ALL_CONFIGS]


def test_meta_matches_abi(compiled, config):
    meta = compiled.meta
    assert meta["params"] == list(PARAMS)
    # grid: (ceil(Hp / head_tile) * cluster.x, B, 1)
    wgmma = config.variant == "wgmma"
    assert meta["head_tile"] == config.head_tile == (64 if wgmma else 16 * config.tiles)
    assert meta["block"] == [384 if wgmma else 512, 1, 1]
    assert meta["cluster"] == [config.split * config.tiles, 1, 1]
    smem = WG_SMEM_BYTES if wgmma else SMEM_BYTES
    assert meta["arch"] == "sm_90a" and meta["smem_bytes"] == smem <= 227 * 1024
    assert meta["config"] == {"variant": config.variant, "split": config.split, "exchange": False}
    assert compiled.cubin[:4] == b"\x7fELF"
    assert meta["kernel_name"].encode() in compiled.cubin


def test_warp_reduction_layout_is_a_bank_free_bijection():
    """cluster-mma's maxima / sums over the 16 warps: every (head, warp) entry has its own
    word, and each of a warp's loads (8 head groups x 4 quarters, warps 4 quarter + low) hits
    32 distinct banks."""
    from jax_sparse_mla.kernel.sparse_decode import red_index

    entries = [red_index(r, w % 4, w // 4, g) for r in (0, 1) for w in range(16) for g in range(8)]
    assert sorted(entries) == list(range(2 * 16 * 8))
    for r in range(2):
        for low in range(4):
            banks = {red_index(r, low, q, g) % 32 for g in range(8) for q in range(4)}
            assert len(banks) == 32, (r, low, banks)


def test_qk_groups_add_every_slice_of_each_tile_once():
    """cluster-mma's Q K^T on 16-key groups: the warps' (group, slice) roles cover every group
    and slice once, and each tile's warp adds exactly the other slices' partials of its own
    tile (what an sPart entry holds: slot 0 of warp v the tile v does not keep, slot 1 in a
    short chunk the tile it keeps)."""
    from jax_sparse_mla.kernel.sparse_decode import (
        LONG_SLICES,
        PAIRS,
        QK_WARPS,
        SHORT_SLICES,
        qk_role,
        qk_sources,
    )

    for slices, tile_warps in ((LONG_SLICES, range(QK_WARPS)), (SHORT_SLICES, range(PAIRS))):
        roles = [qk_role(w, slices) for w in range(QK_WARPS)]
        groups = QK_WARPS // slices
        assert sorted(roles) == [(g, k) for g in range(groups) for k in range(slices)], slices
        held = {}  # sPart entry -> (tile, slice) of the partial in it
        for v, (g, k) in enumerate(roles):
            held[v] = (2 * g + 1 - v % 2, k)
            if slices == SHORT_SLICES:
                held[QK_WARPS + v] = (2 * g + v % 2, k)
        for w in tile_warps:
            group, own_slice = roles[w]
            assert 2 * group + w % 2 == w  # the tile it keeps is keys 8 w ..
            added = [(w, own_slice)] + [held[e] for e in qk_sources(w, slices)]
            assert sorted(added) == [(w, k) for k in range(slices)], (slices, w, added)


def test_entry_params_parse():
    ptx = ".visible .entry k(\n .param .u64 .ptr .global .align 16 k_param_0,\n .param .u32 k_p1\n)"
    assert compile.parse_entry(ptx) == ("k", ["u64", "u32"])


def test_sass(cubin_path, config):
    sass = cuobjdump("--dump-sass", cubin_path)
    assert "sm_90a" in sass
    counts = opcode_counts(sass)
    assert "LDL" not in counts and "STL" not in counts, "local-memory spills"
    # The push exchange's flag release (dcp_decode(exchange="push")): a system-scope store.
    assert "STG.E.STRONG.SYS" in sass and "MEMBAR.ALL.SYS" in sass
    if config.variant == "wgmma":
        # Per 64-key chunk: warpgroup 0's QK, 36 k16 steps of m64n64 (all 64 keys); each
        # warpgroup's PV (its own loop), 4 k16 steps of m64n256 (its 256 columns); F16.
        assert counts.get("HGMMA", 0) == 36 + 2 * 4, counts
        assert "HMMA" not in counts and "QGMMA" not in counts
        # One arrive and one wait per group (QK, two PVs): ptxas did not serialise the wgmmas.
        assert counts.get("WARPGROUP", 0) == 6, counts.get("WARPGROUP")
        assert "LDG.E.128" in sass and "LDGSTS" not in counts  # gathers through registers
        # A loader's 9 pieces of a row at immediate offsets from one address (+0x40 .. +0x200)
        assert re.search(r"LDG\.E\.128 R\d+, desc\[UR\d+\]\[R\d+\.64\+0x200\]", sass)
        # A dead key's words zeroed at the fetch (splits 1 and 8) or selected per word in the
        # widening (2 and 4: 72 SEL per chunk), each split's faster spelling.
        assert (counts.get("SEL", 0) >= 72) == (config.split in (2, 4)), counts.get("SEL")
        assert len(re.findall(r"HGMMA\.64x64x16\.F32 R\d+, gdesc\[UR\d+\]", sass)) == 36
        # PV: B (V) read MN-major from shared memory.
        assert len(re.findall(r"HGMMA\.64x256x16\.F32 R\d+, gdesc\[UR\d+\]\.tnspB", sass)) == 8
        # O / l into the outbox (split > 1) or the output rows (split 1) by stmatrix: 16.
        assert counts.get("STSM", 0) == 16, counts.get("STSM")
        if config.split > 1:  # the cluster merge: a bulk copy over DSMEM per peer
            assert counts.get("UBLKCP", 0) == config.split - 1 and "UCGABAR_WAIT" in counts
            # the (max, sum) stats by st.async, except at split 8, where they ride the copies
            assert (counts.get("STAS", 0) >= 1) == (config.split != 8), counts
        else:
            assert "STAS" not in counts and "UCGABAR_WAIT" not in counts, counts
            assert counts.get("UBLKCP", 0) >= 1, counts  # output rows by bulk copies
            # Only the LSE's stores (the fragments' 4-byte output stores were 64) besides the
            # push exchange's system-scope flag and error record.
            assert len(re.findall(r"STG\.E(?!\.STRONG\.SYS)", sass)) <= 2, counts
    else:
        # QK: 18 k-steps, and 9 more for a short chunk's QK half (each warp of a pair takes 9);
        # each m16n8k32 E4M3 MMA is two HMMA.16816. PV: a loop over the span's 32-key steps
        # (not unrolled over a chunk's 4), its body 2 k16 halves x 4 n-tiles of F16 m16n8k16.
        assert counts.get("HMMA", 0) == 2 * (18 + 9) + 2 * 4, counts.get("HMMA")
        assert counts.get("F2FP", 0) > 0  # E4M3 -> F16 unpack and the P / BF16 packing
        assert counts.get("UBLKCP", 0) >= 1  # cp.async.bulk gathers
        if config.split > 1:
            assert counts.get("STAS", 0) >= 1  # st.async pushes over DSMEM
        else:  # a 1-CTA cluster merges in its own shared memory: no DSMEM at all
            assert "STAS" not in counts and "UCGABAR_WAIT" not in counts, counts
        assert counts.get("LDSM", 0) >= 1
    usage = cuobjdump("--dump-resource-usage", cubin_path)
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    assert registers <= 65536 // config.block[0], usage  # one CTA's threads fit an SM
    assert "STACK:0" in usage and "LOCAL:0" in usage, usage


def test_disk_cache_hit(compiled, cache_dir, config, monkeypatch):
    def fail(*args):
        raise AssertionError("compiled again despite a disk cache entry")

    monkeypatch.setattr(compile, "compile_kernel", fail)
    again = compile.get_kernel(config, cache_dir=cache_dir)
    assert again.cubin == compiled.cubin and again.meta == compiled.meta
    # Without the DSL, an entry of any DSL version is accepted.
    monkeypatch.setattr(compile, "dsl_version", lambda: None)
    assert compile.get_kernel(config, cache_dir=cache_dir).cubin == compiled.cubin


def test_unavailable_without_dsl(tmp_path, monkeypatch):
    monkeypatch.setattr(compile, "dsl_version", lambda: None)
    with pytest.raises(KernelUnavailableError, match=r"jax_sparse_mla\.aot"):
        compile.get_kernel(KernelConfig(), cache_dir=tmp_path)


def test_aot_command(tmp_path, capsys):
    assert aot.main(["--arch", "sm_90a", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    for config in ALL_CONFIGS + PUSH_CONFIGS:
        assert config.slug in printed
        (meta_path,) = tmp_path.glob(f"{config.slug}-{compile.source_fingerprint()}-*.json")
        meta = json.loads(meta_path.read_text())
        assert meta["fingerprint"] == compile.source_fingerprint()
        assert meta["cluster"] == list(config.cluster)
        assert meta_path.with_suffix(".cubin").read_bytes()[:4] == b"\x7fELF"


def test_unknown_variant_or_split():
    with pytest.raises(ValueError, match="variant"):
        KernelConfig("mma-v2")
    with pytest.raises(ValueError, match="split"):
        KernelConfig(split=3)
    with pytest.raises(ValueError, match="split"):
        KernelConfig("wgmma", 16)


@pytest.mark.parametrize("config", PUSH_CONFIGS, ids=lambda c: c.slug)
def test_push_cubins(cache_dir, config):
    """The push exchange's cubins: the plain ABI and launch, plus the query heads' exchange
    (kernel/entry.py exchange_queries): 16-byte pushes, system-scope releases, bounded
    acquire polls (timer, sleep), the timeouts' OR through shared memory (a bar.red.or there
    faulted in cluster-mma), no local memory; the plain cubins have none of the polls."""
    compiled = compile.get_kernel(config, cache_dir=cache_dir)
    meta = compiled.meta
    assert meta["params"] == list(PARAMS) and meta["config"]["exchange"] is True
    assert meta["head_tile"] == config.head_tile and meta["cluster"] == list(config.cluster)
    path = cache_dir / f"{config.slug}-kernel.cubin"
    path.write_bytes(compiled.cubin)
    sass = cuobjdump("--dump-sass", path)
    counts = opcode_counts(sass)
    assert "LDL" not in counts and "STL" not in counts, "local-memory spills"
    assert "LDG.E.STRONG.SYS" in sass and "NANOSLEEP" in sass and "BAR.RED" not in sass
    assert "STG.E.STRONG.SYS" in sass and "STG.E.128" in sass
    usage = cuobjdump("--dump-resource-usage", path)
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    assert registers <= 65536 // config.block[0], usage
    plain = compile.get_kernel(dataclasses.replace(config, exchange=False), cache_dir=cache_dir)
    path.write_bytes(plain.cubin)
    assert "NANOSLEEP" not in cuobjdump("--dump-sass", path)
