"""``python -m torchTensorRef``: see :mod:`torchTensorRef.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
