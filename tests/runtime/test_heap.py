"""engine.runtime.heap: what is alive before the first build is frozen once per process, and a
forked child (the fork server's trainers and ranks) inherits it frozen and settles its own."""

from __future__ import annotations

import gc
import os

from engine.runtime import heap


def test_settle_freezes_once_per_process_and_once_more_in_a_forked_child() -> None:
    heap.settle()  # this worker may have settled already (its first load): either way it has now
    frozen = gc.get_freeze_count()
    assert frozen > 0
    assert heap.settle() is False and gc.get_freeze_count() == frozen  # once per process
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a few lines, then out without running the parent's exit hooks
        try:
            inherited = gc.get_freeze_count()
            first, again = heap.settle(), heap.settle()
            os.write(write, f"{inherited} {int(first)} {int(again)}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as reply:
        inherited, first, again = reply.read().split()
    os.waitpid(pid, 0)
    # The parent's frozen objects stay frozen in the child (less the few fork hooks free:
    # threading drops the records of the parent's other threads).
    assert frozen - 100 < int(inherited) <= frozen
    assert (first, again) == ("1", "0")  # the child's own first settle runs, once
