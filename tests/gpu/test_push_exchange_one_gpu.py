"""The push exchange through XLA and the FFI on ONE GPU: a group of one device exchanging with
itself.

``dcp_decode`` never runs this (at D = 1 it is a plain decode), but it is every part of the
exchange that is not NVLink: ``dcp_setup``'s load of the merge's cubin into the device's
context, the two custom calls' handlers with their parameters and mailbox layout, the slots
by step parity, the flags, the refusal of a repeated parity, the timeout, the error records,
the reset (also under a compiled program, with the data region moved), the capacity error,
jax.export's round trip and a 10,000-step scan across int32's wrap. The kernels' protocol
between several ranks is tested on one GPU by test_dcp_exchange_one_gpu.py (D ranks on D
streams), across GPUs by test_dcp_push_gpu.py.

One rank's partial merged with itself has weight exp2(0) = 1, so the merged rows must be the
plain decode's of the same config; the LSE goes through the merge's log2 domain and back
(within LSE_RTOL). Every step has new queries, so a stale slot would not match.

    python -m pytest -s -m gpu tests/gpu/test_push_exchange_one_gpu.py
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_sparse_mla
from jax_sparse_mla import dcp, push_exchange
from jax_sparse_mla.kernel.config import ALL_CONFIGS, KernelConfig

pytestmark = pytest.mark.gpu
SOFTMAX_SCALE = 576**-0.5
LSE_RTOL = 1e-6


@pytest.fixture(scope="module")
def gpu():
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus or gpus[0].compute_capability != "9.0":
        pytest.skip(f"needs a Hopper GPU, jax sees {jax.devices()}")
    return gpus[0]


def setup_loopback(gpu, timeout_s=push_exchange.DEFAULT_TIMEOUT_S):
    push_exchange.setup_group([gpu.local_hardware_id], 8 << 20, timeout_s)


@pytest.fixture(autouse=True)
def fresh_exchange(gpu):
    """Every test starts from zeroed mailboxes and cleared error records."""
    setup_loopback(gpu)


def pushed_tokens(q, kv, tokens, step, *, config):
    """The whole push exchange of one rank of D = 1 on the global tokens [B, K]."""
    return push_exchange.decode_and_exchange_tokens(
        q, kv, tokens, rank=jnp.int32(0), step=step, dcp_size=1, softmax_scale=SOFTMAX_SCALE,
        q_scale=1.0, kv_scale=1.25, valid_hint=None, kernel_config=config,
    )  # fmt: skip


def pushed(q, kv, rows, valid, step, *, config):
    """The push exchange as ``dcp_decode``'s push path runs it (rows and valid encoded as
    the global tokens the kernel compacts)."""

    keys = jnp.arange(rows.shape[1]) < valid[:, None]
    tokens = dcp._as_tokens(rows, keys, n_rows=kv.shape[0], rank=0, dcp_size=1)
    return pushed_tokens(q, kv, tokens, step, config=config)


def plain(q, kv, rows, valid, *, config):
    return jax_sparse_mla.decode(
        q, kv, rows, valid, softmax_scale=SOFTMAX_SCALE, kv_scale=1.25,
        implementation="cute", kernel_config=config,
    )  # fmt: skip


def inputs(seed, steps, batch, heads, width, n_rows=700):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.uniform(-2, 2, (steps, batch, heads, 576)), jnp.float8_e4m3fn)
    kv = jnp.asarray(rng.uniform(-2, 2, (n_rows, 576)), jnp.float8_e4m3fn)
    rows = jnp.asarray(rng.integers(-3, n_rows + 3, (batch, width)), jnp.int32)
    valid = rng.integers(-1, width + 2, (batch,))
    valid[0] = 0  # a row without keys: zeros and lse -inf
    return q, kv, rows, jnp.asarray(valid, jnp.int32)


def tied_loop(q, kv, rows, valid, first_step, *, unroll=1):
    """A lax.scan of push exchanges over q [steps, B, H, 576] from ``first_step`` on, each
    step's query tied to the previous step's LSEs by value (as a model's is: XLA orders the
    exchanges only through data). Returns the stacked (latent, lse)."""

    def body(carry, q_step):
        step, previous_lse = carry
        q_step = jnp.where(jnp.isnan(previous_lse).any(), jnp.zeros_like(q_step), q_step)
        latent, lse = pushed(q_step, kv, rows, valid, step, config=None)
        return (step + 1, lse), (latent, lse)

    start = (first_step, jnp.zeros(q.shape[1:3], jnp.float32))
    return lax.scan(body, start, q, unroll=unroll)[1]


def assert_same(got, want, what):
    (latent, lse), (want_latent, want_lse) = got, want
    assert np.array_equal(np.asarray(latent), np.asarray(want_latent)), what
    lse, want_lse = np.asarray(lse), np.asarray(want_lse)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse)), what
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], rtol=LSE_RTOL, err_msg=what)


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=lambda c: c.slug)
def test_loopback_equals_the_plain_decode(config):
    """Consecutive steps through the jitted exchange, across int32's wrap and the flag value's
    (2^31 - 1 flags 2^31, -2^31 flags 1): each step's merged rows are the plain decode's, bit
    for bit; no error recorded."""
    steps = (2**31 - 3, 2**31 - 2, 2**31 - 1, -(2**31), -(2**31) + 1)
    q, kv, rows, valid = inputs(1, len(steps), 3, 20, 150)  # 20 heads: the decode pads to 32
    step_fn = jax.jit(functools.partial(pushed, config=config))
    plain_fn = jax.jit(functools.partial(plain, config=config))
    for i, step in enumerate(steps):
        got = step_fn(q[i], kv, rows, valid, jnp.int32(step))
        assert_same(got, plain_fn(q[i], kv, rows, valid), (config, step))
    jax_sparse_mla.dcp_check()


@pytest.mark.parametrize(
    "config, block_size, table_rows",
    [(None, 64, 3), (KernelConfig("wgmma", 8), 24, 1), (KernelConfig("cluster-mma", 2), 16, 3)],
    ids=lambda v: v.slug if isinstance(v, KernelConfig) else str(v),
)
def test_loopback_paged_equals_local_rows_and_the_plain_decode(config, block_size, table_rows):
    """A paged cache [blocks, block_size, 576], the global tokens mapped through the block
    table as dcp_decode_tokens' push path does (a table per row or one shared; positions past
    the table, a negative entry, entries past the cache): the merged rows are the plain
    decode's of ``dcp.local_rows``' rows, bit for bit."""
    rng = np.random.default_rng(block_size)
    n_blocks, batch, width = 12, 3, 300
    q, _, _, _ = inputs(4, 1, batch, 48, width)
    kv = jnp.asarray(rng.uniform(-2, 2, (n_blocks, block_size, 576)), jnp.float8_e4m3fn)
    positions = (n_blocks + 2) * block_size
    tokens = jnp.asarray(rng.integers(-5, positions, (batch, width)), jnp.int32)
    table = np.stack([rng.permutation(n_blocks + 1)[:n_blocks] for _ in range(table_rows)])
    table[0, 2] = -1
    table = jnp.asarray(table, jnp.int32)
    rows, valid = dcp.local_rows(
        tokens, rank=0, dcp_size=1, block_table=table, block_size=block_size
    )

    def run(q, kv, tokens, table, step):
        n_rows = kv.shape[0] * kv.shape[1]
        tokens = dcp.paged_as_tokens(
            tokens, table, block_size=block_size, n_rows=n_rows, rank=0, dcp_size=1
        )
        return pushed_tokens(q, kv, tokens, step, config=config)

    got = jax.jit(run)(q[0], kv, tokens, table, jnp.int32(3))
    want = jax.jit(functools.partial(plain, config=config))(q[0], kv.reshape(-1, 576), rows, valid)
    assert_same(got, want, (config, block_size))
    jax_sparse_mla.dcp_check()


@pytest.mark.parametrize("unroll", [1, 8])
def test_loopback_in_a_scan(unroll):
    """64 exchanges in one lax.scan (the decode loop's shape; XLA may capture the loop's body
    in a CUDA graph), unrolled by 8 too (8 exchanges per iteration): every step's rows equal
    the plain decode's of its queries. Each step's query depends on the previous step's
    result, as a model's does: XLA orders the exchanges only through data (session 45: steps
    tied by lax.optimization_barrier alone ran out of order and were refused)."""
    steps = 64
    q, kv, rows, valid = inputs(2, steps, 5, 96, 256)
    loop = jax.jit(functools.partial(tied_loop, unroll=unroll))
    latent, lse = loop(q, kv, rows, valid, jnp.int32(11))
    plain_fn = jax.jit(functools.partial(plain, config=None))
    for i in range(steps):
        assert_same((latent[i], lse[i]), plain_fn(q[i], kv, rows, valid), (unroll, i))
    jax_sparse_mla.dcp_check()


def test_soak_10000_steps_across_the_wrap():
    """10,000 exchanges in one jitted scan, the step counter crossing int32's wrap (and the
    flag value's) midway, each step's query its own: the pushed rows equal the plain
    decode's, computed in the same step, bit for bit (LSE within LSE_RTOL) in every step."""
    steps, first_step = 10_000, 2**31 - 5_000
    q, kv, rows, valid = inputs(7, 1, 5, 96, 256)

    def loop(q, kv, rows, valid, first):
        def body(counts, i):
            scale = 1.0 + (i % 8).astype(jnp.float32) * 2.0**-3  # E4M3 steps are 2**-3
            q_t = (q.astype(jnp.float32) * scale).astype(q.dtype)
            latent, lse = pushed(q_t, kv, rows, valid, first + i, config=None)
            want_latent, want_lse = plain(q_t, kv, rows, valid, config=None)
            close = jnp.abs(lse - want_lse) <= LSE_RTOL * jnp.maximum(1.0, jnp.abs(want_lse))
            bad_lse = ~(close | (lse == want_lse))  # -inf == -inf; NaN counts as bad
            bad_latent = latent.astype(jnp.float32) != want_latent.astype(jnp.float32)
            return counts + jnp.stack([bad_latent.sum(), bad_lse.sum()]), None

        return lax.scan(body, jnp.zeros(2, jnp.int32), jnp.arange(steps, dtype=jnp.int32))[0]

    counts = jax.jit(loop)(q[0], kv, rows, valid, jnp.int32(first_step))
    assert np.asarray(counts).tolist() == [0, 0]
    jax_sparse_mla.dcp_check()


