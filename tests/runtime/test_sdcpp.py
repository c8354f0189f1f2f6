"""stable-diffusion.cpp, the CPU engine: the plan's choice, and the real library running.

The files are FLUX.1 in the layouts sd.cpp reads (a reduced-width transformer as a
Q8_0 GGUF, the real-shape autoencoder and CLIP-L beside it; see
``families/flux/sdcpp_files.py``), run through the installed binding: nothing
here is faked but the hardware of the planning tests (presets).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine import Engine
from engine.errors import Cancelled, EngineError
from engine.hardware.presets import preset
from engine.policy.plan import InferenceRequest
from tests.support import HostModel

SMALL = {"width": 64, "height": 64, "steps": 2}  # the smallest side a request takes (MIN_SIDE)
#: This machine may multiply bf16 natively (then auto keeps torch, measured faster): ask for sd.cpp.
SDCPP = InferenceRequest(engine="sdcpp")


def cpu(**changes: object) -> object:
    return preset("cpu").replace(sdcpp_installed=True, **changes)


# -- the plan -----------------------------------------------------------------------


@pytest.mark.slow
def test_on_a_cpu_a_gguf_with_its_companions_goes_to_sdcpp_sized_from_its_files(sdcpp_model: Path) -> None:
    plan = Engine(hardware=cpu()).images.plan(str(sdcpp_model))
    engine = plan["engine"]
    assert (engine.value, engine.source) == ("sdcpp", "auto")
    assert "flux-tiny.gguf" in engine.reason and "T5-XXL" in engine.reason  # runs degraded without it, says so
    assert plan.sdcpp is not None
    on_disk = sum(p.stat().st_size for p in sdcpp_model.parent.iterdir()) / 1e9
    assert plan.sdcpp.gb == pytest.approx(on_disk)
    assert set(dict(plan.sdcpp.files)) == {"diffusion_model_path", "vae_path", "clip_l_path"}
    threads = int(__import__("os").environ.get("OMP_NUM_THREADS") or preset("cpu").cpu_count // 2)
    assert plan.value("threads") == threads  # the environment's say, else the preset's (no topology) rule


@pytest.mark.parametrize(("hardware", "why"), [
    (lambda: preset("rtx4090").replace(sdcpp_installed=True), "diffusers runs on the accelerator"),
    (lambda: preset("apple-m3-max").replace(sdcpp_installed=True), "opt-in"),
    (lambda: preset("cpu"), "pip install 'diffusion-engine[cpu]'"),
])
def test_auto_stays_on_diffusers_and_says_why(sdcpp_model: Path, hardware: Callable[[], object], why: str) -> None:
    engine = Engine(hardware=hardware()).images.plan(str(sdcpp_model))["engine"]
    assert engine.value == "diffusers" and why in engine.reason, engine.reason


def test_auto_keeps_torch_where_it_was_measured_faster(sdcpp_model: Path) -> None:
    """Before this CPU's GEMMs are measured its flags decide: native bf16 keeps torch,
    emulated bf16 goes to sd.cpp."""
    roomy = {"total_memory_gb": 24.0, "free_memory_gb": 22.0}  # its table encoders: bf16 fits, fp32 not
    amx = Engine(hardware=cpu(cpu_bf16_matmul=True, **roomy)).images.plan(str(sdcpp_model))
    assert amx.value("dtype") == "bf16" and amx["engine"].value == "diffusers" and "AMX" in amx["engine"].reason
    avx2 = Engine(hardware=cpu(**roomy)).images.plan(str(sdcpp_model))
    assert avx2["engine"].value == "sdcpp" and "without native bf16 matmul" in avx2["engine"].reason


@pytest.mark.parametrize(("flags_say_bf16", "bf16_gflops", "engine"), [
    (True, 427.0, "diffusers"),  # this Zen 5's AVX512-BF16: 427 GFLOP/s against 0.54 x 173 for sd.cpp
    (True, 40.0, "sdcpp"),  # flags that promise native bf16 on a CPU that measured it slow (a masked VM)
    (False, 120.0, "diffusers"),  # no such flags, yet bf16 measured past sd.cpp's: the measurement decides
])
def test_auto_between_torch_and_sdcpp_follows_this_cpus_measured_gemms(
    sdcpp_model: Path, flags_say_bf16: bool, bf16_gflops: float, engine: str,
) -> None:
    """The same rule on every machine: torch's measured GEMM in the plan's dtype against
    what sd.cpp's Q8_0 step reaches relative to this CPU's MKL fp32 (bench/cpu_engines.py)."""
    from engine.hardware.profile import CpuGemm

    roomy = {"total_memory_gb": 24.0, "free_memory_gb": 22.0}  # its table encoders: bf16 fits, fp32 not
    gemm = CpuGemm(fp32_mkl=173.0, fp32_onednn=215.0, bf16=bf16_gflops, threads=2)
    plan = Engine(hardware=cpu(cpu_bf16_matmul=flags_say_bf16, cpu_isa="AVX512-BF16" if flags_say_bf16 else "AVX2",
                               cpu_gemm=gemm, **roomy)).images.plan(str(sdcpp_model))
    assert plan.value("dtype") == "bf16" and plan["engine"].value == engine, plan["engine"].reason
    reason = plan["engine"].reason
    assert f"{bf16_gflops:.0f} GFLOP/s" in reason and "93" in reason  # 0.54 x 173: sd.cpp's reach here


def test_sdcpp_is_sized_from_its_files_where_torch_would_not_fit(sdcpp_model: Path) -> None:
    """fp32 torch needs the 12 B transformer's table size; sd.cpp holds the files as stored."""
    from engine.policy.runtime_engine import resolve_engine
    from engine.preflight.model import resolve_model
    from engine.contract.plugins import load_registry

    facts = resolve_model(load_registry(), str(sdcpp_model)).facts(load_registry())
    short = resolve_engine("auto", cpu(free_memory_gb=facts.sdcpp.gb / 2, swap_free_gb=0.0), facts.sdcpp)
    assert short.value == "diffusers" and "GB of RAM" in short.reason
    plan = Engine(hardware=cpu(free_memory_gb=1.0, total_memory_gb=2.0, swap_free_gb=0.0)).images.plan(str(sdcpp_model))
    assert plan["engine"].value == "sdcpp" and not plan.diffusers_fits and plan.fallback is None
    assert "no fallback" in plan["engine"].reason
    with pytest.raises(EngineError) as refused:  # the same machine without sd.cpp: torch does not fit
        Engine(hardware=cpu(free_memory_gb=1.0, total_memory_gb=2.0, swap_free_gb=0.0)).images.plan(
            str(sdcpp_model), request=InferenceRequest(engine="diffusers"))
    assert refused.value.code == "insufficient_memory"


