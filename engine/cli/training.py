"""``train`` and ``runs``: LoRA training runs from the terminal.

``train`` builds a :class:`~engine.training.config.TrainingConfig` (the model
the HTTP API validates too) from TrainingConfig's defaults, ``--config
FILE``, ``--resume RUN`` and the flags, and asks :class:`engine.Engine` for
every preflight before anything loads; problems name the flags. The run is
started, followed and stopped through Engine alone (the run lock, the
residency arbiter and the canary the HTTP API gets apply here too): this
module only turns flags into a config and Ctrl-C into stop requests.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from engine.cli.common import DOWNLOAD_HELP, add_controls, download_allowed
from engine.errors import EngineError
from engine.requests import TRAIN_CONTROLS, MachineRequest

if TYPE_CHECKING:  # the training config (pydantic) loads with the command that builds one
    from engine.requests import TrainingConfig

#: What ``--tiny`` trains at when --resolution is not given: small and quick for every family.
TINY_RESOLUTION = 64
#: ``--gradient-checkpointing`` words -> the config's value (None: auto).
CHECKPOINTING = {"auto": None, "on": True, "off": False}


def add_parsers(commands: argparse._SubParsersAction, *, runs_dir_help: str,  # type: ignore[type-arg]
                add_machine_args: Callable[[argparse.ArgumentParser], None],
                common: Callable[[argparse.ArgumentParser], None]) -> None:
    train = commands.add_parser(
        "train", help="train a LoRA on a folder of images",
        description="Train a LoRA. Values come from TrainingConfig's defaults, then --config FILE, "
        "then --resume RUN's recorded config, then the flags given here (the last one wins).",
    )
    rows = {c.field: c for c in TRAIN_CONTROLS}
    which = train.add_mutually_exclusive_group()
    which.add_argument(rows["base_model"].flag, **rows["base_model"].argparse_kwargs())  # type: ignore[arg-type]
    which.add_argument("--tiny", metavar="FAMILY", help="a tiny random-weight pipeline of FAMILY "
                       f"(trained at {TINY_RESOLUTION} px unless --resolution says otherwise)")
    train.add_argument("--allow-download", action="store_true", help=DOWNLOAD_HELP)
    train.add_argument("--config", metavar="FILE", help="a TOML (or JSON) file of TrainingConfig fields; "
                       "a run folder's config.toml repeats that run")
    train.add_argument("--resume", metavar="RUN", help="continue RUN (an id in --runs-dir, or its folder) "
                       "from its last checkpoint")
    add_controls(train, [c for c in TRAIN_CONTROLS if c.field != "base_model"])
    train.add_argument("--runs-dir", type=Path, default=None, metavar="DIR", help=runs_dir_help)
    train.add_argument("--dry-run", action="store_true", help="run every preflight, load nothing")
    add_machine_args(train)
    common(train)
    train.set_defaults(run=cmd_train)

    runs = commands.add_parser("runs", help="list training runs; `runs show ID`, `runs rm ID`")
    runs.add_argument("action", nargs="?", choices=("list", "show", "rm"), default="list",
                      help="list the runs, show one, or remove a finished one")
    runs.add_argument("run_id", nargs="?", metavar="ID", help="a run id (or a run folder) for show / rm")
    runs.add_argument("--runs-dir", type=Path, default=None, metavar="DIR", help=runs_dir_help)
    common(runs)
    runs.set_defaults(run=cmd_runs)


def cmd_train(args: argparse.Namespace) -> int:
    import tempfile

    from engine import Engine

    if args.hardware and not args.dry_run:
        raise EngineError(
            "--hardware describes a machine you do not have: use it with --dry-run",
            code="invalid_request",
        )
    if not args.dry_run:  # the trainer's fork server imports torch while this process does
        Engine.prewarm_training()
    machine = MachineRequest(args.hardware, args.free_gb, torchao=not args.no_torchao)
    # A start is heavy anyway: verify torchao and bf16 for real, not by name.
    engine = Engine(hardware=machine, runs_dir=Path(args.runs_dir), allow_download=download_allowed(args))
    if args.tiny:
        engine.catalog.family(args.tiny)  # an unknown family is refused before anything is built
    previous = _resumed_run(engine, args) if args.resume else None
    # Every flag is checked before a tiny pipeline is built or anything is probed.
    _train_config(args, f"tiny-{args.tiny}" if args.tiny else args.base_model, previous)
    with tempfile.TemporaryDirectory(prefix="diffusion-engine-tiny-") as scratch:
        base = args.base_model
        if args.tiny:
            if not args.verbose:
                from engine.logs import quiet_library_logs

                quiet_library_logs(progress_bars=False)  # no "Writing model shards" bars
            base = str(engine.catalog.tiny_pipeline(args.tiny, Path(scratch) / args.tiny))
        config = _train_config(args, base, previous)
        if not args.dry_run:
            return _run_training(engine, config, args.json, resume=args.resume)
        plan = engine.training.plan(config)
        if args.json:
            print(json.dumps({"ok": True, "plan": plan.to_dict()}, indent=2))
        else:
            _print_training_plan(plan)
        return 0


def _train_config(args: argparse.Namespace, base: str | None, previous: dict[str, object] | None) -> TrainingConfig:
    """TrainingConfig defaults < --config FILE < the resumed run's config < the flags given."""
    from engine.requests import InvalidConfig, TrainingConfig, read_config_file

    data: dict[str, object] = dict(read_config_file(args.config)) if args.config else {}
    if previous is not None:
        recorded = previous["config"]
        assert isinstance(recorded, dict)
        data.update({k: v for k, v in recorded.items() if k not in ("output_dir", "resume_from")})
        data["resume_from"] = previous["checkpoint"]
    given = {c.field: getattr(args, c.field) for c in TRAIN_CONTROLS if getattr(args, c.field) is not None}
    if base is not None:
        given["base_model"] = base
    if "gradient_checkpointing" in given:
        given["gradient_checkpointing"] = CHECKPOINTING[str(given["gradient_checkpointing"])]
    if getattr(args, "tiny", None) and "resolution" not in data:
        data["resolution"] = TINY_RESOLUTION
    data.update(given)
    if "steps" in given:
        data.pop("epochs", None)  # a flag wins over the file's other way to say how long
    elif "epochs" in given:
        data.pop("steps", None)
    missing = [flag for flag, field in (("--base (or --tiny)", "base_model"), ("--data", "dataset_dir"))
               if not data.get(field)]
    if missing:
        raise InvalidConfig(f"train needs {' and '.join(missing)} (or a --config file that sets them)")
    return TrainingConfig.from_data(data)  # a refusal's fields become flags where every refusal is printed


