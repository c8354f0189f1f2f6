"""Attention kernels: set the diffusers backend, installing its package if asked.

The install is best-effort and wheel-only (``--only-binary=:all:``), so a
host without a CUDA toolchain never starts a source build. The plan decides
whether to try (explicit request, arch gate passed, not disabled by
``DIFFUSION_ENGINE_ATTENTION_INSTALL=0``) and what to install: the
requirement with its version floor (or, for xformers, the release built
against the installed torch) and ``--no-deps`` where the package's own
requirements would replace torch. Any failure keeps native SDPA.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Callable

#: Our backend names -> diffusers' ``set_attention_backend`` names.
DIFFUSERS_BACKENDS = {
    "native": "native",
    "cudnn": "_native_cudnn",
    "flash": "flash",
    # FA3 as the hub kernel the ``kernels`` package loads (FA3 ships no wheels).
    "flash3": "_flash_3_hub",
    "flash4": "flash_4_hub",
    "sage": "sage",
    "xformers": "xformers",
}

Installer = Callable[[str], bool]


def pip_command(package: str) -> list[str]:
    """The pip command for the plan's install arguments (``sageattention>=1.0.6 --no-deps``)."""
    return [sys.executable, "-m", "pip", "install", "--only-binary=:all:", *shlex.split(package)]


def pip_install_wheel(package: str, timeout_s: float = 600.0) -> bool:
    """``pip install --only-binary=:all: <package arguments>``; True when it succeeded."""
    try:
        result = subprocess.run(
            pip_command(package),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return result.returncode == 0
