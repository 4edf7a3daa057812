"""Test setup: 8 virtual CPU devices (for shard_map tests), the `gpu` marker, the GPU tests'
hang watchdog, and the loader of the repository's scripts (examples/, benchmarks/) as modules."""

import contextlib
import faulthandler
import importlib.util
import os
import sys
from pathlib import Path

# Must be set before jax initializes its CPU backend; harmless where a GPU is the default.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
import pytest
from hypothesis import settings

# CI runs the same examples every time (a red run blocks landing); elsewhere they vary.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def _has_cuda_gpu() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


# A hung kernel cannot be interrupted from Python: a GPU test still running after this many
# seconds dumps every thread's stack (the test's own frame names it) and ends the process, so
# a hang fails fast and says where instead of holding the GPU until an outer timeout.
GPU_WATCHDOG_S = float(os.environ.get("JAX_SPARSE_MLA_GPU_WATCHDOG_S", "900"))


@contextlib.contextmanager
def hang_watchdog(seconds: float):
    """Dump every thread's stack to stderr and exit the process (status 1) if the block is
    still running after ``seconds``; nothing when ``seconds`` <= 0."""
    if seconds <= 0:
        yield
        return
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def gpu_hang_watchdog(request):
    """Every `gpu`-marked test runs under hang_watchdog(GPU_WATCHDOG_S)."""
    seconds = GPU_WATCHDOG_S if "gpu" in request.keywords else 0
    with hang_watchdog(seconds):
        yield


def pytest_collection_modifyitems(config, items):
    if _has_cuda_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU visible to JAX")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def load_script():
    """A context manager that imports a script of the repository (path relative to its root)
    as a module registered under its file name (dataclasses resolve a module by name), and
    unregisters it on exit."""

    @contextlib.contextmanager
    def load(relative: str):
        path = Path(__file__).resolve().parents[1] / relative
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
            yield module
        finally:
            del sys.modules[spec.name]

    return load
