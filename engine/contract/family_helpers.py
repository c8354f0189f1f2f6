"""Helpers a family's runtime module may use: supported, documented, kept stable.

A family's runtime module (:class:`engine.contract.family_runtime.FamilyRuntime`)
may call these instead of reading diffusers' call conventions itself. They
import nothing heavy. Import them from here; the engine's own modules do too.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["call_value", "prompt_list", "true_cfg_prompt_inputs"]


def call_value(pipe: object, kwargs: Mapping[str, object], name: str) -> object:
    """A call argument as the pipeline will see it: given, else its ``__call__``'s default."""
    import inspect

    if name in kwargs:
        return kwargs[name]
    parameter = inspect.signature(pipe.__call__).parameters.get(name)  # type: ignore[operator]
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def prompt_list(value: object) -> list[str] | None:
    """A prompt argument as a list of texts; None for anything else (embeddings, images...)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def true_cfg_prompt_inputs(
    pipe: object, kwargs: Mapping[str, object], prompts: list[str], default_max_sequence_length: int
) -> dict[str, object]:
    """A true-CFG pipeline's prompt-encoding inputs: the prompts, the negatives
    only when true CFG runs (``true_cfg_scale`` > 1 with a negative prompt; else
    they are never encoded), and the text length (the true-CFG families call this)."""
    negatives = prompt_list(kwargs.get("negative_prompt"))
    true_cfg = float(call_value(pipe, kwargs, "true_cfg_scale") or 1.0) > 1 and negatives is not None  # type: ignore[arg-type]
    length = call_value(pipe, kwargs, "max_sequence_length") or default_max_sequence_length
    return {
        "prompt": prompts,
        "negative_prompt": negatives if true_cfg else None,
        "max_sequence_length": int(length),  # type: ignore[call-overload]
    }