def test_what_sdcpp_does_not_read_stays_on_diffusers(sdcpp_model: Path, tiny_pipeline: Callable[[str], Path],
                                                     tmp_path: Path) -> None:
    folder = Engine(hardware=cpu()).images.plan(str(tiny_pipeline("flux")))["engine"]
    assert folder.value == "diffusers" and "diffusers folder" in folder.reason
    alone = tmp_path / "alone" / sdcpp_model.name
    alone.parent.mkdir()
    shutil.copy(sdcpp_model, alone)
    # (a hub id as its base: the tiny diffusers FLUX is another width, a base_mismatch)
    missing = Engine(hardware=cpu()).images.plan(str(alone), base="black-forest-labs/FLUX.1-dev")["engine"]
    assert missing.value == "diffusers" and "the autoencoder" in missing.reason and "ae.safetensors" in missing.reason
    asked = Engine(hardware=cpu()).images.plan(str(sdcpp_model), request=InferenceRequest(engine="diffusers"))["engine"]
    assert (asked.value, asked.source) == ("diffusers", "explicit")


def test_engine_sdcpp_where_it_cannot_run_is_refused_before_any_eviction(
    sdcpp_model: Path, tiny_pipeline: Callable[[str], Path], cli_json: Callable[..., object],
) -> None:
    """The 0-eviction matrix's rows for the ``engine`` field: each refusal leaves the host's
    resident model in place, through the facade and through the CLI."""
    from engine.policy.runtime_engine import resolve_engine
    from engine.preflight.model import resolve_model

    for hardware, model, why in [(cpu(), str(tiny_pipeline("flux")), "diffusers folder"),
                                 (preset("cpu"), str(sdcpp_model), "not installed")]:
        engine = Engine(hardware=hardware)
        host = HostModel(engine)
        with pytest.raises(EngineError) as refused:
            engine.images.load(model, request=InferenceRequest(engine="sdcpp"))
        assert refused.value.code == "sdcpp_unavailable" and why in refused.value.message, refused.value.message
        assert host.evicted == 0 and engine.residency.owner is None
    facts = resolve_model(Engine().registry, str(sdcpp_model)).facts(Engine().registry)
    with pytest.raises(EngineError, match="LoRAs run on diffusers only"):
        resolve_engine("sdcpp", cpu(), facts.sdcpp, needs=("LoRAs",))
    plan = cli_json("plan", "--model", str(sdcpp_model), "--engine", "diffusers")
    assert plan["plan"]["resolved"]["engine"]["value"] == "diffusers"


