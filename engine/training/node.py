"""One rank of a multi-machine run: ``accelerate launch ... -m engine.training.node CONFIG``.

``--gpus N`` (CLI, server, :class:`~engine.Engine`) trains on the GPUs of
one machine: its trainer child forks the ranks (:mod:`engine.training.launch`).
Across machines, accelerate's own launcher starts the ranks on every node
(each node's ``accelerate config`` names the machine count, this machine's
rank and the main machine's address), and every rank runs this module:

* each rank plans the run from the config file on its own machine, so each
  node's preflight checks its own device (one rank per device) before any
  weight is loaded;
* the ranks train exactly as the engine's do (same DDP sync, same sharding
  of the global batch, same per-example noise: ``batch_size`` is per rank);
* rank 0 writes the run record (``run.json``), the checkpoints and the LoRA
  into the config's ``output_dir`` (on the main machine) and prints one JSON
  line per event.

A failed preflight on one node is printed there and ends that rank;
accelerate's launcher then ends the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="accelerate launch -m engine.training.node",
        description="One rank of a multi-machine LoRA run (start it on every node with accelerate launch).",
    )
    parser.add_argument("config", type=Path, help="the run's TOML/JSON config (the fields of train --config)")
    args = parser.parse_args(argv)

    from engine.errors import EngineError
    from engine.logs import quiet_library_logs
    from engine.contract.plugins import load_registry
    from engine.training.replicas import join
    from engine.training.trainer import run_training

    quiet_library_logs(progress_bars=False)
    try:
        registry = load_registry()  # once: the preflight and the trainer share it
        plan = _plan(registry, args.config)
    except EngineError as exc:
        print(f"error[{exc.code}]: {exc.message}", file=sys.stderr)
        return 2
    try:
        replicas = join(plan.device, plan.config.join_timeout)
    except EngineError as exc:  # the other nodes never came: said, not a traceback
        print(f"error[{exc.code}]: {exc.message}", file=sys.stderr)
        return 1
    plan = _for_world(plan, replicas.world)
    folder = Path(plan.config.output_dir or Path("runs") / _run_id(plan))
    emit = _recorder(plan, folder) if replicas.main else (lambda event: None)
    try:
        result = run_training(plan, folder, emit, lambda: None, registry=registry, replicas=replicas)
    except EngineError as exc:
        emit({"type": "error", "code": exc.code, "message": exc.message})
        return 1
    emit(result)
    return 0


def _plan(registry, config_path: Path):  # type: ignore[no-untyped-def]
    """This machine's plan for one rank (``gpus=1``: one device per rank, checked here)."""
    from engine.hardware.probe import probe
    from engine.requests.training import TrainingConfig, read_config_file
    from engine.training.preflight import preflight_training

    config = TrainingConfig.from_data({**read_config_file(config_path), "gpus": 1})
    return preflight_training(registry, config, probe(verify=True))


def _for_world(plan, world: int):  # type: ignore[no-untyped-def]
    """The plan with the run's world size: ``epochs`` count global batches."""
    config = plan.config.model_copy(update={"gpus": world})
    return dataclasses.replace(plan, config=config, steps=config.total_steps(len(plan.dataset.items)))


def _run_id(plan) -> str:  # type: ignore[no-untyped-def]
    from engine.training.runner import new_run_id

    return new_run_id(plan.family.name)


def _recorder(plan, folder: Path):  # type: ignore[no-untyped-def]
    """Rank 0's events into ``run.json`` (written as each event lands) and stdout."""
    from engine.training.lock import ProcessId
    from engine.training.records import RunRecord

    folder.mkdir(parents=True, exist_ok=True)
    record = RunRecord(run_id=folder.name, folder=folder.resolve(), family=plan.family.name,
                       base_model=plan.config.base_model, config=plan.config.public_dict(), plan=plan.to_dict(),
                       steps=plan.steps, history_limit=plan.config.metric_history)
    record.set_owner(ProcessId.current())
    record.set_trainer(ProcessId.current())
    record.save()

    def emit(event: dict[str, object]) -> None:
        record.apply(event)
        record.save()
        print(json.dumps(event, default=str), flush=True)

    return emit


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
