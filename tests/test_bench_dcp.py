"""benchmarks/bench_dcp.py on CPU: the categories it sums the kernels it times into, and the
value tie between its steps."""

import jax.numpy as jnp
import numpy as np
import pytest

# Entry names as the DSL gives them (the shipped cubins' metadata, DSL 4.8.1; cut short):
# the exchange's contain the package's name too.
PREFIX = "kernel_cutlass_kernel_jax_sparse_mlakernel"
MERGE = PREFIX + "exchangekernelsDcpMerge_object_at__ptri32gmemalign16__________0"
DECODES = [
    PREFIX + "wgmma_decodeWgmmaDecode_object_at__ptri8gmemalign16_ptri8gmemalign16",
    PREFIX + "sparse_decodeSparseDecode_object_at__ptri8gmemalign16_ptri8gmemalign16",
]


@pytest.fixture(scope="module")
def bench(load_script):
    with load_script("benchmarks/bench_dcp.py") as module:
        yield module


def test_the_exchange_kernels_are_not_counted_as_the_decode(bench):
    assert bench.category(MERGE) == "push exchange: merge (incl. wait; beside the decode)"
    for name in DECODES:
        assert bench.category(name).startswith("decode kernel"), name
    assert bench.category("ncclDevKernel_AllGather_RING_LL").startswith("nccl all-gather")
    assert bench.category("loop_convert_fusion_3") == "XLA fusions and copies"


def test_step_tokens_are_computed_from_the_previous_result(bench):
    """Each step's tokens depend on the previous step's result by value (XLA orders the push
    exchanges only through data): a NaN result gives no tokens; else the tokens shifted by
    D t, on the same ranks and distinct in each row."""
    dcp, t = 4, 3
    tokens = np.array([[0, 5, 10, 4 * bench.LOCAL_ROWS - 1]], np.int32)
    got = np.asarray(bench.step_tokens(jnp.asarray(tokens), t, jnp.array([0.5]), dcp))
    want = (tokens + dcp * t) % (dcp * bench.LOCAL_ROWS)
    np.testing.assert_array_equal(got, want)
    assert (got % dcp == tokens % dcp).all() and len(set(got[0])) == got.shape[1]
    failed = bench.step_tokens(jnp.asarray(tokens), t, jnp.array([np.nan]), dcp)
    np.testing.assert_array_equal(np.asarray(failed), -1)


def test_step_breakdown_counts_every_instant_of_a_step_once(bench):
    """Two steps (ns): the decode, the merge beside it (PDL) and past its end, a gap, an XLA
    fusion, a gap, the next decode; NCCL beside the decode counts as the decode."""
    decode, merge = DECODES[1], MERGE
    events = [
        (0, 8000, decode),
        (1000, 10000, merge),
        (2000, 3000, "ncclDevKernel_AllGather_RING_LL"),
        (11000, 12000, "loop_convert_fusion"),
        (13000, 20000, decode),
        (14000, 21000, merge),
        (21500, 22000, "loop_convert_fusion"),
        (23000, 30000, decode),
    ]
    first, second = bench.step_breakdown(events)
    assert first == {
        bench.category(decode): 8.0,
        bench.category(merge): 2.0,
        "XLA fusions and copies": 1.0,
        bench.IDLE: 2.0,
    }
    assert sum(second.values()) == 10.0 and second[bench.IDLE] == 1.5
    assert bench.step_breakdown(events[:1]) == []
