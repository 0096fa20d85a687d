"""The torch functions the package has replaced, and by what.

``patching`` fills the table when it patches and empties it when it unpatches; ``compiler``
reads it to make the compiler run every wrapper eagerly. A table of its own, so that
neither of them imports the other.
"""

from __future__ import annotations

from typing import Dict, Tuple

from ..regions import unversioned

#: (module, name) -> (the original, our wrapper)
PATCHED: Dict[Tuple[str, str], Tuple[object, object]] = {}

#: the wrapped functions the compiler puts in its graphs as the functions they wrap: their
#: wrappers only record what a region's call wrote (Note [Unversioned writes] in
#: ``regions/unversioned.py``), and a compiled graph is not a region's call
IN_GRAPHS = frozenset(("torch", name) for name in unversioned.FUNCTIONS)
