"""Flow's settings: one object that ``Flow`` and each of its parts read when they act."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(slots=True)
class FlowOptions:
    """The arguments of :class:`~torchTensorRef.strategies.Flow` (see its docstring).

    ``Flow`` keeps one instance and hands it to its parts, which read it at each use, so a
    setting changed on the ``Flow`` (``flow.lookahead = 2``) holds for every part at once.
    """

    lookahead: int = 6
    min_period: int = 1
    max_history: int = 50_000
    prefetch_evicts: Optional[bool] = None
    compiles_plan: bool = True
    disk_lookahead: int = 64

    def __post_init__(self) -> None:
        if (self.lookahead < 0 or self.min_period < 1 or self.max_history < 2 * self.min_period
                or self.disk_lookahead < 0):
            raise ValueError(
                "Flow needs lookahead >= 0, min_period >= 1, max_history >= 2 * min_period and "
                f"disk_lookahead >= 0 (got: lookahead={self.lookahead}, min_period={self.min_period}, "
                f"max_history={self.max_history}, disk_lookahead={self.disk_lookahead})"
            )
