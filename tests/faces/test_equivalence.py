"""One request, one answer, whichever door it comes in by.

The same table of requests (presets x families x model references x
controls, and the refusals reachable without a GPU) goes through the CLI
(``--json``), a real HTTP server on loopback and the Python API. The plans
must be identical, and a refusal must carry the same code at every door
(its words differ: a flag at the terminal, a JSON field over HTTP).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine import Engine
from engine.cli import main
from engine.errors import EngineError
from engine.requests import FIELD_FLAGS, MachineRequest, PlanControls
from engine.server.app import create_app
from engine.server.settings import ServerSettings
from engine.testing.datasets import write_dataset
from tests.support import LiveServer

PRESETS = ("t4", "rtx3090", "a100-80g")
#: Model references by how they are written; "TINY:F" is F's tiny pipeline folder (built here).
MODELS: tuple[dict[str, str], ...] = (
    {"family": "flux"},
    {"family": "sdxl", "checkpoint": "sdxl-turbo"},
    {"model": "flux.1-dev"},
    {"model": "qwen-image"},
    {"model": "z-image-turbo"},
    {"model": "black-forest-labs/FLUX.1-schnell"},
    {"model": "diffusers/FLUX.1-dev-bnb-4bit"},
    {"model": "someone/a-finetune", "family": "sdxl"},
    {"model": "TINY:flux"},
    {"model": "TINY:sdxl", "family": "flux"},  # family_mismatch
    {"model": "someone/unknown-model"},  # family_unknown: --family names the fix
    {"model": "no-such-checkpoint"},  # model_not_found
)
CONTROLS: tuple[dict[str, object], ...] = (
    {},
    {"quant": "int8", "memory": "model_offload"},
    {"dtype": "fp16", "quant": "fp8", "speed": "off", "attention": "native", "threads": 2},
    {"quant": "int4"},  # invalid_request, at the edge
)


def _flags(request: dict[str, object]) -> list[str]:
    """The CLI's flags for a request, by the control table (a field's flag, its value)."""
    flags: list[str] = []
    for field, value in request.items():
        flags += [FIELD_FLAGS[field], str(value)]
    return flags


@pytest.fixture(scope="module")
def tiny_models(tiny_pipeline: Callable[[str], Path]) -> dict[str, str]:
    return {f"TINY:{name}": str(tiny_pipeline(name)) for name in ("flux", "sdxl")}


@pytest.fixture(scope="module")
def servers(tiny_models: dict[str, str]) -> Iterator[dict[str, tuple[str, Engine]]]:
    """One real loopback server per preset, accepting hub ids and the tiny models' folders."""
    roots = tuple({str(Path(p).parent.parent) for p in tiny_models.values()})
    started: dict[str, tuple[str, Engine]] = {}
    stack = []
    for preset in PRESETS:
        engine = Engine(hardware=MachineRequest(preset))
        settings = ServerSettings(model_roots=tuple(Path(r) for r in roots), allow_hub=True)
        server = LiveServer(create_app(engine, settings))
        started[preset] = (server.__enter__(), engine)
        stack.append(server)
    yield started
    for server in stack:
        server.__exit__(None, None, None)


#: The Python door: one engine per preset, as an app would hold one.
ENGINES: dict[str, Engine] = {}


def _python(preset: str, model: dict[str, str], controls: dict[str, object]) -> dict[str, Any]:
    engine = ENGINES.setdefault(preset, Engine(hardware=MachineRequest(preset)))
    try:
        request = PlanControls.model_validate(controls).request()
    except Exception:  # the edge's refusal: the same model the other faces validate with
        return {"error": "invalid_request"}
    try:
        plan = engine.images.plan(model.get("model"), family=model.get("family"), checkpoint=model.get("checkpoint"),
                           request=request)
    except EngineError as error:
        return {"error": error.code}
    return {"plan": plan.to_dict()}


#: Where each door's refusal messages are kept, to check their words.
MESSAGES: dict[str, list[str]] = {"cli": [], "http": []}
#: A request field written as the engine's messages name one (``quant=int8``).
FIELD_SPELLING = re.compile(r"(?<![\w./-])(" + "|".join(sorted(FIELD_FLAGS, key=len, reverse=True)) + r")=\S")
#: A flag of the control table.
FLAG_SPELLING = re.compile(r"(?<![\w-])(" + "|".join(sorted(set(FIELD_FLAGS.values()), key=len, reverse=True))
                           + r")(?![\w-])")


