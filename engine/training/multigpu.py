"""The preflight of a multi-GPU run (``gpus`` > 1): which devices, and is each one fit.

Pure and CPU-only, run with the rest of the training preflight before
anything is evicted. Every rank holds a whole replica of the run (the base,
the LoRA, its optimizer state and its share of the batch), so the memory
estimate is per rank and must fit on *each* device the run would use, and
the precision gates (native bf16, fp8, bitsandbytes) must pass on each.
The plan is made for device 0 (where the engine's evictions free memory);
every other device must then pass the same gates with the mode chosen for
it, and one that does not is refused by name (``GPU 2 (Tesla T4): ...``),
so a mixed box is never half-trained.

On CPU (``device=cpu``), ``gpus=N`` runs N CPU processes synchronised over
gloo, up to one per core: that is how the distributed trainer is tested
without a GPU, and how a many-core host can split a small run (64 processes
on 2 cores would only thrash, and are refused).
"""

from __future__ import annotations

from collections.abc import Callable

from engine.errors import PreflightError
from engine.hardware.devices import device_profiles, probed_devices
from engine.hardware.profile import HardwareProfile
from engine.requests.training import TrainingConfig


class NotEnoughGpus(PreflightError):
    """``--gpus N`` asks for more devices than the machine has."""

    code = "not_enough_gpus"


class NotEnoughCores(PreflightError):
    """``--gpus N --device cpu`` asks for more CPU processes than the machine has cores."""

    code = "not_enough_cores"


def rank_devices(config: TrainingConfig, hardware: HardwareProfile) -> tuple[HardwareProfile, ...]:
    """The device profile of each rank (device ``i`` for rank ``i``); empty when there is
    nothing to check per device: one process, or CPU processes.

    :raises NotEnoughGpus: ``gpus`` exceeds the devices present (or there is
        no GPU and ``device`` is not ``cpu``).
    :raises NotEnoughCores: ``device`` is ``cpu`` and ``gpus`` exceeds the cores.
    """
    if config.gpus <= 1:
        return ()
    if config.device == "cpu":
        cores = hardware.cpu_count or 1
        if config.gpus > cores:
            raise NotEnoughCores(
                f"--gpus {config.gpus} with --device cpu starts {config.gpus} CPU processes, but this machine "
                f"has {cores} core{'s' if cores != 1 else ''}; give --gpus {cores} or less")
        return ()
    devices = device_profiles(probed_devices(hardware))
    if config.gpus > len(devices):
        present = (
            f"{len(devices)} GPU{'s' if len(devices) != 1 else ''} ({_names(devices)})" if devices
            else f"no GPU ({hardware.device_name})"
        )
        raise NotEnoughGpus(
            f"--gpus {config.gpus} asks for {config.gpus} GPUs but this machine has {present}. "
            + (f"Give --gpus {len(devices)} or less" if len(devices) > 1 else "Give --gpus 1")
            + ("" if devices else ", or --device cpu to run that many CPU processes (gloo)")
            + "; another machine can join with multi-node accelerate (see docs/training.md)"
        )
    return devices[: config.gpus]


def check_each_device(devices: tuple[HardwareProfile, ...], check: Callable[[HardwareProfile], None]) -> None:
    """Run ``check`` (the precision and memory gates) on every rank's device.

    A refusal names the device (``GPU 1 (Tesla T4): ...``): the rules are
    the single-GPU ones, and the message must say which card failed them.
    """
    for index, device in enumerate(devices):
        try:
            check(device)
        except PreflightError as error:
            error.message = (f"GPU {index} ({device.device_name}), one of the {len(devices)} devices "
                             f"--gpus {len(devices)} trains on: {error.message}")
            error.args = (error.message,)
            raise


def _names(devices: tuple[HardwareProfile, ...]) -> str:
    return ", ".join(d.device_name for d in devices)
