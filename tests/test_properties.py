"""Property-based and bad-value tests of the reference and decode against float64 truth."""

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_reference import check_against_truth
from truth import make_inputs

import jax_sparse_mla
from jax_sparse_mla import reference

FP8_NAN = np.array(np.nan, ml_dtypes.float8_e4m3fn)


@st.composite
def decode_problems(draw, batch=None, heads=None, cache_rows=None, width=None):
    """Random problems; sizes left None are drawn too (fixed sizes reuse one kernel)."""
    batch = batch or draw(st.integers(1, 4))
    heads = heads or draw(st.integers(1, 40))
    cache_rows = cache_rows or draw(st.integers(1, 300))
    width = width or draw(st.integers(1, 80))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    q, kv, rows = make_inputs(
        rng, batch, heads, cache_rows, width, scale=draw(st.sampled_from([0.25, 1.0, 6.0]))
    )
    pattern = draw(st.sampled_from(["random", "same", "boundary", "out_of_range"]))
    if pattern == "same":
        rows[:] = rng.integers(0, cache_rows)
    elif pattern == "boundary":
        rows[:, ::2] = cache_rows - 1
        rows[:, 1::3] = 0
    elif pattern == "out_of_range":
        bad = np.array([-1, cache_rows, cache_rows + 7, -(2**31), 2**31 - 1], np.int32)
        mask = rng.random(rows.shape) < 0.4
        rows[mask] = rng.choice(bad, mask.sum())
    valid = rng.integers(-3, width + 4, batch).astype(np.int32)
    scales = dict(
        softmax_scale=draw(st.sampled_from([0.01, 192**-0.5, 0.5])),
        q_scale=draw(st.sampled_from([1.0, 0.37])),
        kv_scale=draw(st.sampled_from([1.0, 2.5])),
    )
    return q, kv, rows, valid, scales


@pytest.mark.parametrize(
    "decode", [reference.decode, jax_sparse_mla.decode], ids=["reference", "default"]
)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=decode_problems())
def test_property(decode, problem):
    """The reference, and the default path (the kernel on Hopper, else the primitive's
    reference lowering), within the float64 truth's bound on random problems."""
    q, kv, rows, valid, scales = problem
    latent, lse = decode(q, kv, rows, valid, **scales)
    check_against_truth(latent, lse, q, kv, rows, valid, averages=False, **scales)


def check_nan_poisoning(implementation, kernel_config=None):
    """NaN in a selected q head or kv row poisons exactly the (row, head)s that read it."""
    q, kv, rows = make_inputs(np.random.default_rng(7), 4, 20, 64, 16)
    rows[:, :] = np.arange(16)[None, :] + 16 * np.arange(4)[:, None]  # row b: keys 16b..16b+15
    valid = np.array([16, 16, 8, 16], np.int32)
    q[1, 3, 100] = FP8_NAN  # one head of row 1
    kv[5, 7] = FP8_NAN  # a key of row 0: all its heads
    kv[2 * 16 + 12, 0] = FP8_NAN  # row 2's slot 12: past valid[2] = 8, never read
    kv[63, 1] = FP8_NAN  # row 3's last slot, redirected below: selected by no row
    rows[3, 15] = 60
    latent, lse = jax_sparse_mla.decode(
        q,
        kv,
        rows,
        valid,
        softmax_scale=0.1,
        implementation=implementation,
        kernel_config=kernel_config,
    )
    bad = np.isnan(np.asarray(latent, np.float32)).any(-1) | np.isnan(np.asarray(lse))
    want = np.zeros_like(bad)
    want[0, :] = True
    want[1, 3] = True
    np.testing.assert_array_equal(bad, want)
    assert np.all(np.isnan(np.asarray(lse))[want])


def check_huge_logits(implementation, kernel_config=None):
    """E4M3 extremes (|x| = 448) with a large scale: logits ~1e10, no inf/NaN anywhere."""
    q, kv, rows = make_inputs(np.random.default_rng(8), 3, 16, 100, 32)
    q = np.where(np.asarray(q, np.float32) > 0, 448.0, -448.0).astype(q.dtype)
    kv[:50] = np.where(np.asarray(kv[:50], np.float32) > 0, 448.0, -448.0).astype(kv.dtype)
    valid = np.array([32, 1, 0], np.int32)
    latent, lse = jax.jit(
        lambda *a: jax_sparse_mla.decode(
            *a, softmax_scale=10.0, implementation=implementation, kernel_config=kernel_config
        )
    )(q, kv, rows, valid)
    assert np.all(np.isfinite(np.asarray(latent, np.float32)))
    assert np.all(np.isfinite(np.asarray(lse[:2]))) and np.all(np.asarray(lse[2]) == -np.inf)
    check_against_truth(latent, lse, q, kv, rows, valid, softmax_scale=10.0)


@pytest.mark.parametrize("implementation", [None, "reference"])
def test_nan_poisons_only_what_reads_it(implementation):
    check_nan_poisoning(implementation)


@pytest.mark.parametrize("implementation", [None, "reference"])
def test_huge_logits_do_not_overflow(implementation):
    check_huge_logits(implementation)
