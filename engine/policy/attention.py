"""Attention: which kernel a plan uses, and how a missing one is installed. Pure.

``auto`` takes a hub kernel (FlashAttention-4 on Blackwell datacenter parts,
-3 on Hopper) where the ``kernels`` package is installed, else cuDNN's fused
SDPA on sm80+ NVIDIA cards, else native SDPA; the ``off`` speed tier keeps
native SDPA. An explicit kernel the card cannot run (or the family denies)
falls back to native SDPA with the reason; a missing (or too old) package is
installed best-effort at load, wheel-only, with the version floor the
installed diffusers' dispatcher enforces (read from its source, see
:mod:`engine.hardware.kernel_floors`) and ``--no-deps`` where its own
requirements would replace the installed torch. A pinned release below that
floor is refused before anything is installed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from engine.hardware.profile import HardwareProfile
from engine.policy.resolved import Resolved, auto, explicit
from engine.requests.choices import ATTENTION_BACKENDS
from engine.contract.types import ATTENTION_KERNELS

ATTENTION_INSTALL_ENV = "DIFFUSION_ENGINE_ATTENTION_INSTALL"
#: cuDNN's fused SDPA kernel: Ampere (sm80) and newer, half-precision inputs.
CUDNN_ATTENTION_MIN_CAPABILITY = (8, 0)
CUDNN_ATTENTION_DTYPES: tuple[str | None, ...] = ("bf16", "fp16", None)


@dataclass(frozen=True)
class AttentionBackend:
    """An optional kernel: the package it needs and the cards it runs on."""

    package: str
    #: The distribution pip installs (its version floor comes from the installed diffusers).
    pip_name: str
    min_capability: tuple[int, int]
    max_capability: tuple[int, int] | None = None
    #: Install without dependencies: the package's own requirements would
    #: replace the installed torch / triton with whatever pip resolves.
    no_deps: bool = False


#: Backends beyond torch's SDPA (``native``, ``cudnn``), by our name.
OPTIONAL_BACKENDS: Mapping[str, AttentionBackend] = {
    "flash": AttentionBackend("flash_attn", "flash-attn", (8, 0)),
    # FlashAttention-3 through the hub kernel diffusers loads with the
    # ``kernels`` package (its ``_flash_3_hub`` backend): FA3 itself has no
    # wheels, and a source build needs a CUDA toolchain.
    "flash3": AttentionBackend("kernels", "kernels", (9, 0), (9, 0)),
    # FlashAttention-4 likewise (diffusers' ``flash_4_hub``), written for Blackwell
    # datacenter parts (sm100 / sm103).
    "flash4": AttentionBackend("kernels", "kernels", (10, 0), (10, 3)),
    "sage": AttentionBackend("sageattention", "sageattention", (8, 0), no_deps=True),
    # The requirement is pinned per torch release (XFORMERS_FOR_TORCH).
    "xformers": AttentionBackend("xformers", "xformers", (7, 0), no_deps=True),
}

#: PyTorch's wheel index; ``/cu128`` and the like hold the wheels built for one CUDA.
PYTORCH_WHEEL_INDEX = "https://download.pytorch.org/whl"
#: The xformers release whose wheels are built against each torch release:
#: any other pairing either pulls a different torch or fails to import.
XFORMERS_FOR_TORCH: Mapping[tuple[int, int, int], str] = {
    (2, 4, 0): "0.0.27.post2",
    (2, 4, 1): "0.0.28.post1",
    (2, 5, 1): "0.0.28.post3",
    (2, 6, 0): "0.0.29.post3",
    (2, 7, 0): "0.0.30",
    (2, 7, 1): "0.0.31.post1",
    (2, 8, 0): "0.0.32.post2",
}


def attention_arch_error(name: str, hardware: HardwareProfile) -> str | None:
    """Why this card cannot run backend ``name`` (the arch gate), or None.

    An NVIDIA card whose capability could not be read is let through: the
    kernel is tried at load, and a failure there falls back to native SDPA
    with the reason (blocking it would refuse every kernel on a new card).
    """
    minimum, maximum = (
        (CUDNN_ATTENTION_MIN_CAPABILITY, None)
        if name == "cudnn"
        else (OPTIONAL_BACKENDS[name].min_capability, OPTIONAL_BACKENDS[name].max_capability)
    )
    if hardware.vendor != "nvidia":
        return f"{name} attention needs an NVIDIA GPU; this is {hardware.device_name}"
    if hardware.capability is None:
        return None
    if hardware.capability < minimum:
        return f"{name} attention needs sm{minimum[0]}{minimum[1]}+; this is {hardware.capability_label}"
    if maximum and hardware.capability > maximum:
        span = f"sm{minimum[0]}{minimum[1]}" + ("" if maximum == minimum else f"-sm{maximum[0]}{maximum[1]}")
        return f"{name} attention runs on {span} only; this is {hardware.capability_label}"
    return None


def _unknown_capability_note(hardware: HardwareProfile) -> str:
    if hardware.vendor == "nvidia" and hardware.capability is None:
        return " (compute capability unknown: tried at load, native SDPA if it fails)"
    return ""


def kernel_floor(name: str, hardware: HardwareProfile) -> str | None:
    """The version diffusers' dispatcher needs for backend ``name`` (None: not read)."""
    return dict(hardware.attention_floors).get(name)


