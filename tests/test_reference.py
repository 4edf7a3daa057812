"""The reference decode against float64 numpy truth over a grid of shapes and index patterns."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Var, jaxprs_in_params
from truth import logit_magnitude, lse_tolerance, make_inputs, truth_decode

import jax_sparse_mla
from jax_sparse_mla import reference

WIDTH = 64  # K: index slots per row
CACHE_ROWS = 300
COUNTS = [0, 1, 31, 32, 33, WIDTH]


def _rows_with_patterns(rng, rows):
    """Row 0..: plain; then duplicates, out-of-range entries, garbage past valid."""
    rows = rows.copy()
    rows[1, :8] = 7  # duplicates of one row (each occurrence counts)
    rows[2, :12:3] = [-1, CACHE_ROWS, 2**31 - 1, -(2**31)]
    rows[3, 33:] = -(2**31)  # garbage past valid[3] = 33 (never read)
    return rows


def check_against_truth(latent, lse, q, kv, rows, valid, *, averages=True, **scales):
    want, want_lse, bound = truth_decode(q, kv, rows, valid, **scales)
    latent = np.asarray(latent, np.float64)
    lse = np.asarray(lse, np.float64)
    assert np.all(np.abs(latent - want) <= bound), np.max(np.abs(latent - want) - bound)
    empty = ~np.isfinite(want_lse)
    assert np.array_equal(lse[empty], want_lse[empty])
    assert np.all(latent[empty] == 0)
    live = ~empty
    magnitude = logit_magnitude(q, kv, rows, valid, **scales)[live]
    lse_err, tolerance = (
        np.abs(lse[live] - want_lse[live]),
        lse_tolerance(want_lse[live], magnitude),
    )
    worst = np.argmax(lse_err - tolerance) if live.any() else 0
    assert np.all(lse_err <= tolerance), (
        f"LSE error {lse_err[worst]:.3g} above {tolerance[worst]:.3g} at LSE "
        f"{want_lse[live][worst]:.6g} (logit magnitude {magnitude[worst]:.4g})"
    )
    # The bound is loose per element; over many distinct keys FP8 P rounding averages out.
    many = _live_counts(rows, valid, kv) >= 16
    if averages and many.any():
        mean_err = np.mean(np.abs(latent - want)[many])
        assert mean_err <= 0.02 * np.mean(np.abs(want[many])) + 1e-6


def _live_counts(rows, valid, kv):
    cache_rows = np.asarray(kv).reshape(-1, 576).shape[0]
    width = rows.shape[1]
    count = np.clip(np.asarray(valid), 0, width)
    slots = np.arange(width)[None, :] < count[:, None]
    return np.sum(slots & (rows >= 0) & (rows < cache_rows), axis=1)


@pytest.mark.parametrize("heads", [1, 12, 16, 96, 128])
def test_reference_matches_float64_truth(heads):
    rng = np.random.default_rng(heads)
    q, kv, rows = make_inputs(rng, len(COUNTS), heads, CACHE_ROWS, WIDTH)
    rows = _rows_with_patterns(rng, rows)
    valid = np.array(COUNTS, np.int32)
    scales = dict(softmax_scale=0.0721, q_scale=0.5, kv_scale=1.75)
    latent, lse = jax.jit(lambda *a: reference.decode(*a, **scales))(q, kv, rows, valid)
    assert latent.shape == (len(COUNTS), heads, 512) and latent.dtype == jnp.bfloat16
    assert lse.shape == (len(COUNTS), heads) and lse.dtype == jnp.float32
    check_against_truth(latent, lse, q, kv, rows, valid, **scales)


@pytest.mark.parametrize("valid_value", [-5, 0, 10, WIDTH, WIDTH + 1, 2**31 - 1])
def test_valid_is_clamped(valid_value):
    rng = np.random.default_rng(1)
    q, kv, rows = make_inputs(rng, 2, 16, CACHE_ROWS, WIDTH)
    valid = np.array([valid_value, 5], np.int32)
    latent, lse = reference.decode(q, kv, rows, valid, softmax_scale=0.1)
    check_against_truth(latent, lse, q, kv, rows, valid, softmax_scale=0.1)
    if valid_value <= 0:
        assert np.all(np.asarray(lse[0]) == -np.inf) and not np.any(np.asarray(latent[0]))


def test_peaked_logits_and_traced_scales():
    """Large logits (one key dominates) and scales passed as traced f32 scalars."""
    rng = np.random.default_rng(2)
    q, kv, rows = make_inputs(rng, 3, 16, CACHE_ROWS, WIDTH, scale=8.0)
    valid = np.array([WIDTH, 40, 2], np.int32)

    @jax.jit
    def run(q_scale, kv_scale):
        return reference.decode(
            q, kv, rows, valid, softmax_scale=0.3, q_scale=q_scale, kv_scale=kv_scale
        )

    latent, lse = run(jnp.float32(2.0), jnp.float32(0.25))
    check_against_truth(
        latent, lse, q, kv, rows, valid, softmax_scale=0.3, q_scale=2.0, kv_scale=0.25
    )


def test_paged_cache_equals_flat():
    rng = np.random.default_rng(3)
    q, kv, rows = make_inputs(rng, 4, 16, 320, WIDTH)
    valid = np.array([WIDTH, 17, 0, 1], np.int32)
    flat = jax_sparse_mla.decode(q, kv, rows, valid, softmax_scale=0.1)
    paged = jax_sparse_mla.decode(q, kv.reshape(5, 64, 576), rows, valid, softmax_scale=0.1)
    for a, b in zip(flat, paged, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    check_against_truth(*flat, q, kv, rows, valid, softmax_scale=0.1)


def _pad_rows(kv, row_bytes):
    """kv [N, 576] with each row padded to row_bytes by NaN bytes (which must never be read)."""
    pad = np.full((kv.shape[0], row_bytes - 576), np.nan, np.float32).astype(kv.dtype)
    return np.concatenate([kv, pad], axis=1)


@pytest.mark.parametrize("row_bytes", [592, 640])
def test_padded_rows_equal_unpadded(row_bytes):
    rng = np.random.default_rng(row_bytes)
    q, kv, rows = make_inputs(rng, 4, 20, 320, WIDTH)
    valid = np.array([WIDTH, 17, 0, 1], np.int32)
    want = jax_sparse_mla.decode(q, kv, rows, valid, softmax_scale=0.1)
    padded = _pad_rows(kv, row_bytes)
    for cache in (padded, padded.reshape(5, 64, row_bytes)):  # flat and paged
        got = jax.jit(lambda *a: jax_sparse_mla.decode(*a, softmax_scale=0.1))(
            q, cache, rows, valid
        )
        for a, b in zip(want, got, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    check_against_truth(*want, q, kv, rows, valid, softmax_scale=0.1)


def test_empty_cache_gives_empty_rows():
    rng = np.random.default_rng(4)
    q, _, rows = make_inputs(rng, 2, 16, 10, 8)
    kv = np.zeros((0, 576), q.dtype)
    latent, lse = jax_sparse_mla.decode(q, kv, rows, np.array([8, 3], np.int32), softmax_scale=1.0)
    assert not np.any(np.asarray(latent)) and np.all(np.asarray(lse) == -np.inf)


def test_decode_default_path_equals_reference():
    """On CPU the primitive lowers to the reference, any H (padded to 16): same values up to
    FP32 summation order (padding changes the einsum shapes)."""
    rng = np.random.default_rng(5)
    for heads in (1, 12, 16, 40):
        q, kv, rows = make_inputs(rng, 3, heads, CACHE_ROWS, WIDTH)
        valid = np.array([WIDTH, 3, 0], np.int32)
        got = jax.jit(lambda *a: jax_sparse_mla.decode(*a, softmax_scale=0.1))(q, kv, rows, valid)
        want = reference.decode(q, kv, rows, valid, softmax_scale=0.1)
        assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
        np.testing.assert_allclose(
            np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), rtol=2**-7, atol=0
        )
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-6)


_LAYOUT_ONLY = {"transpose", "reshape", "broadcast_in_dim", "squeeze", "expand_dims", "copy"}


def _fp8_fed_dots(jaxpr, widened=frozenset()):
    """The dot_generals in ``jaxpr`` (nested jaxprs included) whose two operands are both FP8
    values widened by convert_element_type (through layout-only ops): what XLA's GPU GEMM
    rewriter turns into an FP8 GEMM. ``widened``: the invars that already are."""
    widened = set(widened)
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [v if isinstance(v, Var) else None for v in eqn.invars]
        from_fp8 = name == "convert_element_type" and "float8" in str(eqn.invars[0].aval.dtype)
        if from_fp8 or (name in _LAYOUT_ONLY and ins[0] in widened):
            widened.add(eqn.outvars[0])
        elif name == "dot_general" and all(v in widened for v in ins):
            found.append(eqn)
        for sub in jaxprs_in_params(eqn.params):
            inner = {v for v, outer in zip(sub.invars, ins, strict=False) if outer in widened}
            found += _fp8_fed_dots(sub, inner)
    return found


def _fp8_convert_chains(jaxpr, rounded=frozenset()):
    """The convert_element_type eqns in ``jaxpr`` (nested jaxprs included) that widen an FP8
    value straight from the convert that rounded it (through layout-only ops): the chains
    XLA's SimplifyFPConversions folds into one convert, dropping the E4M3 rounding.
    ``rounded``: the invars that are such values."""
    rounded = set(rounded)
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [v if isinstance(v, Var) else None for v in eqn.invars]
        if name == "convert_element_type":
            if ins[0] in rounded:
                found.append(eqn)
            if "float8" in str(eqn.outvars[0].aval.dtype):
                rounded.add(eqn.outvars[0])
        elif name in _LAYOUT_ONLY and ins[0] in rounded:
            rounded.add(eqn.outvars[0])
        for sub in jaxprs_in_params(eqn.params):
            inner = {v for v, outer in zip(sub.invars, ins, strict=False) if outer in rounded}
            found += _fp8_convert_chains(sub, inner)
    return found


def test_fp8_rounding_of_a_producer_is_kept():
    """In a jitted step that quantizes q or the cache itself, the reference must not widen the
    quantized values straight from their rounding convert: on GPUs XLA folds f32 -> f8 -> bf16
    into f32 -> bf16 (likely why the example step's reference was 2.5e-2 off on an H200)."""
    rng = np.random.default_rng(7)
    q, kv, rows = make_inputs(rng, 2, 16, CACHE_ROWS, WIDTH)
    scales = jnp.array([0.1, 1.0], jnp.float32)
    valid = np.array([WIDTH, 3], np.int32)
    fp8 = jnp.float8_e4m3fn

    def quantized_decode(q32, kv32):
        return reference.decode_flat(q32.astype(fp8), kv32.astype(fp8), rows, valid, scales)

    wide = (np.asarray(q, np.float32), np.asarray(kv, np.float32))
    assert not _fp8_convert_chains(jax.make_jaxpr(quantized_decode)(*wide).jaxpr)
    weights, key_scales = jnp.ones((2, 1, 8), jnp.float32), jnp.ones((4, 16), jnp.float32)
    table, limits = jnp.zeros((2, 4), jnp.int32), jnp.full((2, 1), 64, jnp.int32)

    def quantized_scores(q32, keys32):
        keys8 = keys32.astype(fp8)
        return reference.index_scores_flat(
            q32.astype(fp8), weights, keys8, key_scales, table, limits
        )

    wide = (np.zeros((2, 1, 8, 128), np.float32), np.zeros((4, 16, 128), np.float32))
    assert not _fp8_convert_chains(jax.make_jaxpr(quantized_scores)(*wide).jaxpr)


def test_no_dot_sees_two_fp8_converts():
    """XLA's GPU GEMM rewriter turns dot(convert(f8), convert(f8)) into an FP8 cuBLASLt GEMM
    with a reduced-precision accumulator whatever precision= says (tests/gpu/
    test_reference_gpu.py measures it); the reference keeps one operand behind a barrier."""
    rng = np.random.default_rng(6)
    q, kv, rows = make_inputs(rng, 2, 16, CACHE_ROWS, WIDTH)
    scales = jnp.array([0.1, 1.0], jnp.float32)
    valid = np.array([WIDTH, 3], np.int32)
    decode = jax.make_jaxpr(reference.decode_flat)(q, kv, rows, valid, scales)
    assert not _fp8_fed_dots(decode.jaxpr)
    keys = np.zeros((4, 16, 128), jnp.float8_e4m3fn)
    index_q = np.zeros((2, 1, 8, 128), jnp.float8_e4m3fn)
    weights, key_scales = np.ones((2, 1, 8), np.float32), np.ones((4, 16), np.float32)
    table, limits = np.zeros((2, 4), np.int32), np.full((2, 1), 64, np.int32)
    args = (index_q, weights, keys, key_scales, table, limits)
    assert not _fp8_fed_dots(jax.make_jaxpr(reference.index_scores_flat)(*args).jaxpr)
