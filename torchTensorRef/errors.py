"""Exceptions raised by torchTensorRef."""

from __future__ import annotations

from .sizes import format_size


class OutOfBudgetError(RuntimeError):
    """An op's own inputs and outputs do not fit in the accelerator budget.

    Attributes:
        op: name of the aten op.
        needed: bytes the op needs resident at once.
        budget: the budget in bytes.
    """

    def __init__(self, op: str, needed: int, budget: int, detail: str = ""):
        self.op, self.needed, self.budget = op, needed, budget
        msg = (
            f"op {op} needs {format_size(needed)} ({needed} bytes) resident on the accelerator, "
            f"budget is {format_size(budget)} ({budget} bytes): raise tensorsManager.budget "
            f"or make the tensors of this op smaller"
        )
        super().__init__(msg + (f" ({detail})" if detail else ""))


class DeviceOutOfMemoryError(RuntimeError):
    """The accelerator ran out of memory and nothing more could be evicted."""

    def __init__(self, op: str, needed: int, available: int):
        self.op, self.needed, self.available = op, needed, available
        super().__init__(
            f"op {op} ran out of accelerator memory: it needed about {format_size(needed)}, "
            f"{format_size(available)} was free after evicting every unpinned tensor"
        )


class OpVetoedError(RuntimeError):
    """A ``before`` callback returned ``False`` for this op."""

    def __init__(self, op: str):
        self.op = op
        super().__init__(f"op {op} was vetoed by a tensorsManager callback (it returned False)")
