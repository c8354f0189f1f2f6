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
from collections.abc import Callable
from pathlib import Path
from typing import get_args

from engine.cli.common import DOWNLOAD_HELP, download_allowed
from engine.errors import EngineError
from engine.plugins import load_registry
from engine.training.config import LossWeighting, Optimizer

#: What ``--tiny`` trains at when --resolution is not given: small and quick for every family.
TINY_RESOLUTION = 64


def add_parsers(commands: argparse._SubParsersAction, *, runs_dir_help: str,  # type: ignore[type-arg]
                add_machine_args: Callable[[argparse.ArgumentParser], None],
                common: Callable[[argparse.ArgumentParser], None]) -> None:
    RUNS_DIR_HELP = runs_dir_help
    _add_machine_args = add_machine_args
    train = commands.add_parser(
        "train", help="train a LoRA on a folder of images",
        description="Train a LoRA. Values come from TrainingConfig's defaults, then --config FILE, "
        "then --resume RUN's recorded config, then the flags given here (the last one wins).",
    )
    which = train.add_mutually_exclusive_group()
    which.add_argument("--base", metavar="PATH", help="the base pipeline folder or hub id")
    train.add_argument("--allow-download", action="store_true", help=DOWNLOAD_HELP)
    which.add_argument("--tiny", metavar="FAMILY", help="a tiny random-weight pipeline of FAMILY "
                       f"(trained at {TINY_RESOLUTION} px unless --resolution says otherwise)")
    train.add_argument("--data", metavar="DIR", help="images with .txt/.caption sidecars or metadata.jsonl")
    train.add_argument("--config", metavar="FILE", help="a TOML (or JSON) file of TrainingConfig fields; "
                       "a run folder's config.toml repeats that run")
    train.add_argument("--resume", metavar="RUN", help="continue RUN (an id in --runs-dir, or its folder) "
                       "from its last checkpoint")
    train.add_argument("--family", help="the base's family (detected when omitted)")
    train.add_argument("--steps", type=int, help="optimizer steps (default: from --epochs, else 500)")
    train.add_argument("--epochs", type=int, help="passes over the dataset (instead of --steps)")
    train.add_argument("--resolution", type=int, help="training size in pixels, a multiple of 16 "
                       f"(default 512; {TINY_RESOLUTION} with --tiny)")
    train.add_argument("--batch-size", type=int, help="images per step on each GPU (default 1)")
    train.add_argument("--lr", type=float, help="learning rate (default 1e-4)")
    train.add_argument("--rank", type=int, help="LoRA rank (default 16)")
    train.add_argument(
        "--gradient-checkpointing", choices=("auto", "on", "off"),
        help="recompute block activations in backward: far less memory, about a third "
        "slower; auto turns it on only when the run would not fit without it (default: auto)",
    )
    train.add_argument("--base-precision", help="nf4 | bf16 | int8 | fp8 | mxfp8 | auto (default auto)")
    train.add_argument("--mixed-precision", help="bf16 | fp16 | no (default bf16)")
    train.add_argument("--compile", help="auto | on | off (default auto)")
    train.add_argument("--device", help="auto | cuda | cpu (default auto)")
    train.add_argument("--gpus", type=int, help="train on N GPUs of this machine through accelerate (DDP; "
                       "--batch-size is per GPU); with --device cpu, N CPU processes over gloo (default 1)")
    train.add_argument("--seed", type=int, help="random seed (default 0)")
    train.add_argument("--export-kohya", action="store_true", default=None,
                       help="also write the LoRA in the kohya / ComfyUI key layout")
    train.add_argument("--save-every", type=int, metavar="N", help="write a checkpoint every N steps")
    train.add_argument("--keep-checkpoints", type=int, metavar="K", help="checkpoints kept (default 3)")
    train.add_argument("--sample-prompt", action="append", dest="sample_prompts", metavar="PROMPT",
                       help="render PROMPT with the current LoRA every --sample-every steps (repeatable)")
    train.add_argument("--sample-every", type=int, metavar="N", help="steps between samples")
    train.add_argument("--sample-steps", type=int, metavar="N", help="denoising steps per sample (default 20)")
    levers = train.add_argument_group("optimisation")
    levers.add_argument("--optimizer", choices=get_args(Optimizer),
                        help="adamw (default); adamw8bit needs CUDA and bitsandbytes; adafactor")
    levers.add_argument("--warmup-steps", type=int, metavar="N", help="learning-rate warmup (default: the family's)")
    levers.add_argument("--flow-shift", metavar="SHIFT", help="timestep shift of flow-matching families: a "
                        "number, or auto (from the resolution where the family says so); default: the family's")
    levers.add_argument("--loss-weighting", choices=get_args(LossWeighting),
                        help="per-timestep loss weights (default none)")
    levers.add_argument("--ema-decay", type=float, metavar="D",
                        help="also keep an EMA of the LoRA (saved as a second file), e.g. 0.999")
    levers.add_argument("--no-prompt-cache", dest="prompt_cache", action="store_false", default=None,
                        help="encode captions again instead of reusing the on-disk prompt cache")
    levers.add_argument("--prompt-cache-dir", type=Path, metavar="DIR",
                        help="where caption embeddings are cached (default: under the engine's home)")
    captions = train.add_argument_group("captions and data")
    captions.add_argument("--trigger-word", metavar="WORD", help="put WORD before every caption")
    captions.add_argument("--caption-dropout", type=float, metavar="RATE",
                          help="share of samples trained with the empty prompt, in [0, 1) (default 0)")
    captions.add_argument("--shuffle-tags", action="store_true", default=None,
                          help="shuffle a caption's comma-separated tags (a few fixed orders per caption)")
    captions.add_argument("--keep-tags", type=int, metavar="N",
                          help="with --shuffle-tags, keep the first N tags in place (default 0)")
    captions.add_argument("--strict", action="store_true", default=None,
                          help="refuse images under half the training resolution instead of warning")
    train.add_argument("--output", metavar="DIR", help="run folder (default: RUNS_DIR/<run id>)")
    train.add_argument("--runs-dir", type=Path, default=None, metavar="DIR", help=RUNS_DIR_HELP)
    train.add_argument("--dry-run", action="store_true", help="run every preflight, load nothing")
    _add_machine_args(train)
    common(train)
    # Every refusal train prints names flags, not the config's fields (``lora_rank`` -> ``--rank``).
    train.set_defaults(run=cmd_train, field_flags={"family": "--family"}, field_names=_flag_names)

    runs = commands.add_parser("runs", help="list training runs; `runs show ID`, `runs rm ID`")
    runs.add_argument("action", nargs="?", choices=("list", "show", "rm"), default="list",
                      help="list the runs, show one, or remove a finished one")
    runs.add_argument("run_id", nargs="?", metavar="ID", help="a run id (or a run folder) for show / rm")
    runs.add_argument("--runs-dir", type=Path, default=None, metavar="DIR", help=RUNS_DIR_HELP)
    common(runs)
    runs.set_defaults(run=cmd_runs)