def test_compiled_program_survives_a_new_setup(gpu):
    """A new setup with another capacity (its data region moves) while a compiled program,
    its loop's body possibly captured in a CUDA graph, keeps its kernel parameters: they point
    at the device's permanent header, which the setup rewrote. After the reset the steps may
    start again anywhere; every step's rows stay the plain decode's, bit for bit."""
    steps = 8
    q, kv, rows, valid = inputs(5, steps, 5, 96, 256)
    loop_fn = jax.jit(tied_loop)
    plain_fn = jax.jit(functools.partial(plain, config=None))
    want = [plain_fn(q[i], kv, rows, valid) for i in range(steps)]

    def check(what):
        latent, lse = loop_fn(q, kv, rows, valid, jnp.int32(3))
        for i in range(steps):
            assert_same((latent[i], lse[i]), want[i], (what, i))

    check("first setup")
    push_exchange.setup_group([gpu.local_hardware_id], 16 << 20, push_exchange.DEFAULT_TIMEOUT_S)
    check("after a new setup")
    jax_sparse_mla.dcp_check()


def test_a_mailbox_too_small_names_capacity_bytes(gpu):
    """A call whose slots do not fit the mailbox raises an error that names the setting
    (before any kernel runs); a setup with room runs the same program."""
    q, kv, rows, valid = inputs(6, 1, 5, 96, 256)
    step_fn = jax.jit(functools.partial(pushed, config=None))
    push_exchange.setup_group([gpu.local_hardware_id], 8192, push_exchange.DEFAULT_TIMEOUT_S)
    with pytest.raises(Exception, match="raise capacity_bytes"):
        jax.block_until_ready(step_fn(q[0], kv, rows, valid, jnp.int32(0)))
    setup_loopback(gpu)
    got = step_fn(q[0], kv, rows, valid, jnp.int32(0))
    plain_rows = jax.jit(functools.partial(plain, config=None))(q[0], kv, rows, valid)
    assert_same(got, plain_rows, "after a setup with room")
    jax_sparse_mla.dcp_check()


