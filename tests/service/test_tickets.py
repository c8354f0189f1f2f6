"""Check, then do: one generate resolves its model once and plans once.

A review counted them: ``generate --tiny flux --quant int8`` resolved the model 3
times and planned twice (the check, the weights question, the load). The load ticket
carries what the check resolved and decided into the load, which re-checks only what
can change in between; these tests count the calls where every engine module binds
them, and change the files, the machine and the free memory between check and load.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import Engine
from engine.errors import EngineError
from engine.hardware.presets import preset
from engine.policy import inference
from engine.preflight import model as preflight_model
from engine.requests.machine import MachineRequest
from engine.service.tickets import REPLAN_MARGIN_GB
from tests.support import counted


@pytest.mark.slow
def test_one_cli_generate_resolves_once_and_plans_once(cli_json: Callable[..., object], tmp_path: Path,
                                                       fixed_machine: None) -> None:
    import engine.cli.images  # noqa: F401 - bound before counting, as the command binds it
    import engine.service.images  # noqa: F401

    with counted(preflight_model.resolve_model, inference.plan_inference) as calls:
        done = cli_json("generate", "--tiny", "flux", "--quant", "int8", "--prompt", "a fox", "--steps", "1", "--width", "64",
                        "--height", "64", "--seed", "1", "-o", str(tmp_path / "out.png"))
    assert Path(done["images"][0]).is_file()  # type: ignore[index]
    assert done["status"]["plan"]["resolved"]["transformer_quant"]["value"] == "int8"  # type: ignore[index]
    assert calls == {"resolve_model": 1, "plan_inference": 1}, calls


def test_a_ticket_loads_without_resolving_or_planning_again(tiny_pipeline: Callable[[str], Path]) -> None:
    engine = Engine(hardware=MachineRequest(preset="cpu"))
    with counted(preflight_model.resolve_model, inference.plan_inference) as calls:
        ticket = engine.images.check_load(str(tiny_pipeline("sdxl")))
        assert calls == {"resolve_model": 1, "plan_inference": 1}
        status = engine.images.load(ticket)
    try:
        assert calls == {"resolve_model": 1, "plan_inference": 1}, calls
        assert status["plan"] == ticket.plan.to_dict()
    finally:
        engine.images.unload()


def test_a_file_rewritten_between_check_and_load_is_checked_again(tiny_pipeline: Callable[[str], Path],
                                                                  tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "sdxl"
    shutil.copytree(tiny_pipeline("sdxl"), folder)
    engine = Engine(hardware=MachineRequest(preset="cpu"))
    ticket = engine.images.check_load(str(folder))
    index = folder / "model_index.json"
    index.write_text("{}", encoding="utf-8")  # no longer a pipeline: the load must see it
    os.utime(index, ns=(1, 1))
    with counted(preflight_model.resolve_model) as calls, pytest.raises(EngineError) as refused:
        engine.images.load(ticket)
    assert calls["resolve_model"] == 1 and refused.value.code in ("not_a_pipeline", "family_unknown",
                                                                     "corrupt_checkpoint"), refused.value.code
    assert engine.status()["pipeline"] is None and engine.residency.owner is None


def test_free_memory_that_moved_is_planned_again_and_a_small_move_is_not(tiny_pipeline: Callable[[str], Path]) -> None:
    engine = Engine(hardware=MachineRequest(preset="rtx4090"))
    ticket = engine.images.check_load(str(tiny_pipeline("sdxl")))
    with counted(inference.plan_inference) as calls:
        assert engine.loaded.checks.recheck(ticket).plan is ticket.plan  # noqa: SLF001 - nothing moved
    assert calls["plan_inference"] == 0
    small = preset("rtx4090").replace(free_memory_gb=(ticket.available_gb + REPLAN_MARGIN_GB / 2))
    moved = preset("rtx4090").replace(free_memory_gb=(ticket.available_gb - 4 * REPLAN_MARGIN_GB))
    for profile, replans in ((small, 0), (moved, 1)):
        other = Engine(hardware=profile)
        mine = other.images.check_load(str(tiny_pipeline("sdxl")))
        other.machine._given = preset("rtx4090")  # noqa: SLF001 - the GPU's free memory changed under the ticket
        with counted(inference.plan_inference) as calls:
            other.loaded.checks.recheck(mine)  # noqa: SLF001
        assert calls["plan_inference"] == replans, (profile.free_memory_gb, calls)


def test_a_ticket_is_for_the_engine_that_issued_it(tiny_pipeline: Callable[[str], Path]) -> None:
    first, second = Engine(hardware=preset("cpu")), Engine(hardware=preset("cpu"))
    ticket = first.images.check_load(str(tiny_pipeline("sdxl")))
    with pytest.raises(EngineError) as refused:
        second.images.load(ticket)
    assert refused.value.code == "invalid_request" and second.residency.owner is None


@pytest.mark.parametrize("precision", ["auto", "bf16"])
def test_one_training_dry_run_resolves_its_base_precision_once(
    cli_json: Callable[..., object], tiny_pipeline: Callable[[str], Path], tmp_path: Path, precision: str
) -> None:
    from engine.policy import training
    from engine.testing.datasets import write_dataset

    import engine.training.preflight  # noqa: F401 - bound before counting

    data = write_dataset(tmp_path / "data", count=2)
    with counted(training.resolve_training_precision) as calls:
        plan = cli_json("train", "--base", str(tiny_pipeline("flux")), "--data", str(data), "--steps", "1",
                        "--device", "cpu", "--base-precision", precision, "--resolution", "64",
                        "--runs-dir", str(tmp_path / "runs"), "--dry-run")
    assert plan["plan"]["resolved"]["base_precision"]["value"] == "bf16"  # type: ignore[index]
    assert calls == {"resolve_training_precision": 1}, calls
