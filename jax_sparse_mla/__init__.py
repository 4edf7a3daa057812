"""Sparse MLA decode for JAX: DeepSeek-Sparse-Attention on an FP8 KV cache, with decode
context parallelism, backed by a Hopper CuTe DSL kernel and a pure-jnp reference.

Public API: ``decode``, ``dcp_decode``, ``dcp_setup``, ``dcp_check``, ``local_rows``,
``merge_partials``, ``reference``.
"""

from jax_sparse_mla import cuda_lowering as cuda_lowering  # registers the kernel lowering
from jax_sparse_mla import reference
from jax_sparse_mla.dcp import FILL_ROW, dcp_decode, local_rows
from jax_sparse_mla.merge import merge_partials
from jax_sparse_mla.ops import decode
from jax_sparse_mla.push_exchange import dcp_check, dcp_setup

__all__ = [
    "FILL_ROW",
    "dcp_check",
    "dcp_decode",
    "dcp_setup",
    "decode",
    "local_rows",
    "merge_partials",
    "reference",
]
__version__ = "0.1.0"
