"""transformers' ``generate()`` as one region of its model.

Note [Generation as one region]: between two calls of the model, ``generate()`` runs a few
dozen ops of its own per token (picking the next token, growing the ids and the attention
mask, checking when to stop) on the TensorRefs the model returned, each through the per-op
path. With nothing to page (no budget, or pass-through), the model's calls are one region
each, and those few ops became the larger part of what decoding costs beyond plain torch
(``benchmarks/small_ops.py --regions-only``). A ``generate()`` call is therefore run as one
region of its model (``regions.run_method``): the model's parameters and the call's tensors
are made resident once, the whole loop runs on plain tensors, and the result (the ids, or
the output object with its tensors) comes back as TensorRefs.

Under a budget it is one region too until the budget pages (Note [Regions until the budget
pages] in ``regions/__init__.py``), room kept for what a call with the same shapes and
settings allocated, measured. Once it pages (the whole model does not fit at once, or need not),
the loop runs on plain tensors all the same, and its model's calls are regions that page
(Note [Loops on plain tensors] in ``regions/scope.py``).

It stays on the old path, its model calls regions one by one, where an argument is code or
an object the loop would hand plain tensors to (a streamer, logits processors, stopping
criteria, an assistant model, a cache given in): those must see TensorRefs, as module hooks
must (a hooked model is no region either).
"""

from __future__ import annotations

import torch

from .. import regions

#: the argument types a ``generate()`` region takes: tensors, plain values, and a
#: generation config (settings only)
_PLAIN_VALUES = (torch.Tensor, int, float, bool, str, type(None), torch.dtype, torch.device)


def _settings_only(value, depth: int = 3) -> bool:
    """Whether ``value`` holds tensors and plain values alone (in lists, tuples and dicts)."""
    if isinstance(value, _PLAIN_VALUES):
        return True
    if depth and isinstance(value, (list, tuple)):
        return all(_settings_only(v, depth - 1) for v in value)
    if depth and isinstance(value, dict):
        return all(_settings_only(v, depth - 1) for v in value.values())
    return type(value).__name__ == "GenerationConfig"


def generate_wrapper(wrapped, instance, args, kwargs):
    """``GenerationMixin.generate``: the call as one region of its model where it can be one."""
    if not isinstance(instance, torch.nn.Module) or not all(_settings_only(a) for a in args) \
            or not all(_settings_only(v) for v in kwargs.values()):
        return wrapped(*args, **kwargs)
    with torch.no_grad():  # (generate's own: its region needs no backward)
        return regions.run_method(instance, "generate", wrapped, args, kwargs)
