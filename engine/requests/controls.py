"""The table of controls: one row per thing a user can ask for, in every face.

A row names a control once: the request field (the JSON key over HTTP and
the keyword in Python), the flag a terminal user types, its default, its
choices, its help, and (for a plan control) the key the plan's provenance
reports it under. From these rows come the plan request model's fields
(:class:`engine.requests.PlanControls`), the CLI's flags and ``--help``, the
translation of a refusal into the face's words (a field over HTTP, a flag at
the terminal) and the tables in the docs (:func:`markdown_table`).

A new control is one row here plus its resolver in the policy layer.
Torch-free: the choices are the policy's own tuples.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from engine.requests.choices import (
    ATTENTION_BACKENDS,
    COMPILE_REQUESTS,
    DEVICES,
    DTYPES,
    ENGINES,
    MEMORY_MODES,
    PARALLEL_REQUESTS,
    QUANT_REQUESTS,
    SPEED_REQUESTS,
    STEP_CACHES,
    TEXT_ENCODER_MEMORY_REQUESTS,
    TEXT_ENCODER_QUANT_REQUESTS,
    TRAINING_PRECISIONS,
    VAE_TILING_REQUESTS,
)

#: Which request a control belongs to.
PLAN, GENERATE, TRAIN, MODEL = "plan", "generate", "train", "model"


@dataclass(frozen=True)
class Control:
    """One control: its request field, its flag, and how the CLI reads it."""

    field: str
    flag: str
    help: str
    request: str
    default: object = None
    choices: tuple[str, ...] = ()
    #: The key the plan reports this control under (``quant`` -> ``transformer_quant``).
    plan_key: str | None = None
    #: argparse: how the flag's text becomes the field's value.
    type: Callable[[str], object] | None = None
    action: str | None = None
    metavar: str | None = None
    #: The ``--help`` group the flag is listed under.
    group: str | None = None

    @property
    def dest(self) -> str:
        """The argparse destination: the field's name, so flags map to fields by name."""
        return self.field

    def help_text(self) -> str:
        choices = f": {' | '.join(self.choices)}" if self.choices else ""
        return self.help + choices

    def argparse_kwargs(self) -> dict[str, object]:
        kwargs: dict[str, object] = {"dest": self.dest, "help": self.help_text()}
        if self.action is not None:
            kwargs["action"] = self.action
        if self.action not in ("store_true", "store_false"):
            if self.type is not None:
                kwargs["type"] = self.type
            if self.metavar is not None:
                kwargs["metavar"] = self.metavar
        if self.request == PLAN and self.action is None:
            kwargs["default"] = self.default
        elif self.action in ("store_true", "store_false"):
            kwargs["default"] = None  # unset: the request's own default applies
        return kwargs


def _memory_choices() -> tuple[str, ...]:
    return ("auto", *MEMORY_MODES)


