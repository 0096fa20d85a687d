"""Compiled regions: a function or module compiled by ``torch.compile`` that the manager
runs as one op.

Note [Compiled regions]: the manager cannot run inside a compiled graph (Note
[torch.compile] in ``compiler.py``), so a region is compiled for plain tensors and the
manager works at its boundary, as it does around one aten op (``op_protocol.py``). It is
the mechanism of module regions (Note [Regions] in ``regions/mechanism.py``), with three
differences: the compiled code gets plain views of the copies the kernels run on (on
"sim", CPU tensors: the graph is compiled for them), a call that cannot be a region is
refused rather than run op by op, and a region whose blocks are all on the host runs there:

1. the region's TensorRefs (in its arguments, and the parameters and buffers of a module)
   are its op's blocks: ``prepare`` refuses the call with ``OutOfBudgetError`` if they
   and the region's outputs cannot fit in the budget together, makes room and fetches
   them as one working set, and the strategy sees one op;
2. the blocks are pinned and the compiled code runs on their plain views (a module's
   parameters and buffers are swapped for their views during the call), with creation
   functions making plain tensors (``disabled()``);
3. an input whose view the compiled code wrote (its version counter moved) is marked
   written; each output becomes a TensorRef (a view of an input joins its block, anything
   else is a new resident block), room being made for the new ones first;
4. the blocks are unpinned and ``finish`` lets the strategy react, as after any op.

The outputs' size is known after the first call with given input shapes; from then on it
is part of the working set checked and made room for before the call. The compiled code's
intermediate tensors are allocated by the compiled kernels outside the manager's books, as
an aten op's temporary workspace is (no dispatch mode may watch a compiled graph to measure
them, as a module region's are): the budget counts the region's inputs and outputs.

Autograd cannot see through a region (the compiled code runs on plain views, not on the
TensorRefs autograd tracks), so a call that would need gradients is refused.
"""

from __future__ import annotations

import functools

import torch

from .. import regions
from ..regions.mechanism import Region
from ..regions.scan import parameter_slots

_GRAD_ERROR = (
    "{name}: a compiled region runs inference only, and {what} requires grad with grad mode on: "
    "the compiled code runs on plain views of the TensorRefs, which autograd does not connect "
    "to them, so no gradient would reach them. Call it under torch.no_grad() or "
    "torch.inference_mode(), or use torch.compile without compile_region (its ops then run "
    "eagerly through the manager, gradients included)")


class CompiledRegion:
    """A function or module compiled by ``torch.compile`` that the manager runs as one op
    (Note [Compiled regions]). Made by :func:`compile_region`."""

    def __init__(self, target, compile_kwargs: dict):
        self.module = target if isinstance(target, torch.nn.Module) else None
        self.compiled = torch.compile(target, **compile_kwargs)
        label = type(target).__name__ if self.module is not None else getattr(target, "__qualname__", repr(target))
        self.region = Region(f"compiled region {label}", device_views=False, strict=True, measure=False)
        self.spec = self.region.spec

    @property
    def name(self) -> str:
        return self.spec.name

    def __call__(self, *args, **kwargs):
        module = self.module
        slots = parameter_slots(module) if module is not None else ()
        return self.region.run(self._call, args, kwargs, slots,
                               grad_error=_GRAD_ERROR.format(name=self.name, what="an input or parameter"))

    def _call(self, *args, **kwargs):
        module = self.module
        own = module is not None and module._compiled_call_impl is self
        if own:
            module._compiled_call_impl = None  # the compiled module calls itself: not this again
        try:
            return self.compiled(*args, **kwargs)
        finally:
            if own:
                module._compiled_call_impl = self


def compile_region(target, **compile_kwargs):
    """Compile ``target`` (a function or an ``nn.Module``) with ``torch.compile(target,
    **compile_kwargs)`` and run each call as one op of the manager (Note [Compiled regions]).

    The TensorRefs it reads (its arguments, and a module's parameters and buffers) are made
    resident together within the budget and the compiled code runs on them at compiled
    speed; its outputs are TensorRefs. Inference only: a call that needs gradients raises.

    A module is compiled in place, as ``Module.compile()`` does, and returned (its calls,
    hooks included, go through the region); a function gives a new function.

    Raises (when called):
        OutOfBudgetError: the region's inputs and outputs do not fit in the budget together.
        RuntimeError: grad mode is on and an input or parameter requires grad.
    """
    region = CompiledRegion(target, compile_kwargs)
    if region.module is not None:
        target._compiled_call_impl = region
        regions.generation[0] += 1  # (a module holding it is no module region)
        return target

    @functools.wraps(target)
    def run(*args, **kwargs):
        return region(*args, **kwargs)

    run.region = region
    return run