# -- the library, for real ----------------------------------------------------------


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


@pytest.mark.slow
def test_generate_runs_on_sdcpp_and_the_cli_gives_the_same_pixels(
    sdcpp_model: Path, tmp_path: Path, cli_json: Callable[..., object],
) -> None:
    engine = Engine()
    status = engine.images.load(str(sdcpp_model), request=SDCPP)
    assert status["engine"] == "sdcpp" and status["sdcpp"]["threads"] == int(
        __import__("os").environ.get("OMP_NUM_THREADS") or engine.hardware().physical_cores)
    worker = status["sdcpp"]["worker_pid"]
    steps: list[tuple[int, int]] = []
    first = engine.images.generate("a red fox", seed=7, progress=lambda s, t: steps.append((s, t)), **SMALL)
    other = engine.images.generate("a red fox", seed=8, **{**SMALL, "width": 80, "height": 80})
    assert steps == [(1, 2), (2, 2)]
    assert first[0].size == (64, 64) and first[0].mode == "RGB"
    assert other[0].size == (80, 80) and not (pixels(first[0]) == pixels(other[0])[:64, :64]).all()
    assert engine.status()["pipeline"]["sdcpp"]["worker_pid"] == worker  # one context, reused
    engine.images.unload()
    out = tmp_path / "fox.png"
    payload = cli_json("generate", "--model", str(sdcpp_model), "--engine", "sdcpp", "--prompt", "a red fox", "--seed", "7",
                       "--width", "64", "--height", "64", "--steps", "2", "-o", str(out))
    assert payload["status"]["plan"]["resolved"]["engine"]["value"] == "sdcpp"
    written = Image.open(payload["images"][0])
    assert (pixels(written) == pixels(first[0])).all()
    assert json.loads(written.info["diffusion-engine"])["seed"] == 7  # the same record as a diffusers image


