"""What a region call that needs gradients keeps of the tensors autograd saves inside it
(Note [Regions with gradients] in ``training.py``).

Note [Saved leaves are watched]: a tensor the program changes in place between the forward
that saved it and the backward is refused there, as plain torch refuses it (its version
moved). Inside a region autograd saves the call's plain leaf, whose version counter is not
its TensorRef's: a parameter written op by op after the call (``weight.mul_(0.5)`` under
``no_grad`` before ``backward()``) moved the TensorRef's and not the leaf's, and the backward
ran on the written bytes, silently (found by ``tests/regions/test_programs.py``'s programs
drawn at random, with no budget). So a saved leaf is kept with its TensorRef's version at the
save, under a budget as a ``Saved`` view of its block, with none as ``SavedLeaf`` (the leaf
itself: nothing pages), and unpacking either checks it.
"""

from __future__ import annotations


class Saved:
    """A tensor the call saved for backward: a view of a working-set block (``ref`` and the
    geometry) or an activation (``plain`` until the call returned, then ``ref``)."""

    __slots__ = ("ref", "plain", "geometry", "watch")

    def __init__(self, ref, plain, geometry):
        self.ref = ref
        self.plain = plain
        self.geometry = geometry
        self.watch = ()  # (TensorRef, its version): changed in place before backward, refused


class SavedLeaf:
    """A leaf the call saved while nothing pages: itself, and its TensorRef's version then."""

    __slots__ = ("leaf", "watch")

    def __init__(self, leaf, ref):
        self.leaf = leaf
        self.watch = ((ref, ref._version),)


def changed(watch):
    """The first ``(TensorRef, version)`` of ``watch`` whose TensorRef was written since, or ``None``."""
    for ref, version in watch:
        if ref._version != version:
            return ref, version
    return None
