"""Test support: fake *distributions* (real entry points on a real sys.path).

Plugins reach the engine through ``importlib.metadata`` entry points. To test
that path without pip-installing anything, a fixture writes a ``.dist-info``
folder beside the plugin's module; importlib finds it exactly as it finds an
installed package. Only the hardware is ever faked, never the engine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine import Engine

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_PLUGIN = ROOT / "examples" / "diffusion-engine-sd3"


def load_bench_script(script: str) -> ModuleType:
    """``bench/<script>.py`` as a module (bench/ is not a package), registered so its dataclasses resolve."""
    import importlib.util

    name = f"bench_{script}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "bench" / f"{script}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def example_installed() -> bool:
    """Whether the worked example plugin is pip-installed here (``make install`` does)."""
    import importlib.metadata

    try:
        importlib.metadata.distribution("diffusion-engine-sd3")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def write_distribution(
    site: Path,
    name: str,
    entry_points: Mapping[str, str],
    modules: Mapping[str, str] | None = None,
    version: str = "0.1.0",
) -> Path:
    """Write ``name``'s dist-info (and module sources) under ``site``."""
    dist = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8"
    )
    lines = ["[diffusion_engine.families]"] + [f"{k} = {v}" for k, v in entry_points.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    for module, source in (modules or {}).items():
        path = site / (module.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source), encoding="utf-8")
    return site


def run_cli(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``python -m engine ARGS`` in a child process (a cold start)."""
    return subprocess.run(
        [sys.executable, "-m", "engine", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


class LiveServer:
    """The real app on a real loopback port, served by uvicorn in a thread."""

    def __init__(self, app: object) -> None:
        import threading

        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> str:
        import time

        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        host, port = self._server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


class HostModel:
    """A model the host app keeps on the GPU (a chat model, say): registered
    with the engine as a resident of ``size_gb``; counts how often it was evicted."""

    def __init__(self, engine: Engine, name: str = "host.chat-model", size_gb: float = 8.0) -> None:
        self.evicted = 0
        engine.register_resident(name, self.evict, size_gb=size_gb)

    def evict(self) -> None:
        self.evicted += 1
