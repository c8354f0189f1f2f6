"""A two-expert base's denoisers trained as one module (``--expert both``).

The pipeline hands a step to ``transformer`` (high noise) at or above its
boundary timestep and to ``transformer_2`` below it. :class:`ExpertPair` does
the same per example: each row of a batch goes to the expert of its own
timestep, so each expert's LoRA learns only the steps it will be asked at
inference. The pair is an ``nn.Module`` holding both, so the trainer's
parameters, checkpoints (names ``high.*`` / ``low.*``) and exact resume work
unchanged; the export writes one LoRA file per expert (:data:`EXPERT_FOLDERS`).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.requests.references import SECOND_EXPERT_FOLDER

#: Where each expert's LoRA is written in the run folder: the high-noise one in the run's own
#: place (``pytorch_lora_weights.safetensors``), the low-noise one in a folder beside it.
EXPERT_FOLDERS: dict[str, str] = {"high": "", "low": SECOND_EXPERT_FOLDER}


class ExpertPair(torch.nn.Module):
    """``high`` and ``low`` denoisers; a row at or above ``boundary_timestep`` goes to ``high``."""

    def __init__(self, high: torch.nn.Module, low: torch.nn.Module, boundary_timestep: float) -> None:
        super().__init__()
        self.high = high
        self.low = low
        self.boundary_timestep = float(boundary_timestep)

    def experts(self) -> dict[str, torch.nn.Module]:
        return {"high": self.high, "low": self.low}

    def enable_gradient_checkpointing(self) -> None:
        for expert in (self.high, self.low):
            expert.enable_gradient_checkpointing()  # type: ignore[operator]

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, return_dict: bool = False,
                **kwargs: Any) -> tuple[torch.Tensor]:
        rows = hidden_states.shape[0]
        to_high = timestep.reshape(rows, -1)[:, 0] >= self.boundary_timestep
        out: torch.Tensor | None = None
        for expert, chosen in ((self.high, to_high), (self.low, ~to_high)):
            index = chosen.nonzero().flatten()
            if index.numel() == 0:
                continue
            part = expert(hidden_states=hidden_states[index], timestep=timestep[index], return_dict=False,
                          **{k: _rows(v, index, rows) for k, v in kwargs.items()})[0]
            if out is None:
                out = part.new_empty((rows, *part.shape[1:]))
            out = out.index_copy(0, index, part)
        assert out is not None
        return (out,)


def _rows(value: Any, index: torch.Tensor, rows: int) -> Any:
    """A batch-first tensor argument's chosen rows; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
        return value[index]
    return value


__all__ = ["EXPERT_FOLDERS", "ExpertPair"]
