"""examples/kimi_decode_step.py end to end on CPU, smallest preset: the layer output matches a
dense float32 attention over the same selected keys, on one device and under DCP."""

import dataclasses

import jax
import numpy as np
import pytest


@pytest.fixture(scope="module")
def example(load_script):
    with load_script("examples/kimi_decode_step.py") as module:
        yield module


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
    # index_topk (dcp_index_topk under DCP) selects the float64 top-k of its FP8 operands.
    for path, agreement in result["index_check"].items():
        assert agreement.agrees and agreement.rows == 5, (path, out)
        assert f"CHECK {path} index_topk: " in out
    if dcp > 1:
        assert f"identical on all {dcp} ranks: True" in out


def test_help_documents_every_flag(example, capsys):
    with pytest.raises(SystemExit) as exit_info:
        example.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    flags = ["--small", "--context", "--verify-rows", "--dcp", "--iters", "--warmup", "--seed"]
    for flag in [*flags, "--profile-calls"]:
        assert flag in text
    # The output is documented: wall clock labelled as such, the GPU phase table's columns.
    assert "wall clock incl. dispatch" in text
    assert "phase  us/step  share  median us  events" in text
    assert "GPU TIME sparse_decode" in text and "GPU TIME whole step" in text
    assert "GPU TIME index_topk" in text and "CHECK index_topk, kernel vs reference" in text
    for phase in example.PHASES:
        assert phase in text
    for name in example.SIZE_FLAGS:
        assert "--" + name.replace("_", "-") in text


def test_cpu_run_says_gpu_phase_times_need_a_gpu(example, capsys):
    if jax.devices()[0].platform != "cpu":
        pytest.skip("the CPU message; on a GPU the phase tables print instead")
    result = example.main(SMALL)
    out = capsys.readouterr().out
    assert result["gpu_times"] == {}, out
    assert "GPU time per phase needs a GPU (this run: cpu)" in out
    assert "wall clock incl. dispatch" in out
    assert "kernel vs reference" not in out  # no ratio of dispatch-bound wall clocks


# ---------------------------------------------------------------------------------------------
# The indexer's FP8 operands and the top-k check (examples/token_agreement.py)
# ---------------------------------------------------------------------------------------------

E4M3_ROUNDING = 2.0**-4  # relative half ulp of a normal E4M3 value (3 mantissa bits)


def test_index_keys_are_fp8_with_one_scale_per_token(example):
    """build_cache quantizes each index key with its own amax / 448: every key reaches 448,
    the dequantized keys are the float32 keys within E4M3 rounding, empty rows are zero."""
    weights = example.init_weights(example.SMALL, seed=0)
    key = jax.random.key(1)
    cache = example.build_cache(weights, 60, 80, 1, key)
    _, exact = example.context_entries(weights, key, jax.numpy.int32(0), 60)
    exact = np.asarray(exact, np.float64)
    keys = np.asarray(cache.index_keys, np.float64)
    scales = np.asarray(cache.index_scales, np.float64)
    assert keys.shape == (80, 128) and scales.shape == (80,)
    np.testing.assert_array_equal(np.max(np.abs(keys[:60]), axis=1), example.FP8_MAX)
    np.testing.assert_allclose(scales[:60], np.max(np.abs(exact), axis=1) / 448, rtol=1e-6)
    error = np.abs(keys[:60] * scales[:60, None] - exact)
    assert np.all(error <= E4M3_ROUNDING * np.abs(exact) + 2.0**-9 * scales[:60, None])
    assert not np.any(keys[60:]) and not np.any(scales[60:])


def test_x_projections_split_the_fused_gemm_into_its_parts(example):
    """One GEMM over [wq_a | wkv_a | wi_k | wi_w]: each part has its own width, in order."""
    cfg = example.SMALL
    w = example.init_weights(cfg, seed=0)
    x = jax.numpy.asarray(np.random.default_rng(1).standard_normal((3, cfg.hidden)))
    parts = example.x_projections(w, x)
    widths = [cfg.q_lora_rank, example.CACHE_WIDTH, example.INDEX_HEAD_DIM, cfg.index_heads]
    assert [p.shape for p in parts] == [(3, width) for width in widths]
    fused = np.asarray(example.dot(x, w["w_x"], "rd,dc->rc"))
    np.testing.assert_array_equal(np.concatenate([np.asarray(p) for p in parts], -1), fused)


