"""GPU check: does each GPU path of the engine work on this machine, how fast,
and was its memory plan right?

One command on a GPU machine answers, with numbers, for every family: the
inference schemes (dense, int8, fp8, mxfp8, nvfp4, nf4), the memory modes
(model / group / sequential offload), regional compile, fp16 accumulation
and the attention backends, each planned by the engine's own
``plan_inference`` on the probed hardware, loaded and run for 8 denoise
steps; and LoRA training for 20 steps in each base precision the engine's
preflight allows (nf4, bf16 with and without regional compile, compile with
static shapes, int8, fp8, mxfp8). Each row has steps/s, peak device memory
(``torch.cuda.max_memory_allocated``) beside the plan's estimate, and whether
the output (or the loss) stayed finite. The spec's B200 ratios are printed
beside the measured ones.

The denoisers are real size and random-initialised: the published configs
(over the diffusers class defaults), no weights downloaded. The text
encoders are left out and their output replaced by random embeddings of the
real shapes; the rest (VAE, scheduler, the pipeline object the family's
runtime needs for packing) comes from the family's tiny pipeline. Each
memory estimate is therefore the denoiser's part of the plan (inference:
transformer + overhead, per memory mode; training: the training phase of
``estimate_training_memory``), with the whole plan's figure kept beside it.
The engine's own code
runs everything else: :class:`~engine.runtime.session.InferenceSession`
(quantise on the host then place, memory modes, attention, compile, torch
flags), :func:`~engine.training.trainer.run_training` (LoRA, base precision
via ``place_base``, SDPA pinning, compile, the loop), the family's
``predict``. Two seams are replaced because they read a pipeline from disk:
the session's ``_load_pipeline`` and the trainer's ``load_base`` /
``_cache_inputs``; the static-compile case replaces the trainer's
``_compiled`` (the engine always compiles with ``dynamic=True``).

Each case runs in its own process (forked from a server that imported torch
once), with a timeout; an out-of-memory is a result (``oom``), a crash is a
row (``error``, with its message), and the report is rewritten after every
case. ``--budget-s`` plans the list, runs the most informative cases first
and skips the rest with the reason.

``--tiny`` runs the same code on the tiny pipelines on the CPU (the test
suite runs it); paths that need CUDA are skipped with the engine's reason.

    .venv/bin/python bench/gpu_check.py [--budget-s 540] [--out gpu-check.json]
    .venv/bin/python bench/gpu_check.py --list                  # the run order, seconds each
    .venv/bin/python bench/gpu_check.py --cases 'flux/inference/*' 'zimage/training/int8'
    .venv/bin/python bench/gpu_check.py --tiny --families flux zimage
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import importlib
import json
import math
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine.errors import EngineError, PreflightError  # noqa: E402
from engine.hardware.probe import probe  # noqa: E402
from engine.hardware.profile import HardwareProfile  # noqa: E402
from engine.contract.plugins import Registry, load_registry  # noqa: E402
from engine.policy.inference import InferenceRequest, ModelFacts, Plan, plan_inference  # noqa: E402
from engine.policy.training import MemoryRequest, training_precision_preflight_error  # noqa: E402
from engine.policy.training_memory import BaseFacts, TrainingShape  # noqa: E402
from engine.contract.types import ComponentSizes, FamilySpec  # noqa: E402
from real_configs import SDXL_UNET  # noqa: E402  (bench/ is not a package)

# -- what the spec measured (B200, LoRA training steps/s) ----------------------

#: family -> (bf16 + regional compile, nf4): the spec's B200 training figures.
SPEC_TRAINING = {"flux": (4.12, 1.81), "zimage": (6.38, 2.5)}
#: family -> (compile dynamic=True, dynamic=False): the spec's B200 figures.
SPEC_DYNAMIC = {"zimage": (6.38, 3.84)}

# -- full-size denoisers: the published configs over the class defaults ---------


@dataclass(frozen=True)
class Sheet:
    """How to build one family's real-size denoiser and feed it without its encoders."""

    #: The published denoiser config (keys the diffusers class default differs on).
    config: Mapping[str, Any]
    #: Prompt tokens the real text encoder hands the denoiser.
    text_tokens: int
    #: Random conditioning of the real shapes: (denoiser config, tokens, batch) -> tensors.
    conditioning: Callable[[Mapping[str, Any], int, int], dict[str, Any]]
    #: Latent channels the VAE gives (the denoiser packs them itself or not).
    latent_channels: Callable[[Mapping[str, Any]], int]


def _flux_conditioning(config: Mapping[str, Any], tokens: int, batch: int) -> dict[str, Any]:
    import torch

    return {
        "prompt_embeds": torch.randn(batch, tokens, config["joint_attention_dim"]),
        "pooled_prompt_embeds": torch.randn(batch, config["pooled_projection_dim"]),
        "text_ids": torch.zeros(batch, tokens, 3),
    }


def _qwen_conditioning(config: Mapping[str, Any], tokens: int, batch: int) -> dict[str, Any]:
    import torch

    return {
        "prompt_embeds": torch.randn(batch, tokens, config["joint_attention_dim"]),
        "prompt_embeds_mask": torch.ones(batch, tokens, dtype=torch.long),
    }


def _zimage_conditioning(config: Mapping[str, Any], tokens: int, batch: int) -> dict[str, Any]:
    import torch

    return {
        "cap_feats": torch.randn(batch, tokens, config["cap_feat_dim"]),
        "cap_lens": torch.full((batch,), tokens, dtype=torch.long),
    }


def _wan_conditioning(config: Mapping[str, Any], tokens: int, batch: int) -> dict[str, Any]:
    import torch

    return {"prompt_embeds": torch.randn(batch, tokens, config["text_dim"])}


def _sdxl_conditioning(config: Mapping[str, Any], tokens: int, batch: int) -> dict[str, Any]:
    import torch

    pooled = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]
    return {
        "prompt_embeds": torch.randn(batch, tokens, config["cross_attention_dim"]),
        "pooled_prompt_embeds": torch.randn(batch, pooled),
    }


