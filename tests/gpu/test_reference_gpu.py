"""The jnp reference compiled by XLA for the GPU vs the float64 truth.

XLA's GPU backend rewrites dot(convert(f8), convert(f8)) into an FP8 cuBLASLt matmul with a
reduced-precision accumulator, whatever precision= asks; the reference keeps one operand
behind an optimization barrier. These tests hold it to the same bounds as on CPU at the
sizes where FP8 accumulation shows (hundreds of keys, 576- and 128-byte dot products).

    python -m pytest -m gpu tests/gpu/test_reference_gpu.py
"""

from __future__ import annotations

import pathlib
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/*.py helpers

from index_truth import random_inputs, truth_scores
from test_reference import check_against_truth
from truth import make_inputs

from jax_sparse_mla import reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("batch, heads, width", [(5, 96, 256), (5, 128, 2048), (2, 16, 64)])
def test_reference_decode_on_the_gpu_matches_truth(batch, heads, width):
    rng = np.random.default_rng(width)
    q, kv, rows = make_inputs(rng, batch, heads, 4096, width)
    valid = np.array([width, width - 1, 33, 0, 1][:batch], np.int32)
    scales = dict(softmax_scale=576**-0.5, q_scale=0.8, kv_scale=1.25)
    decode = jax.jit(lambda *a: reference.decode(*a, **scales))
    latent, lse = decode(q, kv, rows, valid)
    assert latent.devices() == {jax.devices("gpu")[0]}
    check_against_truth(
        np.asarray(latent.astype(np.float32)), lse, q, kv, rows, valid, averages=True, **scales
    )


def test_reference_index_scores_on_the_gpu_within_fp32_error():
    rng = np.random.default_rng(3)
    batch, steps, heads, positions, block = 2, 2, 64, 2048, 64
    q, weights, keys, key_scales = random_inputs(rng, batch, steps, heads, (positions,))
    lengths = np.array([positions, 700], np.int32)
    table = np.tile(np.arange(positions // block, dtype=np.int32), (batch, 1))
    limits = lengths[:, None] - steps + 1 + np.arange(steps, dtype=np.int32)[None, :]
    scores, live = jax.jit(reference.index_scores_flat)(
        q,
        weights,
        keys.reshape(-1, block, keys.shape[-1]),
        key_scales.reshape(-1, block),
        table,
        limits,
    )
    want, bounds, candidate = truth_scores(q, weights, keys, key_scales, lengths)
    np.testing.assert_array_equal(np.asarray(live), candidate)
    err = np.abs(np.asarray(scores, np.float64) - want)[candidate]
    assert np.all(err <= bounds[candidate]), f"worst {np.max(err / bounds[candidate]):.3g} x bound"
