"""The public decode's contract: argument checks, shape rules, transformations, export."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from truth import make_inputs

import jax_sparse_mla
from jax_sparse_mla.primitive import sparse_mla_decode_p

FP8 = jnp.float8_e4m3fn


def _args(batch=2, heads=16, cache_rows=50, width=8):
    q, kv, rows = make_inputs(np.random.default_rng(0), batch, heads, cache_rows, width)
    return q, kv, rows, np.full((batch,), width, np.int32)


def _decode(*args, **kwargs):
    kwargs.setdefault("softmax_scale", 0.1)
    return jax_sparse_mla.decode(*args, **kwargs)


BAD_ARGUMENTS = [
    (lambda q, kv, r, v: (q.astype(np.float32), kv, r, v), TypeError, "q must be float8_e4m3fn"),
    (lambda q, kv, r, v: (q, kv.astype(np.float16), r, v), TypeError, "kv must be float8"),
    (lambda q, kv, r, v: (q, kv, r.astype(np.int64), v), TypeError, "rows must be int32"),
    (lambda q, kv, r, v: (q, kv, r.astype(np.float32), v), TypeError, "rows must be int32"),
    (lambda q, kv, r, v: (q, kv, r, v.astype(np.uint32)), TypeError, "valid must be int32"),
    (lambda q, kv, r, v: (q[:, :, :512], kv, r, v), ValueError, r"q must be \[B, H, 576\]"),
    (lambda q, kv, r, v: (q[0], kv, r, v), ValueError, r"q must be \[B, H, 576\]"),
    (lambda q, kv, r, v: (q, kv[:, :575], r, v), ValueError, "kv rows must be W >= 576.*W=575"),
    (
        lambda q, kv, r, v: (q, np.pad(kv, ((0, 0), (0, 8))), r, v),
        ValueError,
        "kv rows must be .*W % 16 == 0.*W=584",
    ),
    (lambda q, kv, r, v: (q, kv[None, None], r, v), ValueError, "kv must be"),
    (lambda q, kv, r, v: (q, kv, r[0], v), ValueError, r"rows must be \[B, K\]"),
    (lambda q, kv, r, v: (q, kv, r, v[:, None]), ValueError, r"valid must be \[B\]"),
    (lambda q, kv, r, v: (q, kv, r[:1], v), ValueError, "agree on B"),
    (lambda q, kv, r, v: (q, kv, r, v[:1]), ValueError, "agree on B"),
    (lambda q, kv, r, v: (q[:, :0], kv, r, v), ValueError, "at least one head"),
    (lambda q, kv, r, v: (q, kv, r[:, :0], v), ValueError, "at least one index slot"),
]


@pytest.mark.parametrize(("mutate", "error", "message"), BAD_ARGUMENTS)
def test_bad_arguments_are_named(mutate, error, message):
    args = mutate(*_args())
    with pytest.raises(error, match=message):
        _decode(*args)
    with pytest.raises(error, match=message):
        jax_sparse_mla.reference.decode(*args, softmax_scale=0.1)


def test_error_messages_show_shapes():
    q, kv, rows, valid = _args()
    with pytest.raises(ValueError, match=r"q_shape=\(2, 16, 512\)"):
        _decode(q[:, :, :512], kv, rows, valid)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"softmax_scale": jnp.float32(0.1)}, TypeError, "softmax_scale must be a static"),
        ({"softmax_scale": -1.0}, ValueError, "softmax_scale must be finite and > 0"),
        ({"softmax_scale": float("nan")}, ValueError, "softmax_scale"),
        ({"q_scale": jnp.ones(2)}, ValueError, "q_scale must be a scalar"),
        ({"kv_scale": jnp.int32(2)}, TypeError, "kv_scale must be a float"),
        ({"implementation": "triton"}, ValueError, "implementation must be one of"),
        ({"valid_hint": 256.0}, TypeError, "valid_hint must be None or a static Python int"),
        ({"valid_hint": True}, TypeError, "valid_hint"),
        ({"valid_hint": jnp.int32(256)}, TypeError, "valid_hint"),
        ({"valid_hint": 0}, ValueError, "valid_hint must be >= 1"),
    ],
)
def test_bad_options(kwargs, error, message):
    with pytest.raises(error, match=message):
        _decode(*_args(), **kwargs)


def test_valid_hint_runs_on_the_portable_path():
    """The primitive carries the hint through the portable lowering (the reference): the
    results are those without it. (The CUDA lowering's use of it: test_cuda_lowering.py.)"""
    args = _args()
    want = _decode(*args)
    for hint in (1, 3, 10_000):
        got = _decode(*args, valid_hint=hint)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_traced_softmax_scale_is_rejected_under_jit():
    with pytest.raises(TypeError, match="softmax_scale"):
        jax.jit(lambda s, *a: jax_sparse_mla.decode(*a, softmax_scale=s))(0.1, *_args())


def test_shape_rules():
    """Abstract evaluation: any H is padded to 16 for the primitive and sliced back."""
    for heads in (1, 16, 17, 96):
        q, kv, rows, valid = _args(batch=3, heads=heads)
        latent, lse = jax.eval_shape(lambda *a: _decode(*a), q, kv, rows, valid)
        assert latent.shape == (3, heads, 512) and latent.dtype == jnp.bfloat16
        assert lse.shape == (3, heads) and lse.dtype == jnp.float32
        jaxpr = jax.make_jaxpr(lambda *a: _decode(*a))(q, kv, rows, valid)
        (eqn,) = [e for e in jaxpr.eqns if e.primitive is sparse_mla_decode_p]
        padded = -(-heads // 16) * 16
        assert eqn.invars[0].aval.shape == (3, padded, 576)
        assert [v.aval.shape for v in eqn.outvars] == [(3, padded, 512), (3, padded)]


def test_reference_implementation_skips_the_primitive():
    jaxpr = jax.make_jaxpr(lambda *a: _decode(*a, implementation="reference"))(*_args())
    assert all(e.primitive is not sparse_mla_decode_p for e in jaxpr.eqns)


def test_cute_on_cpu_raises_not_implemented():
    with pytest.raises(NotImplementedError, match="Hopper"):
        jax.jit(lambda *a: _decode(*a, implementation="cute"))(*_args())


def test_differentiation_raises_a_clear_error():
    q, kv, rows, valid = _args()

    def loss(scale):
        latent, _ = _decode(q, kv, rows, valid, q_scale=scale)
        return latent.astype(jnp.float32).sum()

    with pytest.raises(NotImplementedError, match="inference-only"):
        jax.grad(loss)(jnp.float32(1.0))


def test_vmap_raises_a_clear_error():
    q, kv, rows, valid = _args()
    with pytest.raises(NotImplementedError, match="fold the mapped axis into B"):
        jax.vmap(lambda q: _decode(q, kv, rows, valid))(q[None])


def test_export_of_cpu_function_runs():
    args = _args()
    exported = jax.export.export(jax.jit(lambda *a: _decode(*a)))(*args)
    restored = jax.export.deserialize(exported.serialize())
    got = restored.call(*args)
    want = _decode(*args, implementation="reference")
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), rtol=2**-7
    )
