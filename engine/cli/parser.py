"""The command line's shape: every command, flag, help text and default.

Flags that feed a request model are declared in tables (see
:mod:`engine.cli.requests`), so a new engine capability is one row here and
one field mapping there; the command functions live in their own modules.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from engine import __version__
from engine.cli import images, machine, training
from engine.cli.common import DOWNLOAD_HELP, Parser, add_json, add_verbose

RUNS_DIR_HELP = ("where runs live (default: $DIFFUSION_ENGINE_HOME/runs, else the per-user data folder, "
                 "e.g. ~/.local/share/diffusion-engine/runs)")
STRICT_HELP = "exit 2 instead of warning when the engine overrides a value given explicitly"

#: Plan controls: (flag, default, choices help). The dest is the InferenceRequest field.
PLAN_FLAGS: tuple[tuple[str, str | None, str], ...] = (
    ("--dtype", "auto", "compute dtype: auto | bf16 | fp16 | fp32"),
    ("--quant", "auto", "transformer weights: auto | none | int8 | fp8 | mxfp8 | nvfp4 | nf4"),
    ("--memory", "auto", "placement: auto | resident | model_offload | group_offload | sequential_offload"),
    ("--attention", "auto", "attention kernel: auto | native | flash | flash3 | sage | xformers"),
    ("--step-cache", "auto", "reuse of late denoising steps: auto | off | fbcache"),
    ("--compile", "auto", "torch.compile of the repeated blocks: auto | on | off"),
    ("--speed", "default", "speed tier: off | eager | default | max"),
    ("--text-encoder-quant", "auto", "text-encoder weights: auto | none | int8 | fp8 | nvfp4 | nf4"),
    ("--text-encoder-memory", "auto", "text encoders: auto | resident | streamed (load, encode, free)"),
    ("--vae-tiling", "auto", "decode in tiles: auto (above the size the plan names) | on | off"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="diffusion-engine",
        description="Run diffusion image models and train LoRA adapters, the fastest way "
        "this machine allows.",
    )
    parser.add_argument("--version", action="version", version=f"diffusion-engine {__version__}")
    add_verbose(parser)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=Parser)

    families = commands.add_parser("families", help="list model-family plugins and their checkpoints")
    families.add_argument("--all", action="store_true", help="include the engine's built-in plugin")
    _common(families)
    families.set_defaults(run=machine.cmd_families)

    info = commands.add_parser("info", help="sizes and training options per family on a machine")
    info.add_argument("--family", help="only this family")
    _add_machine_args(info)
    _common(info)
    info.set_defaults(run=machine.cmd_info)

    plan = commands.add_parser("plan", help="every inference control, decided with its reason")
    _add_model_args(plan, tiny=False)
    _add_plan_args(plan)
    plan.add_argument("--steps", type=int, help="denoising steps (default: the checkpoint's)")
    plan.add_argument("--controlnet", metavar="DIR", help="a ControlNet folder that will load beside the "
                      "model: sized into the plan like any component")
    _add_machine_args(plan)
    plan.add_argument("--strict", action="store_true", help=STRICT_HELP)
    _common(plan)
    plan.set_defaults(run=images.cmd_plan)

    generate = commands.add_parser("generate", help="generate images on this machine")
    _add_model_args(generate, tiny=True)
    generate.add_argument("--prompt", required=True, action="append", dest="prompt_list", metavar="PROMPT",
                          help="what to draw; repeat it for one image per prompt")
    generate.add_argument("--negative-prompt", help="what not to draw (families that take one)")
    generate.add_argument("-o", "--output", default="out.png",
                          help="PNG path; with --count N > 1, files NAME-0.png ... NAME-(N-1).png")
    generate.add_argument("--guidance", type=float, help="guidance scale (default: the checkpoint's)")
    generate.add_argument("--width", type=int, help="pixels, a multiple of 16 (default: the "
                          "pipeline's; 64 with --tiny)")
    generate.add_argument("--height", type=int, help="pixels, a multiple of 16 (default: the "
                          "pipeline's; 64 with --tiny)")
    generate.add_argument("--steps", type=int, help="denoising steps (default: the checkpoint's; 4 with --tiny)")
    generate.add_argument("--seed", type=int, help="random seed (default: a random one, printed)")
    generate.add_argument("--count", type=int, default=1, help="images to generate (at most 8)")
    generate.add_argument(
        "--lora", action="append", default=[], metavar="PATH[:SCALE]",
        help="apply a LoRA (.safetensors file or a training run's folder), scale 1.0 by default (repeatable)",
    )
    generate.add_argument("--seeds", type=_seed_list, metavar="N,N,...",
                          help="one seed per image (image k replays alone with seed k)")
    generate.add_argument("--batch", type=int, metavar="N", help="images per forward (default: as memory allows)")
    generate.add_argument("--overwrite", action="store_true", help="replace existing output files")
    inputs = generate.add_argument_group("images in")
    inputs.add_argument("--image", metavar="PATH", help="an input image: img2img (with --strength), or the "
                        "image an edit checkpoint edits; fitted within --width x --height")
    inputs.add_argument("--mask", dest="mask_image", metavar="PATH",
                        help="with --image: inpaint, redrawing where the mask is white")
    inputs.add_argument("--strength", type=float, help="with --image: how much is redrawn, (0, 1] "
                        "(default: the pipeline's)")
    inputs.add_argument("--controlnet", metavar="DIR", help="a diffusers ControlNet folder of a class the "
                        "model's family supports, loaded beside the pipeline")
    inputs.add_argument("--control-image", metavar="PATH", help="with --controlnet: the image to follow")
    inputs.add_argument("--control-preprocess", choices=("canny", "none"), default="canny",
                        help="turn --control-image into the map the ControlNet reads")
    inputs.add_argument("--control-scale", type=float, help="ControlNet strength, 0-2 (default 1)")
    _add_plan_args(generate)
    generate.add_argument("--strict", action="store_true", help=STRICT_HELP)
    _common(generate)
    generate.set_defaults(run=images.cmd_generate)

    tiny = commands.add_parser("tiny", help="tiny random-weight pipelines and datasets, to try "
                               "every command offline in seconds")
    tiny_commands = tiny.add_subparsers(title="what", metavar="WHAT", parser_class=Parser, required=True,
                                       help="save a pipeline, or write a dataset")
    save = tiny_commands.add_parser("save", help="`tiny save FAMILY DIR`: FAMILY's tiny pipeline as a folder")
    save.add_argument("family", metavar="FAMILY", help="a family name (`diffusion-engine families`)")
    save.add_argument("folder", metavar="DIR", type=Path, help="the folder to create (new or empty)")
    _common(save)
    save.set_defaults(run=images.cmd_tiny)
    dataset = tiny_commands.add_parser("dataset", help="`tiny dataset DIR`: drawn images with captions to train on")
    dataset.add_argument("folder", metavar="DIR", type=Path, help="the folder to create (new or empty)")
    dataset.add_argument("--count", type=int, default=4, help="images (1-64)")
    dataset.add_argument("--size", type=int, default=64, help="image side in pixels (16-1024)")
    _common(dataset)
    dataset.set_defaults(run=images.cmd_tiny_dataset)

    training.add_parsers(commands, runs_dir_help=RUNS_DIR_HELP, add_machine_args=_add_machine_args,
                         common=_common)

    serve = commands.add_parser("serve", help="serve the HTTP API (needs the [server] extra)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless you say otherwise)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port")
    serve.add_argument("--token", help="require this bearer token (or DIFFUSION_ENGINE_TOKEN)")
    serve.add_argument("--models", action="append", default=[], metavar="DIR", help="a model root (repeatable)")
    serve.add_argument("--datasets", action="append", default=[], metavar="DIR", help="a dataset root (repeatable)")
    serve.add_argument("--loras", action="append", default=[], metavar="DIR", help="a LoRA root (repeatable)")
    serve.add_argument("--inputs", action="append", default=[], metavar="DIR",
                       help="a root for input images (img2img, masks, control images) (repeatable)")
    serve.add_argument("--outputs", default="runs", metavar="DIR", help="where runs are written")
    serve.add_argument("--allow-hub", action="store_true", help="accept hub repo ids as models")
    serve.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                       help="another name clients may reach the server by (a reverse proxy's; repeatable; "
                            "'*' for any). A loopback server answers only loopback names otherwise")
    serve.add_argument("--load", metavar="PATH", help="load this model at start")
    serve.add_argument(
        "--insecure-no-token", action="store_true",
        help="allow a non-loopback --host without a token (anyone who reaches it can use the engine)",
    )
    serve.add_argument("--max-body-mb", type=float, default=1.0, metavar="MB",
                       help="refuse request bodies larger than this with 413")
    serve.add_argument("--queue-size", type=int, default=128, metavar="N",
                       help="generate jobs that may wait behind the running one; one more is refused "
                            "with 429 and Retry-After")
    add_verbose(serve)
    serve.set_defaults(run=machine.cmd_serve)

    doctor = commands.add_parser("doctor", help="probe this machine with torch, in depth")
    _common(doctor)
    doctor.set_defaults(run=machine.cmd_doctor)
    return parser


def _seed_list(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]`` (argparse reports a ValueError as a usage error naming the flag)."""
    return [int(part) for part in text.split(",") if part.strip()]


