"""A cancel that reaches inside a denoising step: checked before every block.

A diffusers pipeline reports once per step, and a step of a 14B video denoiser at
720p (or the tiled decode of a long clip) runs for minutes, so a cancel checked at
the step's end leaves the engine busy long after ``DELETE`` answered. While a call
runs, every repeated block of the pipeline's models (each child of an
``nn.ModuleList``: the transformer's blocks, the VAE decoder's up blocks and their
resnets, an encoder's layers) gets a forward pre-hook that raises
:class:`~engine.errors.Cancelled` once the event is set; the hooks go when the call
ends. A block that is compiled keeps no hook (adding one would make torch recompile
it, and the check cannot be traced): there the cancel waits for the step's end.

The check is one ``Event.is_set()`` per block (nanoseconds beside the block's work).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from engine.errors import Cancelled


def blocks_of(pipe: Any) -> list[tuple[str, torch.nn.Module]]:
    """Every repeated block of the pipeline's models, named ``component.path``; compiled ones left out."""
    found: list[tuple[str, torch.nn.Module]] = []
    seen: set[int] = set()
    for component, module in getattr(pipe, "components", {}).items():
        if not isinstance(module, torch.nn.Module):
            continue
        for path, child in module.named_modules():
            if not isinstance(child, torch.nn.ModuleList):
                continue
            for index, block in enumerate(child):
                if id(block) in seen or getattr(block, "_compiled_call_impl", None) is not None:
                    continue
                seen.add(id(block))
                found.append((f"{component}.{path}.{index}", block))
    return found


@contextlib.contextmanager
def cancel_points(pipe: Any, cancel: threading.Event | None) -> Iterator[None]:
    """Within: a set ``cancel`` stops the pipeline call before its next block runs
    (:class:`Cancelled`, naming the block); nothing is hooked when ``cancel`` is None."""
    if cancel is None:
        yield
        return

    def hook_for(name: str) -> Any:
        def check(_module: torch.nn.Module, _args: Any) -> None:
            if cancel.is_set():
                raise Cancelled(f"the generate was cancelled inside a step (before {name})")
        return check

    handles = [block.register_forward_pre_hook(hook_for(name)) for name, block in blocks_of(pipe)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