@pytest.mark.slow
def test_cancel_stops_after_the_step_and_the_next_generate_restarts_the_worker(sdcpp_model: Path) -> None:
    engine = Engine()
    engine.images.load(str(sdcpp_model), request=SDCPP)
    before = engine.images.generate("a fox", seed=1, **SMALL)
    cancel = threading.Event()
    seen: list[int] = []

    def on_step(step: int, total: int) -> None:
        seen.append(step)
        cancel.set()  # as a client that went away: the engine stops after this step

    with pytest.raises(Cancelled):
        engine.images.generate("a fox", seed=1, progress=on_step, cancel=cancel, **{**SMALL, "steps": 4})
    assert seen == [1] and engine.status()["job"] is None
    after = engine.images.generate("a fox", seed=1, **SMALL)
    assert engine.status()["pipeline"]["sdcpp"]["restarts"] == 1
    assert (pixels(before[0]) == pixels(after[0])).all()
    with pytest.raises(EngineError) as refused:
        engine.images.generate("a fox", mask_image=before[0], image=before[0], **SMALL)
    assert refused.value.code == "unsupported_on_sdcpp"
    redrawn = engine.images.generate("a fox", image=before[0], strength=0.5, seed=2, **SMALL)  # img2img: the binding's
    assert redrawn[0].size == (64, 64) and not (pixels(redrawn[0]) == pixels(before[0])).all()
    held = engine.available_memory().to_dict()
    assert any(r["name"] == "engine.pipeline" and r["gb"] == pytest.approx(engine.images.loaded_plan().sdcpp.gb, abs=0.01)
               for r in held["releasable"]), held  # the files as stored, not the torch estimate
    engine.images.unload()


def test_a_file_the_library_refuses_falls_back_to_diffusers_with_the_reason(
    sdcpp_model: Path, tiny_pipeline: Callable[[str], Path], tmp_path: Path,
) -> None:
    """A CLIP-L of the wrong shape beside the model: sd.cpp fails to load it, and the
    model (a single transformer file with its base) loads on diffusers instead."""
    from engine.testing.checkpoints import write_single_file
    from safetensors.numpy import save_file

    base = tiny_pipeline("flux")
    model = write_single_file(base, "transformer", tmp_path / "m" / "flux-tiny.safetensors")
    os.link(sdcpp_model.parent / "ae.safetensors", model.parent / "ae.safetensors")  # read, never written
    save_file({"text_model.final_layer_norm.weight": np.ones(8, np.float16)}, str(model.parent / "clip_l.safetensors"))
    fast = Engine(hardware=cpu()).images.plan(str(model), base=str(base))["engine"]  # a tiny base: fp32 fits
    assert fast.value == "diffusers" and "fp32 fits" in fast.reason and "1.85x" in fast.reason
    engine = Engine()
    status = engine.images.load(str(model), base=str(base), request=SDCPP)
    engine_control = status["plan"]["resolved"]["engine"]
    assert status["fallback"]["from"] == "sdcpp" and "stable-diffusion.cpp failed" in engine_control["reason"]
    assert (engine_control["value"], engine_control["requested"], engine_control["status"]) == (
        "diffusers", "sdcpp", "fell back")
    image = engine.images.generate("a fox", seed=1, width=64, height=64, steps=1)[0]
    assert image.size == (64, 64)
    engine.images.unload()
    with pytest.raises(EngineError) as failed:  # without a base, diffusers cannot take it over: said so
        Engine().images.load(str(model), request=SDCPP)
    assert failed.value.code == "sdcpp_files_refused" and failed.value.status == 400  # the file's fault: a 4xx
    assert "base" in failed.value.message and str(model.parent / "clip_l.safetensors") in failed.value.message


# -- a worker that stops answering ----------------------------------------------------


def _stop_at_first_step(engine: Engine, stopped: threading.Event) -> Callable[[int, int], None]:
    """A progress callback that freezes the worker after step 1, as a library stuck in a call."""

    def on_step(step: int, total: int) -> None:
        if not stopped.is_set():
            os.kill(engine.status()["pipeline"]["sdcpp"]["worker_pid"], signal.SIGSTOP)
            stopped.set()

    return on_step


