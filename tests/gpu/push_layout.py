"""The push exchange's data region as ffi/dcp_exchange.cc's MakeLayout places it, for the
one-GPU tests and benchmarks that play the FFI's part (no CUDA import)."""

from __future__ import annotations

from jax_sparse_mla.kernel.config import LATENT, ROW

REGION_ALIGN = 256  # of a data region's parts (kRegionAlign)


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