#: ``train`` flag (argparse dest) -> TrainingConfig field; messages at the terminal name the flag.
TRAIN_FLAGS: dict[str, str] = {
    "base": "base_model", "data": "dataset_dir", "family": "family", "output": "output_dir",
    "steps": "steps", "epochs": "epochs", "resolution": "resolution", "batch_size": "batch_size",
    "lr": "learning_rate", "rank": "lora_rank", "base_precision": "base_precision",
    "mixed_precision": "mixed_precision", "compile": "compile", "device": "device", "seed": "seed",
    "export_kohya": "export_kohya", "gradient_checkpointing": "gradient_checkpointing",
    "save_every": "save_every", "keep_checkpoints": "keep_checkpoints",
    "sample_prompts": "sample_prompts", "sample_every": "sample_every", "sample_steps": "sample_steps",
    "trigger_word": "trigger_word", "caption_dropout": "caption_dropout", "shuffle_tags": "shuffle_tags",
    "keep_tags": "keep_tags", "strict": "strict", "optimizer": "optimizer", "warmup_steps": "warmup_steps",
    "flow_shift": "flow_shift", "loss_weighting": "loss_weighting", "ema_decay": "ema_decay",
    "prompt_cache": "prompt_cache", "prompt_cache_dir": "prompt_cache_dir", "gpus": "gpus",
}