def test_an_unload_with_cancel_kills_a_worker_stuck_in_a_step(sdcpp_model: Path) -> None:
    engine = Engine()
    engine.images.load(str(sdcpp_model), request=SDCPP)
    pid = engine.status()["pipeline"]["sdcpp"]["worker_pid"]
    stopped = threading.Event()
    outcome: list[BaseException] = []

    def generate() -> None:
        try:
            engine.images.generate("a fox", seed=1, progress=_stop_at_first_step(engine, stopped), **{**SMALL, "steps": 6})
        except BaseException as exc:  # noqa: BLE001 - the thread's outcome, asserted below
            outcome.append(exc)

    thread = threading.Thread(target=generate)
    thread.start()
    assert stopped.wait(60)
    started = time.monotonic()
    assert engine.images.unload(cancel=True) is True  # the generate lock came back: the stuck worker did not hold it
    thread.join(120)  # a bound for the failure only: the stopped worker would hold it for ever
    assert not thread.is_alive() and time.monotonic() - started < 120
    assert [type(e) for e in outcome] == [Cancelled]
    assert _gone(pid) and engine.status()["pipeline"] is None and engine.status()["job"] is None


@pytest.mark.slow
def test_a_worker_silent_past_its_step_timeout_is_killed_and_the_next_generate_restarts_it(
    sdcpp_model: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DIFFUSION_ENGINE_SDCPP_STEP_TIMEOUT", "2")
    engine = Engine()
    engine.images.load(str(sdcpp_model), request=SDCPP)
    pid = engine.status()["pipeline"]["sdcpp"]["worker_pid"]
    started = time.monotonic()
    with pytest.raises(EngineError) as stalled:
        engine.images.generate("a fox", seed=1, progress=_stop_at_first_step(engine, threading.Event()), **SMALL)
    assert stalled.value.code == "sdcpp_stalled" and stalled.value.status == 504
    assert "DIFFUSION_ENGINE_SDCPP_STEP_TIMEOUT" in stalled.value.message
    assert time.monotonic() - started < 120 and _gone(pid)  # a stopped worker never answers: only the timeout ends it
    assert engine.status()["job"] is None and engine.status()["pipeline"]["engine"] == "sdcpp"  # no fallback
    # The watchdog is proven; the restart's reload may take over 2 s on a busy machine.
    engine.images.session.step_timeout = 120.0  # type: ignore[union-attr]
    image = engine.images.generate("a fox", seed=1, **SMALL)[0]  # a new worker, reloaded
    assert image.size == (64, 64) and engine.status()["pipeline"]["sdcpp"]["restarts"] == 1
    engine.images.unload()


def test_a_step_timeout_that_is_not_a_number_of_seconds_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.runtime.sdcpp import step_timeout

    for given in ("abc", "0", "-3", "inf", "nan"):
        monkeypatch.setenv("DIFFUSION_ENGINE_SDCPP_STEP_TIMEOUT", given)
        with pytest.raises(EngineError) as refused:
            step_timeout()
        assert refused.value.code == "invalid_request" and given in refused.value.message
    monkeypatch.setenv("DIFFUSION_ENGINE_SDCPP_STEP_TIMEOUT", "1.5")
    assert step_timeout() == 1.5


def _gone(pid: int) -> bool:
    """The process ended (a zombie reaped by the session's wait counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_the_readme_sdcpp_commands_say_what_they_do(
    sdcpp_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """As the README types them: ``plan --engine sdcpp`` says the diffusers fallback's figures
    are below before printing them, and generate downloads nothing, so it says nothing of a
    download (sd.cpp reads the files beside the model, never the hub base's 33.8 GB)."""
    from engine.cli import main

    assert main(["plan", "--model", str(sdcpp_model), "--engine", "sdcpp"]) == 0
    lines = capsys.readouterr().out.splitlines()
    sdcpp_line = next(i for i, line in enumerate(lines) if "memory (sd.cpp)" in line)
    first_control = next(i for i, line in enumerate(lines) if line.strip().startswith("engine "))
    assert "below" in lines[sdcpp_line] and sdcpp_line < first_control
    assert main(["generate", "--model", str(sdcpp_model), "--engine", "sdcpp", "--prompt", "a lighthouse",
                 "--width", "64", "--height", "64", "--steps", "2", "-o", str(tmp_path / "cpu.png")]) == 0
    err = capsys.readouterr().err
    assert "downloading" not in err and "GB into the hub cache" not in err
    assert (tmp_path / "cpu.png").is_file()
