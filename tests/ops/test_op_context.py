"""An op's context (``ops/op_context.py``): how its results find one another's blocks."""

from __future__ import annotations

from types import SimpleNamespace

from torchTensorRef.ops.op_context import OpContext


def _block(key):
    return SimpleNamespace(dev_key=key)


def test_output_on_finds_every_output_however_it_was_adopted_the_first_on_a_storage_first():
    ctx = OpContext(None, [], [], (), {})
    assert ctx.output_on(7) is None
    first = _block(1)
    ctx.outputs.append(first)  # (as the op protocol's adopt_output appends: a result, a resized argument)
    assert ctx.output_on(1) is first
    second, again = _block(2), _block(1)
    ctx.outputs += [second, again]  # outputs added after a lookup are found too
    assert ctx.output_on(2) is second
    assert ctx.output_on(1) is first  # (the first on a storage, as a scan in order finds)
    assert ctx.output_on(3) is None
