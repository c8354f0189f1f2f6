"""The process's long-lived objects, kept out of the garbage collector's walks.

Every unload runs a full collection so a dropped model's reference cycles (hooks that
point back at their modules, a traceback's frames) are freed before the next model
loads. A full collection walks every object the collector tracks; once torch,
diffusers and transformers are imported that is half a million objects, nearly all of
them the libraries' modules, classes and functions, which live as long as the process:
0.25 s a collection on a 2-core CPU, paid at every unload and model switch.

:func:`settle` collects once and freezes what is left (``gc.freeze``: moved to a
permanent generation the collector never walks again). It runs once per process, when
the first model is about to be built, so nothing a model owns exists yet and no
model's memory can be held by the freeze; and in the trainers' fork server before its
first fork, as Python advises, so no child's collection walks or copies (copy-on-write)
what it inherited. Freezing stops only the walk: a frozen object whose last reference
goes is freed as before; only a cycle among objects that existed at that moment would
outlive its last reference.
"""

from __future__ import annotations

import gc
import os

#: The process that settled (a forked child starts unsettled: its own first load settles it).
_settled_in: int | None = None


def settle() -> bool:
    """Collect, then freeze what is left, once per process. True when this call did it."""
    global _settled_in
    if _settled_in == os.getpid():
        return False
    gc.collect()
    gc.freeze()
    _settled_in = os.getpid()
    return True
