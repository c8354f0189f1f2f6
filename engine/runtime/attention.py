"""Attention kernels: set the diffusers backend, installing its package if asked.

The install is best-effort and wheel-only (``--only-binary=:all:``), so a
host without a CUDA toolchain never starts a source build. The plan decides
whether to try (explicit request, arch gate passed, not disabled by
``DIFFUSION_ENGINE_ATTENTION_INSTALL=0``) and what to install: the
requirement with its version floor (or, for xformers, the release built
against the installed torch) and ``--no-deps`` where the package's own
requirements would replace torch. Any failure keeps native SDPA.

The install runs before this process imports diffusers (:func:`install_for_plan`,
called by the engine router ahead of the session import): diffusers reads
which kernels exist once, when it is imported, so a package installed after
that is invisible to ``set_attention_backend`` until the next process. Where
diffusers is already imported (a server's second load, a tiny pipeline built
in-process), the package is still installed for the next start and this load
keeps native SDPA, saying so.
"""

from __future__ import annotations

import dataclasses
import importlib
import shlex
import subprocess
import sys
from collections.abc import Callable

from engine.policy.plan import Plan
from engine.policy.resolved import Resolved

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
    """The pip command for the plan's install arguments (``sageattention>=2.1.1 --no-deps``)."""
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


def diffusers_imported() -> bool:
    """Whether this process has imported diffusers (its kernel flags are then fixed)."""
    return "diffusers" in sys.modules


def install_kernel(plan: Plan, installer: Installer = pip_install_wheel) -> Resolved[str] | None:
    """Run the plan's kernel install; None when the kernel can now be set in this process,
    else the native-SDPA decision saying why (the install failed, or diffusers was
    imported before it and cannot see it until the next process)."""
    if not plan.attention_install:
        return None
    imported_before = diffusers_imported()
    attention = plan["attention_backend"]
    if not installer(plan.attention_install):
        return Resolved("native", attention.source, f"installing {plan.attention_install} failed; native SDPA")
    importlib.invalidate_caches()  # the new package is found by the imports that follow
    if imported_before:
        return Resolved("native", attention.source, (
            f"{plan.attention_install} installed, but this process imported diffusers before the "
            f"install and diffusers reads its kernels once, at import: {attention.value} engages "
            "from the next start (restart the server or run the command again); native SDPA"
        ))
    return None


def install_for_plan(plan: Plan, installer: Installer = pip_install_wheel) -> Plan:
    """``plan`` after its kernel install, run before the session imports diffusers: the
    install is done (no longer pending) and, where the kernel cannot engage, the
    attention decision says why."""
    if not plan.attention_install:
        return plan
    outcome = install_kernel(plan, installer)
    if outcome is not None:
        plan = plan.with_control("attention_backend", outcome)
    return dataclasses.replace(plan, attention_install=None)
