"""Process-wide torch flags: snapshot before a load, restore after unload.

The engine shares its process with the host app. Any global knob it turns
(threads, matmul precision, fp16 accumulation, SDPA backends) is recorded
first and put back when the model is unloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

_MATMUL = torch.backends.cuda.matmul
_SDP: dict[str, tuple[Callable[[], bool], Callable[[bool], None]]] = {
    "sdp_flash": (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp),
    "sdp_mem_efficient": (
        torch.backends.cuda.mem_efficient_sdp_enabled,
        torch.backends.cuda.enable_mem_efficient_sdp,
    ),
    "sdp_math": (torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.enable_math_sdp),
    "sdp_cudnn": (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.enable_cudnn_sdp),
}
_MATMUL_ATTRS = (
    "allow_tf32",
    "allow_fp16_reduced_precision_reduction",
    "allow_bf16_reduced_precision_reduction",
    "allow_fp16_accumulation",
)


@dataclass(frozen=True)
class FlagSnapshot:
    values: dict[str, object]

    def restore(self) -> None:
        values = self.values
        torch.set_num_threads(int(values["threads"]))  # type: ignore[arg-type]
        torch.set_float32_matmul_precision(str(values["float32_matmul_precision"]))
        torch.backends.cudnn.allow_tf32 = bool(values["cudnn_allow_tf32"])
        torch.backends.cudnn.benchmark = bool(values["cudnn_benchmark"])
        for attr in _MATMUL_ATTRS:
            if f"matmul_{attr}" in values:
                setattr(_MATMUL, attr, values[f"matmul_{attr}"])
        for name, (_, setter) in _SDP.items():
            setter(bool(values[name]))


def snapshot() -> FlagSnapshot:
    values: dict[str, object] = {
        "threads": torch.get_num_threads(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }
    for attr in _MATMUL_ATTRS:
        if hasattr(_MATMUL, attr):
            values[f"matmul_{attr}"] = getattr(_MATMUL, attr)
    for name, (getter, _) in _SDP.items():
        values[name] = getter()
    return FlagSnapshot(values)


def fp16_accumulation_available() -> bool:
    return hasattr(_MATMUL, "allow_fp16_accumulation")
