"""Test setup: 8 virtual CPU devices (for shard_map tests), the `gpu` marker, and the loader of
the repository's scripts (examples/, benchmarks/) as modules."""

import contextlib
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
