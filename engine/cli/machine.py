"""``families``, ``info``, ``serve`` and ``doctor``: the machine and what is installed."""

from __future__ import annotations

import argparse
import json
import sys

from engine.cli.common import flag_words
from engine.errors import EngineError
from engine.hardware.profile import HardwareProfile
from engine.plugins import Registry, load_registry


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


def cmd_families(args: argparse.Namespace) -> int:
    registry = load_registry()
    plugins = [p for p in registry.plugins if args.all or not p.builtin]
    if args.json:
        payload = {
            "families": [_family_row(registry, name) for name in registry.families],
            "plugins": [
                {"name": p.name, "package": p.package, "version": p.version, "hooks": list(p.hooks),
                 "families": list(p.families), "builtin": p.builtin}
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
    for name, family in registry.families.items():
        names = ", ".join(c.name for c in family.checkpoints)
        print(f"{name:<22} checkpoints (--model NAME): {names}")
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


def cmd_info(args: argparse.Namespace) -> int:
    from engine.policy.info import images_info, training_info

    registry = load_registry()
    hardware = machine_from_args(args)
    families = [registry.family(args.family)] if args.family else list(registry.families.values())
    rows = [(images_info(registry, f), training_info(registry, f, hardware)) for f in families]
    if args.json:
        print(json.dumps({
            "hardware": hardware.to_dict(),
            "families": {img.family: {"images": img.to_dict(), "training": train.to_dict()} for img, train in rows},
            "errors": [e.__dict__ for e in registry.errors],
        }, indent=2))
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
        print(f"  bf16 GB: transformer {sizes.transformer_gb}, text encoders "
              f"{sizes.text_encoders_gb}, VAE {sizes.vae_gb}")
        resident = ", ".join(
            f"{s} {gb}" + (" (denied)" if s in img.denied else "") for s, gb in img.resident_gb.items()
        )
        print(f"  resident GB: {resident}")
        for scheme, reason in img.denied.items():
            print(f"  denied {scheme}: {reason}")
        modes = ", ".join(train.precision_modes) or "-"
        print(f"  training: {'yes' if train.trainable else 'no'}; modes: {modes}; "
              f"recommended: {train.recommended_precision or '-'}; "
              f"compile: {'yes' if train.supports_compile else 'no'}")
        for mode, gb in (train.estimated_peak_gb or {}).items():
            print(f"    {mode}: about {gb} GB at peak")
        print(f"  note: {flag_words(train.vram_note)}")
    for error in registry.errors:
        print(f"\nplugin {error.plugin} ({error.package}) failed to load: {error.error}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
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
        input_roots=tuple(Path(p) for p in args.inputs),
        output_roots=(outputs,),
        token=args.token if args.token is not None else os.environ.get("DIFFUSION_ENGINE_TOKEN"),
        allow_hub=args.allow_hub,
        insecure_no_token=args.insecure_no_token,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        queue_size=args.queue_size,
        bind_host=args.host,
        extra_hosts=tuple(args.allow_host),
    )
    settings.check_bind(args.host)
    try:
        import uvicorn

        from engine.server.app import create_app
    except ImportError as exc:
        raise EngineError(
            f"the server needs its extra: from the clone, pip install -e '.[server]' ({exc})",
            code="missing_extra",
        ) from None
    from engine.service import Engine

    outputs.mkdir(parents=True, exist_ok=True)
    engine = Engine(runs_dir=outputs, allow_download=settings.allow_hub)
    if args.load:
        engine.load(args.load)
    if settings.token is None and not is_loopback(args.host):
        print(f"warning: serving {args.host} beyond loopback without a token (--insecure-no-token)", file=sys.stderr)
    # Open event streams (SSE) never end by themselves: shutdown waits at most this long for them.
    uvicorn.run(create_app(engine, settings), host=args.host, port=args.port,
                log_level="info", timeout_graceful_shutdown=5)
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    """Versions, then one verdict per family for inference and training: what this machine
    does, why, and what would do better."""
    from engine.doctor import run_doctor
    from engine.service import Engine

    report = run_doctor(Engine(), as_json=args.json)
    print(report if args.json else flag_words(report))  # the verdicts' advice, as flags
    return 0


cmd_doctor = _cmd_doctor
