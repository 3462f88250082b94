"""The indexes' write lock: re-entrant, and taken without sleeping on it while its holder can go on.

Pool shards are threads that take an index's lock once per message and hold
the GIL for most of the message. A shard that loses the GIL while it holds
the lock (the interpreter's switch interval) used to make another shard
sleep on the lock; from then on every release woke a sleeper that needed the
GIL back, and the shards handed the lock to each other once per message (a
lock convoy: two shards ran at 0.36-0.49x one shard's rate, with one
voluntary context switch per message). :class:`WriteLock` tries the lock
without blocking and gives the GIL up between tries, so the holder finishes
with the GIL it gets back and nothing is handed over; after
:data:`YIELDS` tries (a holder in a long GIL-free call) it blocks as a
plain lock does. See docs/design.md, "Locks" (the write path).
"""

from __future__ import annotations

import _thread
import time

__all__ = ["WriteLock", "YIELDS"]

YIELDS = 64  # tries, each after giving the GIL up, before a contended acquire blocks


class WriteLock(_thread.RLock):
    """A :class:`threading.RLock` whose ``with`` yields the GIL while the lock is contended."""

    def __enter__(self) -> bool:
        if self.acquire(False):
            return True
        for _ in range(YIELDS):
            time.sleep(0)  # gives the GIL up: the holder runs on to its release
            if self.acquire(False):
                return True
        return self.acquire()
