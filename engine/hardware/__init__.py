"""Hardware profiles: plain data about a machine, from a probe or a preset."""

from engine.hardware.presets import PRESETS, preset
from engine.hardware.profile import HardwareProfile, native_bf16

__all__ = ["PRESETS", "HardwareProfile", "native_bf16", "preset"]
