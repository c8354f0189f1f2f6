"""Attention kernels: set the diffusers backend, installing its package if asked.

The install is best-effort and wheel-only (``--only-binary=:all:``), so a
host without a CUDA toolchain never starts a source build. The plan decides
whether to try (explicit request, arch gate passed, not disabled by
``DIFFUSION_ENGINE_ATTENTION_INSTALL=0``); any failure keeps native SDPA.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

#: Our backend names -> diffusers' ``set_attention_backend`` names.
DIFFUSERS_BACKENDS = {
    "native": "native",
    "flash": "flash",
    "flash3": "_flash_3",
    "sage": "sage",
    "xformers": "xformers",
}

Installer = Callable[[str], bool]


def pip_install_wheel(package: str, timeout_s: float = 600.0) -> bool:
    """``pip install --only-binary=:all: package``; True when it succeeded."""
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--only-binary=:all:", package],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return result.returncode == 0
