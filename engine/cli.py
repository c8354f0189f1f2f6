"""``diffusion-engine``: the terminal interface.

Every command has ``--json``. Bad input (an unknown family or preset, a
doomed request) prints ``error[code]: message`` on stderr and exits 2, never
a traceback. The light commands (``families``, ``info``) import no torch on a
machine without a GPU: they answer in a fraction of a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.errors import EngineError
from engine.hardware.profile import HardwareProfile
from engine.plugins import Registry, load_registry
from engine.policy.inference import InferenceRequest

EXIT_REFUSED = 2
RUNS_DIR_HELP = ("where runs live (default: $DIFFUSION_ENGINE_HOME/runs, else the per-user data folder, "
                 "e.g. ~/.local/share/diffusion-engine/runs)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if hasattr(args, "runs_dir") and args.runs_dir is None:
        from engine.training.records import default_runs_dir

        args.runs_dir = default_runs_dir()
    if not hasattr(args, "run"):
        parser.print_help()
        return EXIT_REFUSED
    try:
        return int(args.run(args) or 0)
    except EngineError as exc:
        if getattr(args, "json", False):
            print(json.dumps({"error": exc.to_dict()}, indent=2))
        print(f"error[{exc.code}]: {exc.message}", file=sys.stderr)
        return EXIT_REFUSED


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diffusion-engine",
        description="Run diffusion image models and train LoRA adapters, the fastest way "
        "this machine allows.",
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    families = commands.add_parser("families", help="list model-family plugins")
    families.add_argument("--all", action="store_true", help="include the engine's built-in plugin")
    _add_json(families)
    families.set_defaults(run=_cmd_families)

    info = commands.add_parser("info", help="sizes and training options per family on a machine")
    info.add_argument("--family", help="only this family")
    _add_machine_args(info)
    _add_json(info)
    info.set_defaults(run=_cmd_info)

    plan = commands.add_parser("plan", help="every inference control, decided with its reason")
    _add_model_args(plan, tiny=False)
    _add_plan_args(plan)
    _add_machine_args(plan)
    _add_json(plan)
    plan.set_defaults(run=_cmd_plan)

    generate = commands.add_parser("generate", help="generate images on this machine")
    _add_model_args(generate, tiny=True)
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--negative-prompt")
    generate.add_argument("-o", "--output", default="out.png", help="PNG path (-N suffix when --count > 1)")
    generate.add_argument("--guidance", type=float)
    generate.add_argument("--width", type=int)
    generate.add_argument("--height", type=int)
    generate.add_argument("--seed", type=int, help="random seed (default: a random one, printed)")
    generate.add_argument("--count", type=int, default=1)
    generate.add_argument(
        "--lora", action="append", default=[], metavar="PATH[:SCALE]",
        help="apply a LoRA (.safetensors file or a training run's folder), scale 1.0 by default (repeatable)",
    )
    generate.add_argument("--overwrite", action="store_true", help="replace existing output files")
    _add_plan_args(generate)
    _add_json(generate)
    generate.set_defaults(run=_cmd_generate)

    train = commands.add_parser(
        "train", help="train a LoRA on a folder of images",
        description="Train a LoRA. Values come from TrainingConfig's defaults, then --config FILE, "
        "then --resume RUN's recorded config, then the flags given here (the last one wins).",
    )
    which = train.add_mutually_exclusive_group()
    which.add_argument("--base", metavar="PATH", help="the base pipeline folder or hub id")
    which.add_argument("--tiny", metavar="FAMILY", help="a tiny random-weight pipeline of FAMILY")
    train.add_argument("--data", metavar="DIR", help="images with .txt/.caption sidecars or metadata.jsonl")
    train.add_argument("--config", metavar="FILE", help="a TOML (or JSON) file of TrainingConfig fields; "
                       "a run folder's config.toml repeats that run")
    train.add_argument("--resume", metavar="RUN", help="continue RUN (an id in --runs-dir, or its folder) "
                       "from its last checkpoint")
    train.add_argument("--family", help="the base's family (detected when omitted)")
    train.add_argument("--steps", type=int)
    train.add_argument("--epochs", type=int)
    train.add_argument("--resolution", type=int, help="training size in pixels (default 512)")
    train.add_argument("--batch-size", type=int)
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
    train.add_argument("--seed", type=int)
    train.add_argument("--export-kohya", action="store_true", default=None)
    train.add_argument("--save-every", type=int, metavar="N", help="write a checkpoint every N steps")
    train.add_argument("--keep-checkpoints", type=int, metavar="K", help="checkpoints kept (default 3)")
    train.add_argument("--sample-prompt", action="append", dest="sample_prompts", metavar="PROMPT",
                       help="render PROMPT with the current LoRA every --sample-every steps (repeatable)")
    train.add_argument("--sample-every", type=int, metavar="N")
    train.add_argument("--sample-steps", type=int, metavar="N", help="denoising steps per sample (default 20)")
    train.add_argument("--output", metavar="DIR", help="run folder (default: RUNS_DIR/<run id>)")
    train.add_argument("--runs-dir", type=Path, default=None, metavar="DIR", help=RUNS_DIR_HELP)
    train.add_argument("--dry-run", action="store_true", help="run every preflight, load nothing")
    _add_machine_args(train)
    _add_json(train)
    train.set_defaults(run=_cmd_train)

    runs = commands.add_parser("runs", help="list training runs; `runs show ID`, `runs rm ID`")
    runs.add_argument("action", nargs="?", choices=("list", "show", "rm"), default="list")
    runs.add_argument("run_id", nargs="?", metavar="ID", help="a run id (or a run folder) for show / rm")
    runs.add_argument("--runs-dir", type=Path, default=None, metavar="DIR", help=RUNS_DIR_HELP)
    _add_json(runs)
    runs.set_defaults(run=_cmd_runs)

    serve = commands.add_parser("serve", help="serve the HTTP API (extra [server])")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--token", help="require this bearer token (or DIFFUSION_ENGINE_TOKEN)")
    serve.add_argument("--models", action="append", default=[], metavar="DIR", help="a model root (repeatable)")
    serve.add_argument("--datasets", action="append", default=[], metavar="DIR", help="a dataset root")
    serve.add_argument("--loras", action="append", default=[], metavar="DIR", help="a LoRA root (repeatable)")
    serve.add_argument("--outputs", default="runs", metavar="DIR", help="where runs are written")
    serve.add_argument("--allow-hub", action="store_true", help="accept hub repo ids as models")
    serve.add_argument("--load", metavar="PATH", help="load this model at start")
    serve.add_argument(
        "--insecure-no-token", action="store_true",
        help="allow a non-loopback --host without a token (anyone who reaches it can use the engine)",
    )
    serve.add_argument(
        "--max-body-mb", type=float, default=1.0, metavar="MB",
        help="refuse request bodies larger than this with 413 (default: 1)",
    )
    serve.set_defaults(run=_cmd_serve)

    doctor = commands.add_parser("doctor", help="probe this machine with torch, in depth")
    _add_json(doctor)
    doctor.set_defaults(run=_cmd_doctor)
    return parser


def _add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")


def _add_machine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("machine (ask for a machine you do not have)")
    group.add_argument("--hardware", metavar="PRESET", help="a preset instead of this machine")
    group.add_argument("--free-gb", type=float, metavar="N", help="override free device memory")
    group.add_argument(
        "--no-torchao", action="store_true", help="treat torchao as missing or a stub"
    )


def _add_model_args(parser: argparse.ArgumentParser, *, tiny: bool) -> None:
    group = parser.add_argument_group("model")
    which = group.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="PATH", help="pipeline folder, single file, GGUF or hub id")
    if tiny:
        which.add_argument("--tiny", metavar="FAMILY", help="a tiny random-weight pipeline of FAMILY")
    else:
        which.add_argument("--family", dest="family_only", metavar="F", help="plan from F's table")
        group.add_argument("--checkpoint", metavar="C", help="with --family: which checkpoint")
    group.add_argument("--base", metavar="PATH", help="pipeline providing the rest of a single file / GGUF")
    group.add_argument("--model-family", dest="model_family", metavar="F", help="override detection")


def _add_plan_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("plan (auto: the engine decides and says why)")
    group.add_argument("--dtype", default="auto", help="auto | bf16 | fp16 | fp32")
    group.add_argument("--quant", default="auto", help="auto | none | int8 | fp8 | mxfp8 | nvfp4 | nf4")
    group.add_argument("--memory", default="auto", help="auto | resident | model_offload | group_offload | sequential_offload")
    group.add_argument("--attention", default="auto", help="auto | native | flash | flash3 | sage | xformers")
    group.add_argument("--step-cache", default="auto", help="auto | off | fbcache")
    group.add_argument("--compile", default="auto", help="auto | on | off")
    group.add_argument("--speed", default="default", help="off | eager | default | max")
    group.add_argument("--steps", type=int)
    group.add_argument("--threads", type=int)


def _request_from_args(args: argparse.Namespace) -> InferenceRequest:
    """The plan flags' destinations are InferenceRequest's field names (LoRAs
    are read from their files, not from a flag of that name)."""
    return InferenceRequest(**{
        f.name: getattr(args, f.name) for f in dataclasses.fields(InferenceRequest) if f.name != "loras"
    })


def machine_from_args(args: argparse.Namespace, *, verify: bool | None = None) -> HardwareProfile:
    """The profile the flags describe: a preset or a probe, with overrides.

    :param verify: probe with torch (None: only where an accelerator is).
    """
    if args.hardware:
        from engine.hardware.presets import preset

        profile = preset(args.hardware)
    else:
        from engine.hardware.probe import probe

        profile = probe(verify=verify)
    if args.free_gb is not None:
        profile = profile.replace(free_memory_gb=args.free_gb)
    if args.no_torchao:
        profile = profile.replace(torchao_functional=False)
    return profile


def _cmd_families(args: argparse.Namespace) -> int:
    registry = load_registry()
    plugins = [p for p in registry.plugins if args.all or not p.builtin]
    if args.json:
        payload = {
            "families": [_family_row(registry, name) for name in registry.families],
            "plugins": [
                {
                    "name": p.name,
                    "package": p.package,
                    "version": p.version,
                    "hooks": list(p.hooks),
                    "families": list(p.families),
                    "builtin": p.builtin,
                }
                for p in plugins
            ],
            "errors": [e.__dict__ for e in registry.errors],
        }
        print(json.dumps(payload, indent=2))
        return 0
    for plugin in plugins:
        families = ", ".join(plugin.families) or "-"
        print(f"{plugin.name:<22} {plugin.package} {plugin.version}  families: {families}")
        print(f"{'':<22} hooks: {', '.join(plugin.hooks)}")
    for error in registry.errors:
        print(f"{error.plugin:<22} {error.package}  FAILED TO LOAD: {error.error}")
    return 0


def _family_row(registry: Registry, name: str) -> dict[str, object]:
    family = registry.families[name]
    owner = next((p for p in registry.plugins if name in p.families), None)
    return {
        "name": family.name,
        "label": family.label,
        "aliases": list(family.aliases),
        "package": owner.package if owner else "?",
        "version": owner.version if owner else "",
        "plugin": owner.name if owner else "?",
        "checkpoints": [c.name for c in family.checkpoints],
    }


def _cmd_info(args: argparse.Namespace) -> int:
    from engine.policy.info import images_info, training_info

    registry = load_registry()
    hardware = machine_from_args(args)
    families = [registry.family(args.family)] if args.family else list(registry.families.values())
    rows = [
        (images_info(registry, f), training_info(registry, f, hardware)) for f in families
    ]
    if args.json:
        print(
            json.dumps(
                {
                    "hardware": hardware.to_dict(),
                    "families": {
                        img.family: {"images": img.to_dict(), "training": train.to_dict()}
                        for img, train in rows
                    },
                    "errors": [e.__dict__ for e in registry.errors],
                },
                indent=2,
            )
        )
        return 0
    free = "?" if hardware.free_memory_gb is None else f"{hardware.free_memory_gb:.1f}"
    print(
        f"machine: {hardware.name} ({hardware.device_name}, {hardware.vendor}, "
        f"{hardware.capability_label}, {free}/{hardware.total_memory_gb:.1f} GB free, "
        f"native bf16 {'yes' if hardware.native_bf16 else 'no'}, "
        f"torchao {'yes' if hardware.torchao_functional else 'no'})"
    )
    for img, train in rows:
        sizes = img.sizes_gb
        print(f"\n{img.label} [{img.family}]")
        print(
            f"  bf16 GB: transformer {sizes.transformer_gb}, text encoders "
            f"{sizes.text_encoders_gb}, VAE {sizes.vae_gb}"
        )
        resident = ", ".join(
            f"{s} {gb}" + (" (denied)" if s in img.denied else "")
            for s, gb in img.resident_gb.items()
        )
        print(f"  resident GB: {resident}")
        modes = ", ".join(train.precision_modes) or "-"
        print(
            f"  training: {'yes' if train.trainable else 'no'}; modes: {modes}; "
            f"recommended: {train.recommended_precision or '-'}; "
            f"compile: {'yes' if train.supports_compile else 'no'}"
        )
        print(f"  note: {train.vram_note}")
    for error in registry.errors:
        print(f"\nplugin {error.plugin} ({error.package}) failed to load: {error.error}")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from engine.policy.inference import CONTROLS
    from engine.service import Engine

    registry = load_registry()
    hardware = machine_from_args(args)
    plan = Engine(registry=registry, hardware=hardware).plan(
        args.model,
        family=args.family_only or args.model_family,
        checkpoint=args.checkpoint,
        base=args.base,
        request=_request_from_args(args),
    )
    family = registry.family(plan.family)
    if args.json:
        print(json.dumps({"hardware": hardware.to_dict(), "plan": plan.to_dict()}, indent=2))
        return 0
    print(f"{family.label} ({plan.checkpoint or 'unknown checkpoint'}) on {hardware.name} "
          f"({hardware.device_name}); device {plan.device}")
    for name in CONTROLS:
        resolved = plan[name]
        label = "Auto" if resolved.source == "auto" else "Set"
        print(f"  {name:<19} {str(resolved.value):<18} {label}: {resolved.reason}")
    for kind, sizes in plan.sizes.items():
        print(f"  sizes ({kind}): transformer {sizes.transformer_gb:.3g} GB, text encoders "
              f"{sizes.text_encoders_gb:.3g} GB, VAE {sizes.vae_gb:.3g} GB")
    estimate = plan.estimate
    print(f"  memory: {estimate.resident_gb:.1f} GB resident, {estimate.peak_gb:.1f} GB peak, "
          f"budget {estimate.budget_gb:.1f} GB")
    if plan.available is not None:
        print(f"  available: {plan.available.summary()}")
    if plan.fallback:
        fb = plan.fallback
        print(f"  fallback if the {plan.value('transformer_quant')} build fails: "
              f"{fb.value('memory_mode')} ({fb['memory_mode'].reason})")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import tempfile
    import time
    from pathlib import Path

    from engine.hardware.probe import probe
    from engine.policy.inference import plan_inference
    from engine.preflight.model import resolve_model

    from engine.logs import quiet_library_logs

    quiet_library_logs(progress_bars=False)  # the CLI shows its own progress
    from engine.runtime.session import GenerateRequest, InferenceSession

    from engine.preflight.lora import lora_choices, plan_input, read_loras
    from engine.runtime.lora import check_loras

    registry = load_registry()
    request = _request_from_args(args)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    output = Path(args.output)
    paths = [output] if args.count == 1 else [
        output.with_name(f"{output.stem}-{i}{output.suffix}") for i in range(args.count)
    ]
    existing = [str(p) for p in paths if p.exists()]
    if existing and not args.overwrite:
        raise EngineError(
            f"{', '.join(existing)} already exists; choose another -o/--output or pass --overwrite",
            code="output_exists",
        )
    loras = read_loras(lora_choices(args.lora))
    with tempfile.TemporaryDirectory(prefix="diffusion-engine-tiny-") as scratch:
        model = args.model
        if args.tiny:
            model = str(registry.build_tiny_pipeline(registry.family(args.tiny), Path(scratch) / args.tiny))
        source = resolve_model(registry, model, family=args.model_family, base=args.base)
        check_loras(registry, source, loras)
        request = dataclasses.replace(request, loras=plan_input(loras))
        plan = plan_inference(registry, source.facts(registry), probe(), request)
        session = InferenceSession(registry, source, plan, request, loras=loras)
        started = time.perf_counter()
        session.load()
        loaded = time.perf_counter()
        try:
            images = session.generate(
                GenerateRequest(
                    prompt=args.prompt, steps=args.steps, guidance=args.guidance, width=args.width,
                    height=args.height, seed=seed, count=args.count,
                    negative_prompt=args.negative_prompt,
                ),
                progress=None if args.json else _progress_bar(),
            )
            status = session.status()
        finally:
            session.unload()
    done = time.perf_counter()
    output.parent.mkdir(parents=True, exist_ok=True)
    steps = args.steps or plan.default_steps
    for index, (image, path) in enumerate(zip(images, paths)):
        info = _png_info(args, model=str(source.location), seed=seed, steps=steps, image=image, loras=loras, index=index)
        image.save(path, pnginfo=info)
    if args.json:
        print(json.dumps({
            "images": [str(p) for p in paths], "seed": seed, "load_s": round(loaded - started, 3),
            "generate_s": round(done - loaded, 3), "status": status,
        }, indent=2))
    else:
        for path, image in zip(paths, images):
            print(f"wrote {path} ({image.width}x{image.height})")
        print(f"seed {seed}" + "".join(f", LoRA {f.name} x{f.scale:g}" for f in loras))
        print(f"load {loaded - started:.2f} s, generate {done - loaded:.2f} s")
    return 0


def _png_info(args: argparse.Namespace, *, model: str, seed: int, steps: int, image, loras, index: int):  # type: ignore[no-untyped-def]
    """The PNG text chunks that make an image reproducible: prompt, seed (and
    the image's index in a batch), steps, size, model and LoRAs with scales."""
    from PIL.PngImagePlugin import PngInfo

    record = {
        "prompt": args.prompt, "negative_prompt": args.negative_prompt, "seed": seed,
        "batch_index": index, "steps": steps, "guidance": args.guidance,
        "width": image.width, "height": image.height, "model": model,
        "loras": [{"path": str(f.path), "scale": f.scale} for f in loras],
    }
    info = PngInfo()
    info.add_text("prompt", args.prompt)
    info.add_text("diffusion-engine", json.dumps(record))
    return info


def _progress_bar(description: str = "denoising"):  # type: ignore[no-untyped-def]
    from tqdm import tqdm

    bar: dict[str, tqdm] = {}

    def update(step: int, total: int) -> None:
        if "bar" not in bar:
            bar["bar"] = tqdm(total=total, desc=description, unit="step", leave=False)
        bar["bar"].update(step - bar["bar"].n)
        if step >= total:
            bar.pop("bar").close()

    return update


#: ``train`` flag (argparse dest) -> TrainingConfig field; messages at the terminal name the flag.
TRAIN_FLAGS: dict[str, str] = {
    "base": "base_model", "data": "dataset_dir", "family": "family", "output": "output_dir",
    "steps": "steps", "epochs": "epochs", "resolution": "resolution", "batch_size": "batch_size",
    "lr": "learning_rate", "rank": "lora_rank", "base_precision": "base_precision",
    "mixed_precision": "mixed_precision", "compile": "compile", "device": "device", "seed": "seed",
    "export_kohya": "export_kohya", "gradient_checkpointing": "gradient_checkpointing",
    "save_every": "save_every", "keep_checkpoints": "keep_checkpoints",
    "sample_prompts": "sample_prompts", "sample_every": "sample_every", "sample_steps": "sample_steps",
}


def _cmd_train(args: argparse.Namespace) -> int:
    import tempfile

    from engine.training.preflight import preflight_training

    if args.hardware and not args.dry_run:
        raise EngineError(
            "--hardware describes a machine you do not have: use it with --dry-run",
            code="invalid_request",
        )
    from engine.logs import quiet_library_logs

    quiet_library_logs()  # env and loggers only: a dry run must not import torch
    registry = load_registry()
    previous = _resumed_run(args) if args.resume else None
    with tempfile.TemporaryDirectory(prefix="diffusion-engine-tiny-") as scratch:
        base = args.base
        if args.tiny:
            family = registry.family(args.tiny)
            base = str(registry.build_tiny_pipeline(family, Path(scratch) / family.name))
        config = _train_config(args, base, previous)
        # A start is heavy anyway: verify torchao and bf16 for real, not by name.
        hardware = machine_from_args(args, verify=True)
        plan = preflight_training(registry, config, hardware)
        if args.dry_run:
            if args.json:
                print(json.dumps({"ok": True, "plan": plan.to_dict()}, indent=2))
            else:
                _print_training_plan(plan)
            return 0
        return _run_training(plan, Path(args.runs_dir), args.json, previous)


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
    data.update({TRAIN_FLAGS[dest]: value for dest, value in given.items()})
    if "steps" in given:
        data.pop("epochs", None)  # a flag wins over the file's other way to say how long
    elif "epochs" in given:
        data.pop("steps", None)
    missing = [flag for flag, field in (("--base (or --tiny)", "base_model"), ("--data", "dataset_dir"))
               if not data.get(field)]
    if missing:
        raise InvalidConfig(f"train needs {' and '.join(missing)} (or a --config file that sets them)")
    try:
        return TrainingConfig.from_data(data)
    except InvalidConfig as exc:
        raise InvalidConfig(_flag_names(exc.message)) from None


def _flag_names(message: str) -> str:
    """``lora_rank: ...`` -> ``--rank: ...``: the terminal user typed flags, not field names."""
    import re

    flags = {field: "--" + dest.replace("_", "-") for dest, field in TRAIN_FLAGS.items()}
    flags["sample_prompts"] = "--sample-prompt"
    names = "|".join(sorted(flags, key=len, reverse=True))
    # "field:" at the head of a problem, and any snake_case field named in the text.
    message = re.sub(r"\b(" + names + r")\b(?=:)", lambda m: flags[m.group(1)], message)
    return re.sub(r"(?<![-\w])(" + "|".join(f for f in flags if "_" in f) + r")\b",
                  lambda m: flags[m.group(1)], message)


def _resumed_run(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The run ``--resume`` names and its newest checkpoint."""
    from engine.training.checkpoints import latest_checkpoint
    from engine.training.records import find_run

    record = find_run(Path(args.runs_dir), args.resume)
    if record is None:
        raise EngineError(
            f"--resume {args.resume}: no run of that id in {args.runs_dir} and no run folder at that path; "
            "`diffusion-engine runs` lists the runs (pass --runs-dir if they are elsewhere)",
            code="run_not_found",
        )
    if record.status in ("pending", "running"):
        raise EngineError(f"--resume {args.resume}: that run is still {record.status} (PID {record.pid})",
                          code="run_in_progress")
    checkpoint = latest_checkpoint(record.folder)
    if checkpoint is None:
        raise EngineError(
            f"--resume {args.resume}: the run has no checkpoint in {record.folder / 'checkpoints'}; "
            "runs write them with --save-every N",
            code="no_checkpoint",
        )
    return record, checkpoint


def _print_training_plan(plan) -> None:  # type: ignore[no-untyped-def]
    print(f"{plan.family.label} LoRA on {plan.hardware.name} ({plan.hardware.device_name}); "
          f"device {plan.device}; {plan.steps} steps over {len(plan.dataset.items)} images")
    for name in ("base_precision", "weight_dtype", "compile", "gradient_checkpointing"):
        resolved = getattr(plan, name)
        label = "Auto" if resolved.source == "auto" else "Set"
        print(f"  {name:<22} {str(resolved.value):<10} {label}: {resolved.reason}")
    print(f"  lora targets    {', '.join(plan.lora_targets)}")
    if plan.available is not None:
        print(f"  memory          {plan.available.summary()}")
    if plan.memory is not None:
        for line in plan.memory.lines():
            print(f"    {line}")
    for file, reason in plan.dataset.skipped:
        print(f"  skipped {file}: {reason}")
    if plan.dataset.uncaptioned:
        print(f"  {len(plan.dataset.uncaptioned)} images have no caption (trained with an empty one)")


def _run_training(plan, runs_dir, as_json: bool, previous=None) -> int:  # type: ignore[no-untyped-def]
    """Run in the child and follow it; Ctrl-C stops after the step and saves, a second stops now."""
    import signal
    import time

    from engine.training.runner import TrainingRun

    if previous is not None:
        record, _checkpoint = previous
        run = TrainingRun(plan, runs_dir, run_id=record.run_id, folder=record.folder)
        run.carry_over(record)
    else:
        run = TrainingRun(plan, runs_dir)
    interrupts: list[int] = []
    old_handler = signal.signal(signal.SIGINT, lambda signum, frame: interrupts.append(signum))
    try:
        run.start()
        bar = None if as_json else _progress_bar("training")
        handled = 0
        while not run.poll().finished:
            if len(interrupts) > handled:
                handled = len(interrupts)
                if handled == 1:
                    print("\nstopping after this step and saving (Ctrl-C again: stop now, keep the last "
                          "checkpoint)", file=sys.stderr)
                    run.stop(save=True)
                else:
                    run.halt()
                    break
            if bar is not None and run.record.step:
                bar(run.record.step, run.record.steps)
            time.sleep(0.2)
    finally:
        signal.signal(signal.SIGINT, old_handler)
    record = run.record
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


def _cmd_runs(args: argparse.Namespace) -> int:
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


def _cmd_serve(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from engine.server.settings import ServerSettings, is_loopback

    outputs = Path(args.outputs)
    # Checked before anything heavy is imported and before any port opens: an
    # empty token (an unset "$TOKEN") or a public bind without one is refused.
    settings = ServerSettings(
        model_roots=tuple(Path(p) for p in args.models),
        dataset_roots=tuple(Path(p) for p in args.datasets),
        lora_roots=tuple(Path(p) for p in args.loras),
        output_roots=(outputs,),
        token=args.token if args.token is not None else os.environ.get("DIFFUSION_ENGINE_TOKEN"),
        allow_hub=args.allow_hub,
        insecure_no_token=args.insecure_no_token,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
    )
    settings.check_bind(args.host)
    try:
        import uvicorn

        from engine.server.app import create_app
    except ImportError as exc:
        raise EngineError(
            f"the server needs its extra: pip install 'diffusion-engine[server]' ({exc})",
            code="missing_extra",
        ) from None
    from engine.service import Engine

    outputs.mkdir(parents=True, exist_ok=True)
    engine = Engine(runs_dir=outputs)
    if args.load:
        engine.load(args.load)
    if settings.token is None and not is_loopback(args.host):
        print(f"warning: serving {args.host} beyond loopback without a token (--insecure-no-token)", file=sys.stderr)
    uvicorn.run(create_app(engine, settings), host=args.host, port=args.port, log_level="info")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from engine.hardware.probe import probe

    profile = probe(verify=True)
    if args.json:
        print(json.dumps(profile.to_dict(), indent=2))
        return 0
    for key, value in profile.to_dict().items():
        print(f"{key:<20} {value}")
    return 0
