"""The kernel path under bad values, random index patterns and a long soak (GPU only).

Needs cubins for b4-h32-k16, b3-h16-k32, b4-h32-k64 and b5-h96-k2048 (see .ci/gpu-run).
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/ helpers

from test_properties import check_huge_logits, check_nan_poisoning, decode_problems
from test_reference import check_against_truth
from truth import make_inputs

import jax_sparse_mla
from jax_sparse_mla.kernel.config import ALL_CONFIGS

pytestmark = pytest.mark.gpu
each_config = pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda c: c.slug)


@each_config
def test_nan_poisons_only_what_reads_it(config):
    check_nan_poisoning("cute", config)


@each_config
def test_huge_logits_do_not_overflow(config):
    check_huge_logits("cute", config)


@each_config
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(decode_problems(batch=4, heads=20, cache_rows=300, width=64))
def test_kernel_property(config, problem):
    """Random counts (negative, above K), duplicates, one repeated row, boundary rows N - 1
    and 0, out-of-range rows, scales: all within the float64 truth's FP8 bound."""
    q, kv, rows, valid, scales = problem
    latent, lse = jax_sparse_mla.decode(
        q, kv, rows, valid, implementation="cute", kernel_config=config, **scales
    )
    check_against_truth(latent, lse, q, kv, rows, valid, averages=False, **scales)


@each_config
def test_soak_is_bit_identical(config):
    """100,000 calls in one jitted loop, cycling 20 valid patterns: every output equals the
    first call's output for its pattern, bit for bit."""
    batch, heads, width, calls = 5, 96, 2048, 100_000
    rng = np.random.default_rng(11)
    q, kv, rows = make_inputs(rng, batch, heads, 20000, width)
    patterns = jnp.asarray(rng.integers(-2, width + 3, (20, batch)), jnp.int32)
    patterns = patterns.at[0].set(jnp.array([0, 1, 256, width, 33], jnp.int32))

    def decode(q, kv, rows, valid):
        return jax_sparse_mla.decode(
            q, kv, rows, valid, softmax_scale=0.07, implementation="cute", kernel_config=config
        )

    first = [jax.jit(decode)(q, kv, rows, patterns[i]) for i in range(len(patterns))]
    want_latent = jnp.stack([f[0] for f in first])
    want_lse = jnp.stack([f[1] for f in first])

    @jax.jit
    def soak(q, kv, rows):
        def body(i, mismatches):
            k = i % len(patterns)
            latent, lse = decode(q, kv, rows, patterns[k])
            same = jnp.all(
                jax.lax.bitcast_convert_type(latent, jnp.uint16)
                == jax.lax.bitcast_convert_type(want_latent[k], jnp.uint16)
            ) & jnp.all(
                jax.lax.bitcast_convert_type(lse, jnp.uint32)
                == jax.lax.bitcast_convert_type(want_lse[k], jnp.uint32)
            )
            return mismatches + (~same).astype(jnp.int32)

        return jax.lax.fori_loop(0, calls, body, jnp.int32(0))

    assert int(soak(q, kv, rows)) == 0
    check_against_truth(*first[0], q, kv, rows, np.asarray(patterns[0]), softmax_scale=0.07)