def below_floor(version: str | None, floor: str | None) -> bool:
    """Whether ``version`` is older than ``floor`` (False where either is unknown or unreadable)."""
    if version is None or floor is None:
        return False
    try:
        return Version(version) < Version(floor)
    except InvalidVersion:
        return False


def installed_usable(name: str, hardware: HardwareProfile) -> tuple[bool, str | None]:
    """(whether backend ``name``'s package is installed at a version the dispatcher takes,
    why not where it is installed but too old)."""
    package = OPTIONAL_BACKENDS[name].package
    if package not in hardware.attention_packages:
        return False, None
    version = dict(hardware.attention_versions).get(package)
    floor = kernel_floor(name, hardware)
    if below_floor(version, floor):
        return False, f"{package} {version} is older than {floor}, the floor diffusers' dispatcher enforces"
    return True, None


def install_requirement(name: str, hardware: HardwareProfile) -> tuple[str | None, str]:
    """(pip arguments for backend ``name`` or None, why).

    The arguments are one string the runtime splits: the requirement with
    the version floor the installed diffusers' dispatcher enforces, plus
    ``--no-deps`` where the package's own requirements would replace the
    installed torch. xformers is pinned to the release built against the
    installed torch, or not installed at all (also where that release is
    below the dispatcher's floor: it would install and still be refused).
    """
    backend = OPTIONAL_BACKENDS[name]
    floor = kernel_floor(name, hardware)
    requirement = f"{backend.pip_name}>={floor}" if floor else backend.pip_name
    if name == "xformers":
        version = _torch_release(hardware.torch_version)
        pinned = XFORMERS_FOR_TORCH.get(version) if version else None
        if pinned is None:
            return None, (
                f"no xformers wheel is known to match torch {hardware.torch_version or '(version unknown)'}"
            )
        if below_floor(pinned, floor):
            return None, (
                f"xformers {pinned} (the release built for torch {hardware.torch_version}) is older than "
                f"{floor}, the floor diffusers' dispatcher enforces"
            )
        requirement = f"xformers=={pinned}"
        cuda_tag = _cuda_tag(hardware.torch_version)
        if cuda_tag:  # the wheel built for this torch's CUDA, from PyTorch's index for it
            requirement += f" --index-url {PYTORCH_WHEEL_INDEX}/{cuda_tag}"
    args = f"{requirement} --no-deps" if backend.no_deps else requirement
    unknown = "" if floor or name == "xformers" else " (the dispatcher's floor could not be read from diffusers)"
    return args, f"a wheel-only install of {args} is tried at load{unknown}"


def _cuda_tag(version: str | None) -> str | None:
    """``2.8.0+cu128`` -> ``cu128``; None for a CPU or ROCm build, or an unknown version."""
    local = (version or "").partition("+")[2]
    return local if re.fullmatch(r"cu\d+", local) else None


def _torch_release(version: str | None) -> tuple[int, int, int] | None:
    """``2.8.0+cu128`` -> (2, 8, 0); None when unreadable."""
    if not version:
        return None
    numbers = re.findall(r"\d+", version.split("+")[0])[:3]
    if len(numbers) < 3:
        return None
    return int(numbers[0]), int(numbers[1]), int(numbers[2])