def test_fp8_weights_keep_k_last_and_one_scale_per_output(example):
    """--weights fp8: each matrix stored with its contracted axes last and one scale per
    output, amax / 448; dequantized within one E4M3 rounding; fp8_dot (weight-only) equals
    the float32 product of the bf16-rounded activations and the dequantized weights."""
    assert example.fp8_axes("rhv,hvd->rd") == ("dhv", "d")
    assert example.fp8_axes("rhn,hnc->rhc") == ("hcn", "hc")
    cfg = example.SMALL
    bf16 = example.init_weights(cfg, seed=0)
    fp8 = example.init_weights(cfg, seed=0, precision="fp8")
    for name, spec in example.WEIGHT_SPECS.items():
        exact = np.asarray(bf16[name], np.float32)
        values = example.dequantize(fp8[name], spec)
        assert fp8[name].values.dtype == jax.numpy.float8_e4m3fn
        assert example.weight_shape(fp8, name) == exact.shape == values.shape
        scale = example.dequantize(
            example.Fp8Weight(np.ones_like(fp8[name].values), fp8[name].scales), spec
        )
        np.testing.assert_allclose(
            np.max(np.abs(exact) / np.asarray(scale), axis=None), 448, rtol=1e-6
        )
        error = np.abs(np.asarray(values) - exact)
        assert np.all(error <= E4M3_ROUNDING * np.abs(exact) + 2.0**-9 * np.asarray(scale)), name
    rng = np.random.default_rng(2)
    latent = jax.numpy.asarray(rng.standard_normal((3, cfg.heads, 512)), jax.numpy.float32)
    spec = example.WEIGHT_SPECS["w_uv"]
    got = np.asarray(example.dot(latent, fp8["w_uv"], spec))
    x16 = np.asarray(latent.astype(jax.numpy.bfloat16), np.float32)
    want = np.einsum("rhc,hcv->rhv", x16, np.asarray(example.dequantize(fp8["w_uv"], spec)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    x8_scale = np.max(np.abs(np.asarray(latent)), axis=-1, keepdims=True) / 448
    x8 = np.asarray(example.to_fp8(latent, x8_scale).astype(np.float32)) * x8_scale
    w8a8 = np.einsum("rhc,hcv->rhv", x8, np.asarray(example.dequantize(fp8["w_uv"], spec)))
    assert np.max(np.abs(got - want)) < np.max(np.abs(w8a8 - want)) / 4  # not E4M3 activations


@pytest.mark.parametrize("dcp", [1, 2])
def test_fp8_weights_small_layer_passes(example, capsys, dcp):
    """--weights fp8 on one device and under DCP (W_UV and wo sharded by head, values and
    scales alike: head_specs)."""
    if len(jax.devices()) < dcp:
        pytest.skip(f"needs {dcp} devices (tests/conftest.py forces 8 on CPU)")
    result = example.main([*SMALL, "--weights", "fp8", "--dcp", str(dcp)])
    out = capsys.readouterr().out
    assert result["passed"] and "FP8 E4M3 matrices, one scale per output" in out, out


def test_head_specs_follow_each_storage(example):
    """W_UV and wo sharded on their head axis: bf16 in the specs' axes, FP8 in the K-last
    layout (wo's per-output scales replicated, W_UV's per (head, output) sharded)."""
    P, axis = jax.sharding.PartitionSpec, example.MESH_AXIS
    bf16 = example.init_weights(example.SMALL, seed=0)
    fp8 = example.init_weights(example.SMALL, seed=0, precision="fp8")
    assert example.head_specs(bf16["wo"], "wo") == P(axis, None, None)
    assert example.head_specs(fp8["wo"], "wo") == example.Fp8Weight(P(None, axis, None), P(None))
    assert example.head_specs(fp8["w_uv"], "w_uv") == example.Fp8Weight(
        P(axis, None, None), P(axis, None)
    )


def test_index_query_folds_its_scales_into_the_weights(example):
    """One E4M3 scale per (row, head), amax / 448, folded into the head weights with
    heads^-0.5 * 128^-0.5: weights / (W_w x * that constant) is the query's scale."""
    cfg = example.SMALL
    w = example.init_weights(cfg, seed=0)
    x = jax.numpy.asarray(np.random.default_rng(0).standard_normal((5, cfg.hidden)))
    positions = jax.numpy.arange(60, 65, dtype=jax.numpy.int32)
    parts = example.x_projections(w, x)
    _, index_q = example.q_projections(w, parts)
    q8, weights = example.index_query(index_q, parts, positions)
    assert q8.dtype == jax.numpy.float8_e4m3fn and q8.shape == (5, cfg.index_heads, 128)
    q = example.rope_head(index_q, positions[:, None])
    q = np.asarray(q, np.float64)
    head_weights = parts.index_weights * (cfg.index_heads * 128) ** -0.5
    q_scale = np.asarray(weights, np.float64) / np.asarray(head_weights, np.float64)
    np.testing.assert_allclose(q_scale, np.max(np.abs(q), axis=-1) / 448, rtol=1e-6)
    error = np.abs(np.asarray(q8, np.float64) * q_scale[..., None] - q)
    assert np.all(error <= E4M3_ROUNDING * np.abs(q) + 2.0**-9 * q_scale[..., None])


def fp8_values(rng, shape):
    return np.asarray(jax.numpy.asarray(rng.standard_normal(shape), "float8_e4m3fn"), np.float32)


def test_token_agreement_allows_only_fp32_ties_at_the_kth_score(example, capsys):
    """A token swapped with the k-th one whose score it matches within FP32 rounding is a
    tie; a swap far from the k-th score, an unsorted row or a missing token is not."""
    agreement, top_k, visible = example.token_agreement, 8, 40
    rng = np.random.default_rng(0)
    q, keys = fp8_values(rng, (4, 128)), fp8_values(rng, (visible, 128))
    weights = rng.standard_normal(4).astype(np.float32)
    scales = rng.uniform(0.5, 1.0, visible).astype(np.float32)
    scores, _ = agreement.row_scores(q, weights, keys, scales)
    kth = np.argsort(-scores, kind="stable")[top_k - 1]
    twin = int(np.argsort(-scores, kind="stable")[-1])  # becomes the k-th's near twin
    keys[twin] = keys[kth]
    scales[twin] = np.nextafter(scales[kth], np.float32(2), dtype=np.float32)  # +1 ulp
    scores, bounds = agreement.row_scores(q, weights, keys, scales)
    assert scores[twin] > scores[kth] and scores[twin] - scores[kth] < bounds[twin]
    want = agreement.exact_selection(scores, top_k)
    assert twin in want and kth not in want
    row = lambda r: (scores, bounds)  # noqa: E731
    tie = np.sort(np.where(want == twin, kth, want))
    result = agreement.compare(tie[None], want[None], row)
    assert result.agrees and (result.differing, result.unexplained) == (2, 0)

    best, worst = int(np.argmax(scores)), int(np.argmin(scores))
    far = np.sort(np.where(want == best, worst, want))
    result = agreement.compare(far[None], want[None], row)
    assert not result.agrees and (result.differing, result.unexplained) == (2, 2)
    result = agreement.compare(want[::-1][None], want[None], row)
    assert not result.agrees and result.malformed_rows == 1
    short = np.where(want == best, -1, want)
    short = np.concatenate([short[short >= 0], [-1]])
    result = agreement.compare(short[None], want[None], row)
    assert not result.agrees and result.count_mismatch_rows == 1

    # The example's kernel-vs-reference check reports the tie as a PASS.
    selection = example.Selection(want[None], q[None], weights[None], keys, scales, (visible,))
    swapped = dataclasses.replace(selection, tokens=tie[None])
    assert example.compare_paths(swapped, selection).agrees
    out = capsys.readouterr().out
    assert "kernel vs reference path (the same index operands): 2 differing tokens" in out
    assert out.rstrip().endswith("-> PASS")


# ---------------------------------------------------------------------------------------------
# GPU time per phase (examples/phase_times.py): the parts that do not need a GPU
# ---------------------------------------------------------------------------------------------

# Opcodes that launch no work: left out of the "every instruction has a phase" check.
NO_WORK = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}


def compiled_small_step(example, dcp):
    """The --small step (reference path, context 60) compiled on CPU, and its arguments."""
    cfg = example.SMALL
    mesh = example.make_mesh(dcp)
    weights = example.init_weights(cfg, seed=0)
    specs = {name: example.P() for name in weights}
    specs.update(w_uv=example.P(example.MESH_AXIS), wo=example.P(example.MESH_AXIS))
    weights = example.place(weights, mesh, specs)
    capacity = 80 * dcp
    cache = example.build_cache(weights, 60, capacity, dcp, jax.random.key(1))
    cache = example.place(cache, mesh, example.CACHE_SPECS)
    x = jax.numpy.ones((5, cfg.hidden), jax.numpy.bfloat16)
    x, pos = example.place((x, jax.numpy.int32(60)), mesh, (example.P(), example.P()))
    step = example.make_step(cfg, mesh, "reference", "collectives")
    args = (weights, cache, x, pos, np.int32(0))  # the last: dcp_decode's step (unused here)
    return step.lower(*args).compile(), args


@pytest.mark.parametrize("dcp", [1, 2])
def test_every_phase_scope_reaches_the_compiled_hlo(example, dcp):
    """Each declared phase names instructions of the compiled step; every instruction of the
    entry computation that does work has a phase (collectives under DCP, and nothing else
    under 'other' but the rank lookup)."""
    if len(jax.devices()) < dcp:
        pytest.skip(f"needs {dcp} devices")
    phase_times = example.phase_times
    compiled, _ = compiled_small_step(example, dcp)
    text = compiled.as_text()
    ops = phase_times.instruction_phases(text, example.PHASES)
    assert ops.module == "jit_step"
    present = ops.phases_present()
    assert set(example.PHASES) <= present
    _, computations = phase_times.parse_hlo(text)
    (entry,) = [name for name in computations if name.startswith("main")]
    unattributed = {
        inst.opcode
        for inst in computations[entry]
        if inst.opcode not in NO_WORK and ops.phase[inst.name] == phase_times.OTHER
    }
    assert unattributed <= {"partition-id"}, unattributed
    collectives = {
        inst.opcode
        for inst in computations[entry]
        if ops.phase[inst.name] == phase_times.COLLECTIVES
    }
    if dcp == 1:
        assert phase_times.COLLECTIVES not in present
    else:  # dcp_decode's all-gather and all-to-all, the output projection's psum
        assert {"all-gather", "all-to-all", "all-reduce"} <= collectives
    # The reference index_topk selects with lax.top_k (on every rank under DCP).
    top_k = [inst.name for inst in computations[entry] if inst.op_name.endswith("/top_k")]
    assert top_k and {ops.phase[name] for name in top_k} == {"index_topk"}


# A GPU-style compiled module: fusions (one without metadata whose fused ops are all in one
# phase), a copy without metadata (placed by its operand), a cuBLAS custom call, a synchronous
# and an async-wrapped collective.
GPU_STYLE_HLO = """\
HloModule jit_step, entry_computation_layout={(f32[4]{0})->(f32[8]{0}, f32[4]{0})}

%fused_scores (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %multiply.1 = f32[4]{0} multiply(%param_0, %param_0), metadata={op_name="jit(step)/index_query/mul"}
}

%fused_select (param_0.1: f32[4]) -> f32[4] {
  %param_0.1 = f32[4]{0} parameter(0)
  ROOT %add.2 = f32[4]{0} add(%param_0.1, %param_0.1), metadata={op_name="jit(step)/index_topk/add" source_line=3}
}

%async_computation (param_0.2: f32[4]) -> f32[8] {
  %param_0.2 = f32[4]{0} parameter(0)
  ROOT %all-to-all.1 = f32[8]{0} all-to-all(%param_0.2), replica_groups={{0,1}}, dimensions={0}
}

ENTRY %main.9 (p0: f32[4]) -> (f32[8], f32[4]) {
  %p0 = f32[4]{0} parameter(0)
  %loop_multiply_fusion = f32[4]{0} fusion(%p0), kind=kLoop, calls=%fused_scores, metadata={op_name="jit(step)/index_query/mul"}
  %input_add_fusion.3 = f32[4]{0} fusion(%loop_multiply_fusion), kind=kLoop, calls=%fused_select
  %copy.4 = f32[4]{0} copy(%input_add_fusion.3)
  %custom-call.5 = (f32[4]{0}, s8[32]{0}) custom-call(%copy.4, %p0), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1}}, metadata={op_type="dot_general" op_name="jit(step)/output_projection/rhv,hvd->rd/dot_general" source_file="kimi.py" source_line=12}
  %get-tuple-element.6 = f32[4]{0} get-tuple-element(%custom-call.5), index=0
  %all-gather-start = (f32[4]{0}, f32[8]{0}) all-gather-start(%get-tuple-element.6), replica_groups={{0,1}}, dimensions={0}, metadata={op_name="jit(step)/sparse_decode/all_gather"}
  %all-gather-done = f32[8]{0} all-gather-done(%all-gather-start)
  %all-to-all-start = ((f32[4]{0}), f32[8]{0}) async-start(%get-tuple-element.6), calls=%async_computation
  %all-to-all-done = f32[8]{0} async-done(%all-to-all-start)
  ROOT %tuple.7 = (f32[8]{0}, f32[4]{0}) tuple(%all-to-all-done, %input_add_fusion.3)
}
"""  # noqa: E501 (HLO text lines)


def test_instruction_phases_of_a_gpu_style_module(example):
    phase_times = example.phase_times
    ops = phase_times.instruction_phases(GPU_STYLE_HLO, example.PHASES)
    assert ops.module == "jit_step"
    expected = {
        "loop_multiply_fusion": "index_query",  # its own metadata
        "input_add_fusion.3": "index_topk",  # no metadata: its fused ops agree
        "copy.4": "index_topk",  # no metadata, no fused ops: its operand
        "custom-call.5": "output_projection",
        "all-gather-start": "collectives",  # a collective, whatever scope it sits in
        "all-gather-done": "collectives",
        "all-to-all-start": "collectives",  # async wrapper of an all-to-all
        "all-to-all-done": "collectives",
        "all-to-all.1": "collectives",
        "p0": "other",
    }
    assert {name: ops.phase[name] for name in expected} == expected
    assert ops.inferred == {"copy.4"}
    assert ops.opcode["all-to-all-start"] == "async-start"
    assert ops.by_kernel_name["input_add_fusion_3"] == "input_add_fusion.3"


def test_command_buffer_kernels_are_attributed_by_kernel_name(example):
    """In a CUDA graph (XLA's command buffers) every kernel's hlo_op stat names the command
    buffer, not the instruction. Our custom calls' kernels (named in their attributes: one
    kernel_name, or one <stage>_kernel per kernel) and the extra kernels of one instruction
    ("<name>__<n>", e.g. a sort's passes) are still placed."""
    phase_times = example.phase_times
    decode = (
        '  %decode.8 = (bf16[5]{0}, f32[5]{0}) custom-call(%p0), custom_call_target="jax_'
        'sparse_mla_decode", api_version=API_VERSION_TYPED_FFI, backend_config={head_tile = '
        '16 : i64, kernel_name = "kernel_cutlass_SparseDecode_0", smem_bytes = 8 : i64}, '
        'metadata={op_name="jit(step)/sparse_decode/sparse_mla_decode"}\n'
    )
    index = (
        '  %index.9 = (s32[5]{0}, f32[5]{0}) custom-call(%p0), custom_call_target="jax_sparse_'
        'mla_index_topk", api_version=API_VERSION_TYPED_FFI, backend_config={scores_cubin = '
        'dense<"0x00"> : tensor<1xui8>, scores_kernel = "kernel_cutlass_IndexScores_0", span = '
        '4 : i64, topk_kernel = "kernel_cutlass_IndexTopk_0"}, metadata={op_name="jit(step)/'
        'index_topk/jax_sparse_mla_index_topk"}\n'
    )
    hlo = GPU_STYLE_HLO.replace("  ROOT %tuple.7", decode + index + "  ROOT %tuple.7")
    ops = phase_times.instruction_phases(hlo, example.PHASES)
    assert ops.by_kernel_name["kernel_cutlass_SparseDecode_0"] == "decode.8"
    assert ops.by_kernel_name["kernel_cutlass_IndexScores_0"] == "index.9"
    assert ops.by_kernel_name["kernel_cutlass_IndexTopk_0"] == "index.9"
    buffer = ("command_buffer_1", "jit_step")
    events = [
        phase_times.Event(0, 5e3, "kernel_cutlass_SparseDecode_0", *buffer),
        phase_times.Event(8e3, 9e3, "kernel_cutlass_IndexScores_0", *buffer),
        phase_times.Event(9e3, 10e3, "kernel_cutlass_IndexTopk_0", *buffer),
        phase_times.Event(5e3, 6e3, "input_add_fusion_3__2", *buffer),
        phase_times.Event(6e3, 7e3, "input_add_fusion_3", *buffer),
        phase_times.Event(7e3, 8e3, "unknown_kernel__2", *buffer),
    ]
    trace = phase_times.DeviceTrace("/device:GPU:0", ["Stream #1"], events, [])
    placed = [(phase, how) for _, phase, how, _ in phase_times.attribute(trace, ops)]
    assert placed == [
        ("sparse_decode", "kernel name"),
        ("index_topk", "kernel name"),
        ("index_topk", "kernel name"),
        ("index_topk", "kernel name"),
        ("index_topk", "kernel name"),
        ("other", "unattributed"),
    ]


def xspace_text(events, xla_ops):
    """A GPU device plane as the CUPTI collector writes it: kernels on a Stream line with
    hlo_op / hlo_module stats (as a reference to a stat metadata name, or as a string), an
    "XLA Ops" line, and an overhead line that must not be counted."""
    names = sorted({e[0] for e in events} | {op[0] for op in xla_ops})
    meta_id = {name: index + 1 for index, name in enumerate(names)}
    stat_names = ["hlo_op", "hlo_module", "loop_multiply_fusion", "jit_step", "jit_other"]
    stat_id = {name: 100 + index for index, name in enumerate(stat_names)}

    def event(name, start_us, duration_us, stats=()):
        body = [f"metadata_id: {meta_id[name]}", f"offset_ps: {int(start_us * 1e6)}"]
        body.append(f"duration_ps: {int(duration_us * 1e6)}")
        for key, value in stats:
            if value in stat_id:  # the collector stores repeated strings as references
                body.append(f"stats {{ metadata_id: {stat_id[key]} ref_value: {stat_id[value]} }}")
            else:
                body.append(f'stats {{ metadata_id: {stat_id[key]} str_value: "{value}" }}')
        return "events { " + " ".join(body) + " }"

    kernels = "\n".join(event(*e) for e in events)
    ops = "\n".join(event(name, start, duration) for name, start, duration in xla_ops)
    overhead = event(events[0][0], events[0][1], 1000.0)
    metadata = "\n".join(
        f'event_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}' for n, i in meta_id.items()
    ) + "\n".join(
        f'stat_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}' for n, i in stat_id.items()
    )
    return f"""
planes {{
  id: 1
  name: "/device:GPU:0"
  lines {{ id: 7 name: "Stream #7(Kernel,MemcpyD2D)" timestamp_ns: 0
{kernels}
  }}
  lines {{ id: 8 name: "XLA Ops" timestamp_ns: 0
{ops}
  }}
  lines {{ id: 9 name: "CUPTI overhead" timestamp_ns: 0
{overhead}
  }}
{metadata}
}}
planes {{ id: 2 name: "/host:CPU" }}
"""


def test_gpu_trace_is_attributed_per_phase_and_sums_to_the_total(example, tmp_path):
    """Two calls (1 ms apart) of seven events, one per attribution route; the phase sums,
    the per-call split and the table are exact."""
    phase_times = example.phase_times
    ops = phase_times.instruction_phases(GPU_STYLE_HLO, example.PHASES)
    hlo_op = [("hlo_op", "loop_multiply_fusion"), ("hlo_module", "jit_step")]
    call = [  # (kernel name, start us, duration us, stats)
        ("loop_multiply_fusion", 0, 10, hlo_op),  # hlo_op stat (a reference)
        ("sm90_xmma_gemm_bf16bf16", 10, 20, [("hlo_op", "custom-call.5")]),  # (a string)
        ("input_add_fusion_3", 30, 3),  # kernel name = sanitized instruction name
        ("copy_kernel", 33, 4),  # covered by the "XLA Ops" event copy.4
        ("ncclDevKernel_AllGather_RING_LL", 37, 6),  # NCCL
        ("mystery_kernel", 43, 1),  # nothing: other
        (
            "loop_multiply_fusion",
            44,
            2,
            [("hlo_op", "loop_multiply_fusion"), ("hlo_module", "jit_other")],
        ),
    ]
    events = [(e[0], e[1] + offset, *e[2:]) for offset in (0, 1000) for e in call]
    xla_ops = [("copy.4", 32 + offset, 6) for offset in (0, 1000)]
    text = xspace_text(events, xla_ops)
    path = tmp_path / "trace.xplane.pb"
    path.write_bytes(phase_times.ProfileData.text_proto_to_serialized_xspace(text))

    traces = phase_times.read_traces(str(path))
    assert list(traces) == ["/device:GPU:0"]
    (trace,) = traces.values()
    assert len(trace.events) == 14 and len(trace.xla_ops) == 2  # the overhead line is not read
    times = phase_times.phase_times(trace, ops, example.PHASES, calls=2)
    per_call_us = {
        "index_query": 10,
        "output_projection": 20,
        "index_topk": 3 + 4,
        "collectives": 6,
        "other": 1 + 2,  # the unknown kernel and the other module's
    }
    for phase in times.phases:
        assert times.mean_us(phase) == pytest.approx(per_call_us.get(phase, 0.0)), phase
        assert times.median_us(phase) == pytest.approx(per_call_us.get(phase, 0.0)), phase
    assert times.mean_us() == pytest.approx(46.0) and times.median_us() == pytest.approx(46.0)
    assert times.groups_found == 2
    assert dict(times.how) == {
        "hlo_op stat": 4,
        "XLA Ops line": 2,
        "kernel name": 4,
        "unattributed": 4,
    }
    assert times.inferred_ns == pytest.approx(2 * 4e3)  # copy.4, placed by its operand
    assert sum(times.shares().values()) == pytest.approx(1.0)
    assert times.shares()["output_projection"] == pytest.approx(20 / 46)

    table = phase_times.format_table(times)
    rows = {line.split()[0]: line.split() for line in table[1:]}
    assert "cache_write" in rows and "collectives" in rows
    assert rows["output_projection"][1:3] == ["20.0", "43.5%"]
    assert table[-1].split()[3:5] == ["46.0", "100.0%"]  # "sum of phases" row
    line = phase_times.summary_line("step", times)
    assert "median 46.0 us" in line and "over 2 profiled calls" in line


def test_empty_gpu_trace_names_the_lines_found(example):
    phase_times = example.phase_times
    ops = phase_times.instruction_phases(GPU_STYLE_HLO, example.PHASES)
    trace = phase_times.DeviceTrace("/device:GPU:0", ["XLA Modules", "CUPTI overhead"], [], [])
    with pytest.raises(RuntimeError, match=r"XLA Modules.*CUPTI overhead"):
        phase_times.phase_times(trace, ops, example.PHASES, calls=1)


def test_split_calls_at_idle_gaps(example):
    Event = example.phase_times.Event
    events = [Event(0, 10, "a"), Event(5, 400_000, "b"), Event(900_000, 900_010, "c")]
    groups = example.phase_times.split_calls(events, gap_ns=400_000)
    assert [[e.name for e in g] for g in groups] == [["a", "b"], ["c"]]


def test_profile_attributes_the_cpu_thunks_of_the_compiled_step(example):
    """The real profiler on CPU: XLA's CPU thunk events carry the same hlo_op stat as the
    GPU's kernels; every one of the step's maps to an instruction of its compiled HLO, all
    six phases get time, and the phases add up to the total."""
    if jax.devices()[0].platform != "cpu":
        pytest.skip("reads the CPU plane")
    phase_times = example.phase_times
    compiled, (weights, cache, x, pos, step) = compiled_small_step(example, dcp=1)
    ops = phase_times.instruction_phases(compiled.as_text(), example.PHASES)
    state = {"cache": cache}

    def call():
        out, state["cache"], _ = compiled(weights, state["cache"], x, pos, step)
        return out

    times = phase_times.profile(
        call,
        3,
        ops,
        example.PHASES,
        plane_prefix="/host:CPU",
        is_event_line=lambda name: True,
        tagged_only=True,
    )
    (cpu,) = times.values()
    assert cpu.how["hlo_op stat"] > 0
    assert cpu.how["unattributed"] == 0, dict(cpu.how)
    for phase in example.PHASES:
        assert cpu.events[phase] >= cpu.calls, (phase, dict(cpu.events))
    assert sum(cpu.phase_ns.values()) == pytest.approx(cpu.total_ns, rel=1e-12)