#: Every inference plan control, in the order ``plan`` prints them.
PLAN_CONTROLS: tuple[Control, ...] = (
    Control("engine", "--engine", "what runs the model: diffusers (torch), or sdcpp (stable-diffusion.cpp, "
            "the CPU engine, for a GGUF / original-layout file with its companions beside it)", PLAN, "auto",
            ENGINES, plan_key="engine"),
    Control("dtype", "--dtype", "compute dtype", PLAN, "auto", DTYPES, plan_key="dtype"),
    Control("quant", "--quant", "transformer weights", PLAN, "auto", QUANT_REQUESTS,
            plan_key="transformer_quant"),
    Control("memory", "--memory", "placement on the device", PLAN, "auto", _memory_choices(),
            plan_key="memory_mode"),
    Control("attention", "--attention", "attention kernel", PLAN, "auto", ATTENTION_BACKENDS,
            plan_key="attention_backend"),
    Control("step_cache", "--step-cache", "reuse of late denoising steps", PLAN, "auto", STEP_CACHES,
            plan_key="step_cache"),
    Control("compile", "--compile", "torch.compile of the repeated blocks", PLAN, "auto", COMPILE_REQUESTS,
            plan_key="compile"),
    Control("speed", "--speed", "speed tier", PLAN, "auto", SPEED_REQUESTS, plan_key="speed_tier"),
    Control("text_encoder_quant", "--text-encoder-quant", "text-encoder weights", PLAN, "auto",
            TEXT_ENCODER_QUANT_REQUESTS, plan_key="text_encoder_quant"),
    Control("text_encoder_memory", "--text-encoder-memory", "text encoders kept resident, streamed "
            "(load, encode, free), or on the host (run on the CPU)", PLAN, "auto", TEXT_ENCODER_MEMORY_REQUESTS, plan_key="text_encoder_memory"),
    Control("vae_tiling", "--vae-tiling", "decode in tiles (auto: above the size the plan names)", PLAN,
            "auto", VAE_TILING_REQUESTS, plan_key="vae_tiling"),
    Control("threads", "--threads", "CPU threads (default: the engine's choice)", PLAN, None,
            plan_key="threads", type=int, metavar="N"),
    Control("gpus", "--gpus", "run one request on N GPUs of this machine (with --device cpu: N CPU "
            "processes over gloo); the plan picks how it splits (default 1)", PLAN, None, type=int, metavar="N"),
    Control("parallel", "--parallel", "how a request on several GPUs splits: the sequence (ulysses, ring) "
            "or condition and uncondition (cfg)", PLAN, "auto", PARALLEL_REQUESTS, plan_key="parallel"),
    Control("prompt_cache", "--no-prompt-cache", "encode every prompt: neither reuse nor write the prompt "
            "embeddings cached on disk ($DIFFUSION_ENGINE_PROMPT_CACHE, default "
            "~/.cache/diffusion-engine/prompt-embeddings)", PLAN, True, plan_key="prompt_cache",
            action="store_false"),
    Control("steps", "--steps", "denoising steps (default: the checkpoint's)", PLAN, None, type=int,
            metavar="N"),
)

#: The model a plan, a load, a generate or a training run is about.
MODEL_CONTROLS: tuple[Control, ...] = (
    Control("model", "--model", "pipeline folder, single file (with --base), GGUF, hub id, or a checkpoint "
            "name listed by `diffusion-engine families`", MODEL, metavar="NAME|PATH"),
    Control("family", "--family", "the model's family when it cannot be detected from the model "
            "(with no --model on `plan`: plan from this family's table)", MODEL, metavar="FAMILY"),
    Control("checkpoint", "--checkpoint", "with --family and no --model: which of its checkpoints",
            MODEL, metavar="NAME"),
    Control("base", "--base", "the pipeline (folder or hub id) providing the rest of a single file / GGUF",
            MODEL, metavar="PATH"),
    Control("controlnet", "--controlnet", "a diffusers ControlNet folder of a class the model's family "
            "supports, loaded beside the model (sized into the plan like any component)", MODEL, metavar="DIR"),
)

