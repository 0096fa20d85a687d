"""Regions and threads (Note [Regions and threads]).

Note [Regions and threads]: a region swaps its module's parameters and buffers for plain
views while its call runs (Note [Regions] in ``mechanism.py``), and every thread calling
that module would see them: a second thread's call of the same model, op by op or as a
region of its own, would compute on another call's views. So a call runs as a region only
while no other thread is inside a module call, and a module call made while another
thread's region runs waits for it to end (several threads calling one model then take
turns at the regions, and run op by op beside each other). A region's forward must not
wait on another thread that calls modules: inside ``DataParallel`` modules run op by op.
"""

from __future__ import annotations

import threading

_get_ident = threading.get_ident


class Callers:
    """The threads inside module calls, and the one running a region."""

    def __init__(self):
        # (entered as the plain lock: a Condition's own ``with`` runs two Python frames, and
        # every module call enters and leaves; waiting and notifying go through the Condition)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._depth: dict = {}  # thread ident -> module calls in progress
        self._swapping = None  # thread ident running a region
        self._waiting = 0  # threads waiting in ``enter`` (none: a release has no one to wake)

    def enter(self) -> None:
        """A module call starts on this thread (waits while another thread's region runs)."""
        me = _get_ident()
        with self._lock:
            while self._swapping is not None and self._swapping != me:
                self._waiting += 1
                try:
                    self._cond.wait()
                finally:
                    self._waiting -= 1
            self._depth[me] = self._depth.get(me, 0) + 1

    def leave(self) -> None:
        me = _get_ident()
        with self._lock:
            n = self._depth[me] - 1
            if n:
                self._depth[me] = n
            else:
                del self._depth[me]

    def claim(self) -> bool:
        """Whether this thread may run a region now: no other thread is inside a module
        call. It then holds the right until :meth:`release`."""
        me = _get_ident()
        with self._lock:
            if self._swapping is None and len(self._depth) == 1 and me in self._depth:
                self._swapping = me
                return True
            return False

    def release(self) -> None:
        with self._lock:
            self._swapping = None
            if self._waiting:
                self._cond.notify_all()


callers = Callers()
