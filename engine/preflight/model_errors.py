"""The refusals of a model reference that names nothing loadable, below everything that reads one.

The header readers raise them as the resolution does, so they live apart from
:mod:`engine.preflight.source` (which the readers must not import).
"""

from __future__ import annotations

from engine.errors import EngineError


class ModelNotFound(EngineError, FileNotFoundError):
    """A local path that does not exist, or a file a local pipeline lacks."""

    code = "model_not_found"


class NotAPipeline(EngineError):
    """A local folder that is neither a diffusers pipeline nor a single file."""

    code = "not_a_pipeline"