def _resumed_run(engine, args: argparse.Namespace) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The run ``--resume`` names and its newest checkpoint (Engine's rule; the message names the flag)."""
    try:
        return engine.training.resume_point(args.resume)  # type: ignore[no-any-return]
    except EngineError as exc:
        hint = " (pass --runs-dir if the runs are elsewhere)" if exc.code == "run_not_found" else ""
        raise EngineError(f"--resume {args.resume}: {exc.message}{hint}", code=exc.code) from None


def _print_training_plan(plan) -> None:  # type: ignore[no-untyped-def]
    clips = plan.dataset.clips
    examples = f"{clips} clip(s) and {len(plan.dataset.items) - clips} image(s)" if clips else \
        f"{len(plan.dataset.items)} images"
    print(f"{plan.family.label} LoRA on {plan.hardware.name} ({plan.hardware.device_name}); "
          f"device {plan.device}; {plan.steps} steps over {examples}")
    if plan.window is not None:
        print(f"  window                 {plan.window.frames} frames at {plan.window.fps:g} fps "
              f"({plan.window.seconds:.2f} s); short clips: {plan.window.short}")
    decided = [(name, getattr(plan, name)) for name in
               ("base_precision", "weight_dtype", "compile", "gradient_checkpointing")]
    if plan.expert is not None:
        decided.append(("expert", plan.expert))
    if plan.trained_base is not None:
        decided.append(("base", plan.trained_base))
    if plan.levers is not None:
        decided += [(name, getattr(plan.levers, name)) for name in plan.levers.__dataclass_fields__]
    for name, resolved in decided:
        label = "Auto" if resolved.source == "auto" else "Set"
        value = getattr(resolved.value, "name", resolved.value)  # an expert choice prints its name
        print(f"  {name:<22} {str(value):<10} {label}: {resolved.reason}")
    print(f"  lora targets    {', '.join(plan.lora_targets)}")
    if plan.weights is not None and not plan.weights["here"]:
        print(f"  weights         {plan.weights['note']}")
    if plan.available is not None:
        print(f"  memory          {plan.available.summary()}")
    if plan.memory is not None:
        for line in plan.memory.lines():
            print(f"    {line}")
    for line in plan.dataset.warnings():
        print(f"  {line}")
    if plan.buckets is not None:
        for line in plan.buckets.lines():
            print(f"  {line}")


def _run_training(engine, config, as_json: bool, resume: str | None = None) -> int:  # type: ignore[no-untyped-def]
    """Start the run through ``engine`` and follow it; Ctrl-C stops after the step and saves, a second stops now.

    The handler is in place before the start, so a Ctrl-C during the
    preflight or the child's start becomes a stop request once the run exists
    instead of a KeyboardInterrupt that would orphan the record.
    """
    import signal

    from engine.cli.images import progress_bar

    interrupts: list[int] = []
    old_handler = signal.signal(signal.SIGINT, lambda signum, frame: interrupts.append(signum))
    try:
        started = engine.training.start(config, resume=resume)
        bar = None if as_json else progress_bar("training")
        phases = _PhaseLines(str(started.get("base_model", "")), quiet=as_json)
        phases.show("loading")  # every run loads its base first: said now, not when a poll happens to see it
        handled = 0
        while True:
            try:
                record = engine.training.wait(timeout=0.2)
                break
            except TimeoutError:
                pass
            if len(interrupts) > handled:
                handled = len(interrupts)
                stopping = _stop(engine, now=handled > 1)
                if handled == 1:
                    print("\nstopping now: no step is trained yet" if stopping == "now" else
                          "\nstopping after this step and saving (Ctrl-C again: stop now, keep the last "
                          "checkpoint)", file=sys.stderr)
            status = engine.training.status() or {}
            phases.show(str(status.get("phase", "")))
            if bar is not None and status.get("step"):
                bar(int(status["step"]), int(status["steps"]))  # type: ignore[call-overload]
    finally:
        signal.signal(signal.SIGINT, old_handler)
    if as_json:
        print(json.dumps(record.to_dict(), indent=2))
    else:
        losses = record.metrics["loss"].points
        print(f"run {record.run_id}: {record.status} at step {record.step}/{record.steps}"
              + (f", final loss {losses[-1][1]:.4f}" if losses else ""))
        for name, path in record.outputs.items():
            print(f"  {name}: {path}")
        print(f"  record: {record.path}")
        if "lora_from_checkpoint" in record.outputs:
            print(f"the LoRA is the last checkpoint's ({Path(record.outputs['lora_from_checkpoint']).name}): "
                  "the step in progress when it was stopped was not saved")
        if record.error:
            print(f"error[{record.error['code']}]: {record.error['message']}", file=sys.stderr)
        elif record.status == "completed":
            print(f"Training complete: {record.steps} steps; the LoRA is {record.outputs.get('lora', record.folder)}")
    if interrupts:
        return 130  # stopped by Ctrl-C, as a shell reports an interrupted command (and `generate` does)
    return 0 if record.status in ("completed", "stopped") else 1


def _stop(engine, *, now: bool) -> str:  # type: ignore[no-untyped-def]
    """Ask ``engine`` to stop its run: ``now`` or ``after_step`` (the engine's answer); a run that
    finished meanwhile has nothing left to stop."""
    try:
        return str(engine.training.stop(save=True, now=now).get("stopping", "now" if now else "after_step"))
    except EngineError as exc:
        if exc.code != "not_training":
            raise
        return "now"


class _PhaseLines:
    """A line on stderr as the run enters each phase before its first step (a 14B base loads
    for minutes, and a silent terminal looks hung), with how long the one before took."""

    WORDS = {"loading": "loading the base {base} (Ctrl-C stops at once: no step is trained yet)",
             "caching": "encoding the dataset and its captions once",
             "placing": "placing the base on the device in its precision"}

    def __init__(self, base: str, *, quiet: bool) -> None:
        self._base, self._quiet = base, quiet
        self._phase, self._since = "", time.monotonic()

    def show(self, phase: str) -> None:
        if phase == self._phase or phase not in self.WORDS:
            return
        took = f" ({self._phase} took {time.monotonic() - self._since:.1f} s)" if self._phase in self.WORDS else ""
        self._phase, self._since = phase, time.monotonic()
        if not self._quiet:
            print(f"training: {self.WORDS[phase].format(base=self._base)}{took}", file=sys.stderr)


def cmd_runs(args: argparse.Namespace) -> int:
    from engine import Engine

    engine = Engine(runs_dir=Path(args.runs_dir))
    if args.action != "list":
        if not args.run_id:
            raise EngineError(f"`runs {args.action}` needs a run id: `diffusion-engine runs` lists them",
                              code="invalid_request")
        try:
            return _cmd_run_show(engine, args) if args.action == "show" else _cmd_run_rm(engine, args)
        except EngineError as exc:
            if exc.code == "run_not_found":
                raise EngineError(f"{exc.message} (pass --runs-dir if they are elsewhere)", code=exc.code) from None
            raise
    records = engine.training.runs()
    if args.json:
        print(json.dumps(records, indent=2))
        return 0
    for record in records:
        losses = record["metrics"]["loss"]  # type: ignore[index]
        loss = f"loss {losses[-1][1]:.4f}" if losses else ""
        print(f"{record['run_id']:<40} {record['status']:<10} {record['step']}/{record['steps']} {loss}")
    if not records:
        print(f"no runs in {args.runs_dir}")
    return 0


def _cmd_run_show(engine, args: argparse.Namespace) -> int:  # type: ignore[no-untyped-def]
    """One run: status, config, last metrics, samples and the files in its folder."""
    record = engine.training.run(args.run_id)
    if args.json:
        print(json.dumps(record, indent=2))
        return 0
    print(f"run {record['run_id']}: {record['status']} at step {record['step']}/{record['steps']} "
          f"({record['family']})")
    print(f"  folder: {record['folder']}")
    if record.get("error"):
        print(f"  error[{record['error']['code']}]: {record['error']['message']}")
    print("  config:")
    for key, value in record["config"].items():
        if value is not None:
            print(f"    {key:<24} {value}")
    print("  metrics (last):")
    for name, points in record["metrics"].items():
        if points:
            step, value = points[-1]
            print(f"    {name:<24} {value:.6g} at step {step}")
    if record.get("samples"):
        print("  samples:")
        for sample in record["samples"]:
            print(f"    step {sample['step']:<6} {sample['path']}  ({sample['prompt']})")
    print("  files:")
    for name in record["files"]:
        print(f"    {name}")
    return 0


def _cmd_run_rm(engine, args: argparse.Namespace) -> int:  # type: ignore[no-untyped-def]
    """Delete a finished run's folder; a run still going is refused."""
    removed = engine.training.remove(args.run_id)
    print(f"removed run {removed['run_id']} ({removed['folder']})")
    return 0
