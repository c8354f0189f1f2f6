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


_SPECIAL_TOKENS: list[str] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
]

_TOKENIZER_CORPUS: list[str] = [
    "system\nuser\nassistant\n\n",
    "a photo of a cat and a dog, red blue green yellow, an astronaut riding a horse on the moon",
]

# Qwen3-style: with enable_thinking unset/true the generation prompt is "<|im_start|>assistant\n".
_CHAT_TEMPLATE: str = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def qwen_chat_tokenizer(special_tokens: list[str] | None = None, corpus: list[str] | None = None,
                        chat_template: str | None = None) -> Any:
    """A ``Qwen2Tokenizer``: a tiny byte-level BPE trained with Qwen2's pre-tokenizer (any text
    tokenises through the byte alphabet), with Qwen3's chat template (``enable_thinking``
    honoured) by default. A family passes its own special tokens (the first is the pad),
    training corpus and template where its encoder wants others (a Qwen2.5-VL's vision tokens)."""
    import json

    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    special_tokens = special_tokens or _SPECIAL_TOKENS
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=4096,  # upper bound: training stops once every corpus word is one token
        min_frequency=1,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus or _TOKENIZER_CORPUS, trainer=trainer)
    model_json: dict[str, Any] = json.loads(bpe.to_str())["model"]
    vocab: dict[str, int] = model_json["vocab"]
    merges: list[tuple[str, str]] = [(a, b) for a, b in model_json["merges"]]

    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": special_tokens[1:]})
    tokenizer.chat_template = chat_template or _CHAT_TEMPLATE
    return tokenizer


def gemma_char_tokenizer(model_max_length: int = 256) -> Any:
    """A ``GemmaTokenizerFast`` over printable ASCII, one token per character (built with
    ``tokenizers``, no files): what a Gemma-2-encoded family's tiny pipeline takes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GemmaTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    for char in string.printable:
        vocab.setdefault(char, len(vocab))
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return GemmaTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                              unk_token="<unk>", model_max_length=model_max_length)