SHEETS: Mapping[str, Sheet] = {
    # FLUX.1-dev: the class defaults are the real widths and depths; dev embeds guidance.
    "flux": Sheet({"guidance_embeds": True}, 512, _flux_conditioning, lambda c: c["in_channels"] // 4),
    # Qwen-Image: the class defaults (60 blocks, 3072 wide, Qwen2.5-VL-7B 3584 text).
    "qwen_image": Sheet({}, 128, _qwen_conditioning, lambda c: c["in_channels"] // 4),
    # Z-Image(-Turbo): the class defaults (30 blocks, 3840 wide, Qwen3-4B 2560 text).
    "zimage": Sheet({}, 128, _zimage_conditioning, lambda c: c["in_channels"]),
    # SDXL base 1.0 UNet.
    "sdxl": Sheet(dict(SDXL_UNET), 77, _sdxl_conditioning, lambda c: c["in_channels"]),
    # Wan 2.2 TI2V-5B (the tiny pipeline's shape: the 48-channel Wan 2.2 VAE): 30 blocks, 3072
    # wide, UMT5-XXL's 4096-wide text. A video family runs whole through the engine's
    # generate (its pipeline encodes the prompt); the conditioning is the shape its encoder gives.
    "wan": Sheet({"num_attention_heads": 24, "attention_head_dim": 128, "in_channels": 48, "out_channels": 48,
                  "text_dim": 4096, "ffn_dim": 14336, "num_layers": 30, "freq_dim": 256, "patch_size": [1, 2, 2],
                  "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6},
                 512, _wan_conditioning, lambda c: c["in_channels"]),
}
#: A video case's clip on a GPU (frames, width, height): on the lattice, within TI2V's presets.
GPU_CLIP = (33, 640, 352)
TINY_CLIP = (5, 64, 64)
#: Prompt tokens in --tiny mode (the tiny Z-Image's rope tables are short).
TINY_TEXT_TOKENS = 8

# -- cases -----------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One (family, path) to check. ``rank``: lower runs first."""

    family: str
    kind: str  # "inference" or "training"
    path: str
    rank: int
    #: inference: the quant request ("none" = dense); training: the base precision.
    scheme: str = "none"
    memory: str = "auto"
    compile: str = "off"
    static_shapes: bool = False
    attention: str = "native"
    fp16_accumulation: bool = False

    @property
    def id(self) -> str:
        return f"{self.family}/{self.kind}/{self.path}"


#: Paths in the order they answer the most: the spec's ratios first.
TRAINING_PATHS = (
    # (path, base precision, compile, static shapes, rank); "auto": as the engine decides.
    ("bf16+compile", "bf16", "on", False, 0),
    ("nf4", "nf4", "auto", False, 1),
    ("bf16+compile-static", "bf16", "on", True, 2),
    ("fp8", "fp8", "auto", False, 7),
    ("int8", "int8", "auto", False, 8),
    ("bf16", "bf16", "off", False, 9),
    ("mxfp8", "mxfp8", "auto", False, 12),
)
#: Families whose trainer ignores base_precision train in their one mode.
SINGLE_MODE_TRAINING = (("auto+compile", "auto", "on", False, 0), ("auto", "auto", "off", False, 9))
INFERENCE_PATHS = (
    # (path, fields, rank)
    ("dense", {}, 3),
    ("fp8", {"scheme": "fp8"}, 4),
    ("int8", {"scheme": "int8"}, 5),
    ("nf4", {"scheme": "nf4"}, 6),
    ("mxfp8", {"scheme": "mxfp8"}, 10),
    ("nvfp4", {"scheme": "nvfp4"}, 11),
    ("dense+compile", {"compile": "on"}, 13),
    ("dense+group_offload", {"memory": "group_offload"}, 14),
    ("int8+sequential_offload", {"scheme": "int8", "memory": "sequential_offload"}, 15),
    ("dense+model_offload", {"memory": "model_offload"}, 16),
    ("dense+sequential_offload", {"memory": "sequential_offload"}, 17),
    ("dense+fp16-accumulation", {"fp16_accumulation": True}, 18),
    ("dense+attention:cudnn", {"attention": "cudnn"}, 18),
    ("dense+attention:flash", {"attention": "flash"}, 19),
    ("dense+attention:flash3", {"attention": "flash3"}, 19),
    ("dense+attention:sage", {"attention": "sage"}, 19),
    ("dense+attention:xformers", {"attention": "xformers"}, 19),
)
#: A video family's paths: its clip rendered whole by the engine (the pipeline's own prompt
#: encoding, the VAE's tiled decode), dense, int8 on both experts, and offloaded.
VIDEO_PATHS = (
    ("video", {}, 3),
    ("video+int8", {"scheme": "int8"}, 5),
    ("video+model_offload", {"memory": "model_offload"}, 16),
)
#: Spec families first, then the rest in registry order.
FAMILY_ORDER = ("flux", "zimage", "qwen_image", "sdxl")


def all_cases(registry: Registry, families: list[str]) -> list[Case]:
    """Every (family, path), most informative first."""
    cases: list[Case] = []
    for family_name in families:
        family = registry.family(family_name)
        if family.rendering.output == "frames":  # a clip through the engine's generate, dense and int8
            cases += [Case(family_name, "inference", path, rank, **fields) for path, fields, rank in VIDEO_PATHS]  # type: ignore[arg-type]
            continue
        training = TRAINING_PATHS if family.training.base_precision_applies else SINGLE_MODE_TRAINING
        for path, mode, compiled, static, rank in training:
            if static and family_name not in SPEC_DYNAMIC:
                rank = 14  # the spec has a static-vs-dynamic figure for its families only
            elif rank < 3 and family_name not in SPEC_TRAINING:
                rank += 10  # nor a compile-vs-nf4 figure
            cases.append(Case(family_name, "training", path, rank, scheme=mode, compile=compiled, static_shapes=static))
        for path, fields, rank in INFERENCE_PATHS:
            cases.append(Case(family_name, "inference", path, rank, **fields))  # type: ignore[arg-type]
    order = {name: i for i, name in enumerate([*FAMILY_ORDER, *(f for f in families if f not in FAMILY_ORDER)])}
    return sorted(cases, key=lambda c: (c.rank, order[c.family]))


# -- settings shared by parent and children ----------------------------------------


@dataclass(frozen=True)
class Settings:
    tiny: bool
    work: Path
    infer_resolution: int
    infer_steps: int
    train_resolution: int
    train_steps: int
    warmup_steps: int
    lora_rank: int
    #: A case id made to raise (checks the report's error path).
    crash: str | None = None
    #: Start each case as a fresh interpreter (slower) instead of forking a warm one.
    spawn: bool = False

    def tiny_pipeline(self, family: str) -> Path:
        return self.work / "tiny" / family

    @property
    def dataset(self) -> Path:
        return self.work / "dataset"

    @property
    def train_device(self) -> str:
        return "cpu" if self.tiny else "cuda"


def train_shape(settings: Settings) -> TrainingShape:
    return TrainingShape(resolution=settings.train_resolution, batch_size=1, lora_rank=settings.lora_rank)


# -- the checks before anything runs (pure, torch-free) ---------------------------


class Skip(Exception):
    """A case that does not run here, and why (the engine's own words where it has them)."""


def check_training(case: Case, registry: Registry, hardware: HardwareProfile, settings: Settings,
                   memory: MemoryRequest | None) -> None:
    """Raise :class:`Skip` with the engine's preflight reason when the run is refused."""
    family = registry.family(case.family)
    device = "cpu" if settings.tiny else "auto"
    error = training_precision_preflight_error(
        registry, family, hardware, case.scheme, device=device, memory=memory  # type: ignore[arg-type]
    )
    if error is not None:
        raise Skip(f"engine preflight [{error.code}]: {error.message}")
    if case.compile == "on" and settings.tiny:
        raise Skip("--tiny: inductor's first compile costs 30-40 s on a CPU; compile is checked on a GPU")


def check_inference(case: Case, plan: Plan, settings: Settings) -> None:
    """Raise :class:`Skip` when the plan does not give this case what it checks."""
    quant = plan["transformer_quant"]
    if case.scheme != "none" and quant.value != case.scheme:
        raise Skip(f"plan: transformer_quant {quant.value}: {quant.reason}")
    memory = plan["memory_mode"]
    if case.memory != "auto" and memory.value != case.memory:
        raise Skip(f"plan: memory_mode {memory.value}: {memory.reason}")
    if case.compile == "on":
        if plan.value("compile") != "regional":
            raise Skip(f"plan: compile off: {plan['compile'].reason}")
        if settings.tiny:
            raise Skip("--tiny: inductor's first compile costs 30-40 s on a CPU; compile is checked on a GPU")
    attention = plan["attention_backend"]
    if case.attention != "native":
        if attention.value != case.attention:
            raise Skip(f"plan: attention {attention.value}: {attention.reason}")
        if plan.attention_install:
            raise Skip(f"not installed: the engine would pip-install {plan.attention_install!r} at load; "
                       f"this check never installs packages (install it first to check {case.attention})")
    if case.fp16_accumulation and not plan.value("fp16_accumulation"):
        raise Skip(f"plan: fp16 accumulation off: {plan['fp16_accumulation'].reason}")


def inference_request(case: Case, settings: Settings) -> InferenceRequest:
    clip = {}
    if case.path.startswith("video"):
        frames, width, height = TINY_CLIP if settings.tiny else GPU_CLIP
        clip = {"frames": frames, "width": width, "height": height}
    return InferenceRequest(
        quant=case.scheme, memory=case.memory, compile=case.compile,
        attention=case.attention, step_cache="off", steps=settings.infer_steps, **clip,  # type: ignore[arg-type]
    )


def table_facts(registry: Registry, family: FamilySpec) -> ModelFacts:
    checkpoint = family.default_checkpoint
    return ModelFacts(family, checkpoint, registry.component_sizes(family, checkpoint))


def precheck(case: Case, registry: Registry, hardware: HardwareProfile, settings: Settings,
             facts: ModelFacts | None) -> None:
    """The parent's cheap pass: skip what the engine refuses before spending budget on it."""
    family = registry.family(case.family)
    if not settings.tiny and case.family not in SHEETS:
        raise Skip(f"no published {family.label} denoiser config in bench/gpu_check.py SHEETS")
    if case.kind == "training":
        memory = None if settings.tiny else MemoryRequest.from_table(family, train_shape(settings))
        check_training(case, registry, hardware, settings, memory)
        return
    try:
        plan = plan_inference(registry, facts or table_facts(registry, family), hardware,
                              inference_request(case, settings))
    except PreflightError as exc:
        raise Skip(f"plan refused [{exc.code}]: {exc.message}") from None
    check_inference(case, plan, settings)


def estimate_s(case: Case, family: FamilySpec, settings: Settings) -> float:
    """Seconds a case is expected to take, for the budget (the report keeps the real ones)."""
    if settings.tiny:
        return 4.0 if case.kind == "training" else 3.0
    gb = family.sizes.transformer_gb
    seconds = 10 + 0.6 * gb  # process, random init on the GPU, move to the host
    seconds += {"int8": 2.5 * gb, "nf4": 0.6 * gb}.get(case.scheme, 0.4 * gb if case.scheme != "none" else 0.0)
    compiles = case.compile == "on" or (case.compile == "auto" and case.scheme in ("fp8", "mxfp8"))
    seconds += 60 if compiles else 0
    seconds += {"sequential_offload": 60, "group_offload": 20, "model_offload": 20}.get(case.memory, 0)
    seconds += 0.5 * settings.train_steps if case.kind == "training" else 3
    return seconds


# -- the report --------------------------------------------------------------------


@dataclass
class Row:
    family: str
    kind: str
    path: str
    status: str  # ok, skipped, error, oom, timeout, nonfinite, fallback
    message: str = ""
    steps_per_s: float | None = None
    peak_gb: float | None = None
    #: How the peak was read: torch.cuda.max_memory_allocated, or the process's max RSS on a CPU.
    peak_source: str | None = None
    estimate_gb: float | None = None
    estimate_detail: str | None = None
    finite: bool | None = None
    load_s: float | None = None
    wall_s: float | None = None
    expected_s: float | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.family}/{self.kind}/{self.path}"


#: The spec's ratios: (label, numerator path, denominator path, the spec's B200 figures).
RATIOS = (
    ("training bf16+compile / nf4", "training/bf16+compile", "training/nf4", SPEC_TRAINING),
    ("training compile dynamic / static", "training/bf16+compile", "training/bf16+compile-static", SPEC_DYNAMIC),
)


def ratios(rows: list[Row]) -> list[dict[str, Any]]:
    """The spec's ratios measured, beside its B200 figures ("n/a" where a side is
    missing); a family appears where the spec has a figure or both sides ran."""
    speed = {r.id: r.steps_per_s for r in rows if r.status == "ok" and r.steps_per_s}
    out = []
    families = sorted({r.family for r in rows}, key=lambda f: (FAMILY_ORDER + (f,)).index(f))
    for label, top, bottom, figures in RATIOS:
        for family in families:
            fast, slow = speed.get(f"{family}/{top}"), speed.get(f"{family}/{bottom}")
            spec = figures.get(family)
            if spec is None and not (fast and slow):
                continue
            out.append({
                "family": family, "ratio": label,
                "measured": round(fast / slow, 2) if fast and slow else "n/a",
                "measured_steps_per_s": [fast, slow],
                "spec_b200": round(spec[0] / spec[1], 2) if spec else "n/a",
                "spec_b200_steps_per_s": list(spec) if spec else None,
            })
    return out


def write_report(out: Path, header: dict[str, Any], rows: list[Row]) -> None:
    """Atomically (a crash mid-write leaves the previous report)."""
    data = {**header, "rows": [dataclasses.asdict(r) | {"id": r.id} for r in rows], "ratios": ratios(rows)}
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.with_name(out.name + ".tmp")
    temp.write_text(json.dumps(data, indent=2, default=str), encoding="utf-8")
    os.replace(temp, out)


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(rows: list[Row], out: Path) -> None:
    print(f"\n{'case':<44} {'status':<9} {'steps/s':>8} {'peak GB':>8} {'est GB':>8} {'wall s':>7}  note")
    for r in rows:
        note = r.message.replace("\n", " ")
        print(f"{r.id:<44} {r.status:<9} {_num(r.steps_per_s):>8} {_num(r.peak_gb):>8} "
              f"{_num(r.estimate_gb):>8} {_num(r.wall_s, 1):>7}  {note[:110]}")
    print(f"\n{'ratio':<46} {'measured':>9} {'spec B200':>10}")
    for ratio in ratios(rows):
        print(f"{ratio['family'] + ': ' + ratio['ratio']:<46} {ratio['measured']!s:>9} {ratio['spec_b200']!s:>10}")
    print(f"\nreport: {out}")


# -- the parent: prepare, plan, run each case in its own process --------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    registry = load_registry()
    families = args.families or [f for f in FAMILY_ORDER if f in registry.families] + [
        f for f in registry.families if f not in FAMILY_ORDER
    ]
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    settings = Settings(
        tiny=args.tiny, work=work,
        infer_resolution=args.infer_resolution or (64 if args.tiny else 1024),
        infer_steps=args.infer_steps,
        train_resolution=args.train_resolution or (64 if args.tiny else 512),
        train_steps=args.train_steps or (4 if args.tiny else 20),
        warmup_steps=1 if args.tiny else 5,
        lora_rank=4 if args.tiny else 16,
        crash=args.crash,
        spawn=args.spawn,
    )
    out = Path(args.out)
    hardware = probe(verify=False)  # no CUDA context in the parent: children own the device
    started = time.monotonic()
    header = {
        "mode": "tiny (CPU)" if args.tiny else "gpu",
        "hardware": hardware.to_dict(),
        "budget_s": args.budget_s,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(settings).items()},
        "versions": _versions(),
        "spec_b200": {"training_steps_per_s": SPEC_TRAINING, "compile_dynamic_vs_static": SPEC_DYNAMIC},
    }
    cases = [c for c in all_cases(registry, families) if _selected(c, args.cases)]
    rows: list[Row] = []
    if not args.tiny and not hardware.cuda:
        why = f"no NVIDIA GPU found (nvidia-smi sees {hardware.device_name}); --tiny checks the same code on a CPU"
        rows = [Row(c.family, c.kind, c.path, "skipped", why) for c in cases]
        cases = []
    runner = Runner(settings, work / "logs", [registry.family(f) for f in families])
    deadline = started + args.budget_s
    try:
        for case in cases:
            rows.append(run_one(case, registry, hardware, settings, runner, deadline, args.budget_s))
            header["elapsed_s"] = round(time.monotonic() - started, 1)
            header["note"] = runner.note
            header["prepare_cpu_s"] = runner.prepare_cpu_s
            write_report(out, header, rows)
    finally:
        header["elapsed_s"] = round(time.monotonic() - started, 1)
        done = {r.id for r in rows}
        rows += [Row(c.family, c.kind, c.path, "skipped", "not reached (the check was interrupted)")
                 for c in cases if c.id not in done]
        write_report(out, header, rows)
        print_table(rows, out)
    return 0


def run_one(case: Case, registry: Registry, hardware: HardwareProfile, settings: Settings,
            runner: Runner, deadline: float, budget_s: float) -> Row:
    """Skip (over budget, or refused by the engine's plan or preflight), or run ``case``."""
    family = registry.family(case.family)
    expected = estimate_s(case, family, settings)

    def skipped(reason: str) -> Row:
        return Row(case.family, case.kind, case.path, "skipped", reason, expected_s=expected)

    if expected > deadline - time.monotonic():
        left = max(deadline - time.monotonic(), 0)
        reason = f"budget: needs about {expected:.0f} s, {left:.0f} s left of --budget-s {budget_s:.0f}"
        if not settings.tiny or runner.prepared:  # the engine's refusal, where it costs nothing to ask
            try:
                precheck(case, registry, hardware, settings, _facts(registry, settings, case.family))
            except Skip as why:
                reason = str(why)
        return skipped(reason)
    # --tiny plans from the tiny pipeline's files, so they are built first;
    # a GPU run plans from the table and starts nothing for a refused case.
    for step in ("prepare", "precheck") if settings.tiny else ("precheck", "prepare"):
        if step == "prepare" and (failed := runner.prepare()) is not None:
            return Row(case.family, case.kind, case.path, "error", f"preparing the tiny pipelines failed: {failed}")
        if step == "precheck":
            try:
                precheck(case, registry, hardware, settings, _facts(registry, settings, case.family))
            except Skip as why:
                return skipped(str(why))
    left = deadline - time.monotonic()
    if expected > left:
        return skipped(f"budget: needs about {expected:.0f} s, {max(left, 0):.0f} s left of --budget-s {budget_s:.0f}")
    row = runner.run(case, min(left, max(60.0, 3 * expected)))
    row.expected_s = round(expected, 1)
    return row


def _facts(registry: Registry, settings: Settings, family: str) -> ModelFacts | None:
    """--tiny: the tiny pipeline's own facts (read from its files); else None (the table's)."""
    return _tiny_facts(registry, settings, family) if settings.tiny else None


def _tiny_facts(registry: Registry, settings: Settings, family: str) -> ModelFacts:
    from engine.preflight.model import resolve_model

    return resolve_model(registry, settings.tiny_pipeline(family)).facts(registry)


def _selected(case: Case, patterns: list[str] | None) -> bool:
    return not patterns or any(fnmatch.fnmatch(case.id, p) for p in patterns)


def _versions() -> dict[str, str]:
    import importlib.metadata as metadata

    found = {}
    for name in ("torch", "diffusers", "transformers", "peft", "torchao", "bitsandbytes"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


class Runner:
    """Runs each case in a process forked from a server that imported torch and
    diffusers once (so a case starts in a fraction of a second, not ten)."""

    PRELOAD = (
        "torch", "diffusers", "peft", "torchao.quantization", "engine.runtime.session", "engine.training.trainer",
    )

    #: Most a preparation (server start, tiny pipelines, dataset) may take.
    PREPARE_TIMEOUT_S = 180.0

    def __init__(self, settings: Settings, logs: Path, families: list[FamilySpec]) -> None:
        self.settings = settings
        self.logs = logs
        self.families = [f.name for f in families]
        #: None until prepared; then "" (done) or why it failed.
        self._prepared: str | None = None
        #: Anything the report should say about how cases were started.
        self.note = ""
        #: CPU seconds the preparation took (the tiny pipelines, the dataset).
        self.prepare_cpu_s = 0.0
        logs.mkdir(parents=True, exist_ok=True)
        self.context = multiprocessing.get_context("spawn" if settings.spawn else "forkserver")
        if not settings.spawn:
            # Each family's tiny-pipeline module imports its pipeline and encoder classes.
            modules = [f.tiny_pipeline.partition(":")[0] for f in families if f.tiny_pipeline]
            modules += [f.runtime_module for f in families if f.runtime_module]
            self.context.set_forkserver_preload([*self.PRELOAD, *modules])

    @property
    def prepared(self) -> bool:
        return self._prepared == ""

    def prepare(self) -> str | None:
        """Start the server, build the tiny pipelines and the dataset (once, when
        the first case is about to run); why that failed, or None."""
        if self._prepared is None:
            status, message, result = self._spawn(
                "prepare", _prepare_child, (self.settings, self.families), self.PREPARE_TIMEOUT_S
            )
            self._prepared = "" if status == "ok" else message or status
            self.prepare_cpu_s = round(float(result.get("cpu_s", 0.0)), 2)
            if result.get("cuda_in_bad_fork"):
                # A preloaded module initialised CUDA in the server: forked
                # children cannot use the device. Fresh interpreters can.
                self.context = multiprocessing.get_context("spawn")
                self.note = "cases started as fresh interpreters: a preloaded module initialised CUDA"
        return self._prepared or None

    def run(self, case: Case, timeout_s: float) -> Row:
        started = time.monotonic()
        name = case.id.replace("/", "__").replace(":", "-").replace("+", "-")
        status, message, result = self._spawn(name, _case_child, (case, self.settings), timeout_s)
        wall = round(time.monotonic() - started, 1)
        if status != "ok":
            return Row(case.family, case.kind, case.path, status, message, wall_s=wall)
        row = Row(**result)
        row.wall_s = wall
        row.details["log"] = str(self.logs / f"{name}.log")
        if row.peak_gb and row.estimate_gb:
            row.details["peak_over_estimate"] = round(row.peak_gb / row.estimate_gb, 3)
        return row

    def _spawn(self, name: str, target: Callable[..., None], args: tuple[Any, ...],
               timeout_s: float) -> tuple[str, str, dict[str, Any]]:
        result_path = self.logs / f"{name}.json"
        log_path = self.logs / f"{name}.log"
        result_path.unlink(missing_ok=True)
        process = self.context.Process(target=_child, args=(target, args, result_path, log_path), name=name)
        process.start()
        process.join(timeout_s)
        if process.is_alive():
            process.kill()
            process.join()
            return "timeout", f"still running after {timeout_s:.0f} s (killed); log: {log_path}", {}
        if result_path.exists():
            return "ok", "", json.loads(result_path.read_text(encoding="utf-8"))
        return "error", f"{_last_error(log_path)} (exit code {process.exitcode}; log: {log_path})", {}


def _last_error(log: Path) -> str:
    """The exception line of a child's traceback (its last non-empty line)."""
    try:
        lines = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    except OSError:
        return "the case process died before writing its log"
    return lines[-1] if lines else "the case process died without a message"


# -- the children ---------------------------------------------------------------------


def _child(target: Callable[..., Any], args: tuple[Any, ...], result_path: Path, log_path: Path) -> None:
    """Run ``target`` with its output in ``log_path``; write its result (a dict) to ``result_path``.

    An uncaught exception ends the process with its traceback in the log:
    the parent reports the case as an error with that message.
    """
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    os.environ["DIFFUSION_ENGINE_ATTENTION_INSTALL"] = "0"
    os.environ["TQDM_DISABLE"] = "1"  # no progress bars (nor the locks tqdm makes for them)
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.set_verbosity_error()
    diffusers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    result = target(*args)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    if isinstance(result, dict) and isinstance(result.get("details"), dict):
        result["details"]["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 2)
    result_path.write_text(json.dumps(result, default=str), encoding="utf-8")
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is on disk: skip the interpreter's teardown of torch (seconds
    # on a loaded machine; the OS frees the memory and the device context).
    os._exit(0)


def _prepare_child(settings: Settings, families: list[str]) -> dict[str, Any]:
    from engine.testing.datasets import write_dataset

    registry = load_registry()
    for family in families:
        folder = settings.tiny_pipeline(family)
        if not (folder / "model_index.json").exists():
            registry.build_tiny_pipeline(registry.family(family), folder)
    if not settings.dataset.exists():
        write_dataset(settings.dataset, count=2, size=64)
    import torch

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"cuda_in_bad_fork": bool(torch.cuda._is_in_bad_fork()), "cpu_s": usage.ru_utime + usage.ru_stime}


def _case_child(case: Case, settings: Settings) -> dict[str, Any]:
    import torch

    from engine.runtime.quantize import PlacementFailed

    row = Row(case.family, case.kind, case.path, "ok")
    if settings.crash and fnmatch.fnmatch(case.id, settings.crash):
        raise RuntimeError(f"injected failure in {case.id} (--crash)")
    if settings.tiny:
        # The engine's CPU thread rule (half the cores); the trainer leaves
        # threads alone, and two OpenMP threads per core thrash a shared CPU.
        from engine.policy.speed import resolve_threads

        torch.set_num_threads(int(resolve_threads(probe(verify=False), None).value or 1))
    bench: BenchModel | None = None
    try:
        bench = BenchModel(case.family, settings)
        if case.kind == "training":
            run_training_case(case, bench, settings, row)
        else:
            run_inference_case(case, bench, settings, row)
    except Skip as why:
        row.status, row.message = "skipped", str(why)
    except torch.OutOfMemoryError as exc:
        row.status, row.message = "oom", _first_line(exc)
    except PlacementFailed as exc:
        row.status = "oom" if exc.out_of_memory else "error"
        row.message = f"[{exc.code}] {exc.message}"
    except EngineError as exc:
        row.status, row.message = "error", f"[{exc.code}] {exc.message}"
    finally:
        if row.status == "oom" and bench is not None:
            row.peak_gb, row.peak_source = bench.peak()
    return dataclasses.asdict(row)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class BenchModel:
    """One family's denoiser, random-initialised from its config, and its feed.

    --tiny: the tiny pipeline's own denoiser config; else the published
    config (:data:`SHEETS`). The rest of the pipeline is the tiny one.
    """

    def __init__(self, family: str, settings: Settings) -> None:
        import diffusers
        import torch

        self.registry = load_registry()
        self.family = self.registry.family(family)
        self.settings = settings
        self.folder = settings.tiny_pipeline(family)
        self.device = "cpu" if settings.tiny else "cuda"
        tiny_config = json.loads((self.folder / self.family.pipeline.denoiser / "config.json").read_text(encoding="utf-8"))
        self.cls = getattr(diffusers, tiny_config["_class_name"])
        if settings.tiny:
            config: dict[str, Any] = tiny_config
        elif family in SHEETS:
            config = dict(SHEETS[family].config)
        else:
            raise Skip(f"no published {self.family.label} denoiser config in bench/gpu_check.py SHEETS")
        self.init_config = config
        self.sheet = SHEETS.get(family)
        tiny_tokens = settings.tiny and family != "sdxl"
        self.tokens = TINY_TEXT_TOKENS if tiny_tokens else (self.sheet.text_tokens if self.sheet else 77)
        with torch.device("meta"):
            meta = self.cls.from_config(config)
        #: The full config (class defaults filled in) and every tensor's shape.
        self.config = dict(meta.config)
        self.shapes = tuple((name, tuple(t.shape)) for name, t in meta.state_dict().items())

    # -- sizes the plans are made from --------------------------------------------

    def dense_gb(self) -> float:
        from engine.policy.quant_filter import dense_gb

        return dense_gb(list(self.shapes))

    def facts(self) -> ModelFacts:
        """What the planner knows: this denoiser's shapes, the table's encoders and VAE."""
        from engine.preflight.headers import sizes_by_scheme
        from engine.preflight.model import resolve_model

        facts = resolve_model(self.registry, self.folder).facts(self.registry)
        if self.settings.tiny:
            return facts
        table = facts.table_sizes
        return dataclasses.replace(
            facts,
            measured_sizes=ComponentSizes(self.dense_gb(), table.text_encoders_gb, table.vae_gb),
            measured_scheme_gb=sizes_by_scheme(list(self.shapes)),
        )

    def memory_request(self) -> MemoryRequest:
        table = self.family.sizes
        encoders, vae = (0.0, 0.0) if self.settings.tiny else (table.text_encoders_gb, table.vae_gb)
        base = BaseFacts(self.dense_gb(), encoders, vae, source="bench denoiser shapes", shapes=self.shapes)
        return MemoryRequest(base, train_shape(self.settings))

    # -- building ---------------------------------------------------------------------

    def build(self, dtype: Any) -> Any:
        """The denoiser in ``dtype`` on the host, as a loader leaves it.

        Initialised on the GPU when it has room (seconds, not minutes, for a
        12B model), then moved to the host; the peak counter is reset after.
        """
        import gc

        import torch

        torch.manual_seed(0)
        init = "cpu"
        if self.device == "cuda":
            free, _ = torch.cuda.mem_get_info()
            init = "cuda" if free / 1e9 > 2.2 * self.dense_gb() else "cpu"
        with torch.device(init):
            model = self.cls.from_config(self.init_config)
        model = model.to(dtype).to("cpu").eval()
        model.requires_grad_(False)
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        return model

    def pipeline(self, dtype: Any, scheme: str | None) -> Any:
        """The tiny pipeline with this denoiser in place of its own (nf4 already
        placed) and no text encoders: the conditioning is random embeddings."""
        from diffusers import DiffusionPipeline

        denoiser = self.build(dtype)
        if scheme == "nf4":
            denoiser = to_nf4(denoiser, dtype, self.device)
        index = json.loads((self.folder / "model_index.json").read_text(encoding="utf-8"))
        parts: dict[str, Any] = {name: None for name in index if name.startswith(("text_encoder", "tokenizer"))}
        if self.family.rendering.output == "frames":  # its pipeline encodes the prompt: a 1-layer encoder of the real width
            parts = {"text_encoder": self.wide_encoder(dtype)}
        parts[self.family.pipeline.denoiser] = denoiser
        pipe = DiffusionPipeline.from_pretrained(self.folder, dtype=dtype, **parts)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def wide_encoder(self, dtype: Any) -> Any:
        """The tiny pipeline's text encoder class, one layer deep, as wide as the denoiser's
        text input (``text_dim``): the real prompt shape at a fraction of the encoder's weights."""
        import transformers

        config = json.loads((self.folder / "text_encoder" / "config.json").read_text(encoding="utf-8"))
        cls = getattr(transformers, config["architectures"][0])
        if not self.settings.tiny:
            config.update(d_model=int(self.config["text_dim"]), num_layers=1, d_kv=64, num_heads=64, d_ff=1024)
        encoder = cls(cls.config_class.from_dict(config)).to(dtype).eval()
        encoder.requires_grad_(False)
        return encoder

    def conditioning(self, batch: int, device: str, dtype: Any) -> dict[str, Any]:
        import torch

        make = (self.sheet.conditioning if self.sheet else _flux_conditioning)
        torch.manual_seed(1)
        cond = make(self.config, self.tokens, batch)
        return {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in cond.items()}

    def latent_channels(self) -> int:
        return self.sheet.latent_channels(self.config) if self.sheet else int(self.config["in_channels"])

    def peak(self) -> tuple[float | None, str]:
        import torch

        if self.device == "cuda" and torch.cuda.is_available():
            return round(torch.cuda.max_memory_allocated() / 1e9, 3), "torch.cuda.max_memory_allocated"
        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 3), "host max RSS (whole process)"


def to_nf4(model: Any, dtype: Any, device: str) -> Any:
    """bitsandbytes 4-bit nf4 on every Linear but the fp32-kept modules, as
    diffusers' loader with ``nf4_config`` does; quantised as it moves to ``device``."""
    import bitsandbytes as bnb
    import torch

    from engine.runtime.quantize import move_to, nf4_config

    config = nf4_config(dtype)
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if type(child) is not torch.nn.Linear or any(k in full for k in keep):
                continue
            layer = bnb.nn.Linear4bit(
                child.in_features, child.out_features, bias=child.bias is not None,
                compute_dtype=config.bnb_4bit_compute_dtype, quant_type=config.bnb_4bit_quant_type,
                compress_statistics=config.bnb_4bit_use_double_quant, device="meta",
            )
            layer.weight = bnb.nn.Params4bit(
                child.weight.data, requires_grad=False, quant_type=config.bnb_4bit_quant_type,
                compress_statistics=config.bnb_4bit_use_double_quant, module=layer,
            )
            if child.bias is not None:
                layer.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, name, layer)
    move_to(model, device, "the nf4 denoiser")
    return model


