"""Where the bytes live: the manager and its residency accounting, the op protocol around
each op, streams, pinned memory, the host and disk tiers, device backends and (in
:mod:`.sim`) the simulated device.

May import :mod:`..core`, :mod:`..strategies` and :mod:`..analysis`. The global manager is
made in :mod:`.manager` and installed into ``core.context`` there.
"""
