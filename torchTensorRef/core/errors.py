"""Exceptions raised by torchTensorRef."""

from __future__ import annotations

from .sizes import format_size


class OutOfBudgetError(RuntimeError):
    """An op's own inputs and outputs do not fit in the accelerator budget.

    Attributes:
        op: name of the aten op.
        needed: bytes the op needs resident at once (with what is allocated outside the
            manager, when that is what did not fit).
        budget: the budget in bytes.
        outside: device bytes allocated outside the manager at the time (Note [Budget on CUDA]).
    """

    def __init__(self, op: str, needed: int, budget: int, detail: str = "", outside: int = 0):
        self.op, self.needed, self.budget, self.outside = op, needed, budget, outside
        where = (f", of which {format_size(outside)} is allocated outside the manager (library "
                 f"workspaces such as cuBLAS's, the program's own device tensors)") if outside else ""
        msg = (
            f"op {op} needs {format_size(needed)} ({needed} bytes) resident on the accelerator, "
            f"budget is {format_size(budget)} ({budget} bytes){where}: raise tensorsManager.budget "
            f"or make the tensors of this op smaller"
        )
        super().__init__(msg + (f" ({detail})" if detail else ""))


class BudgetBelowFloorError(OutOfBudgetError, ValueError):
    """A budget at or below what the device already holds outside the manager (library
    workspaces, the program's own device tensors): nothing managed could ever fit.

    Attributes:
        budget: the budget asked for, in bytes.
        outside: bytes allocated on the device outside the manager when it was asked.
    """

    def __init__(self, budget: int, outside: int, device: str):
        self.op, self.needed, self.budget, self.outside = "tensorsManager.budget", outside, budget, outside
        RuntimeError.__init__(
            self,
            f"budget must be more than the {format_size(outside)} ({outside} bytes) already allocated on "
            f"{device} outside the manager (library workspaces such as cuBLAS's, the program's own "
            f"device tensors), which it covers (got: {format_size(budget)}, {budget} bytes): set a budget "
            f"of at least {format_size(outside)} plus room for the largest op's tensors")


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
