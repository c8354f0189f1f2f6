"""Which engine runs a load: diffusers (torch) or stable-diffusion.cpp (GGML, the CPU engine).

Torch-free. On a CPU machine torch runs a 12 B transformer in fp32, which is
impractically slow; GGML's quantised CPU kernels are what CPU users run. So
``engine=auto`` sends a load to sd.cpp when all of these hold, and to
diffusers otherwise, with the reason naming the one that failed:

- the machine's device is the CPU (sd.cpp on Apple's Metal is opt-in:
  ``engine=sdcpp``; a CUDA GPU runs diffusers);
- the family's table declares sd.cpp support for this kind of file, and the
  files it reads are beside the model (:class:`SdcppFiles`, found by
  :mod:`engine.preflight.sdcpp`);
- the ``stable-diffusion-cpp-python`` binding is installed;
- the load needs nothing sd.cpp does not run here (LoRAs, a ControlNet);
- torch would be slower (:func:`torch_is_faster`): measured on one model in
  both engines (``bench/cpu_engines.py``, a 12 B transformer's slice at full width, 2
  threads), torch's fp32 GEMMs ran a step 3.5x faster than sd.cpp's Q8_0, and
  its bf16 9x faster on a CPU with AMX, but emulated bf16 (AVX2 only) 2.3x
  slower. So sd.cpp takes a load when torch would not fit it at all, or would
  run it in bf16 on a CPU without native bf16 matmul; it always holds less
  (the files as stored: 1.6 GB against torch's 6.5-6.8 GB there).

``engine=sdcpp`` asked for where one of these fails is refused before
anything is evicted (``sdcpp_unavailable``), naming what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import PreflightError
from engine.hardware.profile import HardwareProfile
from engine.policy.resolved import Resolved, auto, explicit
from engine.requests.choices import ENGINES

#: What installs the binding (the package's extra).
SDCPP_INSTALL = "pip install 'diffusion-engine[cpu]' (stable-diffusion-cpp-python)"


@dataclass(frozen=True)
class SdcppFiles:
    """The files stable-diffusion.cpp would read for a model, or why it cannot read it."""

    #: ``(binding argument, path)`` pairs: the model file and its companions.
    files: tuple[tuple[str, str], ...] = ()
    #: Their size on disk, GB: what sd.cpp holds in RAM (it keeps a GGUF's types).
    gb: float = 0.0
    #: Optional companions that are missing, with what sd.cpp does without them.
    degraded: tuple[str, ...] = ()
    #: Why sd.cpp cannot run this model ("" when it can).
    refusal: str = ""

    @property
    def usable(self) -> bool:
        return not self.refusal and bool(self.files)

    def to_dict(self) -> dict[str, object]:
        return {"files": dict(self.files), "gb": round(self.gb, 3), "degraded": list(self.degraded),
                "refusal": self.refusal or None}


def resolve_engine(
    requested: str, hardware: HardwareProfile, files: SdcppFiles, *, needs: tuple[str, ...] = (),
) -> Resolved[str]:
    """The engine of one load, with its reason (see the module docstring); ``needs``
    names what the load asks that only diffusers runs here ("LoRAs", "a ControlNet")."""
    if requested not in ENGINES:
        raise ValueError(f"unknown engine {requested!r}; choose one of {', '.join(ENGINES)}")
    if requested == "diffusers":
        return explicit("diffusers")
    blocker = _sdcpp_blocker(hardware, files, needs=needs)
    if requested == "sdcpp":
        if blocker:
            raise PreflightError(f"engine=sdcpp cannot run this load: {blocker}; "
                                 "use engine=diffusers (or auto)", code="sdcpp_unavailable")
        return explicit("sdcpp", _sdcpp_reason(files))
    if hardware.vendor != "cpu":
        where = "Apple's Metal (sd.cpp there is opt-in: engine=sdcpp)" if hardware.vendor == "mps" else hardware.device_name
        return auto("diffusers", f"{where}: diffusers runs on the accelerator; sd.cpp is the CPU engine")
    if blocker:
        return auto("diffusers", f"CPU, but {blocker}")
    return auto("sdcpp", f"CPU: {_sdcpp_reason(files)}")


def _sdcpp_blocker(hardware: HardwareProfile, files: SdcppFiles, *, needs: tuple[str, ...]) -> str:
    if files.refusal:
        return files.refusal
    if not files.files:
        return "no files for sd.cpp were found"
    if not hardware.sdcpp_installed:
        return f"the stable-diffusion.cpp binding is not installed ({SDCPP_INSTALL})"
    if needs:
        return f"{' and '.join(needs)} run on diffusers only (the sd.cpp path here loads neither)"
    budget = (hardware.free_memory_gb if hardware.free_memory_gb is not None else hardware.total_memory_gb)
    budget += hardware.swap_free_gb or 0.0
    if budget and files.gb > budget:
        return f"its files need {files.gb:.1f} GB of RAM and {budget:.1f} GB is free"
    return ""


def _sdcpp_reason(files: SdcppFiles) -> str:
    model = dict(files.files)
    name = next(iter(model.values())).rsplit("/", 1)[-1]
    reason = (f"stable-diffusion.cpp runs {name} with GGML's CPU kernels "
              f"({len(files.files)} files, {files.gb:.2f} GB held as stored)")
    if files.degraded:
        reason += "; " + "; ".join(files.degraded)
    return reason


def torch_is_faster(dtype: str, hardware: HardwareProfile) -> str | None:
    """Why diffusers beats sd.cpp per step for a load torch runs in ``dtype`` here, or None
    (the figures: the module docstring)."""
    if dtype == "fp32":
        return ("CPU: fp32 fits, and torch's fp32 GEMMs ran a step 3.5x faster than sd.cpp's Q8_0 "
                "(bench/cpu_engines.py); sd.cpp takes loads torch would not fit or would run in "
                "emulated bf16 (engine=sdcpp forces it: it holds about a quarter of the RAM)")
    if hardware.cpu_bf16_matmul:
        return (f"CPU with native bf16 matmul ({hardware.cpu_isa or 'AMX or AVX512-BF16'}): torch's {dtype} ran a step 9x faster "
                "than sd.cpp's Q8_0 (bench/cpu_engines.py); engine=sdcpp forces it (about a quarter of the RAM)")
    return None
