"""Loading the components a pipeline folder lacks from the repos its family names for them
(see :mod:`engine.preflight.borrowed`: their access was checked before anything was evicted)."""

from __future__ import annotations

from typing import Any

import torch

from engine.preflight.source import ModelSource


def borrowed_components(source: ModelSource, index: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """Each lacking component, loaded from its repo as the class the pipeline's index names for
    it (an ``AutoTokenizer`` / ``AutoModel`` where the index names none), encoders in ``dtype``."""
    import transformers

    loaded: dict[str, Any] = {}
    for borrowed in source.borrowed:
        entry = index.get(borrowed.component)
        named = entry[1] if isinstance(entry, list) and len(entry) >= 2 and isinstance(entry[1], str) else None
        tokenizer = borrowed.component.startswith("tokenizer")
        cls = getattr(transformers, named or "", None) or (transformers.AutoTokenizer if tokenizer else transformers.AutoModel)
        extra = {} if tokenizer else {"dtype": dtype}
        loaded[borrowed.component] = cls.from_pretrained(borrowed.repo, **extra)
    return loaded
