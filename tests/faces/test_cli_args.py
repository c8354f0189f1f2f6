"""The CLI refuses bad input before anything loads: exit 2, ``error[code]``
naming the flag, no traceback; explicit requests the engine overrides are
said (``warning[overridden]``) or refused (``--strict``).

Argument errors run in-process against spies on the two ways a command
could load weights (building a tiny pipeline, ``Engine.load``): a row whose
refusal came after a load would fail on the spy.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.cli import main
from engine.cli.parser import build_parser
from engine.contract.plugins import Registry
from engine.service.facade import Engine
from engine.testing.checkpoints import write_single_file

GEN = ["generate", "--tiny", "sdxl", "--prompt", "x"]
#: (argv, error code, text the message must hold): one row per case the CLI must refuse.
REFUSED: list[tuple[list[str], str, str]] = [
    ([*GEN, "--width", "100", "--height", "72"],
     "invalid_request", "--width must be a multiple of 16 (got 100); 96 or 112 would do; --height must be a multiple of 16 (got 72)"),
    (["generate", "--tiny", "flux", "--prompt", "x", "--width", "100"], "invalid_request",
     "--width must be a multiple of 16 (got 100); 96 or 112 would do"),
    ([*GEN, "--count", "0"], "invalid_request", "--count must be greater than or equal to 1"),
    ([*GEN, "--count", "-1"], "invalid_request", "--count"),
    ([*GEN, "--count", "9"], "invalid_request", "--count must be less than or equal to 8"),
    ([*GEN, "--seed", "1234567890123456789012345"], "invalid_request", "--seed"),
    ([*GEN, "-o", "out"], "invalid_request", "-o/--output out"),
    ([*GEN, "--steps", "0"], "invalid_request", "--steps must be greater"),
    ([*GEN, "--width", "0"], "invalid_request", "--width must be greater"),
    ([*GEN, "--guidance", "nan"], "invalid_request", "--guidance"),
    ([*GEN, "--count", "abc"], "usage", "--count"),
    (["generate", "--tiny", "nope", "--prompt", "x"], "unknown_family", "valid family names"),
    (["plan", "--family", "flux", "--steps", "-3"], "invalid_request", "--steps must be greater than or equal to 1"),
    (["plan", "--family", "flux", "--threads", "0"], "invalid_request", "--threads"),
    (["generate", "--model", "black-forest-labs/FLUX.1-dev", "--prompt", "x"], "hub_offline", "HF_HUB_OFFLINE"),
    (["generate", "--model", "flux.1-schnell", "--prompt", "x", "--allow-download"], "hub_offline",
     "black-forest-labs/FLUX.1-schnell"),
    (["train", "--tiny", "sdxl", "--data", ".", "--rank", "0"], "invalid_config", "--rank"),
    (["tiny", "save", "nope", "x"], "unknown_family", "nope"),
    # The rows of this wave's fields: the engine, replicas, nodes (refused before Ray or a rank starts).
    (["plan", "--family", "flux", "--engine", "nope"], "invalid_request", "--engine must be 'auto', 'diffusers' or 'sdcpp'"),
    (["serve", "--replicas", "0"], "invalid_request", "--replicas must be at least 1"),
    (["serve", "--threads", "0"], "invalid_request", "--threads 0: give 1 or more threads"),
    (["serve", "--replicas", "2", "--ray-autoscaling", "{nope"], "invalid_request", "--ray-autoscaling is not JSON"),
    (["train", "--tiny", "sdxl", "--data", ".", "--nodes", "2"], "invalid_config", "needs --main-address HOST:PORT"),
    (["train", "--tiny", "sdxl", "--data", ".", "--nodes", "2", "--node-rank", "2", "--main-address", "h:1"],
     "invalid_config", "is not below nodes 2"),
]


@pytest.fixture
def no_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a command builds a pipeline or loads a model."""

    def refuse(*_args: object, **_kwargs: object) -> None:
        pytest.fail("a model was built or loaded for an argument error")

    monkeypatch.setattr(Registry, "build_tiny_pipeline", refuse)
    monkeypatch.setattr(Engine, "load", refuse)


def refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``argv``; assert exit 2 and no traceback; the stderr."""
    status = main(argv)
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(("argv", "code", "text"), REFUSED, ids=[" ".join(r[0][:4]) + f" [{r[1]}]" for r in REFUSED])
def test_bad_input_is_refused_before_anything_loads(
    argv: list[str], code: str, text: str, no_loads: None, capsys: pytest.CaptureFixture[str],
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    err = refused(capsys, argv)
    assert f"error[{code}]" in err and text in err, err


def test_model_files_are_refused_before_loading(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    flux, sdxl = tiny_pipeline("flux"), tiny_pipeline("sdxl")
    single = write_single_file(flux, "transformer", tmp_path / "flux1-dev.safetensors")
    (tmp_path / "taken.png").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("loaded"))

    no_base = refused(capsys, ["generate", "--model", str(single), "--prompt", "x"])
    assert "error[base_required]" in no_base and "--base" in no_base and "FluxPipeline" in no_base
    wrong_base = refused(capsys, ["generate", "--model", str(single), "--base", str(sdxl), "--prompt", "x"])
    assert "error[family_mismatch]" in wrong_base and "FLUX.1" in wrong_base and "Stable Diffusion XL" in wrong_base
    wrong_family = refused(capsys, ["generate", "--model", str(sdxl), "--family", "flux", "--prompt", "x"])
    assert "error[family_mismatch]" in wrong_family and "--family sdxl" in wrong_family
    # The spelling earlier releases had still works, and is answered in today's words.
    older = refused(capsys, ["generate", "--model", str(sdxl), "--model-family", "flux", "--prompt", "x"])
    assert "error[family_mismatch]" in older and "--family sdxl" in older
    assert "warning[deprecated]: --model-family is deprecated and will be removed in 0.3.0; use --family" in older
    exists = refused(capsys, ["generate", "--model", str(sdxl), "--prompt", "x", "-o", "taken.png"])
    assert "error[output_exists]" in exists and "--overwrite" in exists
    occupied = refused(capsys, ["tiny", "save", "sdxl", str(tmp_path)])
    assert "error[output_exists]" in occupied


# -- explicit requests the engine overrides -----------------------------------------------

#: (argv, the flag overridden): explicit values this machine (a preset) cannot honour.
OVERRIDES: list[tuple[list[str], str]] = [
    (["plan", "--family", "flux", "--hardware", "t4", "--quant", "fp8"], "--quant fp8"),
    (["plan", "--family", "sdxl", "--hardware", "cpu", "--quant", "nf4"], "--quant nf4"),
    (["plan", "--family", "sdxl", "--hardware", "cpu", "--attention", "flash"], "--attention flash"),
    (["plan", "--family", "qwen-image", "--hardware", "b200", "--quant", "mxfp8"], "--quant mxfp8"),
    (["plan", "--family", "qwen-image", "--hardware", "h100", "--quant", "fp8", "--no-torchao"], "--quant fp8"),
]


@pytest.mark.parametrize(("argv", "flag"), OVERRIDES, ids=[" ".join(o[0][2:]) for o in OVERRIDES])
def test_an_override_warns_and_strict_refuses_it(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    warnings = [line for line in err.splitlines() if line.startswith("warning[overridden]")]
    assert len(warnings) == 1 and flag in warnings[0], err
    (listed,) = json.loads(out)["overridden"]
    assert f"{listed['flag']} {listed['requested']}" == flag and listed["reason"]
    strict = refused(capsys, [*argv, "--strict"])
    assert "error[overridden]" in strict and flag in strict


def test_honoured_requests_do_not_warn(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--family", "flux", "--hardware", "h100", "--quant", "fp8", "--strict"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_generate_strict_refuses_before_loading(
    tiny_pipeline: Callable[[str], Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    sdxl = tiny_pipeline("sdxl")
    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("loaded"))
    err = refused(capsys, ["generate", "--model", str(sdxl), "--prompt", "x", "--quant", "nf4", "--strict",
                           "-o", str(tmp_path / "x.png")])
    assert "error[overridden]" in err and "--quant nf4" in err


# -- the parser and the process --------------------------------------------------------------


def test_every_flag_has_help_and_shows_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    for name, sub in commands.choices.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
    assert main(["generate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: auto)" in text and "(default: out.png)" in text
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("diffusion-engine ")


def test_info_text_shows_the_reasons(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--family", "qwen-image", "--hardware", "b200"]) == 0
    text = capsys.readouterr().out
    assert "denied mxfp8: mxfp8 damages Qwen-Image semantics" in text


def test_ctrl_c_exits_130_quietly(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(*_args: object, **_kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("engine.service.facade.load_registry", interrupted)
    assert main(["families"]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_a_closed_pipe_ends_quietly() -> None:
    """``diffusion-engine info | head -1``: the reader goes away before the output is written."""
    child = subprocess.Popen([sys.executable, "-m", "engine", "info", "--hardware", "h100"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()
    err = child.stderr.read().decode()
    assert child.wait(timeout=120) in (0, 1) and "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize(("flags", "cached"), [([], True), (["--no-prompt-cache"], False)])
def test_the_prompt_cache_flag_reaches_the_engines_request(flags: list[str], cached: bool) -> None:
    from engine.cli.requests import plan_controls

    for command in ("plan", "generate"):
        args = build_parser().parse_args([command, "--family" if command == "plan" else "--tiny", "sdxl",
                                          *(["--prompt", "x"] if command == "generate" else []), *flags])
        assert plan_controls(args).request().prompt_cache is cached


def test_an_unknown_flag_is_named_first_with_the_nearest_known_one(capsys: pytest.CaptureFixture[str]) -> None:
    """``--modle`` is the mistake, not a missing ``--model``; abbreviations argparse expands still work."""
    assert main(["generate", "--modle", "x", "--prompt", "a fox"]) == 2
    err = capsys.readouterr().err
    assert "error[usage]" in err and "unknown flag --modle (did you mean --model?)" in err
    assert "required" not in err
    args = build_parser().parse_args(["generate", "--tiny", "flux", "--prompt", "a", "--neg", "b"])
    assert args.negative_prompt == "b"  # an unambiguous prefix is argparse's own
    from engine.error_catalogue import CATALOGUE

    assert "usage" in CATALOGUE  # the code the terminal prints has its row in docs/errors.md


def test_an_unknown_family_suggests_the_nearest_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--family", "zimage-turbo"]) == 2
    err = capsys.readouterr().err
    assert "error[unknown_family]" in err and "did you mean 'zimage'?" in err


def test_replicas_without_a_model_are_refused_before_ray_starts(capsys: pytest.CaptureFixture[str]) -> None:
    """A replica cannot load a model after it starts, so ``serve --replicas 2`` needs ``--load``."""
    assert main(["serve", "--replicas", "2", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "error[invalid_request]" in err and "--load MODEL" in err


def test_a_port_in_use_or_out_of_range_is_refused_before_anything_loads(
        capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    assert main(["serve", "--port", "99999"]) == 2
    assert "error[usage]" in capsys.readouterr().err  # not printed as 99999 and served elsewhere
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--load", "/no/such/model"]) == 2
    err = capsys.readouterr().err
    assert f"error[port_in_use]: port {port} on 127.0.0.1 is in use" in err  # before the load is tried