def cmd_train(args: argparse.Namespace) -> int:
    import tempfile

    from engine.cli.machine import machine_from_args
    from engine.service import Engine

    if args.hardware and not args.dry_run:
        raise EngineError(
            "--hardware describes a machine you do not have: use it with --dry-run",
            code="invalid_request",
        )
    registry = load_registry()
    family = registry.family(args.tiny) if args.tiny else None
    previous = _resumed_run(args) if args.resume else None
    # Every flag is checked before a tiny pipeline is built or anything is probed.
    _train_config(args, f"tiny-{family.name}" if family else args.base, previous)
    with tempfile.TemporaryDirectory(prefix="diffusion-engine-tiny-") as scratch:
        base = args.base
        if family is not None:
            if not args.verbose:
                from engine.logs import quiet_library_logs

                quiet_library_logs(progress_bars=False)  # no "Writing model shards" bars
            base = str(registry.build_tiny_pipeline(family, Path(scratch) / family.name))
        config = _train_config(args, base, previous)
        # A start is heavy anyway: verify torchao and bf16 for real, not by name.
        engine = Engine(registry=registry, hardware=machine_from_args(args, verify=True),
                        runs_dir=Path(args.runs_dir), allow_download=download_allowed(args))
        if not args.dry_run:
            return _run_training(engine, config, args.json, resume=args.resume)
        plan = engine.plan_training(config)
        if args.json:
            print(json.dumps({"ok": True, "plan": plan.to_dict()}, indent=2))
        else:
            _print_training_plan(plan)
        return 0


def _train_config(args: argparse.Namespace, base: str | None, previous):  # type: ignore[no-untyped-def]
    """TrainingConfig defaults < --config FILE < the resumed run's config < the flags given."""
    from engine.training.config import InvalidConfig, TrainingConfig, read_config_file

    data: dict[str, object] = dict(read_config_file(args.config)) if args.config else {}
    if previous is not None:
        record, checkpoint = previous
        data.update({k: v for k, v in record.config.items() if k not in ("output_dir", "resume_from")})
        data["resume_from"] = str(checkpoint)
    given = {dest: getattr(args, dest) for dest in TRAIN_FLAGS if getattr(args, dest) is not None}
    if base is not None:
        given["base"] = base
    if "gradient_checkpointing" in given:
        given["gradient_checkpointing"] = {"auto": None, "on": True, "off": False}[given["gradient_checkpointing"]]
    if getattr(args, "tiny", None) and "resolution" not in data:
        data["resolution"] = TINY_RESOLUTION
    data.update({TRAIN_FLAGS[dest]: value for dest, value in given.items()})
    if "steps" in given:
        data.pop("epochs", None)  # a flag wins over the file's other way to say how long
    elif "epochs" in given:
        data.pop("steps", None)
    missing = [flag for flag, field in (("--base (or --tiny)", "base_model"), ("--data", "dataset_dir"))
               if not data.get(field)]
    if missing:
        raise InvalidConfig(f"train needs {' and '.join(missing)} (or a --config file that sets them)")
    return TrainingConfig.from_data(data)  # a refusal's fields become flags where every refusal is printed


def _flag_names(message: str) -> str:
    """``lora_rank: ...`` -> ``--rank: ...``: the terminal user typed flags, not field names."""
    import re

    flags = {field: "--" + dest.replace("_", "-") for dest, field in TRAIN_FLAGS.items()}
    flags["sample_prompts"] = "--sample-prompt"
    flags["prompt_cache"] = "--no-prompt-cache"
    names = "|".join(sorted(flags, key=len, reverse=True))
    # "field:" at the head of a problem, and any snake_case field named in the text.
    message = re.sub(r"\b(" + names + r")\b(?=:)", lambda m: flags[m.group(1)], message)
    return re.sub(r"(?<![-\w])(" + "|".join(f for f in flags if "_" in f) + r")\b",
                  lambda m: flags[m.group(1)], message)


