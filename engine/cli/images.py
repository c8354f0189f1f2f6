"""``plan``, ``generate`` and ``tiny save``: thin faces over :class:`engine.Engine`.

Every check that can fail runs before a model loads: the flags' request
models, the output path, the model itself (a single file needs ``--base``;
a hub id needs the hub and consent to download), and the plan. An explicit
request the plan overrides prints one ``warning[overridden]`` line per
control (exit 2 with ``--strict``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from engine.cli.common import download_allowed
from engine.cli.machine import machine_request
from engine.cli.started import PROCESS_STARTED
from engine.errors import EngineError


class Strict(EngineError):
    """``--strict``: an explicit request the engine would override."""

    code = "overridden"


# -- plan ---------------------------------------------------------------------------------


def cmd_plan(args: argparse.Namespace) -> int:
    from engine import Engine
    from engine.cli.requests import plan_body  # the request models load with the command that uses them

    controls = plan_body(args)  # the controls and the request's shape (--width --height --count --frames)
    if args.model is None and args.family is None:
        raise EngineError("plan needs a model (--model NAME|PATH) or a family's table (--family F)",
                          code="invalid_request")
    engine = Engine(hardware=machine_request(args))
    checked = engine.catalog.check_model(args.model, family=args.family, base=args.base) if args.model else None
    plan = engine.images.plan(
        args.model, family=args.family, checkpoint=args.checkpoint,
        base=args.base, request=controls.request(), controlnet=args.controlnet,
    )
    hardware = engine.hardware()
    overridden = report_overrides(plan.controls, strict=args.strict)
    label = engine.catalog.family(plan.family)["label"]
    notes = []
    on_sdcpp = plan.sdcpp is not None  # it reads the files beside the model: no base, no hub
    if checked is not None and checked["kind"] in ("single_file", "gguf") and not args.base and not on_sdcpp:
        notes.append(f"{args.model} is a single {label} denoiser file: without --base its text encoders "
                     f"and VAE are sized from the {label} table, and generate needs --base")
    if checked is not None and not checked["weights"]["here"] and not on_sdcpp:  # type: ignore[index]
        notes.append(str(checked["weights"]["note"]))  # type: ignore[index]
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps({"hardware": hardware.to_dict(), "plan": plan.to_dict(), "overridden": overridden,
                          **({"model": checked} if checked is not None else {})}, indent=2))
        return 0
    print(f"{label} ({plan.checkpoint or 'unknown checkpoint'}) on {hardware.name} "
          f"({hardware.device_name}); device {plan.device}")
    if plan.sdcpp is not None:  # first: every line after it is the diffusers fallback's
        print(f"  memory (sd.cpp): {plan.sdcpp.gb:.2f} GB, its {len(plan.sdcpp.files)} files as stored; "
              "the torch controls and figures below are the diffusers fallback's")
    for name in plan.to_dict()["resolved"]:  # type: ignore[union-attr]
        resolved = plan[name]
        how = "Auto" if resolved.source == "auto" else "Set"
        print(f"  {name:<19} {str(resolved.value):<18} {how}: {resolved.reason}")
    for kind, sizes in plan.sizes.items():
        print(f"  sizes ({kind}): {plan.denoiser_label} {sizes.transformer_gb:.3g} GB, text encoders "
              f"{sizes.text_encoders_gb:.3g} GB, VAE {sizes.vae_gb:.3g} GB" + (f" ({sizes.source})" if sizes.source else ""))
    if plan.lora_sampling is not None:
        print(f"  sampling: {plan.default_steps} steps; {plan.lora_sampling.reason}")
    if plan.lora_modules is not None:
        print(f"  loras: {plan.lora_modules.summary()}")
    estimate = plan.estimate
    controlnet = estimate.components.controlnet_gb
    print(f"  memory: {estimate.resident_gb:.1f} GB resident, {estimate.peak_gb:.1f} GB peak, "
          f"budget {estimate.budget_gb:.1f} GB" + (f" (ControlNet {controlnet:.2g} GB)" if controlnet else ""))
    if plan.available is not None:
        print(f"  available: {plan.available.summary()}")
    if plan.fallback:
        fb = plan.fallback
        print(f"  fallback if the {plan.value('transformer_quant')} build fails: "
              f"{fb.value('memory_mode')} ({fb['memory_mode'].reason})")
    return 0


def report_overrides(controls: Mapping[str, Any], *, strict: bool,
                     already: Iterable[str] = ()) -> list[dict[str, object]]:
    """One ``warning[overridden]`` line per explicit request the engine did not honour.

    :raises Strict: with ``strict``, instead of warning (before anything loads).
    """
    from engine.cli.requests import CONTROL_FLAGS

    found = [
        {"control": name, "flag": CONTROL_FLAGS.get(name, name), "requested": r.asked,
         "value": r.value, "status": r.outcome, "reason": r.reason}
        for name, r in controls.items() if r.overridden and name not in already
    ]
    lines = [f"{o['flag']} {o['requested']} {o['status']} (using {_shown(o['value'])}): {o['reason']}"
             for o in found]
    if found and strict:
        raise Strict("; ".join(lines) + " (--strict refuses overrides; drop --strict to accept them)")
    for line in lines:
        print(f"warning[overridden]: {line}", file=sys.stderr)
    return found


def _shown(value: object) -> str:
    return "none" if value is None else str(value)


# -- generate -------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    """One engine question (the ticket: every check, each decision once), then load, generate."""
    from engine import Engine
    from engine.cli.requests import generate_body, output_paths, plan_controls

    if args.device == "cpu":  # before torch loads: this process and its ranks see no GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["HIP_VISIBLE_DEVICES"] = ""
    controls = plan_controls(args)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    body = generate_body(args, seed)
    items = body.images()
    paths = output_paths(args.output, len(items), overwrite=args.overwrite)
    if not args.json:  # before torch and diffusers are imported: a cold start is many seconds of silence
        print(starting_line(args, len(items), paths[0]), file=sys.stderr, flush=True)
    request = controls.request()
    if args.tiny and request.steps is None:
        request = dataclasses.replace(request, steps=body.steps)
    startup = StartUp()
    with tempfile.TemporaryDirectory(prefix="diffusion-engine-tiny-") as scratch, \
            Engine(allow_download=download_allowed(args)) as engine:  # unloaded before its folder goes
        door = engine.videos if paths[0].suffix.lower() == ".mp4" else engine.images
        model = _tiny_model(args, engine, Path(scratch), startup) if args.tiny else args.model
        checking = time.perf_counter()
        ticket = door.check_generate(body.model_copy(update={"model": model}), base=args.base, family=args.family,
                                     request=request, controlnet=args.controlnet)  # every refusal, nothing heavy
        startup.checks = time.perf_counter() - checking
        plan, weights = ticket.plan, ticket.target.ticket.weights
        if not weights["here"] and plan.sdcpp is None:  # sd.cpp reads the files beside the model: no download
            print(f"downloading {weights['repo']}: about {weights['download_gb']} GB into the hub cache",
                  file=sys.stderr)
        overridden = report_overrides(plan.controls, strict=args.strict)
        if not args.tiny:
            startup.imports += _import_runtime(args, engine)  # start-up, not the model's load
        started = time.perf_counter()
        status = door.load(ticket)  # the ticket's decisions, re-checked only where they can have changed
        loaded = time.perf_counter()
        overridden += report_overrides(_controls(status), strict=args.strict,
                                       already=[o["control"] for o in overridden])
        made: Any = door.generate(ticket, progress=None if args.json else progress_bar())  # a Video, or images
    done = time.perf_counter()
    times = {**startup.to_dict(started - PROCESS_STARTED), "load_s": loaded - started, "generate_s": done - loaded}
    if ticket.shape is not None:
        made.save(paths[0])
        return report_clip(args, paths[0], made, seed, times, overridden)
    return report_images(args, body, ticket, made, paths, status, times, overridden)


def report_images(args: argparse.Namespace, body: Any, ticket: Any, images: list[Any], paths: list[Path],
                  status: Mapping[str, Any], times: Mapping[str, float], overridden: list[Any]) -> int:
    """Write the images with their PNG records; what was written, as lines or as JSON (``--json``)."""
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    items = body.images()
    steps = body.steps or ticket.plan.default_steps
    applied = list((status.get("loras") or {}).get("applied") or [])
    for index, (image, path) in enumerate(zip(images, paths)):
        info = _png_info(body, items[index], model=ticket.model, steps=steps, image=image, index=index, loras=applied)
        image.save(path, pnginfo=info)
    if args.json:
        print(json.dumps({
            "images": [str(p) for p in paths], "seed": body.seed,
            **{k: round(v, 3) for k, v in times.items()}, "overridden": overridden, "status": status,
        }, indent=2, default=str))
        return 0
    for path, image in zip(paths, images):
        print(f"wrote {path} ({image.width}x{image.height}, {steps} steps)")
    seeds = ", ".join(str(s) for s in body.seeds) if body.seeds else str(body.seed)
    print(f"seed{'s' if body.seeds else ''} {seeds}" + "".join(f", LoRA {lo['name']} x{lo['scale']:g}" for lo in applied))
    print(f"{StartUp.line_of(times)}, load {times['load_s']:.2f} s, generate {times['generate_s']:.2f} s")
    return 0


@dataclasses.dataclass
class StartUp:
    """Where a generate's start-up (process start to the model's load) went, so the timing
    line explains it: the imports, the tiny pipeline's build, the request's checks; what is
    left is Python itself and the engine's own import."""

    imports: float = 0.0
    build: float = 0.0
    checks: float = 0.0

    def to_dict(self, total: float) -> dict[str, float]:
        return {"startup_s": total, "import_s": self.imports, "build_s": self.build, "checks_s": self.checks}

    @staticmethod
    def line_of(times: Mapping[str, float]) -> str:
        """The start-up line for :meth:`to_dict`'s figures."""
        total, imports, build, checks = (times[k] for k in ("startup_s", "import_s", "build_s", "checks_s"))
        parts = [f"importing torch and diffusers {imports:.2f} s"]
        if build:
            parts.append(f"building the tiny pipeline {build:.2f} s")
        parts.append(f"checks {checks:.2f} s")
        parts.append(f"Python and the engine {max(0.0, total - imports - build - checks):.2f} s")
        return f"start-up {total:.2f} s ({', '.join(parts)})"