#: The generate request's fields that come from flags (``prompt`` is the repeatable --prompt).
GENERATE_CONTROLS: tuple[Control, ...] = (
    Control("negative_prompt", "--negative-prompt", "what not to draw (families that take one)", GENERATE),
    Control("guidance", "--guidance", "guidance scale (default: the checkpoint's)", GENERATE, type=float),
    Control("guidance_2", "--guidance-2", "a two-expert video model's low-noise guidance (the pipeline's "
            "guidance_scale_2; default: the checkpoint's)", GENERATE, type=float, group="video"),
    Control("width", "--width", "pixels, a multiple of 16 (default: the pipeline's; 64 with --tiny)",
            GENERATE, type=int),
    Control("height", "--height", "pixels, a multiple of 16 (default: the pipeline's; 64 with --tiny)",
            GENERATE, type=int),
    Control("seed", "--seed", "random seed (default: a random one, printed)", GENERATE, type=int),
    Control("count", "--count", "images to generate (at most 8; default 1)", GENERATE, type=int),
    Control("batch", "--batch", "images per forward (default: as memory allows)", GENERATE, type=int,
            metavar="N"),
    Control("image", "--image", "an input image: img2img (with --strength), or the image an edit "
            "checkpoint edits; fitted within --width x --height; repeat it for a multi-image edit "
            "checkpoint (its table says how many it takes)", GENERATE, metavar="PATH",
            group="images in", action="append"),
    Control("mask_image", "--mask", "with --image: inpaint, redrawing where the mask is white", GENERATE,
            metavar="PATH", group="images in"),
    Control("strength", "--strength", "with --image: how much is redrawn, (0, 1] (default: the pipeline's)",
            GENERATE, type=float, group="images in"),
    Control("control_image", "--control-image", "with --controlnet: the image to follow", GENERATE,
            metavar="PATH", group="images in"),
    Control("control_preprocess", "--control-preprocess", "turn --control-image into the map the "
            "ControlNet reads (default canny)", GENERATE, choices=("canny", "none"), group="images in"),
    Control("control_scale", "--control-scale", "ControlNet strength, 0-2 (default 1)", GENERATE,
            type=float, group="images in"),
    Control("frames", "--frames", "a video model's clip length in frames, on its lattice (4k+1 for most; "
            "default: the checkpoint's)", GENERATE, type=int, group="video"),
    Control("fps", "--fps", "a video's frame rate (default: the checkpoint's)", GENERATE, type=int, group="video"),
    Control("window_frames", "--window-frames", "render the clip in windows of N frames, each after the first "
            "continuing from the last frame before it (default: one window up to the checkpoint's trained "
            "length, then windows of that length)", GENERATE, type=int, metavar="N", group="video"),
)

#: Fields the generate command fills itself (the repeatable --prompt, --lora PATH:SCALE, --seeds N,N).
GENERATE_SPECIAL_FLAGS: Mapping[str, str] = MappingProxyType({
    "prompt": "--prompt", "prompts": "--prompt", "loras": "--lora", "seeds": "--seeds",
})


def _flow_shift(text: str) -> object:
    return text if text == "auto" else float(text)


