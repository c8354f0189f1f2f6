"""``doctor``: what this machine will do with each family, why, and what would do better.

The report is a dict (``--json``) and a text rendering of it: the versions of
the libraries decisions depend on, the machine as probed, then per family one
line for inference (the plan's dtype, scheme, memory mode, attention, compile,
or the refusal) and one for training (the recommended base precision, or why
it cannot train here), each with the change that would do better. Every
verdict is the planner's own answer (the same functions ``plan`` and ``info``
call), so doctor never disagrees with a load or a start.
"""

from __future__ import annotations

import importlib.metadata
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from engine.errors import EngineError
from engine.hardware.profile import HardwareProfile
from engine.policy.info import training_info
from engine.policy.plan import Plan
from engine.policy.video_fit import ClipFit, clip_fit

if TYPE_CHECKING:
    from engine.service.facade import Engine

#: Distributions whose versions decide what runs (torch's CUDA build is read apart).
PACKAGES: tuple[str, ...] = ("torch", "diffusers", "transformers", "peft", "torchao", "bitsandbytes", "kernels")


@dataclass(frozen=True)
class Verdict:
    """One family's answer on this machine for one purpose."""

    family: str
    purpose: str  # inference | training
    ok: bool
    does: str
    reason: str
    better: tuple[str, ...] = ()


def versions() -> dict[str, str | None]:
    """Installed versions (None: not installed), read from package metadata
    without importing; ``cuda`` from torch's build when torch is already loaded."""
    found: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None) if torch is not None else None
    found["cuda"] = cuda or _cuda_from_wheel(found["torch"])
    return found


def _cuda_from_wheel(version: str | None) -> str | None:
    """``2.8.0+cu128`` -> ``12.8``; None for CPU builds or an unknown suffix."""
    if not version or "+cu" not in version:
        return None
    digits = version.split("+cu", 1)[1]
    return f"{digits[:-1]}.{digits[-1]}" if len(digits) >= 2 and digits.isdigit() else None


def inference_verdict(engine: Engine, family: str, hardware: HardwareProfile) -> Verdict:
    """The default plan for ``family`` here, summarised, with what would do better (for a
    video family: its default clip, and the longest clip that plans better)."""
    clip = _clip_here(engine, family, hardware)
    shorter = (clip.hint(),) if clip is not None and clip.hint() else ()
    try:
        plan: Plan = engine.images.plan(family=family)
    except EngineError as exc:
        refused = f"{clip.frames} frames of {clip.width}x{clip.height}: refused" if clip is not None else "refused"
        return Verdict(family, "inference", False, refused, exc.message, (*shorter, *_better_when_refused(hardware)))
    quant = plan.value("transformer_quant") or "dense"
    does = (
        f"{plan.value('dtype')} {quant}, {plan.value('memory_mode')}, attention {plan.value('attention_backend')}, "
        f"compile {plan.value('compile')}"
    )
    if clip is not None:
        does = f"{clip.frames} frames of {clip.width}x{clip.height} at {clip.fps} fps: {does}"
    reason = plan["memory_mode"].reason
    return Verdict(family, "inference", True, does, reason, (*shorter, *_better_inference(plan, hardware)))


def _clip_here(engine: Engine, family: str, hardware: HardwareProfile) -> ClipFit | None:
    """A video family's default clip on this machine (None: an image family)."""
    spec = engine.registry.family(family)
    if spec.rendering.output != "frames":
        return None
    return clip_fit(engine.registry, spec, spec.default_checkpoint, hardware)


def _better_when_refused(hardware: HardwareProfile) -> tuple[str, ...]:
    if not hardware.cuda:
        return ("a CUDA GPU",)
    if not hardware.native_bf16:
        return ("a GPU with native bf16 (Ampere or newer, compute capability 8.0+)",)
    return ("a GPU with more memory",)


def _better_inference(plan: Plan, hardware: HardwareProfile) -> tuple[str, ...]:
    better: list[str] = []
    if not hardware.cuda:
        better.append("a CUDA GPU (this machine computes on the CPU)")
    if plan.value("memory_mode") != "resident" and not hardware.unified_memory:
        if plan.value("transformer_quant") is None and hardware.torchao_functional and hardware.native_bf16:
            better.append("--quant int8 (or fp8) to hold more of the model on the GPU")
        better.append("more free GPU memory (unload other models) to run resident")
    if hardware.cuda and not hardware.torchao_functional:
        better.append("pip install torchao (int8 / fp8 transformers)")
    if hardware.cuda and not hardware.bitsandbytes_usable:
        better.append("pip install 'diffusion-engine[nf4]' (bitsandbytes 4-bit)")
    if hardware.vendor == "nvidia" and hardware.capability == (9, 0) and "kernels" not in hardware.attention_packages:
        better.append("pip install kernels (FlashAttention-3 on Hopper)")
    return tuple(better)


def training_verdict(engine: Engine, family: str, hardware: HardwareProfile) -> Verdict:
    """What a training start would do for ``family`` here (``info``'s answer)."""
    registry = engine.registry
    info = training_info(registry, registry.family(family), hardware)
    if not info.trainable:
        return Verdict(family, "training", False, "cannot train here", info.vram_note, _better_when_refused(hardware))
    does = f"trains in {info.recommended_precision}" if info.recommended_precision else "trains"
    if info.supports_compile:
        does += " (regional compile available)"
    better: list[str] = []
    if info.recommended_precision == "nf4":
        better.append("more free GPU memory: bf16 with compile is about 2.3x faster than nf4")
    if not hardware.cuda:
        better.append("a CUDA GPU (training on the CPU is for tiny models)")
    return Verdict(family, "training", True, does, info.vram_note, tuple(better))


def doctor_report(engine: Engine, *, hardware: HardwareProfile | None = None) -> dict[str, object]:
    """The whole report as plain data (the ``--json`` form)."""
    hardware = hardware or engine.hardware(verify=True)
    names = sorted(engine.registry.families)
    return {
        "versions": versions(),
        "hardware": hardware.to_dict(),
        "families": {
            name: {
                "inference": asdict(inference_verdict(engine, name, hardware)),
                "training": asdict(training_verdict(engine, name, hardware)),
            }
            for name in names
        },
    }


def format_doctor(report: dict[str, object]) -> str:
    """The text form: versions, the machine, then one line per family and purpose."""
    lines = ["versions: " + ", ".join(f"{k} {v or '-'}" for k, v in report["versions"].items())]  # type: ignore[attr-defined]
    hw: dict[str, object] = report["hardware"]  # type: ignore[assignment]
    capability = hw.get("capability")
    arch = f", sm{capability[0]}{capability[1]}" if isinstance(capability, (list, tuple)) else ""
    lines.append(
        f"machine: {hw['device_name']} ({hw['vendor']}{arch}, native bf16 {'yes' if hw['native_bf16'] else 'no'})"
    )
    for name, verdicts in report["families"].items():  # type: ignore[attr-defined]
        for purpose in ("inference", "training"):
            v = verdicts[purpose]
            mark = "ok " if v["ok"] else "no "
            line = f"{mark}{name:<12} {purpose:<9} {v['does']}: {v['reason']}"
            if v["better"]:
                line += f" | better: {'; '.join(v['better'])}"
            lines.append(line)
    return "\n".join(lines)


def run_doctor(engine: Engine, *, as_json: bool = False) -> str:
    """What the CLI prints: the libraries' import chatter quieted first."""
    import json

    from engine.logs import quiet_library_logs

    quiet_library_logs(warnings_too=True)
    report = doctor_report(engine)
    return json.dumps(report, indent=2) if as_json else format_doctor(report)
