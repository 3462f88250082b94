"""kvindex.locks.WriteLock: a re-entrant lock that excludes other threads, contended or not."""

from __future__ import annotations

import threading
import time

from kvindex.locks import YIELDS, WriteLock
from kvindex.native import NativeKVBlockIndex
from kvindex.reference import KVBlockIndex


def test_reentrant_and_released_by_its_owner_only() -> None:
    lock = WriteLock()
    with lock:
        with lock:
            assert lock._is_owned()
        assert lock._is_owned()
    assert not lock._is_owned()
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(lock.acquire(False)))
    with lock:
        t.start()
        t.join()
    assert got == [False]


def test_threads_that_give_the_gil_up_inside_never_overlap() -> None:
    lock = WriteLock()
    inside = 0
    overlaps = 0
    done = 0

    def work() -> None:
        nonlocal inside, overlaps, done
        for _ in range(300):
            with lock:
                inside += 1
                if inside > 1:
                    overlaps += 1
                time.sleep(0)  # lose the GIL while holding the lock: the others must wait
                inside -= 1
                done += 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (overlaps, done) == (0, 1200)


def test_a_long_holder_makes_a_contender_block_then_take_the_lock() -> None:
    lock = WriteLock()
    held = threading.Event()
    release = threading.Event()
    order: list[str] = []

    def holder() -> None:
        with lock:
            held.set()
            release.wait()  # longer than YIELDS tries: the contender blocks on the lock
            order.append("holder")

    def contender() -> None:
        with lock:
            order.append("contender")

    h = threading.Thread(target=holder)
    h.start()
    held.wait()
    c = threading.Thread(target=contender)
    c.start()
    for _ in range(YIELDS * 4):
        time.sleep(0)
    assert order == []
    release.set()
    h.join()
    c.join(timeout=30)
    assert order == ["holder", "contender"]


def test_the_indexes_write_under_it() -> None:
    assert isinstance(KVBlockIndex()._lock, WriteLock)
    assert isinstance(NativeKVBlockIndex()._lock, WriteLock)
