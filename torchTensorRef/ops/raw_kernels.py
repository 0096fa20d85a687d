"""Kernels launched outside the dispatcher: CUDA's jiterator, run on TensorRefs' device copies.

Note [Raw kernels]: ``torch.cuda.jiterator._create_jit_fn(code)(*tensors)`` (and
``_create_multi_output_jit_fn``) compiles an elementwise kernel and launches it through a
raw CPython entry point, ``torch._C._cuda_jiterator_compile_and_launch_kernel``. It honours
no ``__torch_function__`` and goes through no dispatcher, so ``TensorRef.__torch_dispatch__``
never runs: the kernel reads the data pointer of the wrapper itself, whose storage has no
bytes, and on CUDA faults with an illegal memory access that ends the process's CUDA
context. ``patching`` therefore wraps the entry point with :func:`jiterator_wrapper`. A
launch with TensorRef arguments becomes one op of the manager's protocol, as any aten op
(``ops/dispatch.py``): under the manager's lock its blocks are made resident together
within the budget (room made for its results too), the kernel gets the plain views of the
device copies, and its new results are adopted as resident blocks. Callbacks, the
strategy and recordings see the launch as an op named ``jiterator.<kernel name>``.

A launch inside a managed op (a kernel written in Python, a callback), where the manager's
lock is held and the op's own blocks must stay where they are, is refused with a
``TypeError``: making room there could evict the blocks of the op in flight.
"""

from __future__ import annotations

import time
from typing import Dict

import torch

from ..core.tensor_ref import TensorRef
from ..memory.manager import tensorsManager as _mgr
from . import workers
from .op_context import OpContext, blocks_of, swap_in, wrap_nested

#: the entry points wrapped: ``(owner, name)``, as in ``patching``'s tables
JITERATOR_FUNCTIONS = (("torch._C", "_cuda_jiterator_compile_and_launch_kernel"),)

_NESTED_ERROR = (
    "jiterator kernel {name}: called with TensorRef arguments inside a managed op (a kernel "
    "written in Python, or a tensorsManager callback), where the manager cannot move their "
    "bytes; call it outside the op, or with plain tensors (TensorRef.target)")


class KernelSpec:
    """What the op protocol reads of an op's ``OpSpec``, for one jiterator kernel.

    One per kernel (code, name, outputs): a strategy that learns the op sequence (Flow) keys
    ops by their spec, so every launch of a kernel must be the same op to it.
    """

    __slots__ = ("func", "call", "name", "write_args", "return_args", "allocates", "restrides",
                 "one_result", "one_tensor", "host_results", "host_args", "handler")

    def __init__(self, func, kernel_name: str, num_outputs: int):
        self.func = self.call = func
        self.name = f"jiterator.{kernel_name}"
        self.write_args = ()  # its results are new tensors: it writes none of its inputs
        self.return_args = (None,) * num_outputs
        self.allocates = True
        self.restrides = False
        self.one_result = num_outputs == 1
        self.one_tensor = num_outputs == 1
        self.host_results = ()
        self.host_args = ()
        self.handler = None


_SPECS: Dict[tuple, KernelSpec] = {}
_MAX_SPECS = 4096  # (kernels are compiled once each: a program has a handful)


def _spec_of(func, code_string, kernel_name, return_by_ref, num_outputs) -> KernelSpec:
    key = (func, code_string, kernel_name, bool(return_by_ref), num_outputs)
    spec = _SPECS.get(key)
    if spec is None:
        if len(_SPECS) >= _MAX_SPECS:
            _SPECS.clear()
        spec = _SPECS[key] = KernelSpec(func, str(kernel_name), num_outputs)
    return spec


def output_bytes(tensors, num_outputs: int) -> int:
    """Bytes of the results of an elementwise kernel over ``tensors``: ``num_outputs``
    tensors of their broadcast shape, of their promoted type (an upper bound: type
    promotion by category can only give a type as small)."""
    shape: list = []
    dtype = None
    itemsize = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            return 0  # the entry point refuses it before launching anything
        size = list(t.shape)
        if len(size) > len(shape):
            shape = [1] * (len(size) - len(shape)) + shape
        for i, n in enumerate(size, len(shape) - len(size)):
            if shape[i] == 1:
                shape[i] = n
            elif n != 1 and n != shape[i]:
                return 0  # no broadcast shape: the kernel raises before allocating
        dtype = t.dtype if dtype is None else torch.promote_types(dtype, t.dtype)
        itemsize = max(itemsize, t.dtype.itemsize, dtype.itemsize)
    numel = 1
    for n in shape:
        numel *= n
    return numel * itemsize * num_outputs


def jiterator_wrapper(wrapped, instance, args, kwargs):
    """``torch._C._cuda_jiterator_compile_and_launch_kernel`` that runs on TensorRefs'
    device copies (Note [Raw kernels]); without TensorRefs it is the entry point itself."""
    if kwargs or len(args) < 5 or args[4].__class__ is not tuple:
        return wrapped(*args, **kwargs)  # (the entry point refuses these before any launch)
    extra = args[5] if len(args) > 5 else None
    if isinstance(extra, dict) and any(isinstance(v, TensorRef) for v in extra.values()):
        # The entry point reads a tensor given for a scalar argument with ``item()``, an op:
        # read it so here, before the launch holds the manager.
        extra = {k: v.item() if isinstance(v, TensorRef) else v for k, v in extra.items()}
        args = args[:5] + (extra,) + args[6:]
    if not any(isinstance(t, TensorRef) for t in args[4]):
        return wrapped(*args)
    return launch(wrapped, args)


def launch(func, args):
    """Run the jiterator entry point ``func`` on ``args`` (``args[4]``: its tensors, some of
    them TensorRefs) as one managed op; return its results as TensorRefs."""
    code_string, kernel_name, return_by_ref, num_outputs, tensors = args[:5]
    mgr = _mgr
    if mgr.forked and workers.in_worker():
        # (a forked DataLoader worker: on the bytes this process can read, as any op there)
        return workers.run_in_worker(func, args, {})
    if mgr.lock._is_owned():
        raise TypeError(_NESTED_ERROR.format(name=kernel_name))
    with mgr.lock:
        if mgr.trace is not None:
            mgr.trace.entered = time.perf_counter_ns()  # our host time for this op starts here
        if mgr.books.dead:
            mgr.drain()
        blocks = blocks_of([t for t in tensors if isinstance(t, TensorRef)])
        backend = mgr.backend
        # Only CPU TensorRefs: the kernel gets CPU tensors, which it refuses as it does
        # plain ones (the op runs "on the host" and moves nothing).
        on_host = not backend.passthrough and all(b.host_only for b in blocks)
        spec = _spec_of(func, code_string, kernel_name, return_by_ref, num_outputs)
        ctx = OpContext(spec, blocks, [], args, {}, on_host)
        ctx.estimate = 0 if on_host or backend.passthrough else output_bytes(tensors, int(num_outputs))
        mgr.prepare(ctx)
        if on_host:
            for b in blocks:
                mgr.sync_host(b)  # the kernel reads host copies: they must hold the current bytes
        plain = tuple(swap_in(t, on_host) for t in tensors)
        out = mgr.call(ctx, func, args[:4] + (plain,) + args[5:], {})
        result = wrap_nested(out, ctx, mgr)
        mgr.finish(ctx)
        return result
