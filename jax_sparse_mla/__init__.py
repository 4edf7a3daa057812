"""Sparse MLA decode for JAX: DeepSeek-Sparse-Attention on an FP8 KV cache, with decode
context parallelism, backed by a Hopper CuTe DSL kernel and a pure-jnp reference.

Public API: ``decode``, ``dcp_decode``, ``dcp_decode_tokens``, ``dcp_setup``, ``dcp_check``,
``local_rows``, ``merge_partials``, ``index_topk``, ``dcp_index_topk``, ``token_rows``,
``reference``, ``export_disabled_checks`` (for ``jax.export``).
"""

from jax_sparse_mla import cuda_lowering as cuda_lowering  # registers the kernel lowering
from jax_sparse_mla import index_lowering as index_lowering  # and the indexer's
from jax_sparse_mla import reference
from jax_sparse_mla.dcp import FILL_ROW, dcp_decode, dcp_decode_tokens, local_rows
from jax_sparse_mla.dcp_indexer import dcp_index_topk
from jax_sparse_mla.export import export_disabled_checks
from jax_sparse_mla.indexer import index_topk, token_rows
from jax_sparse_mla.merge import merge_partials
from jax_sparse_mla.ops import decode
from jax_sparse_mla.push_exchange import dcp_check, dcp_setup

__all__ = [
    "FILL_ROW",
    "dcp_check",
    "dcp_decode",
    "dcp_decode_tokens",
    "dcp_index_topk",
    "dcp_setup",
    "decode",
    "export_disabled_checks",
    "index_topk",
    "local_rows",
    "merge_partials",
    "reference",
    "token_rows",
]
__version__ = "0.1.0"
