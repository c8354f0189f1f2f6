"""Test support, one module, one name per helper.

- fake *distributions* (real entry points on a real sys.path): plugins reach the
  engine through ``importlib.metadata`` entry points; a fixture writes a
  ``.dist-info`` folder beside the plugin's module, and importlib finds it exactly
  as it finds an installed package;
- a real server on a loopback port (:class:`LiveServer`), a host model that counts
  its evictions (:class:`HostModel`);
- counters: the calls of a decision (:func:`counted`) and the calls a face makes
  into the engine (:func:`engine_calls`);
- a family's plan from its table on a preset (:func:`table_plan`), the one helper
  every policy test plans with.

Only the hardware is ever faked, never the engine.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine import Engine
    from engine.hardware.profile import HardwareProfile
    from engine.policy.inference import Plan

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


@contextlib.contextmanager
def counted(*functions: Callable[..., object]) -> Iterator[Counter[str]]:
    """Count the outermost calls of ``functions`` through every engine module that binds them."""
    calls: Counter[str] = Counter()
    depth = Counter[str]()
    patches = []
    for function in functions:
        name = function.__name__

        def wrapper(*args: object, _f: Callable[..., object] = function, _n: str = name, **kwargs: object) -> object:
            if depth[_n] == 0:
                calls[_n] += 1
            depth[_n] += 1
            try:
                return _f(*args, **kwargs)
            finally:
                depth[_n] -= 1

        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith(("engine.", "families.")) and getattr(module, name, None) is function:
                patches.append((module, name, function))
                setattr(module, name, wrapper)
    try:
        yield calls
    finally:
        for module, name, function in patches:
            setattr(module, name, function)


@contextlib.contextmanager
def engine_calls(*parts: type) -> Iterator[list[str]]:
    """The calls a face makes into the engine: every public method of ``parts`` (the facade's
    classes) recorded as ``Class.method`` when no other engine method is running (the
    outermost ones: ``images.load`` calling the loaded model's ``load`` is one call)."""
    calls: list[str] = []
    depth = [0]
    patches = []
    for part in parts:
        for name, function in list(vars(part).items()):
            if name.startswith("_") or not inspect.isfunction(function):
                continue

            def wrapper(*args: object, _f: Callable[..., object] = function, _n: str = f"{part.__name__}.{name}",
                        **kwargs: object) -> object:
                if depth[0] == 0:
                    calls.append(_n)
                depth[0] += 1
                try:
                    return _f(*args, **kwargs)
                finally:
                    depth[0] -= 1

            patches.append((part, name, function))
            setattr(part, name, wrapper)
    try:
        yield calls
    finally:
        for part, name, function in patches:
            setattr(part, name, function)


_REGISTRY: list[Any] = []


def table_plan(family: str, hw: str | HardwareProfile, checkpoint: str | None = None,
               env: dict[str, str] | None = None, gguf_gb: float | None = None, **request: object) -> Plan:
    """A family's checkpoint (its default one) planned from its table alone on a preset (or a
    profile): the policy's answer, torch-free, with no environment switch (``env``: some)."""
    from engine.contract.plugins import load_registry
    from engine.hardware.presets import PRESETS
    from engine.policy.inference import ModelFacts, plan_inference
    from engine.requests.inference import InferenceRequest

    if not _REGISTRY:
        _REGISTRY.append(load_registry())
    registry = _REGISTRY[0]
    spec = registry.family(family)
    chosen = spec.checkpoint(checkpoint) if checkpoint else spec.default_checkpoint
    hardware = PRESETS[hw] if isinstance(hw, str) else hw
    facts = ModelFacts(spec, chosen, registry.component_sizes(spec, chosen), gguf_transformer_gb=gguf_gb)
    return plan_inference(registry, facts, hardware, InferenceRequest(**request),  # type: ignore[arg-type]
                          env={} if env is None else env)


# -- files a test plants: a cut download, a linked copy, a dataset with a link out ---------------


def truncated_pipeline(pipeline: Path, target: Path, component: str) -> Path:
    """A copy of ``pipeline`` whose ``component`` safetensors stop just after their
    header (a download cut short); the other components are symlinks to the originals."""
    import shutil

    target.mkdir(parents=True)
    for entry in pipeline.iterdir():
        if entry.is_dir() and entry.name != component:
            (target / entry.name).symlink_to(entry)
        elif entry.is_file():
            shutil.copy(entry, target / entry.name)
    (target / component).mkdir()
    for entry in (pipeline / component).iterdir():
        data = entry.read_bytes()
        if entry.suffix == ".safetensors":
            data = data[: 8 + int.from_bytes(data[:8], "little") + 64]
        (target / component / entry.name).write_bytes(data)
    return target


def linked_pipeline(pipeline: Path, target: Path) -> Path:
    """``pipeline`` under another name: its files copied, its component folders linked."""
    import shutil

    target.mkdir(parents=True)
    for entry in pipeline.iterdir():
        if entry.is_dir():
            (target / entry.name).symlink_to(entry)
        else:
            shutil.copy(entry, target / entry.name)
    return target


def escaping_dataset(folder: Path, secret: Path, link: str) -> Path:
    """A good dataset plus one symlink, ``link``, that leads to ``secret`` outside it."""
    from engine.testing.datasets import write_dataset

    write_dataset(folder, count=2)
    if (folder / link).exists():
        (folder / link).unlink()
    (folder / link).symlink_to(secret)
    return folder


class Planted:
    """Unpickling this runs a shell command that leaves ``marker`` behind."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (f"touch {self.marker}",))


def real_state() -> dict[str, object]:
    """The state the trainer writes, from a real optimizer step, scheduler and RNGs."""
    import torch
    from diffusers.optimization import get_scheduler

    weight = torch.nn.Parameter(torch.randn(2, 3))  # rank 2, as the runs that use it
    optimizer = torch.optim.AdamW([weight], lr=1e-3)
    weight.sum().backward()
    optimizer.step()
    schedule = get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=2, num_training_steps=10)
    schedule.step()
    generator = torch.Generator().manual_seed(3)
    return {
        "trainable": {"block.lora_A.weight": weight.detach().clone()},
        "optimizer": optimizer.state_dict(), "scheduler": schedule.state_dict(),
        "torch_rng": torch.get_rng_state(), "cuda_rng": None, "generator": generator.get_state(),
        "order": [[1, 0], [2]], "scaler": {}, "ema": {"decay": 0.5, "shadow": [weight.detach().float()]},
        "step": 7,
    }


# -- a tiny pipeline's session, driven directly; a run's CLI flags and losses ----------------------

#: The size :func:`pixels` draws at: non-square on purpose.
SIZE = {"width": 64, "height": 48}
#: A tiny training run's flags: 64 px, rank 2, on the CPU.
TINY = ("--resolution", "64", "--rank", "2", "--device", "cpu")


def session_for(model: Path, request: Any = None, *, base: Path | None = None, **options: object) -> Any:
    """The runtime session for ``model`` planned on this machine (the light probe), not loaded."""
    from engine.contract.plugins import load_registry
    from engine.hardware.probe import probe
    from engine.policy.inference import plan_inference
    from engine.preflight.model import resolve_model
    from engine.requests.inference import InferenceRequest
    from engine.runtime.session import InferenceSession

    if not _REGISTRY:
        _REGISTRY.append(load_registry())
    registry, request = _REGISTRY[0], request or InferenceRequest()
    source = resolve_model(registry, model, base=base)
    plan = plan_inference(registry, source.facts(registry), probe(verify=False), request)
    return InferenceSession(registry, source, plan, request, **options)  # type: ignore[arg-type]


def pixels(session: Any, seed: int = 0, steps: int = 2, **kwargs: object) -> Any:
    """One image of a lighthouse from ``session`` at :data:`SIZE`, as an array."""
    import numpy as np

    from engine.runtime.generation import GenerateRequest

    [image] = session.generate(GenerateRequest("a lighthouse at dusk", steps=steps, seed=seed, **{**SIZE, **kwargs}))  # type: ignore[arg-type]
    return np.asarray(image)


def losses(record: dict[str, object]) -> list[list[float]]:
    """A run record's loss per step, as its metrics keep them."""
    return record["metrics"]["loss"]  # type: ignore[index, return-value]
