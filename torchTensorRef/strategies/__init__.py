"""Paging policies: what to bring to the accelerator, what to evict, what to prefetch."""

from .base import Strategy
from .flow import Flow
from .genoa import Genoa

__all__ = ["Strategy", "Genoa", "Flow", "by_name", "NAMES", "DEFAULT"]

NAMES = ("genoa", "flow")
#: the strategy a new manager starts with
DEFAULT = "flow"


def by_name(name: str) -> Strategy:
    """A new strategy instance for ``name``; raises ``ValueError`` naming the accepted ones."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key == "genoa":
        return Genoa()
    if key == "flow":
        return Flow()
    accepted = ", ".join(f'"{n}"' for n in NAMES)
    raise ValueError(
        f"strategy must be one of {accepted} or an instance of "
        f"torchTensorRef.strategies.Strategy (got: {name!r})"
    )