def _resumed_run(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The run ``--resume`` names and its newest checkpoint (Engine's rule; the message names the flag)."""
    from engine.training.resume import resumable_run

    try:
        return resumable_run(Path(args.runs_dir), args.resume)
    except EngineError as exc:
        hint = " (pass --runs-dir if the runs are elsewhere)" if exc.code == "run_not_found" else ""
        raise EngineError(f"--resume {args.resume}: {exc.message}{hint}", code=exc.code) from None


def _print_training_plan(plan) -> None:  # type: ignore[no-untyped-def]
    print(f"{plan.family.label} LoRA on {plan.hardware.name} ({plan.hardware.device_name}); "
          f"device {plan.device}; {plan.steps} steps over {len(plan.dataset.items)} images")
    decided = [(name, getattr(plan, name)) for name in
               ("base_precision", "weight_dtype", "compile", "gradient_checkpointing")]
    if plan.levers is not None:
        decided += [(name, getattr(plan.levers, name)) for name in plan.levers.__dataclass_fields__]
    for name, resolved in decided:
        label = "Auto" if resolved.source == "auto" else "Set"
        print(f"  {name:<22} {str(resolved.value):<10} {label}: {resolved.reason}")
    print(f"  lora targets    {', '.join(plan.lora_targets)}")
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
        engine.start_training(config, resume=resume)
        bar = None if as_json else progress_bar("training")
        handled = 0
        while True:
            try:
                record = engine.wait_training(timeout=0.2)
                break
            except TimeoutError:
                pass
            if len(interrupts) > handled:
                handled = len(interrupts)
                if handled == 1:
                    print("\nstopping after this step and saving (Ctrl-C again: stop now, keep the last "
                          "checkpoint)", file=sys.stderr)
                _stop(engine, now=handled > 1)
            status = engine.training_status() or {}
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
        if record.error:
            print(f"error[{record.error['code']}]: {record.error['message']}", file=sys.stderr)
    return 0 if record.status in ("completed", "stopped") else 1


def _stop(engine, *, now: bool) -> None:  # type: ignore[no-untyped-def]
    """Ask ``engine`` to stop its run; a run that finished meanwhile has nothing left to stop."""
    try:
        engine.stop_training(save=True, now=now)
    except EngineError as exc:
        if exc.code != "not_training":
            raise


def cmd_runs(args: argparse.Namespace) -> int:
    from engine.training.records import list_runs

    if args.action != "list":
        return _cmd_run_show(args) if args.action == "show" else _cmd_run_rm(args)
    records = list_runs(Path(args.runs_dir))
    if args.json:
        print(json.dumps([r.to_dict() for r in records], indent=2))
        return 0
    for record in records:
        losses = record.metrics["loss"].points
        loss = f"loss {losses[-1][1]:.4f}" if losses else ""
        print(f"{record.run_id:<40} {record.status:<10} {record.step}/{record.steps} {loss}")
    if not records:
        print(f"no runs in {args.runs_dir}")
    return 0


def _named_run(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from engine.training.records import find_run

    if not args.run_id:
        raise EngineError(f"`runs {args.action}` needs a run id: `diffusion-engine runs` lists them",
                          code="invalid_request")
    record = find_run(Path(args.runs_dir), args.run_id)
    if record is None:
        raise EngineError(f"no run {args.run_id} in {args.runs_dir}; `diffusion-engine runs` lists them "
                          "(pass --runs-dir if they are elsewhere)", code="run_not_found")
    return record


def _cmd_run_show(args: argparse.Namespace) -> int:
    """One run: status, config, last metrics, samples and the files in its folder."""
    record = _named_run(args)
    files = sorted(str(p.relative_to(record.folder)) for p in record.folder.rglob("*") if p.is_file())
    if args.json:
        print(json.dumps({**record.to_dict(), "files": files}, indent=2))
        return 0
    print(f"run {record.run_id}: {record.status} at step {record.step}/{record.steps} ({record.family})")
    print(f"  folder: {record.folder}")
    if record.error:
        print(f"  error[{record.error['code']}]: {record.error['message']}")
    print("  config:")
    for key, value in record.config.items():
        if value is not None:
            print(f"    {key:<24} {value}")
    print("  metrics (last):")
    for name, history in record.metrics.items():
        if history.points:
            step, value = history.points[-1]
            print(f"    {name:<24} {value:.6g} at step {step}")
    if record.samples:
        print("  samples:")
        for sample in record.samples:
            print(f"    step {sample['step']:<6} {sample['path']}  ({sample['prompt']})")
    print("  files:")
    for name in files:
        print(f"    {name}")
    return 0


def _cmd_run_rm(args: argparse.Namespace) -> int:
    """Delete a finished run's folder; a run still going is refused."""
    import shutil

    record = _named_run(args)
    if not record.finished:
        raise EngineError(f"run {record.run_id} is still {record.status} (PID {record.pid}); stop it first",
                          code="run_in_progress")
    shutil.rmtree(record.folder)
    print(f"removed run {record.run_id} ({record.folder})")
    return 0