def test_exported_push_program_runs():
    """jax.export of the push exchange, serialized and read back as a deployment loads it,
    runs on the GPU through the FFI (the mailboxes are found through the device's header at
    run time, nothing of them is baked into the program): alternating with the jitted
    program on one step counter (they share the device's mailbox), every step's rows are the
    plain decode's, bit for bit; no error recorded."""
    q, kv, rows, valid = inputs(4, 4, 5, 96, 256)
    jitted = jax.jit(functools.partial(pushed, config=None))
    exported = jax.export.export(
        jitted, platforms=("cuda",), disabled_checks=jax_sparse_mla.export_disabled_checks()
    )(q[0], kv, rows, valid, jnp.int32(7))
    restored = jax.export.deserialize(exported.serialize())
    plain_fn = jax.jit(functools.partial(plain, config=None))
    for i in range(4):  # steps 7 .. 10: jitted, restored, jitted, restored
        program = restored.call if i % 2 else jitted
        got = program(q[i], kv, rows, valid, jnp.int32(7 + i))
        assert_same(got, plain_fn(q[i], kv, rows, valid), ("restored" if i % 2 else "jitted", i))
    jax_sparse_mla.dcp_check()


@pytest.mark.parametrize(
    "steps",
    [(4, 5, 4), (4, 4), (6, 7, 8, 9, 0), (0, 2**30 + 1)],
    ids=lambda s: "-".join(map(str, s)),
)
def test_a_step_that_does_not_advance_is_refused(gpu, steps):
    """Steps 4, 5, 4 (slot 0's flags still hold the first 4's value), 4, 4, a restarted
    counter (6 .. 9, then 0: slot 0 last held 1 at step 0) and a jump of 2^30 (past the bound
    that keeps a flag value from coming back within two exchanges): before session 46 the
    first three returned an earlier call's rows bit for bit (4, 5, 4 with no error). Now the
    merge refuses at once: NaN rows (the timeout is 20 s: they do not come from a timeout),
    dcp_check names the step (or, for 4, 4, the decode's parity refusal, whichever is recorded
    first); dcp_setup resets it. At a shape whose decode outlasts the merge's start."""
    setup_loopback(gpu, timeout_s=20.0)
    q, kv, rows, valid = inputs(5, len(steps), 5, 128, 2048, n_rows=20000)
    step_fn = jax.jit(functools.partial(pushed, config=None))
    for i, step in enumerate(steps[:-1]):
        jax.block_until_ready(step_fn(q[i], kv, rows, valid, jnp.int32(step)))
    jax_sparse_mla.dcp_check()
    last = len(steps) - 1
    latent, lse = jax.block_until_ready(step_fn(q[last], kv, rows, valid, jnp.int32(steps[-1])))
    assert np.isnan(np.asarray(latent.astype(jnp.float32))).all()
    assert np.isnan(np.asarray(lse)).all()
    cause = r"does not advance past|previous exchange's parity" if steps == (4, 4) else "advance"
    with pytest.raises(RuntimeError, match=cause):
        jax_sparse_mla.dcp_check()
    setup_loopback(gpu)
    want = jax.jit(functools.partial(plain, config=None))(q[last], kv, rows, valid)
    assert_same(step_fn(q[last], kv, rows, valid, jnp.int32(steps[-1])), want, "after the reset")
    jax_sparse_mla.dcp_check()


