"""The compile-time entry shared by the decode kernels: the cubin ABI (PARAMS in config.py).

The FFI handler launches the compiled cubin with the grid of each call's shapes; the launch
here only serves compilation (it fixes the block, cluster and shared memory of the config).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from jax_sparse_mla.kernel import ptx
from jax_sparse_mla.kernel.config import KernelConfig


class DecodeKernel:
    """Base of a kernel variant: subclasses define ``kernel`` with the ABI's parameters."""

    def __init__(self, config: KernelConfig):
        self.config = config
        self.split = config.split

    @cute.jit
    def __call__(
        self,
        mQ: cute.Pointer,
        mKV: cute.Pointer,
        mRows: cute.Pointer,
        mValid: cute.Pointer,
        mScales: cute.Pointer,
        mLatent: cute.Pointer,
        mLse: cute.Pointer,
        n_rows: Int32,
        width: Int32,
        heads: Int32,
        row_bytes: Int32,
    ):
        config = self.config
        tiles = (heads + config.head_tile - 1) // config.head_tile
        self.kernel(
            mQ, mKV, mRows, mValid, mScales, mLatent, mLse, n_rows, width, heads, row_bytes
        ).launch(
            grid=(tiles * config.split, 1, 1),
            block=config.block,
            cluster=config.cluster,
            smem=config.smem_bytes,
            use_pdl=True,
        )

    @cute.jit
    def push_stats(self, sStats, inbound, part, head, tile_heads: int, maximum, total):
        """This CTA's (max, sum) of ``head`` into every cluster CTA's stats
        ([split, 2, tile_heads] f32, slot ``part``): st.async on each receiver's inbound
        barrier, for the cluster merge."""
        m_dst = sStats + ((part * 2 + 0) * tile_heads + head) * 4
        l_dst = sStats + ((part * 2 + 1) * tile_heads + head) * 4
        for peer in cutlass.range_constexpr(self.split):
            peer_inbound = ptx.map_peer(inbound, peer)
            ptx.push_f32(ptx.map_peer(m_dst, peer), maximum, peer_inbound)
            ptx.push_f32(ptx.map_peer(l_dst, peer), total, peer_inbound)
