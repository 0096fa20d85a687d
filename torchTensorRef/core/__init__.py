"""The proxy itself: ``TensorRef``, its blocks and ``proxyInfo``, raw views, sizes, errors
and the per-op facts read from aten schemas.

Imports nothing else of the package. What the core needs from the layers above (the
manager that owns the blocks, the function that runs ops) is installed into
:mod:`.context` at import by those layers: see ``docs/architecture.md``.
"""
