"""Fixtures shared by the engine's tests."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import EXAMPLE_PLUGIN, example_installed, write_distribution

pytest_plugins = ["tests.leftovers"]  # no trainer outlives the test that started it

# One compute thread per process: the suite runs on xdist workers that share the cores
# (see the Makefile's test target); children started by the tests inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Runs, caches and settings of the suite never land in the user's own folders.
os.environ["DIFFUSION_ENGINE_HOME"] = tempfile.mkdtemp(prefix="diffusion-engine-test-home-")
# The user's keys (the compile cache's signing key) live apart from the data folder, as a user's do.
os.environ["DIFFUSION_ENGINE_KEYS"] = tempfile.mkdtemp(prefix="diffusion-engine-test-keys-")


def _remove_made(folders: tuple[str, ...], maker: int) -> None:
    """... and go with the process that made them (each xdist worker makes its own), not with
    a forked child that inherited the exit hook."""
    if os.getpid() == maker:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


atexit.register(_remove_made, (os.environ["DIFFUSION_ENGINE_HOME"], os.environ["DIFFUSION_ENGINE_KEYS"]), os.getpid())


#: The GEMM figures the first pytest process measured (xdist's controller), for its workers.
MEASURED_GEMM = "DIFFUSION_ENGINE_TEST_CPU_GEMM"


def pytest_configure(config: pytest.Config) -> None:
    """The suite's home starts as a used machine's does: its CPU GEMMs measured once (a fresh
    machine's first verified probe measures them and re-plans once; test_cpu_kernel covers that).
    Measured once per run, not once per process (3.5 s each on a CPU that emulates bf16): an
    xdist worker's home gets a copy of what the controller measured, read back as any cache is."""
    from engine.hardware import cpu, gemm

    measured = os.environ.get(MEASURED_GEMM)
    if measured and os.path.isfile(measured) and not gemm.cache_file().exists():
        gemm.cache_file().parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(measured, gemm.cache_file())
    gemm.measured(cpu.matmul_isa(cpu.cpu_flags()))
    os.environ[MEASURED_GEMM] = str(gemm.cache_file())


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh folder on sys.path (and PYTHONPATH, for child processes)."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    return folder


@pytest.fixture
def install_example(site: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Path]:
    """Make the example third-party family (examples/) visible as installed."""

    def install() -> Path:
        if example_installed():  # installed for real (make install): one distribution, not two
            return site
        write_distribution(site, "diffusion-engine-sd3", {"sd3": "diffusion_engine_sd3"})
        monkeypatch.syspath_prepend(str(EXAMPLE_PLUGIN))
        monkeypatch.setenv(
            "PYTHONPATH", os.pathsep.join([str(EXAMPLE_PLUGIN), os.environ["PYTHONPATH"]])
        )
        sys.modules.pop("diffusion_engine_sd3", None)
        return site

    return install


@pytest.fixture
def cli_json(capsys: pytest.CaptureFixture[str]) -> Callable[..., object]:
    """``diffusion-engine ARGS --json`` run in this process (no cold start; a trainer it
    starts is still a real child); what it printed, parsed. A non-zero exit fails the test."""
    from engine.cli import main

    def run(*args: str) -> object:
        capsys.readouterr()
        status = main([*args, "--json"])
        out, err = capsys.readouterr()
        assert status == 0, err[-3000:]
        return json.loads(out)

    return run


#: The files that take longest, run first: xdist (``--dist loadfile``) hands whole files to the
#: workers in collection order, so a long file collected last leaves one worker alone at the
#: end. Ordered by each file's measured total on 2 cores (``--durations=0``); the rest keep their order.
SLOW_FIRST = (
    "test_compile_cache.py", "test_memory_preflight.py", "test_stock_diffusers.py", "test_training_runs.py",
    "test_web.py", "test_readme.py", "test_ltx2_family.py", "test_video_training.py", "test_distributed.py",
    "test_sdcpp.py", "test_minimax_h3_family.py", "test_forkserver.py", "test_gpu_check.py", "test_flux2_family.py",
    "test_ltx2_training.py", "test_replicas.py", "test_service.py", "test_demo.py", "test_server_fuzz.py",
    "test_types.py", "test_attention_install.py", "test_generate.py", "test_minimax_h3_training.py", "test_lora.py",
    "test_geometry.py", "test_cli_inference.py", "test_server.py", "test_training_preflight.py",
    "test_equivalence.py", "test_split_families.py", "test_inference_policy.py", "test_quantize.py",
    "test_upstream_formats.py", "test_checkpoint_safety.py", "test_images_in_more.py", "test_running_jobs.py",
    "test_training_resume.py", "test_lora_trained.py", "test_ideogram4_family.py", "test_training_reliability.py",
    "test_lora_export.py", "test_split_requests.py", "test_library_quantised.py", "test_multi_image_edit.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture()
def fixed_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's profile, frozen for the test: the light and the verified probe answer the
    same, so a decision counted or compared does not move with the host's load or free memory
    (a busy CI machine frees and takes memory between a check and its load)."""
    from engine.hardware import probe as hardware_probe

    profile = hardware_probe.probe(verify=False)
    monkeypatch.setattr(hardware_probe, "probe", lambda verify=None: profile)


@pytest.fixture(scope="session")
def sdcpp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FLUX.1 as stable-diffusion.cpp reads it, written once per worker: the GGUF transformer
    with the real-shape ``ae.safetensors`` and ``clip_l.safetensors`` (400 MB) beside it."""
    from families.flux.sdcpp_files import write_tiny

    return write_tiny(tmp_path_factory.mktemp("flux-sdcpp"), gguf=True)["diffusion_model_path"]
