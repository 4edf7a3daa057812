"""merge_partials: merging the decodes of a split of the keys equals the unsplit decode."""

import jax.numpy as jnp
import numpy as np
import pytest
from truth import lse_tolerance, make_inputs, truth_decode

import jax_sparse_mla
from jax_sparse_mla import reference


def _split_decodes(q, kv, rows, valid, parts, **scales):
    """Decode each contiguous part of every row's live keys separately."""
    width = rows.shape[1]
    count = np.clip(valid, 0, width)
    outs = []
    for s in range(parts):
        lo = count * s // parts
        hi = count * (s + 1) // parts
        part_rows = np.full_like(rows, -1)
        for b in range(rows.shape[0]):
            part_rows[b, : hi[b] - lo[b]] = rows[b, lo[b] : hi[b]]
        outs.append(reference.decode(q, kv, part_rows, (hi - lo).astype(np.int32), **scales))
    latent = jnp.stack([o[0].astype(jnp.float32) for o in outs])
    lse = jnp.stack([o[1] for o in outs])
    return latent, lse


@pytest.mark.parametrize("parts", [1, 2, 3, 8])
def test_merge_of_split_equals_unsplit(parts):
    rng = np.random.default_rng(parts)
    q, kv, rows = make_inputs(rng, 5, 16, 200, 48)
    valid = np.array([48, 5, 1, 0, 30], np.int32)
    scales = dict(softmax_scale=0.08, kv_scale=1.5)
    partials, partial_lse = _split_decodes(q, kv, rows, valid, parts, **scales)
    latent, lse = jax_sparse_mla.merge_partials(partials, partial_lse)
    want, want_lse, bound = truth_decode(q, kv, rows, valid, **scales)
    live = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), live)
    assert np.all(np.abs(np.asarray(lse)[live] - want_lse[live]) <= lse_tolerance(want_lse[live]))
    # Each part rounds P at its own max (within the truth bound) and its output to BF16.
    slack = 2.0**-8 * np.max(np.abs(np.asarray(partials, np.float64)), axis=0)
    assert np.all(np.abs(np.asarray(latent, np.float64) - want) <= bound + slack)
    assert np.all(np.asarray(lse)[3] == -np.inf) and not np.any(np.asarray(latent)[3])


def test_merge_exact_cases():
    latent = jnp.asarray(np.random.default_rng(0).standard_normal((3, 2, 4, 512)), jnp.float32)
    lse = jnp.array(
        [
            [[-jnp.inf] * 4, [0.0, 1.0, -jnp.inf, 5.0]],
            [[-jnp.inf] * 4, [-jnp.inf, 1.0, -jnp.inf, -jnp.inf]],
            [[-jnp.inf] * 4, [-jnp.inf, 1.0, -jnp.inf, -jnp.inf]],
        ],
        jnp.float32,
    )
    out, out_lse = jax_sparse_mla.merge_partials(latent, lse)
    assert np.all(np.asarray(out_lse[0]) == -np.inf) and not np.any(np.asarray(out[0]))
    # A single live partial passes through unchanged.
    np.testing.assert_array_equal(np.asarray(out[1, 0]), np.asarray(latent[0, 1, 0]))
    np.testing.assert_array_equal(np.asarray(out[1, 3]), np.asarray(latent[0, 1, 3]))
    assert out_lse[1, 0] == 0.0 and out_lse[1, 3] == 5.0 and out_lse[1, 2] == -np.inf
    # Three equal-LSE partials: the mean, LSE + log 3.
    np.testing.assert_allclose(np.asarray(out[1, 1]), np.asarray(latent[:, 1, 1].mean(0)), 1e-6)
    np.testing.assert_allclose(float(out_lse[1, 1]), 1.0 + np.log(3.0), rtol=1e-6)


def test_merge_rejects_bad_shapes():
    with pytest.raises(ValueError, match="latent"):
        jax_sparse_mla.merge_partials(jnp.zeros((2, 3, 512)), jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match="lse"):
        jax_sparse_mla.merge_partials(jnp.zeros((2, 1, 3, 512)), jnp.zeros((2, 3)))
    with pytest.raises(TypeError, match="lse"):
        jax_sparse_mla.merge_partials(jnp.zeros((2, 1, 3, 512)), jnp.zeros((2, 1, 3), jnp.float16))