# -- inference --------------------------------------------------------------------------


def run_inference_case(case: Case, bench: BenchModel, settings: Settings, row: Row) -> None:
    import torch

    from engine.runtime.session import InferenceSession

    registry, family = bench.registry, bench.family
    hardware = probe()
    request = inference_request(case, settings)
    try:
        plan = plan_inference(registry, bench.facts(), hardware, request)
    except PreflightError as exc:
        raise Skip(f"plan refused [{exc.code}]: {exc.message}") from None
    check_inference(case, plan, settings)
    row.details["plan"] = {name: plan[name].to_dict() for name in plan.controls}
    row.estimate_gb, row.estimate_detail = denoiser_estimate(plan)
    row.details["plan_peak_gb_with_encoders"] = round(plan.estimate.peak_gb, 2)
    from engine.preflight.model import resolve_model

    source = resolve_model(registry, bench.folder)

    class BenchSession(InferenceSession):
        """The engine's session with the pipeline built in memory instead of read from disk."""

        def _load_pipeline(self, dtype: torch.dtype, scheme: str | None) -> Any:
            return bench.pipeline(dtype, scheme)

    session = BenchSession(registry, source, plan, request, installer=lambda _package: False)
    started = time.perf_counter()
    session.load()
    row.load_s = round(time.perf_counter() - started, 2)
    try:
        row.details["placement"] = session.placement.path if session.placement else None
        row.details["quantised_layers"] = session.quantised_layers
        if case.fp16_accumulation:
            row.details["allow_fp16_accumulation_set"] = bool(
                getattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", False))
        if session.fallback is not None:
            row.status, row.message = "fallback", str(session.fallback["reason"])
        final = session.plan
        if final["attention_backend"].value != plan["attention_backend"].value:
            row.status, row.message = "fallback", str(final["attention_backend"].reason)
        render = render_clip if family.rendering.output == "frames" else denoise
        speed, finite, warm_s = render(session, bench, settings, str(plan.value("dtype")), plan.device)
        row.steps_per_s, row.finite = round(speed, 3), finite
        row.details["warmup_s"] = round(warm_s, 2)
        row.peak_gb, row.peak_source = bench.peak()
        if not finite:
            row.status, row.message = "nonfinite", "the denoised latents are not finite"
    finally:
        session.unload()
    if case.fp16_accumulation:
        restored = not getattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", False)
        row.details["flags_restored"] = restored
        if not restored:
            row.status, row.message = "error", "allow_fp16_accumulation is still set after unload"


def denoiser_estimate(plan: Plan) -> tuple[float, str]:
    """What the plan expects on the device for the denoiser alone (this check
    replaces the text encoders with embeddings): per memory mode."""
    estimate = plan.estimate
    parts = estimate.components
    mode = plan.value("memory_mode")
    if mode in ("resident", "model_offload"):
        gb = parts.transformer_gb + estimate.overhead_gb
        return round(gb, 2), f"{mode}: transformer {parts.transformer_gb:.2f} + overhead {estimate.overhead_gb:.2f} GB"
    return round(estimate.overhead_gb, 2), f"{mode}: overhead {estimate.overhead_gb:.2f} GB (blocks streamed)"


def render_clip(
    session: Any, bench: BenchModel, settings: Settings, dtype_name: str, device: str
) -> tuple[float, bool, float]:
    """A video family: one warm-up clip, then one timed clip through the engine's own generate
    (the lattice, the second expert, the tiled fp32 decode); steps/s between the first and the
    last step's callback. Finite: every frame is not one flat colour (NaNs decode to black)."""
    from engine.runtime.session import GenerateRequest

    frames, width, height = TINY_CLIP if settings.tiny else GPU_CLIP
    request = GenerateRequest("a red fox running through snow", steps=settings.infer_steps, width=width,
                              height=height, frames=frames, seed=0)
    started = time.perf_counter()
    session.generate(GenerateRequest(request.prompt, steps=2, width=width, height=height, frames=frames, seed=0))
    warm_s = time.perf_counter() - started
    stamps: list[float] = []
    clips = session.generate(request, lambda done, total: stamps.append(time.perf_counter()))
    steps_s = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    clip = clips[0]
    finite = len(clip) == frames and all(frame.convert("L").getextrema()[0] != frame.convert("L").getextrema()[1]
                                         for frame in clip)
    return steps_s, finite, warm_s


def denoise(
    session: Any, bench: BenchModel, settings: Settings, dtype_name: str, device: str
) -> tuple[float, bool, float]:
    """One warm-up call, then ``infer_steps`` Euler steps through the family's ``predict``.

    Returns (steps/s, every latent finite, warm-up seconds).
    """
    import torch

    from engine.runtime.session import TORCH_DTYPES

    dtype = TORCH_DTYPES[dtype_name]
    runtime = importlib.import_module(bench.family.runtime_module)
    objective = bench.registry.training_objective(bench.family)
    flow = objective is None or objective.prediction == "flow_matching"
    side = settings.infer_resolution // 8
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, bench.latent_channels(), side, side, generator=generator).to(device, dtype)
    cond = bench.conditioning(1, device, dtype)
    steps = settings.infer_steps
    if flow:
        times = torch.linspace(1.0, 0.0, steps + 1)
    else:
        times = torch.linspace(999, 0, steps + 1).round()
    pipe, model = session.pipeline, session.denoiser

    def call(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        timestep = t.reshape(1).to(device)
        return runtime.predict(pipe, model, x, timestep if flow else timestep.long(), cond)

    with torch.inference_mode():
        started = time.perf_counter()
        call(times[0], latents)
        _sync(device)
        warm = time.perf_counter() - started
        started = time.perf_counter()
        for i in range(steps):
            out = call(times[i], latents)
            # Flow: Euler on the velocity; epsilon: a small step against the noise.
            delta = (times[i + 1] - times[i]) if flow else torch.tensor(-1.0 / steps)
            latents = latents + delta.to(latents.dtype) * out.to(latents.dtype)
        _sync(device)
        elapsed = time.perf_counter() - started
        finite = bool(torch.isfinite(latents).all())
    return steps / elapsed, finite, warm


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# -- training -----------------------------------------------------------------------------


def run_training_case(case: Case, bench: BenchModel, settings: Settings, row: Row) -> None:
    from engine.policy.training import training_memory_error
    from engine.training import trainer
    from engine.requests.training import TrainingConfig
    from engine.training.preflight import preflight_training

    registry, family = bench.registry, bench.family
    hardware = probe()
    if settings.tiny:
        # The preflight's first memory check sizes the base from the family's
        # table (the full model) before it reads the tiny base's files; with
        # the free host memory unknown it refuses nothing on memory.
        hardware = hardware.replace(free_memory_gb=None)
    memory = bench.memory_request()
    check_training(case, registry, hardware, settings, None if settings.tiny else memory)
    config = TrainingConfig.from_data({
        "base_model": str(bench.folder), "dataset_dir": str(settings.dataset),
        "resolution": settings.train_resolution, "steps": settings.train_steps,
        "lora_rank": settings.lora_rank, "base_precision": case.scheme, "compile": case.compile,
        "device": settings.train_device, "output_dir": str(settings.work / "runs" / case.id.replace("/", "__")),
    })
    try:
        plan = preflight_training(registry, config, hardware)
    except PreflightError as exc:
        raise Skip(f"engine preflight [{exc.code}]: {exc.message}") from None
    mode = plan.base_precision.value
    refusal = training_memory_error(
        registry, family, hardware, mode, memory, device=settings.train_device  # type: ignore[arg-type]
    )
    if refusal is not None and not settings.tiny:
        raise Skip(f"engine preflight at full size [{refusal.code}]: {refusal.message}")
    estimate = memory.estimate(family, mode, plan.device)
    # The training phase: this check caches random embeddings, not the real encoders.
    row.estimate_gb = round(estimate.training_peak_gb, 2)
    row.estimate_detail = "training phase of: " + "; ".join(estimate.lines()) + (
        "" if estimate.sized else " (activations unmeasured: a lower bound)"
    )
    row.details["plan"] = plan.to_dict()["resolved"]
    if case.compile == "on" and plan.compile.value != "regional":
        raise Skip(f"engine preflight: compile {plan.compile.value}: {plan.compile.reason}")
    for name, replacement in _trainer_seams(case, bench).items():
        if not hasattr(trainer, name):  # a renamed seam would otherwise replace nothing, silently
            raise RuntimeError(f"engine.training.trainer has no {name} to replace")
        setattr(trainer, name, replacement)
    marks: list[float] = []
    losses: list[float] = []
    peaks: list[float] = []

    def emit(event: dict[str, Any]) -> None:
        if event["type"] == "started":
            marks.append(time.perf_counter())
            row.details["base_placement"] = event.get("base_placement")
            row.details["quantised_layers"] = event.get("quantised_layers")
            row.details["sdpa_backends_in_run"] = _sdpa_backends()  # the trainer pins them on CUDA
        elif event["type"] == "progress":
            marks.append(time.perf_counter())
            losses.append(float(event["loss"]))  # type: ignore[arg-type]
            if event.get("peak_memory_gb") is not None:
                peaks.append(float(event["peak_memory_gb"]))  # type: ignore[arg-type]

    def should_stop() -> str | None:
        return "discard" if len(losses) >= plan.steps else None  # no LoRA file to write

    started = time.perf_counter()
    trainer.run_training(plan, Path(str(config.output_dir)), emit, should_stop)
    row.load_s = round(marks[0] - started, 2) if marks else None
    durations = [b - a for a, b in zip(marks, marks[1:])][settings.warmup_steps:]
    if durations:
        row.steps_per_s = round(1 / statistics.median(durations), 3)
    row.details["warmup_s"] = round(sum([b - a for a, b in zip(marks, marks[1:])][: settings.warmup_steps]), 2)
    row.details["losses"] = [round(v, 5) for v in losses]
    row.finite = bool(losses) and all(math.isfinite(v) for v in losses)
    if peaks:
        row.peak_gb, row.peak_source = round(max(peaks), 3), "torch.cuda.max_memory_allocated (trainer events)"
    else:
        row.peak_gb, row.peak_source = bench.peak()
    if not row.finite:
        row.status, row.message = "nonfinite", "a training loss was not finite"


def _sdpa_backends() -> dict[str, bool]:
    """Which SDPA kernels torch may pick right now."""
    import torch

    cuda = torch.backends.cuda
    return {
        "flash": cuda.flash_sdp_enabled(), "mem_efficient": cuda.mem_efficient_sdp_enabled(),
        "math": cuda.math_sdp_enabled(), "cudnn": cuda.cudnn_sdp_enabled(),
    }


def _trainer_seams(case: Case, bench: BenchModel) -> dict[str, Callable[..., Any]]:
    """The trainer functions that read the base from disk (and, for the static
    case, the one that compiles), replaced for this process only."""
    import torch

    def load_pipeline(_plan: Any, dtype: torch.dtype) -> Any:
        return bench.pipeline(dtype, "nf4" if _plan.base_precision.value == "nf4" else None)

    def cache_inputs(
        _plan: Any, pipe: Any, runtime: Any, device: torch.device, dtype: torch.dtype, *_stop: Any
    ) -> Any:
        side = _plan.config.resolution // 8
        generator = torch.Generator().manual_seed(2)
        latents = [torch.randn(bench.latent_channels(), side, side, generator=generator)
                   for _ in _plan.dataset.items]
        conditioning = bench.conditioning(1, "cpu", dtype)
        from engine.training.inputs import Captions as _Captions

        return latents, conditioning, _Captions([[0]] * len(_plan.dataset.items), None)  # one prompt row

    seams: dict[str, Callable[..., Any]] = {"load_base": load_pipeline, "cache_inputs": cache_inputs}
    if case.static_shapes:
        def compiled_static(_plan: Any, denoiser: torch.nn.Module) -> torch.nn.Module:
            regions = set(_plan.family.speed.compile_regions)
            for module in denoiser.modules():
                if type(module).__name__ in regions:
                    module.compile(dynamic=False)
            return denoiser

        seams["_compiled"] = compiled_static
    return seams


# -- command line --------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny pipelines on the CPU (what the tests run)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget for all cases (default 540)")
    parser.add_argument("--out", default="gpu-check.json", help="where the JSON report goes (default gpu-check.json)")
    parser.add_argument("--families", nargs="*", help="families to check (default: all installed)")
    parser.add_argument("--cases", nargs="*", help="only case ids matching these globs (flux/training/*)")
    parser.add_argument("--work", help="scratch folder for tiny pipelines and logs (default: a new temp folder)")
    parser.add_argument("--infer-resolution", type=int, help="inference image side (default 1024; --tiny 64)")
    parser.add_argument("--infer-steps", type=int, default=8)
    parser.add_argument("--train-resolution", type=int, help="training image side (default 512; --tiny 64)")
    parser.add_argument("--train-steps", type=int, help="LoRA steps (default 20; --tiny 4)")
    parser.add_argument("--crash", help="make the case(s) matching this glob raise (checks the error rows)")
    parser.add_argument("--spawn", action="store_true",
                        help="start each case as a fresh interpreter (if a preloaded module touched CUDA)")
    parser.add_argument("--list", action="store_true", help="print the planned cases and exit")
    args = parser.parse_args(argv)
    if args.list:  # in run order, with the seconds the budget counts for each
        registry = load_registry()
        settings = Settings(tiny=args.tiny, work=Path("."), infer_resolution=0, infer_steps=args.infer_steps,
                            train_resolution=0, train_steps=args.train_steps or (4 if args.tiny else 20),
                            warmup_steps=0, lora_rank=0)
        for case in all_cases(registry, args.families or list(registry.families)):
            if _selected(case, args.cases):
                print(f"{case.id:<44} ~{estimate_s(case, registry.family(case.family), settings):.0f} s")
        raise SystemExit(0)
    return args


if __name__ == "__main__":
    raise SystemExit(main())
