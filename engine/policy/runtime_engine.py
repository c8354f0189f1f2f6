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
- torch would be slower (:func:`torch_is_faster`), judged from this CPU's own measured
  GEMMs (:mod:`engine.hardware.gemm`): the installed sd.cpp wheel's ggml is an AVX2 build
  whatever the CPU, and on one model in both engines (``bench/cpu_engines.py``, a 12 B
  transformer's slice at full width, 2 threads) its Q8_0 step ran at 0.54 of torch's MKL
  fp32 step on a Zen 5 (41.5 GFLOP/s a thread against 76.7) and 0.33 on a Sapphire Rapids.
  So torch is faster where its GEMM in the plan's dtype and kernel beats
  :data:`SDCPP_PER_MKL_FP32` x this CPU's MKL fp32 GEMM: fp32 everywhere (1.85x), bf16
  where the CPU multiplies it natively (Zen 5, AVX512-BF16: 427 GFLOP/s against 173 for
  MKL fp32, 4.6x sd.cpp), but not emulated bf16 (several times slower than fp32). Where
  nothing is measured yet the CPU's flags decide (native bf16 matmul or not). sd.cpp
  always holds less (the files as stored: 2.3 GB against torch's 6.6-6.8 GB there).

``engine=sdcpp`` asked for where one of these fails is refused before
anything is evicted (``sdcpp_unavailable``), naming what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import PreflightError
from engine.hardware.profile import CpuGemm, HardwareProfile
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


#: sd.cpp's Q8_0 step at best, as a share of torch's MKL fp32 step on the same CPU
#: (``bench/cpu_engines.py``: 0.54 on a Zen 5, 0.33 on a Sapphire Rapids; the higher one,
#: so "torch is faster" is never claimed on the Intel figure alone).
SDCPP_PER_MKL_FP32 = 0.54


def _measured(dtype: str, hardware: HardwareProfile, kernel: str | None) -> tuple[float, str, float, CpuGemm] | None:
    """This CPU's measured GEMM GFLOP/s for torch in ``dtype`` through ``kernel``, its name,
    what sd.cpp's Q8_0 step reaches here, and the figures; None before a measurement."""
    gemm = hardware.cpu_gemm
    if gemm is None or gemm.fp32_mkl <= 0:
        return None
    if dtype == "bf16":
        torch_gflops, how = gemm.bf16, f"bf16 ({hardware.cpu_isa or 'ISA unknown'})"
    elif kernel == "onednn" and gemm.fp32_onednn > 0:
        torch_gflops, how = gemm.fp32_onednn, "fp32 through oneDNN"
    else:
        torch_gflops, how = gemm.fp32_mkl, "fp32 through MKL"
    return torch_gflops, how, SDCPP_PER_MKL_FP32 * gemm.fp32_mkl, gemm


def torch_is_faster(dtype: str, hardware: HardwareProfile, kernel: str | None = None) -> str | None:
    """Why diffusers beats sd.cpp per step for a load torch runs in ``dtype`` (through
    ``kernel``: ``mkl`` or ``onednn`` for fp32) here, or None (see the module docstring)."""
    measured = _measured(dtype, hardware, kernel)
    if measured is not None:
        torch_gflops, how, sdcpp, gemm = measured
        if torch_gflops <= sdcpp:
            return None
        return (f"CPU: torch's {how} GEMMs ran {torch_gflops:.0f} GFLOP/s here on {gemm.threads} threads, "
                f"{torch_gflops / sdcpp:.1f}x the {sdcpp:.0f} sd.cpp's Q8_0 step reaches (at best {SDCPP_PER_MKL_FP32} "
                f"of MKL's fp32, {gemm.fp32_mkl:.0f} here: bench/cpu_engines.py); engine=sdcpp forces it "
                "(about a third of the RAM)")
    if dtype == "fp32":
        return ("CPU: fp32 fits, and torch's fp32 GEMMs ran a step 1.85x faster than sd.cpp's Q8_0 "
                "(bench/cpu_engines.py); sd.cpp takes loads torch would not fit or would run in "
                "emulated bf16 (engine=sdcpp forces it: it holds about a third of the RAM)")
    if hardware.cpu_bf16_matmul:
        return (f"CPU with native bf16 matmul ({hardware.cpu_isa or 'AMX or AVX512-BF16'}): torch's {dtype} ran a "
                "step 4x faster than sd.cpp's Q8_0 (bench/cpu_engines.py); engine=sdcpp forces it "
                "(about a third of the RAM)")
    return None


def torch_is_slower(dtype: str, hardware: HardwareProfile, kernel: str | None = None) -> str:
    """Why sd.cpp beats torch here for a load torch would run in ``dtype`` (where
    :func:`torch_is_faster` says None)."""
    measured = _measured(dtype, hardware, kernel)
    if measured is not None:
        torch_gflops, how, sdcpp, _ = measured
        return (f"torch's {how} GEMMs ran {torch_gflops:.0f} GFLOP/s here, below the {sdcpp:.0f} sd.cpp's "
                f"Q8_0 step reaches ({SDCPP_PER_MKL_FP32} of MKL's fp32: bench/cpu_engines.py)")
    return (f"torch would run {dtype} without native bf16 matmul here, several times slower than "
            "fp32 and slower than sd.cpp per step (bench/cpu_engines.py)")