def _common(parser: argparse.ArgumentParser) -> None:
    add_json(parser)
    add_verbose(parser)


def _add_machine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("machine (ask for a machine you do not have)")
    group.add_argument("--hardware", metavar="PRESET",
                       help="a preset instead of this machine (an unknown name lists them)")
    group.add_argument("--free-gb", type=float, metavar="N", help="override free device memory")
    group.add_argument("--no-torchao", action="store_true", help="treat torchao as missing or a stub")


def _add_model_args(parser: argparse.ArgumentParser, *, tiny: bool) -> None:
    group = parser.add_argument_group("model")
    which = group.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", metavar="NAME|PATH",
                       help="pipeline folder, single file (with --base), GGUF, hub id, or a checkpoint "
                       "name listed by `diffusion-engine families`")
    if tiny:
        which.add_argument("--tiny", metavar="FAMILY", help="a tiny random-weight pipeline of FAMILY "
                           "(64 px, 4 steps unless you say otherwise)")
    else:
        which.add_argument("--family", dest="family_only", metavar="F", help="plan from F's table")
        group.add_argument("--checkpoint", metavar="C", help="with --family: which checkpoint")
    group.add_argument("--base", metavar="PATH", help="the pipeline providing the rest of a single file / GGUF")
    group.add_argument("--model-family", dest="model_family", metavar="F",
                       help="the model's family when detection cannot tell")
    group.add_argument("--allow-download", action="store_true", help=DOWNLOAD_HELP)


def _add_plan_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("plan (auto: the engine decides and says why)")
    for flag, default, text in PLAN_FLAGS:
        group.add_argument(flag, default=default, help=text)
    group.add_argument("--threads", type=int, help="CPU threads (default: the engine's choice)")
    group.add_argument("--no-prompt-cache", dest="prompt_cache", action="store_false",
                       help="encode every prompt: neither reuse nor write the prompt embeddings cached on disk "
                            "($DIFFUSION_ENGINE_PROMPT_CACHE, default ~/.cache/diffusion-engine/prompt-embeddings)")
