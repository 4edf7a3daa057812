"""Push-exchange launches on two GPUs for compute-sanitizer (the pushing decode kernels and
the merge kernel).

    compute-sanitizer --tool memcheck --report-api-errors no --kernel-name-exclude kns=nccl \
        python3 tests/gpu/sanitize_dcp_push.py

Runs alternating steps of dcp_decode(exchange="push") at a few shapes (B = 1 and 5; 1, 20
and 48 heads per rank, so row strides, owners inside a tile and the per-thread loops are
exercised) and, at one shape, with every kernel config forced; checks the results against
the collectives exchange of the same config, raises on any recorded exchange failure, and
finally takes the timeout path (the ranks disagree on the step: NaN rows, an error record).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jax_sparse_mla
from jax_sparse_mla.kernel.config import ALL_CONFIGS

AXIS = "dcp"


def disagreeing(q, kv, rows, valid, step):
    step = step + 2 * lax.axis_index(AXIS)  # no owner ever sees its own step pushed
    return jax_sparse_mla.dcp_decode(
        q, kv, rows, valid, axis_name=AXIS, softmax_scale=0.1, exchange="push", step=step
    )


def main() -> None:
    gpus = [d for d in jax.devices() if d.platform == "gpu"][:2]
    if len(gpus) < 2:
        raise SystemExit(f"needs 2 GPUs, jax sees {jax.devices()}")
    mesh = Mesh(np.array(gpus), (AXIS,))
    assert jax_sparse_mla.dcp_setup(mesh, AXIS, capacity_bytes=4 << 20)
    rng = np.random.default_rng(0)
    step = 0
    cases = [(1, 1, 7, None), (5, 48, 256, None)]
    cases += [(3, 20, 150, config) for config in ALL_CONFIGS]
    for batch, heads_own, keys, config in cases:
        q = jnp.asarray(rng.standard_normal((batch, 2 * heads_own, 576)), jnp.float8_e4m3fn)
        kv = jnp.asarray(rng.standard_normal((2 * 512, 576)), jnp.float8_e4m3fn)
        rows = jnp.asarray(rng.integers(0, 512, (batch, keys)), jnp.int32)
        valid = jnp.asarray(rng.integers(-1, keys + 2, (batch,)), jnp.int32)

        def body(q, kv, rows, valid, step, config=config):
            common = dict(
                axis_name=AXIS, softmax_scale=0.1, implementation="cute", kernel_config=config
            )
            pushed = jax_sparse_mla.dcp_decode(
                q, kv, rows, valid, exchange="push", step=step, **common
            )
            return (*pushed, *jax_sparse_mla.dcp_decode(q, kv, rows, valid, **common))

        spec = (P(None, AXIS), P(None, AXIS))
        fn = jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P(None, AXIS), P(AXIS), P(), P(), P()),
                out_specs=spec + spec,
            )
        )
        for _ in range(2):
            latent, lse, want_latent, want_lse = fn(q, kv, rows, valid, jnp.int32(step))
            step += 1
            np.testing.assert_allclose(
                np.asarray(latent.astype(jnp.float32)),
                np.asarray(want_latent.astype(jnp.float32)),
                rtol=2**-7,
                atol=1e-6,
            )
            np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5)
    jax_sparse_mla.dcp_check()
    print(f"sanitize_dcp_push: {step} push steps checked")

    assert jax_sparse_mla.dcp_setup(mesh, AXIS, capacity_bytes=4 << 20, timeout_s=0.05)
    timing_out = jax.jit(
        jax.shard_map(
            disagreeing,
            mesh=mesh,
            in_specs=(P(None, AXIS), P(AXIS), P(), P(), P()),
            out_specs=spec,
        )
    )
    try:
        latent = np.asarray(timing_out(q, kv, rows, valid, jnp.int32(0))[0].astype(jnp.float32))
        assert np.isnan(latent).all()
        print("sanitize_dcp_push: timeout path gave NaN rows")
    except Exception as error:  # the next exchange's execute may see the record
        assert "timed out" in str(error), error
        print("sanitize_dcp_push: timeout path raised:", str(error)[:120])


if __name__ == "__main__":
    main()
