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
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from engine.cli.common import download_allowed
from engine.cli.machine import machine_from_args
from engine.cli.requests import CONTROL_FLAGS, generate_body, images_of, output_paths, plan_controls
from engine.errors import EngineError
from engine.plugins import Registry, load_registry
from engine.policy.resolved import Resolved


class Strict(EngineError):
    """``--strict``: an explicit request the engine would override."""

    code = "overridden"


# -- plan ---------------------------------------------------------------------------------


def cmd_plan(args: argparse.Namespace) -> int:
    from engine.policy.inference import CONTROLS
    from engine.service import Engine

    controls = plan_controls(args)
    registry = load_registry()
    hardware = machine_from_args(args)
    model = model_location(registry, args.model) if args.model else None
    plan = Engine(registry=registry, hardware=hardware).plan(
        model, family=args.family_only or args.model_family, checkpoint=args.checkpoint,
        base=args.base, request=controls.request(), controlnet=args.controlnet,
    )
    overridden = report_overrides(plan.controls, strict=args.strict)
    family = registry.family(plan.family)
    if model is not None and not args.base:
        from engine.preflight.model import resolve_model

        if resolve_model(registry, model, family=args.model_family).kind in ("single_file", "gguf"):
            print(f"note: {model} is a single {family.label} denoiser file: without --base its text encoders "
                  f"and VAE are sized from the {family.label} table, and generate needs --base", file=sys.stderr)
    if args.json:
        print(json.dumps({"hardware": hardware.to_dict(), "plan": plan.to_dict(),
                          "overridden": overridden}, indent=2))
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


def report_overrides(controls: dict[str, Resolved], *, strict: bool,
                     already: Iterable[str] = ()) -> list[dict[str, object]]:
    """One ``warning[overridden]`` line per explicit request the engine did not honour.

    :raises Strict: with ``strict``, instead of warning (before anything loads).
    """
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


# -- the model: names, single files, the hub -------------------------------------------------


def model_location(registry: Registry, text: str) -> str:
    """``text``, or the hub repo of the checkpoint it names (a ``Checkpoint.name`` or label) when
    no such local path exists."""
    if os.path.lexists(Path(text).expanduser()):
        return text
    lowered = text.lower()
    for family in registry.families.values():
        for checkpoint in family.checkpoints:
            if lowered in (checkpoint.name.lower(), checkpoint.label.lower()):
                return checkpoint.repo
    return text


def check_source(source: Any, args: argparse.Namespace) -> None:
    """Refuse, before loading, a model that would need what was not given:
    ``--base`` for a single file, the hub (and consent) for a repo not cached."""
    family = source.family
    if source.kind in ("single_file", "gguf") and not args.base:
        raise EngineError(
            f"{source.location} is a single {family.label} denoiser file: pass --base with a "
            f"{family.label} diffusers pipeline folder ({family.pipeline_class}) for its text encoders "
            f"and VAE, e.g. `diffusion-engine tiny save {family.name} DIR` for a tiny one, or "
            f"--base {(source.checkpoint or family.default_checkpoint).repo} --allow-download",
            code="base_required",
        )
    from engine.preflight.hub import hub_access_error, hub_download_gb, hub_repo, in_hub_cache

    refusal = hub_access_error(source, allow_download=download_allowed(args))
    if refusal is not None:
        raise refusal
    repo = hub_repo(source)
    if repo is not None and not in_hub_cache(repo):
        print(f"downloading {repo}: {hub_download_gb(repo):.1f} GB into the hub cache", file=sys.stderr)


