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
import sys
from collections.abc import Sequence

from engine.errors import EngineError
from engine.hardware.profile import HardwareProfile
from engine.plugins import Registry, load_registry
from engine.policy.inference import InferenceRequest

EXIT_REFUSED = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
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
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--count", type=int, default=1)
    _add_plan_args(generate)
    _add_json(generate)
    generate.set_defaults(run=_cmd_generate)

    train = commands.add_parser("train", help="train a LoRA on a folder of images")
    which = train.add_mutually_exclusive_group(required=True)
    which.add_argument("--base", metavar="PATH", help="the base pipeline folder or hub id")
    which.add_argument("--tiny", metavar="FAMILY", help="a tiny random-weight pipeline of FAMILY")
    train.add_argument("--data", required=True, metavar="DIR", help="images with .txt/.caption sidecars or metadata.jsonl")
    train.add_argument("--family", help="the base's family (detected when omitted)")
    train.add_argument("--steps", type=int)
    train.add_argument("--epochs", type=int)
    train.add_argument("--resolution", type=int, default=512)
    train.add_argument("--batch-size", type=int, default=1)
    train.add_argument("--lr", type=float, default=1e-4)
    train.add_argument("--rank", type=int, default=16)
    train.add_argument("--base-precision", default="auto", help="nf4 | bf16 | int8 | fp8 | mxfp8 | auto")
    train.add_argument("--mixed-precision", default="bf16", help="bf16 | fp16 | no")
    train.add_argument("--compile", default="auto", help="auto | on | off")
    train.add_argument("--device", default="auto", help="auto | cuda | cpu")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--export-kohya", action="store_true")
    train.add_argument("--output", metavar="DIR", help="run folder (default: RUNS_DIR/<run id>)")
    train.add_argument("--runs-dir", default="runs", metavar="DIR")
    train.add_argument("--dry-run", action="store_true", help="run every preflight, load nothing")
    _add_machine_args(train)
    _add_json(train)
    train.set_defaults(run=_cmd_train)

    runs = commands.add_parser("runs", help="list training runs")
    runs.add_argument("--runs-dir", default="runs", metavar="DIR")
    _add_json(runs)
    runs.set_defaults(run=_cmd_runs)

    serve = commands.add_parser("serve", help="serve the HTTP API (extra [server])")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--token", help="require this bearer token (or DIFFUSION_ENGINE_TOKEN)")
    serve.add_argument("--models", action="append", default=[], metavar="DIR", help="a model root (repeatable)")
    serve.add_argument("--datasets", action="append", default=[], metavar="DIR", help="a dataset root")
    serve.add_argument("--outputs", default="runs", metavar="DIR", help="where runs are written")
    serve.add_argument("--allow-hub", action="store_true", help="accept hub repo ids as models")
    serve.add_argument("--load", metavar="PATH", help="load this model at start")
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
    """The plan flags' destinations are InferenceRequest's field names."""
    return InferenceRequest(**{f.name: getattr(args, f.name) for f in dataclasses.fields(InferenceRequest)})


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

    registry = load_registry()
    request = _request_from_args(args)
    with tempfile.TemporaryDirectory(prefix="diffusion-engine-tiny-") as scratch:
        model = args.model
        if args.tiny:
            model = str(registry.build_tiny_pipeline(registry.family(args.tiny), Path(scratch) / args.tiny))
        source = resolve_model(registry, model, family=args.model_family, base=args.base)
        plan = plan_inference(registry, source.facts(registry), probe(), request)
        session = InferenceSession(registry, source, plan, request)
        started = time.perf_counter()
        session.load()
        loaded = time.perf_counter()
        try:
            images = session.generate(
                GenerateRequest(
                    prompt=args.prompt, steps=args.steps, guidance=args.guidance, width=args.width,
                    height=args.height, seed=args.seed, count=args.count,
                    negative_prompt=args.negative_prompt,
                ),
                progress=None if args.json else _progress_bar(),
            )
            status = session.status()
        finally:
            session.unload()
    done = time.perf_counter()
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    paths = [output] if len(images) == 1 else [
        output.with_name(f"{output.stem}-{i}{output.suffix}") for i in range(len(images))
    ]
    for image, path in zip(images, paths):
        image.save(path)
    if args.json:
        print(json.dumps({
            "images": [str(p) for p in paths], "load_s": round(loaded - started, 3),
            "generate_s": round(done - loaded, 3), "status": status,
        }, indent=2))
    else:
        for path, image in zip(paths, images):
            print(f"wrote {path} ({image.width}x{image.height})")
        print(f"load {loaded - started:.2f} s, generate {done - loaded:.2f} s")
    return 0


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


