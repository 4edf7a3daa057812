"""The sparse decode kernel: static config, compiled cubins and their disk cache.

Importing this package does not import the DSL; only compiling a missing cubin does.
"""

from jax_sparse_mla.kernel.compile import CompiledKernel, get_kernel
from jax_sparse_mla.kernel.config import KernelConfig, KernelUnavailableError

__all__ = ["CompiledKernel", "KernelConfig", "KernelUnavailableError", "get_kernel"]
