"""Reentrant checkpoints (``torch.utils.checkpoint`` with ``use_reentrant=True``) counted as
they run: a region whose call runs one computes its gradients op by op (Note [Reentrant
checkpoints in a region]).

Note [Reentrant checkpoints in a region]: a reentrant checkpoint's backward recomputes its
function and runs ``torch.autograd.backward`` on the result, which PyTorch refuses inside a
backward that asks for given inputs' gradients ("When use_reentrant=True,
torch.utils.checkpoint is incompatible with .grad() ..."). A region's backward is such a
call on its inner graph: a model whose forward checkpoints its layers (transformers'
gradient checkpointing with ``use_reentrant=True``), itself a region, trained its first step
(a region's first call with gradients runs op by op, measured) and raised from the second.
A measured call during which one ran makes the region's calls with gradients run op by op,
where the checkpoint's node is the program's own; the checkpointed layers are regions of
their own inside the recomputation, whose backward the checkpoint runs without inputs.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint as _checkpoint

_runs = [0]


def runs() -> int:
    """How many reentrant checkpoints have run their forward (any thread)."""
    return _runs[0]


def install() -> None:
    """Count ``CheckpointFunction``'s forwards (once)."""
    cls = getattr(_checkpoint, "CheckpointFunction", None)
    if cls is None or getattr(cls.forward, "counted", False):
        return
    original = cls.forward

    def forward(ctx, *args):
        if not torch.compiler.is_compiling():  # (no side effect in a traced graph)
            _runs[0] += 1
        return original(ctx, *args)

    forward.counted = True  # type: ignore[attr-defined]
    cls.forward = staticmethod(forward)


install()