# -- generate -------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.preflight.model import resolve_model
    from engine.service import Engine

    controls = plan_controls(args)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    body = generate_body(args, seed)
    items = images_of(body)
    paths = output_paths(args.output, len(items), overwrite=args.overwrite)
    registry = load_registry()
    tiny = registry.family(args.tiny) if args.tiny else None
    request = controls.request()
    if tiny is not None and request.steps is None:
        request = dataclasses.replace(request, steps=body.steps)
    # The activation guard sizes the plan for this image size and batch.
    request = dataclasses.replace(request, width=body.width, height=body.height, count=len(items))
    engine = Engine(registry=registry, allow_download=download_allowed(args))
    with tempfile.TemporaryDirectory(prefix="diffusion-engine-tiny-") as scratch:
        if tiny is not None:
            _quiet_loading(args)
            model = str(registry.build_tiny_pipeline(tiny, Path(scratch) / tiny.name))
        else:
            model = model_location(registry, args.model)
        source = resolve_model(registry, model, family=args.model_family, base=args.base)
        check_source(source, args)  # before diffusers is even imported: a refusal is instant
        _quiet_loading(args)
        plan = engine.plan(model, family=args.model_family, base=args.base, request=request)
        overridden = report_overrides(plan.controls, strict=args.strict)
        started = time.perf_counter()
        loras = [f"{lora.path}:{lora.scale}" for lora in body.loras or ()]
        engine.load(model, base=args.base, family=args.model_family, request=request, loras=loras,
                    controlnet=args.controlnet)
        loaded = time.perf_counter()
        try:
            status = engine.status()["pipeline"] or {}
            overridden += report_overrides(_controls(engine), strict=args.strict,
                                           already=[o["control"] for o in overridden])
            images = engine.generate(
                body.prompt, progress=None if args.json else progress_bar(),
                **body.model_dump(exclude={"prompt", "loras"}, exclude_none=True),
            )
            status = engine.status()["pipeline"] or {}
        finally:
            engine.unload()
    done = time.perf_counter()
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    steps = body.steps or plan.default_steps
    applied = list((status.get("loras") or {}).get("applied") or [])  # type: ignore[union-attr]
    for index, (image, path) in enumerate(zip(images, paths)):
        info = _png_info(body, items[index], model=str(source.location), steps=steps, image=image, index=index,
                         loras=applied)
        image.save(path, pnginfo=info)
    if args.json:
        print(json.dumps({
            "images": [str(p) for p in paths], "seed": seed, "load_s": round(loaded - started, 3),
            "generate_s": round(done - loaded, 3), "overridden": overridden, "status": status,
        }, indent=2, default=str))
        return 0
    for path, image in zip(paths, images):
        print(f"wrote {path} ({image.width}x{image.height}, {steps} steps)")
    seeds = ", ".join(str(s) for s in body.seeds) if body.seeds else str(seed)
    print(f"seed{'s' if body.seeds else ''} {seeds}" + "".join(f", LoRA {lo['name']} x{lo['scale']:g}" for lo in applied))
    print(f"load {loaded - started:.2f} s, generate {done - loaded:.2f} s")
    return 0


def _quiet_loading(args: argparse.Namespace) -> None:
    """No loading / saving bars from the libraries (the CLI shows its own progress) unless -v."""
    if not args.verbose:
        from engine.logs import quiet_library_logs

        quiet_library_logs(progress_bars=False)


def _controls(engine: Any) -> dict[str, Resolved]:
    """The loaded pipeline's controls, as the runtime recorded them (fallbacks included)."""
    plan = engine.loaded_plan()
    return dict(plan.controls) if plan is not None else {}


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
    from tqdm import tqdm

    bar: dict[str, tqdm] = {}

    def update(step: int, total: int) -> None:
        if "bar" not in bar:
            bar["bar"] = tqdm(total=total, desc=description, unit="step", leave=False)
        bar["bar"].update(step - bar["bar"].n)
        if step >= total:
            bar.pop("bar").close()

    return update


# -- tiny save ------------------------------------------------------------------------------


def _new_folder(folder: Path) -> Path:
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise EngineError(f"{folder} already exists and is not an empty folder; give a new folder",
                          code="output_exists")
    return folder


def cmd_tiny(args: argparse.Namespace) -> int:
    """Write FAMILY's tiny random-weight pipeline to DIR: a real diffusers folder to try
    every command on, offline, in seconds."""
    registry = load_registry()
    family = registry.family(args.family)
    folder = _new_folder(Path(args.folder))
    _quiet_loading(args)
    written = registry.build_tiny_pipeline(family, folder)
    if args.json:
        print(json.dumps({"family": family.name, "path": str(written)}, indent=2))
    else:
        print(f"wrote a tiny {family.label} pipeline to {written}")
        print(f"  try: diffusion-engine generate --model {written} --prompt 'a fox' "
              "--width 64 --height 64 --steps 4 -o fox.png")
    return 0


def cmd_tiny_dataset(args: argparse.Namespace) -> int:
    """Write a few drawn, captioned PNGs to DIR: a dataset ``train`` accepts, offline."""
    from engine.testing.datasets import write_dataset

    if not 1 <= args.count <= 64:
        raise EngineError(f"--count must be from 1 to 64 (got {args.count})", code="invalid_request")
    if not 16 <= args.size <= 1024:
        raise EngineError(f"--size must be from 16 to 1024 (got {args.size})", code="invalid_request")
    folder = write_dataset(_new_folder(Path(args.folder)), count=args.count, size=args.size)
    if args.json:
        print(json.dumps({"path": str(folder), "images": args.count}, indent=2))
    else:
        print(f"wrote {args.count} captioned {args.size}x{args.size} images to {folder}")
    return 0


__all__ = ["cmd_generate", "cmd_plan", "cmd_tiny", "cmd_tiny_dataset"]
