"""The push exchange's mailbox header and data region as ffi/dcp_exchange.cc makes them
(dcp_setup's header, MakeLayout's offsets), and the push cubins' scratch, for the one-GPU
tests and benchmarks that play the FFI's part (no CUDA import)."""

from __future__ import annotations

import numpy as np

from jax_sparse_mla.kernel.config import (
    HEADER_ERROR_RECORD,
    HEADER_OWN_DATA,
    HEADER_RANK,
    HEADER_TIMEOUT,
    LATENT,
    ROW,
)

HEADER_BYTES = 256  # kHeaderBytes
REGION_ALIGN = 256  # of a data region's parts (kRegionAlign)


def mailbox_header(regions: list[int], rank: int, timeout_ns: int, error_record: int):
    """Rank ``rank``'s header as dcp_setup writes it (bytes, uint8 [HEADER_BYTES]): every
    rank's data region, its rank, the waits' timeout, its error record's address and its own
    region again; no exchange ran since (no last step)."""
    header = np.zeros(HEADER_BYTES, np.uint8)
    words = header.view(np.uint64)
    words[: len(regions)] = regions
    header[HEADER_RANK : HEADER_RANK + 4].view(np.uint32)[0] = rank
    words[HEADER_TIMEOUT // 8] = timeout_ns
    words[HEADER_ERROR_RECORD // 8] = error_record
    words[HEADER_OWN_DATA // 8] = regions[rank]
    return header


def padded_heads(dcp: int, heads_own: int) -> int:
    """Hp: the D ranks' gathered heads padded to 16 (the decode's grain)."""
    return -(-dcp * heads_own // 16) * 16


def mailbox_layout(dcp: int, batch: int, heads_own: int, flags_per_row: int) -> dict:
    """A push exchange data region's byte offsets and size, as ffi/dcp_exchange.cc's
    MakeLayout places them (``flags_per_row``: the decode's CTAs per row)."""

    def align(value: int) -> int:
        return -(-value // REGION_ALIGN) * REGION_ALIGN

    latent = align(4 * 2 * dcp * batch * flags_per_row)
    lse = latent + 2 * dcp * batch * heads_own * LATENT * 2
    query_flags = align(lse + 2 * dcp * batch * heads_own * 4)
    queries = align(query_flags + 4 * 2 * dcp * batch * flags_per_row)
    size = queries + 2 * batch * padded_heads(dcp, heads_own) * ROW
    return {"latent": latent, "lse": lse, "query_flags": query_flags, "queries": queries,
            "bytes": size}  # fmt: skip


def scratch_rows(batch: int, columns: int, width: int, split: int) -> int:
    """Rows of a push cubin's scratch (the FFI's push target allocates it): one list of
    ceil(K / split) per CTA of the [columns, B] grid."""
    return batch * columns * -(-width // split)
