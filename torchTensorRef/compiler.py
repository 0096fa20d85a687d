"""``torch.compile`` with TensorRefs: the manager's own code is hidden from the compiler.

Note [torch.compile]: Dynamo, the tracer of ``torch.compile``, follows every Python frame
that runs while a compiled function runs, and that includes the manager's: the patched
creation functions, ``__torch_dispatch__`` and everything under them. Traced, that code
failed inside the compiler (``InternalTorchDynamoError``). So the first ``torch.compile``
call (or ``patch()``, if the compiler was loaded before) puts this package on Dynamo's list
of code it never traces. What it meets then is a TensorRef, a tensor subclass it cannot
trace: it breaks the graph there and the ops run eagerly, through the manager, with the
results of plain eager torch. Code that touches no TensorRef still compiles as usual.
``fullgraph=True`` allows no break, so compiling code that touches TensorRefs with it
raises Dynamo's ``Unsupported`` error naming the TensorRef method it could not trace.
"""

from __future__ import annotations

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
            add(__package__)
        # (the compiler warns that it cannot trace the patched functions: it is told not to)
        warnings.filterwarnings("ignore", category=UserWarning,
                                message=r"Dynamo does not know how to trace the builtin `torch\._VariableFunctionsClass\.")
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

    from .patching import _patched

    for _original, wrapper in _patched.values():
        if id(wrapper) not in _breaks:
            try:
                torch._dynamo.disallow_in_graph(wrapper)
            except RuntimeError:  # a function the compiler never puts in a graph: it runs eagerly
                pass
            _breaks[id(wrapper)] = wrapper


#: the wrappers already made to break the graph, by id; held, so that an id is never reused
#: by a new wrapper after ``unpatch()`` (which would then be skipped)
_breaks: dict = {}


def compile_wrapper(wrapped, instance, args, kwargs):
    """The patched ``torch.compile``: hide the manager's code, then compile as asked."""
    hide_from_compiler()
    return wrapped(*args, **kwargs)
