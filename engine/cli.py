"""``diffusion-engine``: the terminal interface.

Every command has ``--json``. Bad input (an unknown family or preset, a
doomed request) prints ``error[code]: message`` on stderr and exits 2, never
a traceback. The light commands (``families``, ``info``) import no torch on a
machine without a GPU: they answer in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from engine.errors import EngineError
from engine.hardware.profile import HardwareProfile
from engine.plugins import Registry, load_registry

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


def machine_from_args(args: argparse.Namespace) -> HardwareProfile:
    """The profile the flags describe: a preset or a probe, with overrides."""
    if args.hardware:
        from engine.hardware.presets import preset

        profile = preset(args.hardware)
    else:
        from engine.hardware.probe import probe

        profile = probe()
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


def _cmd_doctor(args: argparse.Namespace) -> int:
    from engine.hardware.probe import probe

    profile = probe(verify=True)
    if args.json:
        print(json.dumps(profile.to_dict(), indent=2))
        return 0
    for key, value in profile.to_dict().items():
        print(f"{key:<20} {value}")
    return 0