def resolve_attention(
    requested: str,
    hardware: HardwareProfile,
    denied: Mapping[str, str],
    env: Mapping[str, str],
    dtype: str | None = None,
    tier: str = "default",
) -> tuple[Resolved[str], str | None]:
    """(backend, pip arguments to try installing at load or None).

    On the ``off`` tier ``auto`` stays native SDPA: that tier engages nothing
    (an explicit kernel is still honoured).

    ``auto`` takes FlashAttention-3 where its loader (``kernels``) is installed on Hopper, else
    cuDNN's fused SDPA on sm80+ NVIDIA cards (faster than the kernel SDPA
    picks by itself there), else native SDPA. An explicit request that the
    card cannot run (or the family denies) falls back to native SDPA with
    the reason. A missing package is installed best-effort at load, only for
    an explicit request, only after the arch gate, and only while
    ``DIFFUSION_ENGINE_ATTENTION_INSTALL`` is not ``0``.
    """
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention {requested!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if requested == "native":
        return explicit("native"), None
    if requested == "auto":
        if tier == "off":
            return auto("native", "speed tier off: torch SDPA, as stock diffusers runs it"), None
        return _auto_attention(hardware, denied, dtype), None
    if requested in denied:
        why = f"{requested} is denied for this family: {denied[requested]}; native SDPA"
        return explicit("native", why, requested=requested), None
    arch = attention_arch_error(requested, hardware)
    if arch:
        return explicit("native", f"{arch}; native SDPA", requested=requested), None
    note = _unknown_capability_note(hardware)
    if requested == "cudnn":
        if dtype not in CUDNN_ATTENTION_DTYPES:
            why = f"cuDNN attention runs bf16 / fp16 only; this plan computes in {dtype}; native SDPA"
            return explicit("native", why, requested=requested), None
        return explicit("cudnn", f"cuDNN fused SDPA (built into torch){note}"), None
    backend = OPTIONAL_BACKENDS[requested]
    usable, too_old = installed_usable(requested, hardware)
    if usable:
        return explicit(requested, f"requested{note}"), None
    missing = too_old or f"{backend.package} is not installed"
    if env.get(ATTENTION_INSTALL_ENV, "auto") == "0":
        return explicit(
            "native", f"{missing} and {ATTENTION_INSTALL_ENV}=0; native SDPA", requested=requested,
        ), None
    args, why = install_requirement(requested, hardware)
    if args is None:
        return explicit("native", f"{missing} and {why}; native SDPA", requested=requested), None
    return explicit(requested, f"{missing}: {why}; native SDPA if it fails{note}"), args


#: Hub kernels ``auto`` takes where ``kernels`` is installed, each on its own generation.
HUB_KERNELS: Mapping[str, str] = {
    "flash4": "FlashAttention-4 (hub kernel via the installed kernels package) on a Blackwell datacenter GPU",
    "flash3": "FlashAttention-3 (hub kernel via the installed kernels package) on a Hopper GPU",
}


def _auto_attention(hardware: HardwareProfile, denied: Mapping[str, str], dtype: str | None) -> Resolved[str]:
    for name, what in HUB_KERNELS.items():
        if (
            installed_usable(name, hardware)[0]
            and name not in denied
            and hardware.capability is not None
            and attention_arch_error(name, hardware) is None
        ):
            return auto(name, f"{what}; native SDPA if the kernel cannot be loaded")
    if (
        "cudnn" not in denied
        and dtype in CUDNN_ATTENTION_DTYPES
        and hardware.capability is not None
        and attention_arch_error("cudnn", hardware) is None
    ):
        return auto(
            "cudnn",
            f"cuDNN fused SDPA on {hardware.capability_label} (sm80+): faster than the kernel "
            "SDPA picks by itself; native SDPA if it cannot be set",
        )
    if "cudnn" in denied:
        why = f"cudnn denied for this family: {denied['cudnn']}"
    elif dtype not in CUDNN_ATTENTION_DTYPES:
        why = f"cuDNN attention runs bf16 / fp16 only, this plan computes in {dtype}"
    else:
        why = "not an sm80+ NVIDIA GPU of known capability"
    return auto("native", f"torch SDPA ({why}; SDPA picks the flash / memory-efficient kernel itself)")