def starting_line(args: argparse.Namespace, count: int, first: Path) -> str:
    """The first thing ``generate`` prints, before the heavy imports: what it is about to do."""
    what = f"a tiny {args.tiny} pipeline (random weights)" if args.tiny else args.model
    images = "a clip" if first.suffix.lower() == ".mp4" else f"{count} image{'s' if count != 1 else ''}"
    return f"generate: {images} with {what} into {first} (checking the request, then importing torch and diffusers)"


def _tiny_model(args: argparse.Namespace, engine: Any, scratch: Path, startup: StartUp) -> str:
    """Build ``--tiny``'s pipeline in ``scratch``, timing its imports apart from the build."""
    engine.registry.family(args.tiny)  # an unknown family before anything is imported or built
    startup.imports += _import_runtime(args, engine)
    building = time.perf_counter()
    model = str(engine.catalog.tiny_pipeline(args.tiny, scratch / args.tiny))
    startup.build = time.perf_counter() - building
    return model


def report_clip(args: argparse.Namespace, path: Path, clip: Any, seed: int, times: Mapping[str, float],
                overridden: list[Any]) -> int:
    """What a video generate wrote, as a line or as JSON (``--json``)."""
    recipe = path.with_suffix(".json")
    if args.json:
        print(json.dumps({"video": str(path), "recipe": str(recipe), "seed": seed, **clip.shape.to_dict(),
                          "audio": clip.audio, **{k: round(v, 3) for k, v in times.items()},
                          "overridden": overridden}, indent=2, default=str))
        return 0
    shape = clip.shape
    sound = clip.sound
    heard = f", with {sound.seconds:.2f} s of {sound.sample_rate / 1000:g} kHz sound" if sound is not None else ""
    print(f"wrote {path} ({shape.frames} frames, {shape.width}x{shape.height}, {shape.fps} fps, "
          f"{shape.seconds:.2f} s{heard}) and its recipe {recipe}")
    print(f"seed {seed}; start-up {times['startup_s']:.2f} s, load {times['load_s']:.2f} s, "
          f"generate {times['generate_s']:.2f} s")
    return 0


