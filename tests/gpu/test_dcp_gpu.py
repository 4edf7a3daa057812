"""dcp_decode on two GPUs (the collectives exchange) vs single-device decode and float64.

Needs two Hopper GPUs (the device tool's nvidia-h200-x2); skipped with fewer. The same
problems as tests/test_dcp.py (which runs them on 8 virtual CPU devices), here on the
kernel path, plus a jitted multi-step decode loop and repeats that must be bit-identical.

    python -m pytest -s -m gpu tests/gpu/test_dcp_gpu.py
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from test_dcp import (
    SOFTMAX_SCALE,
    check_against_truth,
    compare_with_single,
    dcp_program,
    fp8,
    global_rows,
    make_tokens,
    shard_flat_cache,
    shard_paged_cache,
    truth,
)

import jax_sparse_mla
from jax_sparse_mla import cuda_lowering

pytestmark = pytest.mark.gpu
DCP = 2


def dcp_step(mesh, *, block_size: int | None = None):
    """dcp_program on the kernel path: fn(q, kv, tokens, table, q_scale, kv_scale, step)."""
    return dcp_program(mesh, block_size=block_size, implementation="cute")


def test_flat_cache_latency_shape(mesh):
    """B = 5, 96 gathered heads, K = 256 global slots (some rows sparse, one empty)."""
    rng = np.random.default_rng(1)
    batch, heads, width, n_global = 5, 96, 256, DCP * 4096
    q = fp8(rng, (batch, heads, 576))
    kv_global = fp8(rng, (n_global, 576))
    tokens = make_tokens(rng, batch, width, DCP, n_global)
    scales = (jnp.float32(0.75), jnp.float32(1.5))
    kv = shard_flat_cache(kv_global, DCP)
    table = None  # a flat cache
    step = dcp_step(mesh)
    assert cuda_lowering.FFI_TARGET in step.lower(q, kv, tokens, table, *scales, 0).as_text()
    latent, lse = step(q, kv, tokens, table, *scales, 0)

    keys = np.asarray(kv_global.astype(jnp.float32), np.float64)
    t = truth(q, lambda b: keys[tokens[b][tokens[b] >= 0]], SOFTMAX_SCALE, 0.75, 1.5)
    err = check_against_truth(latent, lse, t)
    rows, valid = global_rows(tokens)
    single = jax.jit(
        lambda *a: jax_sparse_mla.decode(
            *a, softmax_scale=SOFTMAX_SCALE, q_scale=0.75, kv_scale=1.5, implementation="cute"
        )
    )
    single_latent, single_lse = single(q, kv_global, rows, valid)
    single_err = check_against_truth(single_latent, single_lse, t)
    compare_with_single(latent, lse, single_latent, single_lse, err, single_err, t, DCP)
    again = step(q, kv, tokens, table, *scales, 0)
    for a, b in zip((latent, lse), again, strict=True):  # repeats are bit-identical
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("shared_table", [False, True])
def test_paged_cache(mesh, shared_table):
    rng = np.random.default_rng(2 + shared_table)
    batch, heads, width, n_global, block_size = 6, 40, 128, DCP * 512, 64
    n_seqs = 1 if shared_table else batch
    q = fp8(rng, (batch, heads, 576))
    seqs = fp8(rng, (n_seqs, n_global, 576))
    tokens = make_tokens(rng, batch, width, DCP, n_global)
    pools, tables = shard_paged_cache(rng, seqs, DCP, block_size)
    step = dcp_step(mesh, block_size=block_size)
    latent, lse = step(q, pools, tokens, tables, jnp.float32(1), jnp.float32(1), 0)

    keys = np.asarray(seqs.astype(jnp.float32), np.float64)
    t = truth(q, lambda b: keys[b % n_seqs][tokens[b][tokens[b] >= 0]], SOFTMAX_SCALE, 1, 1)
    err = check_against_truth(latent, lse, t)
    rows, valid = global_rows(tokens, n_global, per_row_seq=not shared_table)
    single_latent, single_lse = jax_sparse_mla.decode(
        q, seqs.reshape(-1, 576), rows, valid, softmax_scale=SOFTMAX_SCALE, implementation="cute"
    )
    single_err = check_against_truth(single_latent, single_lse, t)
    compare_with_single(latent, lse, single_latent, single_lse, err, single_err, t, DCP)


def test_multi_step_loop_matches_single_steps(mesh):
    """A jitted scan of 32 decode steps (new query each step) equals step-by-step calls bit
    for bit, and a second run of the loop equals the first."""
    rng = np.random.default_rng(4)
    steps, batch, heads, width, n_global = 32, 5, 96, 256, DCP * 4096
    qs = fp8(rng, (steps, batch, heads, 576))
    kv = shard_flat_cache(fp8(rng, (n_global, 576)), DCP)
    tokens = jnp.asarray(make_tokens(rng, batch, width, DCP, n_global))
    table = None  # a flat cache
    one = jnp.float32(1)
    step = dcp_step(mesh)

    def loop(qs, kv, tokens, table):
        return lax.scan(lambda c, q: (c, step(q, kv, tokens, table, one, one, 0)), 0, qs)[1]

    looped = jax.jit(loop)
    latent, lse = looped(qs, kv, tokens, table)
    for s in range(steps):
        want_latent, want_lse = step(qs[s], kv, tokens, table, one, one, 0)
        np.testing.assert_array_equal(np.asarray(latent[s]), np.asarray(want_latent))
        np.testing.assert_array_equal(np.asarray(lse[s]), np.asarray(want_lse))
    again = looped(qs, kv, tokens, table)
    np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(latent))
    np.testing.assert_array_equal(np.asarray(again[1]), np.asarray(lse))
