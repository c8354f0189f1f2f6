"""The command line's shape: every command, flag, help text and default.

Flags that feed a request model are declared in tables (see
:mod:`engine.cli.requests`), so a new engine capability is one row here and
one field mapping there; the command functions live in their own modules.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine import __version__
from engine.cli import images, machine, training
from engine.deprecation import register, told
from engine.requests.choices import STORED_SCHEMES
from engine.cli.common import DOWNLOAD_HELP, Parser, add_controls, add_json, add_verbose, port_number
from engine.requests import GENERATE_CONTROLS, MODEL_CONTROLS, PLAN_CONTROLS
from engine.server.settings import DEFAULT_GALLERY_GB

RUNS_DIR_HELP = ("where runs live (default: $DIFFUSION_ENGINE_HOME/runs, else the per-user data folder, "
                 "e.g. ~/.local/share/diffusion-engine/runs)")
STRICT_HELP = "exit 2 instead of warning when the engine overrides a value given explicitly"

#: The subcommands of the one parser (argparse's type for them).
Commands = argparse._SubParsersAction  # type: ignore[type-arg]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="diffusion-engine",
        description="Run diffusion image models and train LoRA adapters, the fastest way "
        "this machine allows.",
    )
    parser.add_argument("--version", action="version", version=f"diffusion-engine {__version__}")
    add_verbose(parser)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=Parser)

    _add_families(commands)
    _add_info(commands)
    _add_plan(commands)
    _add_generate(commands)
    _add_tiny(commands)
    _add_quantize(commands)
    training.add_parsers(commands, runs_dir_help=RUNS_DIR_HELP, add_machine_args=_add_machine_args,
                         common=_common)
    _add_serve(commands)
    _add_doctor(commands)
    return parser


def _add_families(commands: Commands) -> None:
    families = commands.add_parser("families", help="list model-family plugins and their checkpoints")
    families.add_argument("--all", action="store_true", help="include the engine's built-in plugin")
    families.add_argument("--hook", metavar="NAME", help="which plugins implement hook NAME, in the order "
                          "they are asked (set DIFFUSION_ENGINE_TRACE_PLUGINS=1 to log who answers each call)")
    _common(families)
    families.set_defaults(run=machine.cmd_families)


def _add_info(commands: Commands) -> None:
    info = commands.add_parser("info", help="sizes and training options per family on a machine")
    info.add_argument("--family", help="only this family")
    info.add_argument("--model", metavar="NAME|PATH", help="only this model's family, with what the model "
                      "reference resolves to (a hub id or checkpoint name that is not here is sized from its "
                      "family's table; nothing is downloaded)")
    _add_machine_args(info)
    _common(info)
    info.set_defaults(run=machine.cmd_info)


def _add_plan(commands: Commands) -> None:
    plan = commands.add_parser("plan", help="every inference control, decided with its reason")
    _add_model_args(plan, tiny=False)
    _add_plan_args(plan, steps=True)
    add_controls(plan.add_argument_group("the request's shape (the plan is made for it)"),
                 [c for c in GENERATE_CONTROLS if c.field in SHAPE_FIELDS])
    _add_machine_args(plan)
    plan.add_argument("--strict", action="store_true", help=STRICT_HELP)
    _common(plan)
    plan.set_defaults(run=images.cmd_plan)


def _add_generate(commands: Commands) -> None:
    generate = commands.add_parser("generate", help="generate images on this machine")
    _add_model_args(generate, tiny=True)
    generate.add_argument("--prompt", required=True, action="append", dest="prompt_list", metavar="PROMPT",
                          help="what to draw; repeat it for one image per prompt")
    generate.add_argument("-o", "--output", default="out.png",
                          help="PNG path; with --count N > 1, files NAME-0.png ... NAME-(N-1).png")
    generate.add_argument("--steps", type=int, help="denoising steps (default: the checkpoint's; 4 with --tiny)")
    generate.add_argument(
        "--lora", action="append", default=[], metavar="PATH[:SCALE]",
        help="apply a LoRA (.safetensors file or a training run's folder), scale 1.0 by default (repeatable)",
    )
    generate.add_argument(
        "--lora-partial", action="store_true",
        help="apply the modules of each --lora that match this model and skip the rest (the plan counts "
             "both); without it a LoRA with a module the model lacks is refused",
    )
    generate.add_argument("--seeds", type=_seed_list, metavar="N,N,...",
                          help="one seed per image (image k replays alone with seed k)")
    generate.add_argument("--overwrite", action="store_true", help="replace existing output files")
    generate.add_argument("--device", choices=("auto", "cpu"), default="auto",
                          help="cpu: run on the CPU where a GPU is too (the GPUs hidden from this process and its "
                               "ranks: --gpus N then starts N CPU processes over gloo); default auto")
    add_controls(generate, GENERATE_CONTROLS)
    _add_plan_args(generate, steps=False)
    generate.add_argument("--strict", action="store_true", help=STRICT_HELP)
    _common(generate)
    generate.set_defaults(run=images.cmd_generate)


def _add_tiny(commands: Commands) -> None:
    tiny = commands.add_parser("tiny", help="tiny random-weight pipelines and datasets, to try "
                               "every command offline in seconds")
    tiny_commands = tiny.add_subparsers(title="what", metavar="WHAT", parser_class=Parser, required=True,
                                       help="save a pipeline, or write a dataset")
    save = tiny_commands.add_parser("save", help="`tiny save FAMILY DIR`: FAMILY's tiny pipeline as a folder")
    save.add_argument("family", metavar="FAMILY", help="a family name (`diffusion-engine families`)")
    save.add_argument("folder", metavar="DIR", type=Path, help="the folder to create (new or empty)")
    save.add_argument("--sdcpp", action="store_true", help="write the files stable-diffusion.cpp reads (a GGUF "
                      "with its autoencoder and text encoder beside it), not a diffusers folder")
    _common(save)
    save.set_defaults(run=images.cmd_tiny)
    dataset = tiny_commands.add_parser("dataset", help="`tiny dataset DIR`: drawn images with captions to train on")
    dataset.add_argument("folder", metavar="DIR", type=Path, help="the folder to create (new or empty)")
    dataset.add_argument("--count", type=int, default=4, help="images (1-64)")
    dataset.add_argument("--size", type=int, default=64, help="image side in pixels (16-1024)")
    _common(dataset)
    dataset.set_defaults(run=images.cmd_tiny_dataset)


def _add_quantize(commands: Commands) -> None:
    quantize = commands.add_parser("quantize", help="store a pipeline's denoiser quantised (int8 / fp8), "
                                   "so it loads with no dense transient and no quantising")
    quantize.add_argument("--model", required=True, metavar="DIR", help="a diffusers pipeline folder")
    quantize.add_argument("--scheme", required=True, choices=STORED_SCHEMES, help="how to store the denoiser")
    quantize.add_argument("-o", "--output", required=True, type=Path, metavar="DIR",
                          help="the pipeline folder to write (new or empty)")
    quantize.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                          help="the device it is made for (torchao's int8 is weight-only on a CPU, dynamic on a "
                          "GPU; default: this machine's)")
    _common(quantize)
    quantize.set_defaults(run=images.cmd_quantize)


def _add_serve(commands: Commands) -> None:
    serve = commands.add_parser("serve", help="serve the HTTP API (needs the [server] extra)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless you say otherwise)")
    serve.add_argument("--port", type=port_number, default=8000, help="TCP port (0-65535; 0: any free one)")
    serve.add_argument("--token", help="require this bearer token (or DIFFUSION_ENGINE_TOKEN)")
    serve.add_argument("--models", action="append", default=[], metavar="DIR", help="a model root (repeatable)")
    serve.add_argument("--datasets", action="append", default=[], metavar="DIR", help="a dataset root (repeatable)")
    serve.add_argument("--loras", action="append", default=[], metavar="DIR", help="a LoRA root (repeatable)")
    serve.add_argument("--inputs", action="append", default=[], metavar="DIR",
                       help="a root for input images (img2img, masks, control images) (repeatable)")
    serve.add_argument("--outputs", default=None, metavar="DIR", help="where runs are written and read: "
                       "the same folder as `train --runs-dir` (default: $DIFFUSION_ENGINE_HOME/runs, else the "
                       "per-user data folder), so the web page and `runs` see the same runs")
    serve.add_argument("--allow-hub", action="store_true", help="accept hub repo ids as models")
    serve.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                       help="another name clients may reach the server by (a reverse proxy's; repeatable; "
                            "'*' for any). A loopback server answers only loopback names otherwise")
    serve.add_argument("--load", metavar="PATH", help="load this model at start")
    serve.add_argument("--threads", type=int, default=None, metavar="N",
                       help="CPU threads for every model this server loads (as OMP_NUM_THREADS, which the plan "
                            "takes as your say; default: the plan's, one per physical core or one for a tiny model)")
    serve.add_argument(
        "--insecure-no-token", action="store_true",
        help="allow a non-loopback --host without a token (anyone who reaches it can use the engine)",
    )
    serve.add_argument("--max-body-mb", type=float, default=1.0, metavar="MB",
                       help="refuse request bodies larger than this with 413")
    serve.add_argument("--max-upload-mb", type=float, default=64.0, metavar="MB",
                       help="the cap on one dataset upload (the page's dataset manager); larger is refused with 413")
    serve.add_argument("--keep-alive", type=float, default=None, metavar="SECONDS",
                       help="unload a model that sat idle this long, giving its memory back (default: keep it "
                            "until unloaded); every load and generate restarts the clock")
    serve.add_argument("--queue-size", type=int, default=128, metavar="N",
                       help="generate jobs that may wait behind the running one; one more is refused "
                            "with 429 and Retry-After")
    serve.add_argument("--gallery-max-gb", type=float, default=DEFAULT_GALLERY_GB, metavar="GB",
                       help="the gallery's size bound (every output is kept there with its recipe, under the "
                            "outputs folder): past it the oldest unpinned outputs go (default %(default)s)")
    serve.add_argument("--gallery-max-age", type=float, default=None, metavar="SECONDS",
                       help="remove unpinned outputs older than this from the gallery (default: kept until the "
                            "size bound removes them)")
    serve.add_argument("--keep-url-images", dest="gallery_max_age", type=float, metavar="SECONDS",
                       help=argparse.SUPPRESS, action=_Renamed)
    serve.add_argument("--replicas", type=int, default=1, metavar="N",
                       help="serve through N replicas on Ray Serve, one engine each (one GPU each on a GPU "
                            "machine); needs the ray extra")
    serve.add_argument("--ray-address", metavar="ADDR",
                       help="run the replicas on this existing Ray cluster (e.g. auto, or ray://HOST:10001) "
                            "instead of a Ray started here")
    serve.add_argument("--ray-autoscaling", metavar="JSON",
                       help="Ray Serve's autoscaling_config for the replicas (min_replicas, max_replicas, "
                            "target_ongoing_requests...), in place of a fixed --replicas")
    add_verbose(serve)
    serve.set_defaults(run=machine.cmd_serve)


def _add_doctor(commands: Commands) -> None:
    doctor = commands.add_parser("doctor", help="probe this machine with torch, in depth")
    _common(doctor)
    doctor.set_defaults(run=machine.cmd_doctor)



#: The generate flags that shape a plan: ``plan`` takes them too (one row, one spelling).
SHAPE_FIELDS = ("width", "height", "count", "frames")

#: The flags earlier releases spelled differently: rows of the register (engine.deprecation).
RENAMED_FLAGS = {old: register(old, new, kind="flag") for old, new in (
    ("--keep-url-images", "--gallery-max-age"), ("--model-family", "--family"))}


class _Renamed(argparse.Action):
    """A flag an earlier release spelled differently: still taken, with the register's warning."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        for line in told(RENAMED_FLAGS[str(option_string)]):
            print(f"warning[deprecated]: {line}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _seed_list(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]`` (argparse reports a ValueError as a usage error naming the flag)."""
    return [int(part) for part in text.split(",") if part.strip()]


def _common(parser: argparse.ArgumentParser) -> None:
    add_json(parser)
    add_verbose(parser)


def _add_machine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("machine (ask for a machine you do not have)")
    group.add_argument("--hardware", metavar="PRESET",
                       help="a preset instead of this machine (an unknown name lists them); a dry run "
                            "for a model that is not here is sized from its family's table")
    group.add_argument("--free-gb", type=float, metavar="N", help="override free device memory")
    group.add_argument("--no-torchao", action="store_true", help="treat torchao as missing or a stub")


def _add_model_args(parser: argparse.ArgumentParser, *, tiny: bool) -> None:
    """The model a command is about, as every command names it (the control table's model rows)."""
    group = parser.add_argument_group("model")
    rows = {c.field: c for c in MODEL_CONTROLS}
    which = group.add_mutually_exclusive_group(required=tiny)
    which.add_argument(rows["model"].flag, **rows["model"].argparse_kwargs())  # type: ignore[arg-type]
    if tiny:
        which.add_argument("--tiny", metavar="FAMILY", help="a tiny random-weight pipeline of FAMILY "
                           "(64 px, 4 steps unless you say otherwise)")
    group.add_argument(rows["family"].flag, **rows["family"].argparse_kwargs())  # type: ignore[arg-type]
    # The name earlier releases gave the model's family on plan and generate.
    group.add_argument("--model-family", dest="family", help=argparse.SUPPRESS, action=_Renamed)
    if not tiny:
        group.add_argument(rows["checkpoint"].flag, **rows["checkpoint"].argparse_kwargs())  # type: ignore[arg-type]
    group.add_argument(rows["base"].flag, **rows["base"].argparse_kwargs())  # type: ignore[arg-type]
    group.add_argument(rows["controlnet"].flag, **rows["controlnet"].argparse_kwargs())  # type: ignore[arg-type]
    group.add_argument("--allow-download", action="store_true", help=DOWNLOAD_HELP)


def _add_plan_args(parser: argparse.ArgumentParser, *, steps: bool) -> None:
    add_controls(parser.add_argument_group("plan (auto: the engine decides and says why)"),
                 [c for c in PLAN_CONTROLS if steps or c.field != "steps"])