#: The training request's fields that come from flags (TrainingConfig's fields).
TRAIN_CONTROLS: tuple[Control, ...] = (
    Control("base_model", "--base", "the base pipeline folder, hub id or checkpoint name", TRAIN,
            metavar="PATH"),
    Control("dataset_dir", "--data", "images with .txt/.caption sidecars or metadata.jsonl", TRAIN,
            metavar="DIR"),
    Control("family", "--family", "the base's family (detected when omitted)", TRAIN, metavar="FAMILY"),
    Control("steps", "--steps", "optimizer steps (default: from --epochs, else 500)", TRAIN, type=int),
    Control("epochs", "--epochs", "passes over the dataset (instead of --steps)", TRAIN, type=int),
    Control("resolution", "--resolution", "training size in pixels, a multiple of 16 (default 512; 64 "
            "with --tiny)", TRAIN, type=int),
    Control("batch_size", "--batch-size", "images per step on each GPU (default 1)", TRAIN, type=int),
    Control("learning_rate", "--lr", "learning rate (default: the family's, else 1e-4)", TRAIN, type=float),
    Control("lora_rank", "--rank", "LoRA rank (default 16)", TRAIN, type=int),
    Control("gradient_checkpointing", "--gradient-checkpointing", "recompute block activations in "
            "backward: far less memory, about a third slower; auto turns it on only when the run would "
            "not fit without it (default: auto)", TRAIN, choices=("auto", "on", "off")),
    Control("base_precision", "--base-precision", "how the frozen base is held (default auto)", TRAIN,
            choices=TRAINING_PRECISIONS),
    Control("mixed_precision", "--mixed-precision", "autocast dtype (default bf16)", TRAIN,
            choices=("bf16", "fp16", "no")),
    Control("compile", "--compile", "regional torch.compile (default auto)", TRAIN, choices=("auto", "on", "off")),
    Control("device", "--device", "where to train (default auto)", TRAIN, choices=DEVICES),
    Control("gpus", "--gpus", "train on N GPUs of this machine through accelerate (DDP; --batch-size is "
            "per GPU); with --device cpu, N CPU processes over gloo (default 1)", TRAIN, type=int),
    Control("nodes", "--nodes", "machines the run spans: start the same command on each, with its own "
            "--node-rank and --main-address of node 0 (default 1)", TRAIN, type=int, metavar="N"),
    Control("node_rank", "--node-rank", "this machine's place among --nodes (0: the main node, which "
            "writes the run)", TRAIN, type=int, metavar="R"),
    Control("main_address", "--main-address", "HOST:PORT of node 0, where every node's ranks meet",
            TRAIN, metavar="HOST:PORT"),
    Control("join_timeout", "--join-timeout", "seconds the ranks wait for every node to join before the "
            "run fails with nodes_not_joined (default 600)", TRAIN, type=float, metavar="SECONDS"),
    Control("seed", "--seed", "random seed (default 0)", TRAIN, type=int),
    Control("export_kohya", "--export-kohya", "also write the LoRA in the kohya / ComfyUI key layout", TRAIN,
            action="store_true"),
    Control("save_every", "--save-every", "write a checkpoint every N steps", TRAIN, type=int, metavar="N"),
    Control("keep_checkpoints", "--keep-checkpoints", "checkpoints kept (default 3)", TRAIN, type=int,
            metavar="K"),
    Control("sample_prompts", "--sample-prompt", "render PROMPT with the current LoRA every --sample-every "
            "steps (repeatable)", TRAIN, action="append", metavar="PROMPT"),
    Control("sample_every", "--sample-every", "steps between samples", TRAIN, type=int, metavar="N"),
    Control("sample_steps", "--sample-steps", "denoising steps per sample (default 20)", TRAIN, type=int,
            metavar="N"),
    Control("optimizer", "--optimizer", "adamw (default); adamw8bit needs CUDA and bitsandbytes", TRAIN,
            choices=("adamw", "adamw8bit", "adafactor"), group="optimisation"),
    Control("warmup_steps", "--warmup-steps", "learning-rate warmup (default: the family's)", TRAIN,
            type=int, metavar="N", group="optimisation"),
    Control("flow_shift", "--flow-shift", "timestep shift of flow-matching families: a number, or auto "
            "(from the resolution where the family says so); default: the family's", TRAIN,
            type=_flow_shift, metavar="SHIFT", group="optimisation"),
    Control("loss_weighting", "--loss-weighting", "per-timestep loss weights (default none)", TRAIN,
            choices=("none", "min_snr", "bell"), group="optimisation"),
    Control("ema_decay", "--ema-decay", "also keep an EMA of the LoRA (saved as a second file), e.g. 0.999",
            TRAIN, type=float, metavar="D", group="optimisation"),
    Control("prompt_cache", "--no-prompt-cache", "encode captions again instead of reusing the on-disk "
            "prompt cache", TRAIN, action="store_false", group="optimisation"),
    Control("prompt_cache_dir", "--prompt-cache-dir", "where caption embeddings are cached (default: under "
            "the engine's home)", TRAIN, metavar="DIR", group="optimisation"),
    Control("trigger_word", "--trigger-word", "put WORD before every caption", TRAIN, metavar="WORD",
            group="captions and data"),
    Control("caption_dropout", "--caption-dropout", "share of samples trained with the empty prompt, in "
            "[0, 1) (default 0)", TRAIN, type=float, metavar="RATE", group="captions and data"),
    Control("shuffle_tags", "--shuffle-tags", "shuffle a caption's comma-separated tags (a few fixed orders "
            "per caption)", TRAIN, action="store_true", group="captions and data"),
    Control("keep_tags", "--keep-tags", "with --shuffle-tags, keep the first N tags in place (default 0)",
            TRAIN, type=int, metavar="N", group="captions and data"),
    Control("strict", "--strict", "refuse images under half the training resolution instead of warning",
            TRAIN, action="store_true", group="captions and data"),
    Control("frames", "--frames", "frames of each training clip, on the family's lattice (e.g. 4k+1), "
            "sampled at its fps (default: the family's)", TRAIN, type=int, metavar="N", group="video"),
    Control("short_clips", "--short-clips", "a clip shorter than --frames: refuse it (default) or pad it "
            "by holding its last frame", TRAIN, choices=("refuse", "pad"), group="video"),
    Control("expert", "--expert", "a two-expert base: train the high-noise expert, the "
            "low-noise one, or both (default), each on the timesteps of its range", TRAIN,
            choices=("high", "low", "both"), group="video"),
    Control("output_dir", "--output", "run folder (default: RUNS_DIR/<run id>)", TRAIN, metavar="DIR"),
)

