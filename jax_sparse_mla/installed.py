"""Files the wheel build installs inside the package: the FFI handler and the shipped cubins.

They are looked up in every directory the package can live in: ``jax_sparse_mla.__path__``
and, for a checkout whose sources shadow an installed copy (tests run from the repository
root), the ``jax_sparse_mla`` folder of every ``sys.path`` entry.
"""

from __future__ import annotations

import pathlib
import sys

import jax_sparse_mla


def package_dirs() -> list[pathlib.Path]:
    """Candidate package directories, the imported one first, without duplicates."""
    dirs = [pathlib.Path(d) for d in jax_sparse_mla.__path__]
    dirs += [pathlib.Path(entry) / "jax_sparse_mla" for entry in sys.path if entry]
    return list(dict.fromkeys(d.resolve() for d in dirs if d.is_dir()))


def find(relative: str) -> pathlib.Path | None:
    """The first ``<package dir>/<relative>`` that exists, or None."""
    for directory in package_dirs():
        path = directory / relative
        if path.exists():
            return path
    return None
