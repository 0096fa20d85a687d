"""A region call's plain leaves, and the gradients that reach them past the region's node.

Note [Gradients past a region's node]: a call that needs gradients gets plain leaves for the
TensorRefs it reads (Note [Regions with gradients] in ``training.py``), and the region's node
gives their gradients to the TensorRefs, asking the inner graph for them (``autograd.grad``,
which accumulates into no ``.grad``). A result computed inside from a leaf and a TensorRef
the region's scan did not find is a TensorRef made op by op (Note [Tensors no scan finds] in
``scan.py``), whose graph reaches the leaf with no node of the region between: the outer
backward then accumulated that gradient into the leaf's ``.grad``, which nothing reads, and
the parameter got none, silently (peft's MonteCLoRA adapters, whose sampler holds its
samples in a plain object, lost their first training step's gradients: a measured call in
eval mode had not read them). Where an op of the manager ran inside a call (a hook on each
leaf of every call costs more host time than the call's boundary can spare), a gradient
accumulated into one of its leaves is given to its TensorRef as autograd gives one (set, or
added in place), and the region's later calls with gradients run op by op, where autograd
sees every tensor.
"""

from __future__ import annotations

import functools

import torch

from ..core.tensor_ref import TensorRef


def watch(leaves, refs, region) -> None:
    """Give each of ``refs`` what autograd accumulates into its plain leaf in a call of
    ``region`` (``leaves``, in the same order)."""
    for leaf, ref in zip(leaves, refs):
        leaf.register_post_accumulate_grad_hook(functools.partial(_past_the_node, ref, region))


def _past_the_node(ref: TensorRef, region, leaf) -> None:
    grad, leaf.grad = leaf.grad, None
    if grad is None:
        return
    region.unseen = True  # (its calls with gradients run op by op from now on)
    with torch.no_grad():
        if ref.grad is None:
            ref.grad = grad
        else:
            ref.grad += grad