ALL_CONTROLS: tuple[Control, ...] = (*MODEL_CONTROLS, *PLAN_CONTROLS, *GENERATE_CONTROLS, *TRAIN_CONTROLS)


def flags_of(controls: Iterable[Control], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Request field -> the flag that sets it."""
    return {**{c.field: c.flag for c in controls}, **(extra or {})}


#: Plan key (``transformer_quant``) -> the flag that asks for it (``--quant``).
PLAN_KEY_FLAGS: Mapping[str, str] = MappingProxyType(
    {c.plan_key: c.flag for c in PLAN_CONTROLS if c.plan_key is not None}
)
#: Request field -> flag, for every request (a field with two meanings takes its plan / model flag).
FIELD_FLAGS: Mapping[str, str] = MappingProxyType({
    **flags_of(TRAIN_CONTROLS), **flags_of(GENERATE_CONTROLS), **GENERATE_SPECIAL_FLAGS,
    **flags_of(PLAN_CONTROLS), **flags_of(MODEL_CONTROLS),
    # Engine messages name a training base / dataset by these words too.
    "base_model": "--base", "dataset_dir": "--data",
})


def in_flag_words(message: str, flags: Mapping[str, str] = FIELD_FLAGS) -> str:
    """A message that names request fields, in the terminal's words.

    ``Pass quant=int8`` -> ``Pass --quant int8``; ``lora_rank: must be ...``
    -> ``--rank: must be ...``; a snake_case field named in the text
    (``base_precision``) -> its flag. Words inside paths, flags and other
    identifiers are left alone.
    """
    names = "|".join(sorted(flags, key=len, reverse=True))
    message = re.sub(r"(?<![\w./-])(" + names + r")=([\w.-]+)",
                     lambda m: f"{flags[m.group(1)]} {m.group(2)}", message)
    message = re.sub(r"(?<![\w./-])(" + names + r")(?=:\s)", lambda m: flags[m.group(1)], message)
    snake = "|".join(sorted((f for f in flags if "_" in f), key=len, reverse=True))
    return re.sub(r"(?<![\w./-])(" + snake + r")\b(?![./-]\w)", lambda m: flags[m.group(1)], message)


def markdown_table(controls: Iterable[Control]) -> str:
    """The docs' table of ``controls``: flag, JSON field, default, choices, what it does."""
    rows = ["| flag | JSON field | default | choices | what it does |", "|---|---|---|---|---|"]
    for c in controls:
        default = "" if c.default is None else f"`{c.default}`"
        choices = ", ".join(f"`{v}`" for v in c.choices)
        rows.append(f"| `{c.flag}` | `{c.field}` | {default} | {choices} | {c.help} |")
    return "\n".join(rows)


__all__ = [
    "ALL_CONTROLS", "Control", "FIELD_FLAGS", "GENERATE_CONTROLS", "GENERATE_SPECIAL_FLAGS", "MODEL_CONTROLS",
    "PLAN_CONTROLS", "PLAN_KEY_FLAGS", "TRAIN_CONTROLS", "flags_of", "in_flag_words", "markdown_table",
]