def _cmd_train(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from engine.training.config import TrainingConfig
    from engine.training.preflight import preflight_training

    if args.hardware and not args.dry_run:
        raise EngineError(
            "--hardware describes a machine you do not have: use it with --dry-run",
            code="invalid_request",
        )
    from engine.logs import quiet_library_logs

    quiet_library_logs()  # env and loggers only: a dry run must not import torch
    registry = load_registry()
    with tempfile.TemporaryDirectory(prefix="diffusion-engine-tiny-") as scratch:
        base = args.base
        if args.tiny:
            family = registry.family(args.tiny)
            base = str(registry.build_tiny_pipeline(family, Path(scratch) / family.name))
        config = TrainingConfig.from_data({
            "base_model": base, "family": args.family, "dataset_dir": args.data,
            "output_dir": args.output, "steps": args.steps, "epochs": args.epochs,
            "resolution": args.resolution, "batch_size": args.batch_size,
            "learning_rate": args.lr, "lora_rank": args.rank, "base_precision": args.base_precision,
            "mixed_precision": args.mixed_precision, "compile": args.compile, "device": args.device,
            "seed": args.seed, "export_kohya": args.export_kohya,
        })
        # A start is heavy anyway: verify torchao and bf16 for real, not by name.
        hardware = machine_from_args(args, verify=True)
        plan = preflight_training(registry, config, hardware)
        if args.dry_run:
            if args.json:
                print(json.dumps({"ok": True, "plan": plan.to_dict()}, indent=2))
            else:
                _print_training_plan(plan)
            return 0
        return _run_training(plan, Path(args.runs_dir), args.json)


def _print_training_plan(plan) -> None:  # type: ignore[no-untyped-def]
    print(f"{plan.family.label} LoRA on {plan.hardware.name} ({plan.hardware.device_name}); "
          f"device {plan.device}; {plan.steps} steps over {len(plan.dataset.items)} images")
    for name in ("base_precision", "weight_dtype", "compile"):
        resolved = getattr(plan, name)
        label = "Auto" if resolved.source == "auto" else "Set"
        print(f"  {name:<15} {resolved.value:<10} {label}: {resolved.reason}")
    print(f"  lora targets    {', '.join(plan.lora_targets)}")
    for file, reason in plan.dataset.skipped:
        print(f"  skipped {file}: {reason}")
    if plan.dataset.uncaptioned:
        print(f"  {len(plan.dataset.uncaptioned)} images have no caption (trained with an empty one)")


def _run_training(plan, runs_dir, as_json: bool) -> int:  # type: ignore[no-untyped-def]
    import time

    from engine.training.runner import TrainingRun

    run = TrainingRun(plan, runs_dir)
    run.start()
    bar = None if as_json else _progress_bar("training")
    try:
        while not run.poll().finished:
            if bar is not None and run.record.step:
                bar(run.record.step, run.record.steps)
            time.sleep(0.2)
    except KeyboardInterrupt:
        run.stop(save=True)
        run.wait(timeout=600)
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
    from pathlib import Path

    from engine.training.records import list_runs

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


def _cmd_serve(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    try:
        import uvicorn

        from engine.server.app import ServerSettings, create_app
    except ImportError as exc:
        raise EngineError(
            f"the server needs its extra: pip install 'diffusion-engine[server]' ({exc})",
            code="missing_extra",
        ) from None
    from engine.service import Engine

    outputs = Path(args.outputs)
    outputs.mkdir(parents=True, exist_ok=True)
    settings = ServerSettings(
        model_roots=tuple(Path(p) for p in args.models),
        dataset_roots=tuple(Path(p) for p in args.datasets),
        output_roots=(outputs,),
        token=args.token or os.environ.get("DIFFUSION_ENGINE_TOKEN") or None,
        allow_hub=args.allow_hub,
    )
    engine = Engine(runs_dir=outputs)
    if args.load:
        engine.load(args.load)
    if args.host not in ("127.0.0.1", "localhost", "::1") and settings.token is None:
        print("warning: serving beyond loopback without --token", file=sys.stderr)
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
