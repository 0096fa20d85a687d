"""``torch.compile`` with TensorRefs: the manager's own code is hidden from the compiler.

Note [torch.compile]: Dynamo, the tracer of ``torch.compile``, follows every Python frame
that runs while a compiled function runs, and that includes the manager's: the patched
creation functions, ``__torch_dispatch__`` and everything under them. Traced, that code
failed inside the compiler (``InternalTorchDynamoError``). So the first ``torch.compile``
call (or ``patch()``, if the compiler was loaded before) puts this package on Dynamo's list
of code it never traces. What it meets then is a TensorRef, a tensor subclass it cannot
trace: it breaks the graph there and the ops run eagerly, through the manager, with the
results of plain eager torch. Code that touches no TensorRef still compiles as usual.
``fullgraph=True`` allows no break: the compiled function then raises
:class:`FullGraphError`, which says why and points to ``compile_region``.

For compiled speed on managed tensors, ``compile_region`` (Note [Compiled regions] in
``compiled_region.py``) compiles a function or module for plain tensors and lets the
manager run each call as one op, at the region's boundary.

Why TensorRef is not a traceable subclass (``__tensor_flatten__``, as DTensor's): tracing
such a subclass builds fake TensorRefs from fake inner tensors (``__tensor_unflatten__``)
and runs ``__torch_dispatch__`` on them once, at trace time, to learn which aten ops to
put in the graph on the inner tensors. Everything else ``__torch_dispatch__`` does (blocks,
fetches and evictions within the budget, the strategy, the counters) would run on fake
tensors then, and nothing of it is in the graph that runs: the budget would hold for a
trace, not for the calls. At run time the subclass's inputs are unwrapped one by one
(``__tensor_flatten__``), with no point where all of a graph's inputs are made resident
together and kept so while it runs (bringing in one could evict another), and an evicted
TensorRef has no device tensor to hand out. What remains possible is residency at the
graph's boundary for all its inputs at once, which is what a compiled region does without
the subclass protocol. (Tried: with a ``__tensor_flatten__`` returning the target,
``__tensor_unflatten__`` is called with ``FakeTensor``s, which the manager cannot adopt.)
"""

from __future__ import annotations

import functools
import sys
import warnings

import torch

_hidden = False


def hide_from_compiler() -> None:
    """Put this package on the compiler's list of code it never traces, and make it run the
    patched torch functions eagerly (cheap after the first call)."""
    global _hidden
    if not _hidden:
        from torch._dynamo import trace_rules

        add = getattr(trace_rules, "add", None)  # (its name in the torch versions supported)
        if add is None:
            warnings.warn(f"torch {torch.__version__}: torchTensorRef cannot hide its code from torch.compile, "
                          "which may then fail while tracing it; compile code that touches no TensorRef")
        else:
            add(__name__.partition(".")[0])  # the whole package, every layer
        # (the compiler warns that it cannot trace the patched functions: it is told not to)
        warnings.filterwarnings("ignore", category=UserWarning,
                                message=r"Dynamo does not know how to trace the builtin "
                                        r"`torch\._VariableFunctionsClass\.")
        _hidden = True
    break_graph_at_wrappers()


def hide_if_loaded() -> None:
    """:func:`hide_from_compiler` if the compiler is loaded already (it is slow to load)."""
    if "torch._dynamo" in sys.modules:
        hide_from_compiler()


def break_graph_at_wrappers() -> None:
    """Make the compiler run the patched torch functions (``torch.zeros`` ...) eagerly.

    A wrapper looks like the torch function it wraps, so the compiler would put it in its
    graph as that op: the tensor it makes would be a plain tensor of the device, which the
    compiled code then returns outside the manager (and ``"sim"`` has no compiled kernels).
    """
    import torch._dynamo

    from .wrapped import PATCHED

    # What disallow_in_graph raises for a function it would not put in a graph anyway:
    # RuntimeError on torch 2.13, its own IncorrectUsage (an Exception only) on 2.11 and
    # older (looked up here, not at import: the compiler may be loaded after this module).
    not_in_graphs = (RuntimeError, getattr(torch._dynamo.exc, "IncorrectUsage", RuntimeError))
    for _original, wrapper in PATCHED.values():
        if id(wrapper) not in _breaks:
            try:
                torch._dynamo.disallow_in_graph(wrapper)
            except not_in_graphs:  # a function the compiler never puts in a graph: it runs eagerly
                pass
            _breaks[id(wrapper)] = wrapper


#: the wrappers already made to break the graph, by id; held, so that an id is never reused
#: by a new wrapper after ``unpatch()`` (which would then be skipped)
_breaks: dict = {}


class FullGraphError(RuntimeError):
    """``torch.compile(..., fullgraph=True)`` met a TensorRef, which it cannot put in a graph."""


_FULLGRAPH = (
    "torch.compile(fullgraph=True) cannot compile code that touches TensorRefs: every op on a "
    "TensorRef runs through the manager (it makes the op's blocks resident within the budget), "
    "which cannot run inside a compiled graph, so the compiler must break its graph there and "
    "fullgraph=True allows no break. Compile with torchTensorRef.compile_region(fn_or_module, "
    "fullgraph=True) instead: the manager makes the region's TensorRefs resident together and "
    "the whole region runs compiled on them (inference only)")


def _explained(fn):
    """``fn`` (compiled with ``fullgraph=True``), raising :class:`FullGraphError` rather than
    the compiler's error when it fails on a TensorRef."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except torch._dynamo.exc.Unsupported as e:
            if "TensorRef" not in str(e):
                raise
            raise FullGraphError(_FULLGRAPH) from e

    return call


def compile_wrapper(wrapped, instance, args, kwargs):
    """The patched ``torch.compile``: hide the manager's code, then compile as asked."""
    hide_from_compiler()
    compiled = wrapped(*args, **kwargs)
    if not kwargs.get("fullgraph") or not callable(compiled):
        return compiled  # (fullgraph is keyword-only; without a model, a decorator is returned)
    if isinstance(compiled, torch.nn.Module):
        compiled.forward = _explained(compiled.forward)  # (an OptimizedModule's own attribute)
        return compiled
    return _explained(compiled)
