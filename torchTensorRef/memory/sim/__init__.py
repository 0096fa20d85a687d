"""The simulated accelerator ``"sim"``: a PrivateUse1 device whose memory is host memory,
its kernels and its caching allocator.

Part of :mod:`..` (memory): it may import core and the memory modules it emulates for
(streams), and reaches the manager only through ``core.context``.
"""