def _import_runtime(args: argparse.Namespace, engine: Any) -> float:
    """Import torch, diffusers and transformers (their log set-up included); seconds it took."""
    started = time.perf_counter()
    engine.images.prepare_runtime()
    _quiet_loading(args)  # imports diffusers and transformers for their logging
    return time.perf_counter() - started


def _quiet_loading(args: argparse.Namespace) -> None:
    """No loading / saving bars from the libraries (the CLI shows its own progress) unless -v."""
    if not args.verbose:
        from engine.logs import quiet_library_logs

        quiet_library_logs(progress_bars=False)


def _controls(status: Mapping[str, Any]) -> dict[str, Any]:
    """The loaded pipeline's controls, as the runtime recorded them (fallbacks included), from its status."""
    resolved = (status.get("plan") or {}).get("resolved") or {}
    return {name: argparse.Namespace(asked=r["requested"], value=r["value"], outcome=r["status"],
                                     overridden=r["overridden"], reason=r["reason"]) for name, r in resolved.items()}


def _png_info(body: Any, item: Any, *, model: str, steps: int, image: Any, index: int,
              loras: list[dict[str, Any]]) -> Any:
    """The PNG text chunks that make an image reproducible alone: its own prompt
    and seed (``item``, as the engine made it), its index in the batch, steps,
    size, model and LoRAs with scales."""
    from PIL.PngImagePlugin import PngInfo

    record = {
        "prompt": item.prompt, "negative_prompt": body.negative_prompt, "seed": item.seed,
        "batch_index": index, "steps": steps, "guidance": body.guidance,
        "width": image.width, "height": image.height, "model": model,
        "loras": [{"path": lo["path"], "scale": lo["scale"]} for lo in loras],
    }
    info = PngInfo()
    info.add_text("prompt", item.prompt)
    info.add_text("diffusion-engine", json.dumps(record))
    return info


