"""Fixtures of the GPU tests."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

DCP_AXIS = "dcp"  # tests/test_dcp.py's AXIS
DCP_GPUS = 2


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    """A 1-D mesh over two Hopper GPUs along the "dcp" axis; skips with fewer."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < DCP_GPUS or any(d.compute_capability != "9.0" for d in gpus[:DCP_GPUS]):
        pytest.skip(f"needs {DCP_GPUS} Hopper GPUs, jax sees {jax.devices()}")
    return Mesh(np.array(gpus[:DCP_GPUS]), (DCP_AXIS,))