def test_repeated_parity_times_out_and_resets(gpu):
    """The same parity twice: the decode pushes nothing, the merge waits out its timeout, the
    rows are NaN, dcp_check names the parity, the next call refuses; dcp_setup resets it."""
    setup_loopback(gpu, timeout_s=0.2)
    q, kv, rows, valid = inputs(3, 2, 5, 48, 256)
    step_fn = jax.jit(functools.partial(pushed, config=None))
    want = jax.jit(functools.partial(plain, config=None))(q[1], kv, rows, valid)
    jax.block_until_ready(step_fn(q[0], kv, rows, valid, jnp.int32(4)))
    latent, lse = jax.block_until_ready(step_fn(q[1], kv, rows, valid, jnp.int32(6)))
    assert np.isnan(np.asarray(latent.astype(jnp.float32))).all()
    assert np.isnan(np.asarray(lse)).all()
    with pytest.raises(RuntimeError, match="previous exchange's parity"):
        jax_sparse_mla.dcp_check()
    with pytest.raises(Exception, match="dcp_setup again"):
        jax.block_until_ready(step_fn(q[1], kv, rows, valid, jnp.int32(7)))
    setup_loopback(gpu)
    assert_same(step_fn(q[1], kv, rows, valid, jnp.int32(7)), want, "after the reset")
    jax_sparse_mla.dcp_check()
