"""Checks made before autograd runs a backward of managed tensors (Note [Refused before a backward runs]).

Note [Refused before a backward runs]: autograd frees each node's saved tensors as it runs
it and accumulates gradients into ``.grad`` as they come, so a backward that fails midway
cannot be run again: what ran is consumed, and a second run would add the gradients that
arrived twice. What the manager can know before the engine starts is therefore checked
before it starts (``torch.autograd.backward``, which ``Tensor.backward`` calls, and
``torch.autograd.grad`` are wrapped), and refused with the graph untouched:

- a graph recorded while ``tensorsManager.device`` was another device: its tensors report
  that device, and the engine would mix the two;
- a region's backward whose saved blocks and incoming gradients alone exceed the budget in
  force now (the budget was lowered after the forward): it could not be made resident.

What cannot be known before (an op of the per-op path whose working set no longer fits) is
refused when it comes, saying that the backward stopped midway.

Note [Autograd's device thread at exit]: autograd runs a backward of an accelerator's tensors
(CUDA's, "sim"'s) on a thread of its own for that device, and wakes the caller when the
graph's work is done, before that thread has let go of the task: its tensors (TensorRefs,
whose release runs Python) and, on "sim", the stream guards of PyTorch's Python device
guard. A program that ends right then finalizes the interpreter under that thread, which,
taking the GIL to go on, is ended through C++ frames that may not be unwound: "terminate
called without an active exception", the process aborted with what it printed but had not
flushed. So at exit, where a backward ran, the package first runs a one-element backward on
the device: the thread takes its tasks in order, so when that one ends the thread has let go
of the ones before it, and it pauses a moment, so that the thread lets go of that last one too.
"""

from __future__ import annotations

import atexit
import time

import torch

from ..core.errors import OutOfBudgetError
from ..core.tensor_ref import TensorRef, block_of
from ..memory.manager import tensorsManager as _mgr
from ..regions import step, training
from .plain import disabled

#: autograd's entry points, wrapped by ``patching``
FUNCTIONS = (("torch.autograd", "backward"), ("torch.autograd", "grad"))
#: seconds the exit waits after its last backward (Note [Autograd's device thread at exit])
EXIT_GRACE_S = 0.02
#: whether a backward was run since the package was imported (Note [Autograd's device thread at exit])
ran = [False]


def guard_wrapper(wrapped, instance, args, kwargs):
    """``torch.autograd.backward`` / ``grad``, after the checks of the Note; regions' backwards
    keep their inner graphs while it runs as it keeps its own (Note [Keeping the inner graph]
    in ``regions/training.py``)."""
    roots = args[0] if args else kwargs.get("tensors", kwargs.get("outputs"))
    check(roots)
    ran[0] = True
    with training.backwards.call(_keeps_graph(wrapped, args, kwargs)):
        return wrapped(*args, **kwargs)


def _keeps_graph(wrapped, args, kwargs) -> bool:
    """Whether this call of ``torch.autograd.backward`` or ``grad`` keeps the graph it runs."""
    # positional: backward(tensors, grad_tensors, retain_graph, create_graph),
    # grad(outputs, inputs, grad_outputs, retain_graph, create_graph)
    at = 2 if wrapped.__name__ == "backward" else 3
    retain = args[at] if len(args) > at else kwargs.get("retain_graph")
    create = args[at + 1] if len(args) > at + 1 else kwargs.get("create_graph", False)
    return bool(create) if retain is None else bool(retain)


def check(roots) -> None:
    """Refuse, before anything runs, a backward of ``roots`` that would fail midway.

    Raises:
        RuntimeError: a root was computed on another device than the manager's now.
        OutOfBudgetError: a region's backward in the graph cannot fit the budget now.
    """
    if isinstance(roots, torch.Tensor):
        roots = (roots,)
    elif not isinstance(roots, (tuple, list)):
        return
    nodes = []
    mgr = _mgr
    for t in roots:
        if isinstance(t, TensorRef):
            _check_device(mgr, t)
            if t.grad_fn is not None:
                nodes.append(t.grad_fn)
    limit = mgr.limit
    if nodes and limit is not None and step.largest_held[0] and not mgr.backend.passthrough:
        outside = mgr.outside_bytes()
        if step.largest_held[0] + outside > limit:
            _check_regions(mgr, nodes, limit, outside)


def _check_device(mgr, t: TensorRef) -> None:
    if block_of(t).host_only:
        return  # (a CPU tensor: its graph may still run on the device; ops there check)
    device = t.device
    if mgr.is_accelerator(device) or (mgr.backend.passthrough and device.type == "cpu"):
        return
    raise RuntimeError(
        f"backward of a graph recorded on {device}, but tensorsManager.device is now {mgr.device!r}: "
        f"its tensors stay on the device they were made for, and the engine cannot run it on another. "
        f"Set tensorsManager.device back before calling backward() (nothing has run)")


def _check_regions(mgr, nodes, limit: int, outside: int) -> None:
    """Walk the graph from ``nodes``: every region's backward in it must fit the budget."""
    size = mgr.backend.block_bytes
    seen = set()
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        pending = getattr(node, "training", None)
        if isinstance(pending, training.Training):
            need = pending.resident_need(size)
            if need + outside > limit:
                raise OutOfBudgetError(
                    pending.region.backward_spec.name, need + outside, limit,
                    detail="refused before the backward ran: the graph is untouched, so raising the budget "
                           "and calling backward() again works", outside=outside)
        todo.extend(child for child, _ in node.next_functions)


def finish_device_thread() -> None:
    """Wait until autograd's thread for the managed device has ended what it began (Note
    [Autograd's device thread at exit]); nothing where no such thread can have run."""
    backend = _mgr.backend
    device = backend.declared
    if not ran[0] or backend.passthrough or device.type == "cpu" or (
            device.type == "cuda" and not torch.cuda.is_initialized()):
        return
    try:
        with disabled():
            leaf = torch.zeros((), device=device, requires_grad=True)
            torch.autograd.backward(leaf)
        # (the thread lets go of this last task too, and on "sim" that takes the GIL: a pause
        # gives it the GIL before the interpreter finalizes, where the caller would keep it)
        time.sleep(EXIT_GRACE_S)
    except Exception:  # (at exit there is no one to tell; the interpreter ends as it would have)
        pass


atexit.register(finish_device_thread)  # (run before the manager's own exit handler: registered after it)
