"""``jax.export`` support: the safety checks to disable for the library's custom calls."""

from __future__ import annotations

import jax

from jax_sparse_mla import cuda_lowering, index_lowering

__all__ = ["export_disabled_checks"]


def export_disabled_checks() -> tuple[jax.export.DisabledSafetyCheck, ...]:
    """The ``disabled_checks`` that let ``jax.export`` serialize every custom call of the
    library: the decode kernel's (plain and pushing) and ``index_topk``'s. A program that
    uses any of them (a model step: ``index_topk``, ``token_rows``, ``decode``) exports with
    ``jax.export.export(f, platforms=("cuda",), disabled_checks=export_disabled_checks())``."""
    return (
        *cuda_lowering.export_disabled_checks(),
        *index_lowering.export_disabled_checks(),
    )
