"""What a test's plain-diffusers reference needs to be called as the engine ran: the dtypes.

The engine's plan decides each component's dtype (the compute dtype: bf16 by default on a CPU
that multiplies it natively; the ones a family keeps in fp32); a reference that loads plain
diffusers in another would differ by its rounding, not by anything the engine did. Tests pass
these to ``from_pretrained(dtype=...)`` (or a modular pipeline's ``load_components``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.preflight.pipeline_index import MODULAR_INDEX


def stock_dtypes(folder: Path, spec: Any, plan: Any) -> Any:
    """The dtypes the plan loads each of ``folder``'s components in, as ``from_pretrained`` takes
    them (one dtype, or ``{"default": ..., component: ...}``)."""
    from engine.runtime.loading import component_dtypes

    index = Path(folder) / (MODULAR_INDEX if (Path(folder) / MODULAR_INDEX).is_file() else "model_index.json")
    return component_dtypes(spec, plan, lambda: json.loads(index.read_text()))


def planned_dtypes(folder: Path, **request: Any) -> Any:
    """:func:`stock_dtypes` of the plan a load of ``folder`` gets on this machine (checked, not
    loaded), for a reference beside a CLI or server call; ``request``: the load's controls."""
    from engine.requests.inference import InferenceRequest
    from engine.service.facade import Engine

    with Engine() as engine:
        plan = engine.images.check_load(str(folder), request=InferenceRequest(**request)).plan
        return stock_dtypes(folder, engine.registry.family(plan.family), plan)
