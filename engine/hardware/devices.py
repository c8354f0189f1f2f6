"""Every accelerator a multi-GPU run would use, one profile per device.

A :class:`HardwareProfile` describes device 0; on a machine with several
GPUs its ``devices`` lists them all. Multi-GPU training checks its memory
estimate and precision gates against each device it would use
(:mod:`engine.training.preflight`), so a box with one smaller or older card
is refused before anything is evicted, naming that card.

The per-device facts come from ``nvidia-smi`` (one call for every GPU), not
from torch's per-device queries: ``torch.cuda.mem_get_info(i)`` creates a
CUDA context on device ``i``, about 0.5 GB on every card of a machine the
engine shares with other programs.
"""

from __future__ import annotations


from engine.hardware.probe import consumer_class, gpu_class, nvidia_smi_rows
from engine.hardware.profile import DeviceFacts, HardwareProfile, native_bf16


def with_devices(profile: HardwareProfile, count: int) -> HardwareProfile:
    """``profile`` as a machine with ``count`` identical devices (presets: ``4xh100``)."""
    facts = DeviceFacts(profile.device_name, profile.total_memory_gb, profile.free_memory_gb, profile.capability)
    return profile.replace(devices=(facts,) * count if count > 1 else ())


def device_profiles(profile: HardwareProfile) -> tuple[HardwareProfile, ...]:
    """One profile per accelerator, device 0 first; empty for a machine without CUDA.

    Device 0 keeps ``profile``'s free memory as given: that is the figure
    after the engine's eviction (:class:`~engine.policy.available.AvailableMemory`
    applies it), and evicted residents live on device 0.
    """
    if not profile.cuda:
        return ()
    if not profile.devices:
        return (profile.replace(devices=()),)
    profiles = []
    for index, facts in enumerate(profile.devices):
        free = profile.free_memory_gb if index == 0 else facts.free_memory_gb
        changes: dict[str, object] = {
            "device_name": facts.name, "total_memory_gb": facts.total_memory_gb, "free_memory_gb": free,
            "capability": facts.capability, "devices": (),
        }
        if profile.vendor == "nvidia":
            changes.update(native_bf16=native_bf16("nvidia", facts.capability, False),
                           consumer=consumer_class(facts.name), gpu_class=gpu_class(facts.name))
        profiles.append(profile.replace(**changes))
    return tuple(profiles)


def probed_devices(profile: HardwareProfile) -> HardwareProfile:
    """``profile`` (this machine's, probed) with every visible GPU listed in ``devices``.

    Presets and profiles that already list devices come back as they are.
    Honours ``CUDA_VISIBLE_DEVICES`` (numeric indices) as torch does, like the
    probe's device 0 (both read :func:`~engine.hardware.probe.nvidia_smi_rows`); where
    ``nvidia-smi`` cannot say (ROCm, UUID lists), torch's device count and
    device 0's facts stand for every device.
    """
    if profile.devices or not profile.cuda or not profile.source.startswith("probe"):
        return profile
    gpus = _nvidia_smi_all() if profile.vendor == "nvidia" else []  # CUDA_VISIBLE_DEVICES applied
    if gpus:
        return profile.replace(devices=tuple(gpus)) if len(gpus) > 1 else profile
    return with_devices(profile, _torch_device_count())


def _torch_device_count() -> int:
    try:
        import torch

        return int(torch.cuda.device_count())  # reads the driver; creates no context
    except (ImportError, RuntimeError):
        return 1


def _nvidia_smi_all() -> list[DeviceFacts]:
    rows = nvidia_smi_rows()
    if any(total is None for _, _, total, _ in rows):
        return []  # integrated GPUs report no memory of their own: one device, as probed
    return [DeviceFacts(name, float(total or 0.0), free, capability) for name, capability, total, free in rows]