def _cli(preset: str, model: dict[str, str], controls: dict[str, object], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    code = main(["plan", "--json", "--hardware", preset, *_flags(model), *_flags(controls)])
    out = capsys.readouterr().out
    if code != 0:
        if not out.strip():  # argparse's own refusals (usage) print no JSON
            return {"error": "usage"}
        MESSAGES["cli"].append(json.loads(out)["error"]["message"])
        return {"error": json.loads(out)["error"]["code"]}
    return {"plan": json.loads(out)["plan"]}


def _http(url: str, model: dict[str, str], controls: dict[str, object]) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/images/plan", json={**model, **controls}, timeout=60)
    body = response.json()
    if response.status_code != 200:
        MESSAGES["http"].append(body["error"]["message"])
        return {"error": body["error"]["code"]}
    return {"plan": body}


def _resolved(request: dict[str, str], tiny: dict[str, str]) -> dict[str, str]:
    return {k: tiny.get(v, v) for k, v in request.items()}


@pytest.mark.slow
def test_plans_and_refusals_are_the_same_through_every_door(
    servers: dict[str, tuple[str, Engine]], tiny_models: dict[str, str], capsys: pytest.CaptureFixture[str],
) -> None:
    compared, refusals = 0, set()
    for preset in PRESETS:
        url, _ = servers[preset]
        for written in MODELS:
            model = _resolved(written, tiny_models)
            for controls in CONTROLS:
                python = _python(preset, model, controls)
                cli = _cli(preset, model, controls, capsys)
                http = _http(url, model, controls)
                label = (preset, written, controls)
                assert cli == python, label
                assert http == python, label
                compared += 1
                if "error" in python:
                    refusals.add(python["error"])
    assert compared >= 100  # 3 presets x 12 references x 4 control sets
    # The refusals a plan can give without a GPU were all reached, and agreed on.
    assert {"invalid_request", "family_mismatch", "family_unknown", "model_not_found",
            "fp16_unsafe"} <= refusals, refusals
    # Each door in its own words: the terminal names flags, never a field=value; HTTP names
    # JSON fields, never a flag.
    assert MESSAGES["cli"] and MESSAGES["http"]
    assert [m for m in MESSAGES["cli"] if FIELD_SPELLING.search(m)] == []
    assert [m for m in MESSAGES["http"] if FLAG_SPELLING.search(m)] == []


@pytest.mark.slow
def test_training_dry_runs_are_the_same_through_every_door(
    servers: dict[str, tuple[str, Engine]], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A hub id, a checkpoint name and a pre-quantised repo are sized offline alike at every door."""
    data = write_dataset(tmp_path / "data", count=2)
    cases = [
        ("rtx3090", {"base_model": "black-forest-labs/FLUX.1-dev"}),
        ("rtx3090", {"base_model": "flux.1-dev"}),
        ("a100-80g", {"base_model": "Qwen/Qwen-Image"}),
        ("rtx3090", {"base_model": "diffusers/FLUX.1-dev-bnb-4bit"}),
        ("t4", {"base_model": "flux.1-dev"}),  # no native bf16: refused
        ("a100-80g", {"base_model": "flux.1-dev", "base_precision": "int4"}),
        ("a100-80g", {"base_model": "sdxl-base-1.0", "lora_rank": 8, "mixed_precision": "fp16"}),
    ]
    for preset, fields in cases:
        url, _ = servers[preset]
        config = {**fields, "dataset_dir": str(data)}
        engine = Engine(hardware=MachineRequest(preset), allow_download=False)
        try:
            python: dict[str, Any] = {"plan": engine.training.plan(config).to_dict()}
        except EngineError as error:
            python = {"error": error.code}
        capsys.readouterr()
        code = main(["train", "--dry-run", "--json", "--hardware", preset, *_flags(config)])
        out = json.loads(capsys.readouterr().out)
        cli = {"plan": out["plan"]} if code == 0 else {"error": out["error"]["code"]}
        # The server confines the dataset to its roots: give it one holding this dataset.
        settings = ServerSettings(dataset_roots=(tmp_path,), allow_hub=True)
        with LiveServer(create_app(engine, settings)) as own:
            response = httpx.post(f"{own}/v1/training/plan", json=config, timeout=60)
        body = response.json()
        http = {"plan": body} if response.status_code == 200 else {"error": body["error"]["code"]}
        assert cli == python == http, (preset, fields)
        if "plan" in python:
            assert python["plan"]["weights"]["here"] is False
            assert python["plan"]["weights"]["download_gb"] > 1
    assert url  # the module's servers started


def test_a_refusal_names_the_flag_at_the_terminal_and_the_field_over_http(
    servers: dict[str, tuple[str, Engine]], capsys: pytest.CaptureFixture[str],
) -> None:
    url, _ = servers["a100-80g"]
    capsys.readouterr()
    assert main(["plan", "--family", "flux", "--quant", "int4"]) == 2
    terminal = capsys.readouterr().err
    assert "--quant must be" in terminal and "'int4'" in terminal
    body = httpx.post(f"{url}/v1/images/plan", json={"family": "flux", "quant": "int4"}, timeout=30).json()
    assert body["error"]["code"] == "invalid_request"
    assert "quant must be" in body["error"]["message"] and "--quant" not in body["error"]["message"]


def test_a_dry_runs_refusals_are_reported_together_at_every_door(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A mistyped dataset on a T4 (no native bf16 for FLUX): both refusals, through every door."""
    config = {"base_model": "flux.1-dev", "dataset_dir": str(tmp_path / "no-such-data")}
    engine = Engine(hardware=MachineRequest("t4"), allow_download=False)
    with pytest.raises(EngineError) as raised:
        engine.training.plan(config)
    python = (raised.value.code, [other.code for other in raised.value.also])
    capsys.readouterr()
    assert main(["train", "--dry-run", "--json", "--hardware", "t4", *_flags(config)]) == 2
    out = json.loads(capsys.readouterr().out)["error"]
    cli = (out["code"], [other["code"] for other in out["also"]])
    with LiveServer(create_app(engine, ServerSettings(dataset_roots=(tmp_path,), allow_hub=True))) as url:
        body = httpx.post(f"{url}/v1/training/plan", json=config, timeout=60).json()["error"]
    http = (body["code"], [other["code"] for other in body["also"]])
    assert python == cli == http == ("dataset_not_found", ["no_native_bf16"])