def progress_bar(description: str = "denoising") -> Any:
    """``update(step, total)``: one bar per run of steps, closed once when it reaches the
    total. Updates that repeat the finished total (a run saving after its last step, polled
    meanwhile) draw nothing; a step below it starts the next bar (the next image)."""
    from tqdm import tqdm

    bar: dict[str, Any] = {"finished": None}

    def update(step: int, total: int) -> None:
        if "bar" not in bar:
            if bar["finished"] == (total, step) or (bar["finished"] is not None and step >= total):
                return  # the same finished run of steps, asked again
            bar["bar"] = tqdm(total=total, desc=description, unit="step", leave=False)
        bar["bar"].update(step - bar["bar"].n)
        if step >= total:
            bar.pop("bar").close()
            bar["finished"] = (total, step)

    return update


# -- tiny save ------------------------------------------------------------------------------


def cmd_tiny(args: argparse.Namespace) -> int:
    """Write FAMILY's tiny random-weight pipeline to DIR: a real diffusers folder to try
    every command on, offline, in seconds."""
    from engine import Engine

    engine = Engine()
    family = engine.catalog.family(args.family)
    _quiet_loading(args)
    written = engine.catalog.tiny_pipeline(args.family, args.folder, sdcpp=args.sdcpp)
    if args.json:
        print(json.dumps({"family": family["name"], "path": str(written)}, indent=2))
    elif args.sdcpp:
        print(f"wrote tiny {family['label']} files for stable-diffusion.cpp: {written}, with its companions beside it")
    else:
        print(f"wrote a tiny {family['label']} pipeline to {written}")
        what = "--frames 9 -o fox.mp4" if family.get("output") == "frames" else "-o fox.png"  # a clip, or an image
        print(f"  try: diffusion-engine generate --model {written} --prompt 'a fox' "
              f"--width 64 --height 64 --steps 4 {what}")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    """Write a pipeline folder whose denoiser is stored quantised (``Engine.quantize``)."""
    from engine import Engine

    _quiet_loading(args)
    written = Engine().quantize(args.model, args.scheme, args.output, device=args.device)
    if args.json:
        print(json.dumps(written, indent=2))
    else:
        print(f"wrote {written['output']}: {', '.join(written['quantised'])} stored {written['scheme']} for "  # type: ignore[arg-type]
              f"{written['device']} ({written['layers']} layers, {written['seconds']} s)")
        print(f"  try: diffusion-engine generate --model {written['output']} --prompt 'a fox' -o fox.png")
    return 0


def cmd_tiny_dataset(args: argparse.Namespace) -> int:
    """Write a few drawn, captioned PNGs to DIR: a dataset ``train`` accepts, offline."""
    from engine import Engine

    folder = Engine().catalog.tiny_dataset(args.folder, count=args.count, size=args.size)
    if args.json:
        print(json.dumps({"path": str(folder), "images": args.count}, indent=2))
    else:
        print(f"wrote {args.count} captioned {args.size}x{args.size} images to {folder}")
    return 0


__all__ = ["cmd_generate", "cmd_plan", "cmd_tiny", "cmd_tiny_dataset"]
