"""An exact cache of what a denoiser computes from the prompt alone: computed once per prompt
per call, reused at every step.

A cross-attention block projects the prompt's embeddings to its keys and values at every step,
though they depend on the prompt only (a text embedder, then each block's cross-attention
``to_k`` / ``to_v`` and its key norm). The family's table names those modules
(``SpeedRules.text_kv_sites``); each is wrapped so that a call with the very tensor it saw
(the same object, unmodified since: ``_version``) returns the output it gave, and any other
call runs as before. The pipeline hands the same prompt tensor to every step (and the text
embedder's cached output is then the same tensor for every block), so from the second step on
these projections are not recomputed; the outputs are the ones the module computed, so the
image is bit-identical. The memo is cleared before each call (a LoRA or its scale may change
between calls), holds a few prompts (a CFG call's two), and steps aside where autograd runs
(training) or regional compile is planned (a Python-side check would break its graphs).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

#: Prompts kept per module within one call (a CFG call's positive and negative, with room).
_KEPT = 4
_WRAPPED = "_diffusion_engine_text_kv"


@dataclass
class TextKVCache:
    """The memos installed on one pipeline's denoisers, and how often they answered."""

    memos: list[_Memo] = field(default_factory=list)

    def reset(self) -> None:
        for memo in self.memos:
            memo.entries.clear()

    def to_dict(self) -> dict[str, int]:
        return {"sites": len(self.memos), "hits": sum(m.hits for m in self.memos),
                "misses": sum(m.misses for m in self.memos)}


class _Memo:
    """``module.forward`` answering a repeated input (the same tensor, unmodified) from memory."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.forward = module.forward
        self.entries: list[tuple[torch.Tensor, int, torch.Tensor, int]] = []
        self.hits = self.misses = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor) or torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        given = args[0]
        for seen, version, output, out_version in self.entries:
            if seen is given and version == _version(given) and _version(output) == out_version:
                self.hits += 1
                return output
        output = self.forward(given)
        if isinstance(output, torch.Tensor):
            self.entries = [(given, _version(given), output, _version(output)), *self.entries][:_KEPT]
        self.misses += 1
        return output


def _version(tensor: torch.Tensor) -> int:
    """The tensor's in-place version (an inference-mode tensor has none: -1; the wrapped modules'
    callers never write into their prompt tensors or these outputs in place)."""
    return -1 if tensor.is_inference() else tensor._version


def install(denoisers: Iterable[torch.nn.Module], sites: tuple[str, ...]) -> TextKVCache | None:
    """Wrap every module of ``denoisers`` whose name ends with one of ``sites``; None where none does."""
    if not sites:
        return None
    cache = TextKVCache()
    for denoiser in denoisers:
        for name, module in denoiser.named_modules():
            if name.endswith(sites) and not getattr(module, _WRAPPED, False):
                memo = _Memo(module)
                module.forward = memo  # type: ignore[method-assign]
                setattr(module, _WRAPPED, True)
                cache.memos.append(memo)
    return cache if cache.memos else None
