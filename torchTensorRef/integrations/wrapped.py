"""The torch functions the package has replaced, and by what.

``patching`` fills the table when it patches and empties it when it unpatches; ``compiler``
reads it to make the compiler run every wrapper eagerly. A table of its own, so that
neither of them imports the other.
"""

from __future__ import annotations

from typing import Dict, Tuple

#: (module, name) -> (the original, our wrapper)
PATCHED: Dict[Tuple[str, str], Tuple[object, object]] = {}
