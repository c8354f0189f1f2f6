"""Tokenizers for the families' tiny pipelines, built here with no files and no hub.

A family's tiny pipeline needs a tokenizer its pipeline class accepts; the ones that
several families share live here so each is written once.
"""

from __future__ import annotations

import string
from typing import Any


def t5_unigram_tokenizer(model_max_length: int = 512) -> Any:
    """A ``T5Tokenizer`` (sentencepiece Unigram) over printable ASCII characters and their
    word-initial ``▁`` forms: any English prompt tokenises, one piece per character."""
    from transformers import T5Tokenizer

    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    chars = string.ascii_letters + string.digits + string.punctuation
    pieces += [("▁" + char, -3.0) for char in chars]
    pieces += [(char, -4.0) for char in chars]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)
