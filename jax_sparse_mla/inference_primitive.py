"""What the package's primitives share: inference-only ops with a reference lowering on every
platform (the CUDA lowerings register over it for "cuda"), no gradient and no vmap rule, each
refusal in the op's own words."""

from __future__ import annotations

import functools
import logging

from jax._src import dispatch
from jax.extend import core
from jax.interpreters import ad, batching, mlir

log = logging.getLogger("jax_sparse_mla")


def define(name: str, abstract_eval, reference_rule, *, op: str, no_gradient: str, no_vmap: str):
    """(primitive, reference_lowering) of a multiple-results primitive ``name``: its abstract
    evaluation, the reference lowering (``reference_rule`` traced, for any platform, also the
    CUDA lowerings' fallback) and the refusals. ``op`` names it in messages (e.g.
    "jax_sparse_mla.decode"); ``no_gradient`` and ``no_vmap`` are its refusals' texts."""
    primitive = core.Primitive(name)
    primitive.multiple_results = True
    primitive.def_impl(functools.partial(dispatch.apply_primitive, primitive))
    primitive.def_abstract_eval(abstract_eval)
    reference_lowering = mlir.lower_fun(reference_rule, multiple_results=True)

    @functools.cache
    def note_reference(platform: str) -> None:
        log.info("%s: the kernel needs a Hopper GPU; using the reference on %s", op, platform)

    def portable_lowering(ctx, *args, require_kernel, **params):
        platform = ctx.module_context.platforms[0] if ctx.module_context.platforms else "?"
        if require_kernel:
            raise NotImplementedError(
                f"{op}(implementation='cute') needs a Hopper (sm_90) CUDA GPU; lowering for "
                f"{platform!r}. Use implementation=None to fall back to the reference."
            )
        note_reference(platform)
        return reference_lowering(ctx, *args, require_kernel=require_kernel, **params)

    def refuse_differentiation(primals, tangents, **params):
        raise NotImplementedError(no_gradient)

    def refuse_vmap(args, dims, **params):
        raise NotImplementedError(no_vmap)

    mlir.register_lowering(primitive, portable_lowering)
    ad.primitive_jvps[primitive] = refuse_differentiation
    batching.primitive_batchers[primitive] = refuse_vmap
    return primitive, reference_lowering
