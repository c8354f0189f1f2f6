"""The machine a request is decided for: this one, or a preset with overrides.

``plan --hardware rtx3090 --free-gb 20`` and ``Engine(hardware=...)`` ask the
same question: what would happen on that machine. :class:`MachineRequest` is
that question as a record; :meth:`MachineRequest.profile` answers it (a
preset from the table, or this machine's probe), torch-free unless
``verify`` asks for the torch probe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MachineRequest:
    #: A hardware preset name (``rtx3090``); None: this machine.
    preset: str | None = None
    #: Free device memory to assume, GB (None: the preset's, or the probe's).
    free_gb: float | None = None
    #: False: treat torchao as missing or a stub.
    torchao: bool = True

    def profile(self, *, verify: bool | None = None) -> Any:
        """The :class:`~engine.hardware.profile.HardwareProfile` this describes.

        :param verify: probe with torch (None: only where an accelerator is); presets are never probed.
        """
        if self.preset:
            from engine.hardware.presets import preset

            profile = preset(self.preset)
        else:
            from engine.hardware.probe import probe

            profile = probe(verify=verify)
        if self.free_gb is not None:
            profile = profile.replace(free_memory_gb=self.free_gb)
        if not self.torchao:
            profile = profile.replace(torchao_functional=False)
        return profile
