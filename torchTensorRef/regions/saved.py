"""What a region call that needs gradients keeps of the tensors autograd saves inside it
(Note [Regions with gradients] in ``training.py``).

Note [Saved leaves are watched]: a tensor the program changes in place between the forward
that saved it and the backward is refused there, as plain torch refuses it (its version
moved). Inside a region autograd saves the call's plain leaves (or views of them), whose
version counters are not their TensorRefs': a parameter written op by op after the call
(``weight.mul_(0.5)`` under ``no_grad`` before ``backward()``) moved its TensorRef's and not
its leaf's, and the backward ran on the written bytes, silently (found by
``tests/regions/test_programs.py``'s programs drawn at random, with no budget). Under a budget
that pages, the saved-tensor hooks keep a saved view of a block as a ``Saved`` with its
TensorRef's version, checked when it is unpacked. With nothing paged there are no hooks (a
Python call for every tensor saved, where a step with nothing to move should cost what plain
torch's costs): the leaves are what is saved, and before the inner graph runs, a leaf whose
TensorRef was written since the call has its own version moved too (``sync_versions``), so
that autograd's check refuses it where it saved the leaf or a view of it, and only there, as
in plain torch.
A write inside the call itself, after the save (``weight.mul_(0.5)`` under ``no_grad`` at the
end of the forward), moves the leaf's version and not the TensorRef's: with nothing paged
autograd's check sees it; a ``Saved`` view of a block remembers the version of the tensor
autograd saved until the call returns, and is refused where it moved (found by the same
programs under Genoa, whose saved tensors are always blocks); from then on it watches its
TensorRef's version as the call left it (a write before the save, which plain torch passes,
moved it as the call returned). And a tensor saved before the
call, the TensorRef itself (op by op, or an earlier call of the region in the same graph),
sees the call's writes: the TensorRef's version moves as its view's moved
(``move_versions``), as plain torch's moves with each write.
"""

from __future__ import annotations

import functools
import weakref

from torch.autograd.graph import increment_version, saved_tensors_hooks


class Saved:
    """A tensor the call saved for backward: a view of a working-set block (``ref`` and the
    geometry) or an activation (``plain`` until the call returned, then ``ref``)."""

    __slots__ = ("ref", "plain", "geometry", "watch", "seen", "written")

    def __init__(self, ref, plain, geometry):
        self.ref = ref
        self.plain = plain
        self.geometry = geometry
        self.watch = ()  # (TensorRef, its version): changed in place before backward, refused
        #: a view of a block: the tensor autograd saved and its version, while the call runs
        self.seen = None
        #: that tensor was written in place later in the call: refused too
        self.written = False

    def stale(self, region: str):
        """Why autograd may not use it (written in place since it was saved), or ``None``."""
        if self.written:
            return ("one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: the region {region!r} wrote a tensor it saved for backward later in its call")
        for ref, version in self.watch:
            if ref._version != version:
                return ("one of the variables needed for gradient computation has been modified by an inplace "
                        f"operation: a tensor the region {region!r} saved for backward is at version "
                        f"{ref._version}; expected version {version} instead")
        return None

    def saw_the_call_end(self) -> None:
        """The call returned: whether it wrote the saved view after saving it, remembered;
        and the version its TensorRef has now watched from here on (the call's writes before
        the save, which plain torch's check passes, moved it as the call returned:
        ``move_versions``)."""
        if self.seen is not None:
            t, version = self.seen
            self.written, self.seen = t._version != version, None
            self.watch = tuple((ref, ref._version) for ref, _version in self.watch)


def sync_versions(refs, leaves, versions) -> None:
    """Move the version of each leaf whose TensorRef was written since ``versions`` were read
    (and read them again): autograd then refuses a backward that saved it."""
    for i, ref in enumerate(refs):
        version = ref._version
        if version != versions[i]:
            increment_version(leaves[i])
            versions[i] = version


def move_versions(written) -> None:
    """Move the version of each TensorRef by as much as its view's moved while a call ran
    (``(ref, view, version before)``): a tensor autograd saved before the call, the TensorRef
    itself, is then refused in backward as plain torch refuses a tensor written since."""
    moved: dict = {}
    for ref, view, version in written:
        if version is not None:
            delta = view._version - version
            if delta:
                moved.setdefault(delta, []).append(ref)
    for delta, refs in moved.items():
        for _ in range(delta):
            increment_version(refs)


def saved_hooks(call) -> saved_tensors_hooks:
    """The saved-tensor hooks of a region call that pages (its ``_pack`` and ``_unpack``).

    The call is held weakly: autograd keeps the hooks in the inner graph's nodes, which the
    call holds, and the collector does not see that reference, so bound methods would make a
    cycle never freed (a forward whose graph is dropped without a backward leaked its
    activations). While its backward may run, the outer graph's node holds the call."""
    ref = weakref.ref(call)
    return saved_tensors_hooks(functools.partial(_pack, ref), functools.partial(_unpack, ref))


def _pack(call, t):
    return call()._pack(t)  # (the call is running: alive)


def _unpack(call, saved):
    if saved.__class__ is not Saved:
        return saved  # (a TensorRef kept as it is: no call needed, alive or not)
    training = call()
    if training is not None:
        return training._unpack(saved)
    # The region's node is gone, and the node unpacking it is reached past it (Note
    # [Gradients past a region's node] in ``leaves.py``): its backward runs on TensorRefs.
    stale = saved.stale("that ran")
    if stale is not None:
        raise RuntimeError(stale)
    return saved.ref.as_strided(*saved.geometry) if saved.ref is not None else saved.plain
