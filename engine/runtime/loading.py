"""Building a plan's pipeline and placing it on the device, with the fallback.

This is the weight-handling half of :class:`~engine.runtime.session.InferenceSession`,
kept apart so the path from files to placed modules reads in one place: which
loader a model kind takes (pipeline folder, single file, GGUF, whole-pipeline
file, nf4), the numeric canary of a quantised or fp16 build, text-encoder
quantisation or streaming, and how the memory mode places what was loaded.

A quantised build that fails, or any failure to place weights on the device
(out of memory while moving, quantising or installing offload hooks), releases
what was placed and builds the plan's fallback, with the reason recorded on the
session. A torchao-quantised transformer is quantised on the way in (see
:func:`engine.runtime.quantize.quantize_on_host_then_place`): it is never
resident on the GPU in dense bf16.
"""

from __future__ import annotations

import gc
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.errors import EngineError
from engine.contract.plugins import Registry
from engine.policy.plan import Plan
from engine.policy.resolved import explicit
from engine.preflight.hub import hub_root
from engine.preflight.source import ModelSource
from engine.runtime import flags, quantize, text_encoders
from engine.runtime.canary import inference_canary
from engine.runtime.cpu_kernels import route_linears_to_onednn
from engine.runtime.processors import pipeline_processors
from engine.runtime.quantize import (
    Placement,
    PlacementFailed,
    QuantisationFailed,
    nf4_config,
    quantize_on_host_then_place,
)
from engine.runtime.whole_file import load_whole_file
from engine.runtime.modular import load_modular
from engine.preflight.pipeline_index import modular_index
from engine.preflight.quantised_folder import STORED_SCHEMES, read_marker
from engine.policy.stored_formats import THROUGH_DIFFUSERS
from engine.runtime.prequantised import load_quantised
from engine.runtime.stored_layouts import converted_denoisers

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

#: Called with (steps done, steps planned) while loading or generating.
Progress = Callable[[int, int], None]


class LoadFailed(EngineError):
    """The loader could not read the model (a missing, corrupt or mismatched file)."""

    code = "load_failed"


class PipelineLoading:
    """Mixin of :class:`~engine.runtime.session.InferenceSession`: applies the
    process-wide torch flags, loads the pipeline and places it per the plan,
    falling back to the plan's fallback when placement or quantisation fails.

    It reads and records on the session's own attributes (set in its
    ``__init__``), so ``status()`` reports what really happened.
    """

    registry: Registry
    source: ModelSource
    plan: Plan
    canary: dict[str, object] | None
    quantised_layers: int
    onednn_layers: int
    placement: Placement | None
    fallback: dict[str, object] | None
    encoder_stream: text_encoders.EncoderStream | None
    encoder_placements: list[Placement]

    def _apply_process_flags(self) -> None:
        threads = self.plan.value("threads")
        if threads:
            torch.set_num_threads(int(threads))  # type: ignore[arg-type]
        if self.plan.device == "cuda" and self.plan.value("tf32"):
            torch.set_float32_matmul_precision("high")
        if self.plan.value("fp16_accumulation") and flags.fp16_accumulation_available():
            torch.backends.cuda.matmul.allow_fp16_accumulation = True

    def _build(self, plan: Plan, progress: Progress | None) -> Any:
        """Load and place per ``plan``; on any placement or quantisation
        failure, release what was placed and build the plan's fallback."""
        while True:
            try:
                return self._build_once(plan)
            except (PlacementFailed, QuantisationFailed) as exc:
                plan = self._fallback_after(plan, exc)

    def _build_once(self, plan: Plan) -> Any:
        dtype = TORCH_DTYPES[str(plan.value("dtype"))]
        scheme = plan.value("transformer_quant")
        pipe = self._load_pipeline(dtype, str(scheme) if scheme else None)
        self.quantised_layers, self.onednn_layers, self.placement = 0, 0, None
        quantised_by_loader = self.source.prequantised_scheme is not None or self.source.upstream_format in THROUGH_DIFFUSERS
        if scheme and scheme != "nf4" and not quantised_by_loader:
            keep = quantize.module_filter(str(scheme), self.source.family.quantisation.int8_dense_modules)
            for denoiser in denoisers_of(pipe, self.source.family):  # every expert, or the load fails
                self.placement = quantize_on_host_then_place(
                    denoiser, str(scheme), plan.device, resident=resident(plan), keep=keep,
                )
                self.quantised_layers += self.placement.layers
                self.canary = inference_canary(
                    denoiser, keep, scheme=str(scheme), dtype=dtype,
                ).to_dict()  # a broken scheme raises CanaryFailed: the fallback is built instead
        elif dtype == torch.float16 or (plan.device == "cpu" and dtype == torch.bfloat16):
            # fp16 compute (some families render black in it), or bf16 chosen for a CPU's kernels
            self.canary = inference_canary(
                getattr(pipe, self.source.family.pipeline.denoiser), lambda module, _: isinstance(module, torch.nn.Linear),
                scheme=str(plan.value("dtype")), dtype=dtype,
            ).to_dict()
        encoder_dtype = TORCH_DTYPES[str(plan.value("text_encoder_dtype", plan.value("dtype")))]
        self.encoder_stream, self.encoder_placements, failure = text_encoders.prepare_encoders(
            pipe, getattr(pipe, self.source.family.pipeline.denoiser), plan, self._root(), encoder_dtype, resident=resident(plan),
            precast=self.source.precast_encoders,
            int8_schedule=self.source.family.quantisation.text_encoder_int8_keep,
        )
        if failure is not None:
            self.plan = plan = plan.with_control("text_encoder_quant", explicit("none", failure))
        from engine.runtime.mixed_precision import align_components

        align_components(pipe, denoisers_of(pipe, self.source.family), plan)  # where dtypes differ
        self._apply_memory_mode(pipe, plan)
        if plan.value("cpu_kernel") == "onednn" and dtype == torch.float32:
            self.onednn_layers = route_linears_to_onednn(pipe)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def _fallback_after(self, plan: Plan, exc: PlacementFailed | QuantisationFailed) -> Plan:
        """The fallback plan to build after ``exc``, with the reason recorded;
        re-raise (with what to do) when the plan has none."""
        release(exc)
        if plan.fallback is None:
            if isinstance(exc, PlacementFailed):
                raise PlacementFailed(
                    f"{exc.message}; free GPU memory (unload other models) or load with a "
                    "lighter --memory mode (model_offload, sequential_offload) or a --quant scheme",
                    out_of_memory=exc.out_of_memory,
                ) from None
            raise exc
        scheme = plan.value("transformer_quant")
        tried = f"the {scheme} build" if scheme else "the planned build"
        reason = f"{tried} failed: {exc.message}; loaded the fallback instead"
        self.fallback = {
            "code": exc.code,
            "reason": reason,
            "from": {"transformer_quant": scheme, "memory_mode": plan.value("memory_mode")},
        }
        fallback = plan.fallback.with_control("transformer_quant", explicit(None, reason))
        self.plan = fallback
        return fallback

    def _root(self) -> str:
        """The pipeline folder (or hub id) the non-denoiser components load from."""
        source = self.source
        return str(source.base if source.kind in ("single_file", "single_file_pipeline", "gguf") else source.location)

    def _load_pipeline(self, dtype: torch.dtype, scheme: str | None) -> Any:
        import diffusers

        source = self.source
        denoiser_name = source.family.pipeline.denoiser
        from_file = source.kind == "single_file" or (source.kind == "gguf" and scheme is None)
        # A GGUF model with a torchao scheme is the dense-quant candidate: the
        # base's dense transformer is loaded and quantised instead of the file.
        root = source.base if source.kind in ("single_file", "gguf") else hub_root(source)
        try:
            if source.kind == "single_file_pipeline":  # every weight in one file: no base
                return load_whole_file(source, dtype)
            components: dict[str, Any] = {}
            stored = source.prequantised_scheme in STORED_SCHEMES and source.kind == "pipeline"
            if from_file or scheme == "nf4" or stored:
                config = diffusers.DiffusionPipeline.load_config(root)
                denoiser_cls = getattr(diffusers, config[denoiser_name][1])
            if stored:  # written by `quantize`: the stored torchao tensors, never a dense transient
                folder = Path(source.location)
                for name in (denoiser_name, *source.family.pipeline.experts):
                    if read_marker(folder / name) is not None:
                        components[name] = load_quantised(getattr(diffusers, config[name][1]), folder / name, dtype,
                                                           scheme=source.prequantised_scheme)
            components.update(converted_denoisers(source, Path(str(root)), dtype))
            if from_file and source.upstream_format is not None and source.upstream_format not in THROUGH_DIFFUSERS:
                from engine.runtime.upstream_files import decoded_denoiser  # stored quantised: decoded first

                components[denoiser_name] = decoded_denoiser(denoiser_cls, Path(source.location), root, denoiser_name,
                                                             dtype, keep_rotated=scheme == "int8_convrot")
            elif from_file:
                extra: dict[str, Any] = {}
                if source.kind == "gguf":
                    extra["quantization_config"] = diffusers.GGUFQuantizationConfig(compute_dtype=dtype)
                if source.upstream_format in THROUGH_DIFFUSERS:  # BFL's linears: diffusers' own quantizer
                    extra["quantization_config"] = diffusers.BFLQuantizationConfig(compute_dtype=dtype)
                components[denoiser_name] = denoiser_cls.from_single_file(
                    source.location, config=root, subfolder=denoiser_name, dtype=dtype, **extra
                )
            elif scheme == "nf4":
                components[denoiser_name] = denoiser_cls.from_pretrained(
                    root, subfolder=denoiser_name, dtype=dtype,
                    quantization_config=nf4_config(dtype),
                )
            if self.plan.value("text_encoder_quant") == "nf4":
                components.update(text_encoders.nf4_encoder_components(
                    str(root), diffusers.DiffusionPipeline.load_config(root),
                    TORCH_DTYPES[str(self.plan.value("text_encoder_dtype", self.plan.value("dtype")))],
                ))
            if source.borrowed:  # named by the repo, not shipped: from the family's repos
                from engine.runtime.borrowed import borrowed_components

                components.update(borrowed_components(source, diffusers.DiffusionPipeline.load_config(root),
                                                      TORCH_DTYPES[str(self.plan.value("text_encoder_dtype",
                                                                                       self.plan.value("dtype")))]))
            index = modular_index(Path(str(root)))
            if index is not None:  # a modular pipeline: its blocks and a ComponentsManager
                return load_modular(Path(str(root)), index, source.family,
                                    component_dtypes(source.family, self.plan, lambda: index.entries))
            components.update(pipeline_processors(str(root)))  # built here: see runtime.processors
            return diffusers.DiffusionPipeline.from_pretrained(
                root, dtype=component_dtypes(source.family, self.plan, lambda: diffusers.DiffusionPipeline.load_config(root)),
                **components,
            )
        except torch.OutOfMemoryError as exc:  # nf4 loads onto the GPU as it quantises
            raise PlacementFailed(
                f"ran out of memory loading {source.location} ({quantize.first_line(exc)})",
                out_of_memory=True,
            ) from exc
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise LoadFailed(f"could not load {source.location} ({source.kind}): {exc}") from exc

    def _apply_memory_mode(self, pipe: Any, plan: Plan) -> None:
        """Place the pipeline per the memory mode; failures raise :class:`PlacementFailed`."""
        device = plan.device
        mode = plan.value("memory_mode")
        host = plan.value("text_encoder_memory") == "host"  # the encoders do not fit the card even alone
        if resident(plan) and (self.encoder_stream is not None or host):
            waiting = self.encoder_stream.names if self.encoder_stream is not None else text_encoders.encoder_names(pipe)
            for name, component in pipe.components.items():  # the encoders wait on the host
                if isinstance(component, torch.nn.Module) and name not in waiting:
                    quantize.move_to(component, device, f"the {name}")
            if host:
                text_encoders.keep_on_host(pipe, device)
            return
        if resident(plan):
            quantize.move_to(pipe, device, "the pipeline")
            return
        with quantize.placing(f"the pipeline ({mode})", device):
            if mode == "model_offload":
                pipe.enable_model_cpu_offload(device=device)
            elif mode == "sequential_offload":
                pipe.enable_sequential_cpu_offload(device=device)
            elif mode == "group_offload":
                pipe.enable_group_offload(
                    onload_device=torch.device(device),
                    offload_device=torch.device("cpu"),
                    offload_type="block_level",
                    num_blocks_per_group=1,
                    use_stream=True,
                )


def denoisers_of(pipe: Any, family: Any) -> list[Any]:
    """The loaded pipeline's denoisers: the family's ``denoiser`` and each expert it has
    (a one-expert checkpoint of a two-expert family leaves ``transformer_2`` None)."""
    return [module for name in family.denoisers if (module := getattr(pipe, name, None)) is not None]


def component_dtypes(family: Any, plan: Plan, read_config: Callable[[], dict[str, Any]]) -> Any:
    """The plan's compute dtype, or per component where the plan gives the text encoders or the
    VAE their own (``text_encoder_dtype``, ``vae_dtype``: an fp16-unsafe one beside an fp16
    denoiser) or the family keeps one in fp32 (``precision.keep_fp32``: a video VAE), as
    diffusers' ``from_pretrained`` takes a mapping. The pipeline's config is read only then."""
    dtype = TORCH_DTYPES[str(plan.value("dtype"))]
    own = {component: TORCH_DTYPES[str(plan.value(control, plan.value("dtype")))]
           for component, control in (("text_encoders", "text_encoder_dtype"), ("vae", "vae_dtype"))}
    own.update({component: torch.float32 for component, _ in family.precision.keep_fp32})
    differs = {component: d for component, d in own.items() if d != dtype}
    if not differs:
        return dtype
    config = read_config()
    names = {"denoiser": set(family.denoisers), "vae": {"vae"},
             "text_encoders": {name for name in config if name.startswith("text_encoder")}}
    pinned = {name: d for component, d in differs.items() for name in names[component] if name in config}
    return {"default": dtype, **pinned} if pinned else dtype


def resident(plan: Plan) -> bool:
    """Whether the whole pipeline lives on the plan's device (no offload hooks)."""
    return plan.device == "cpu" or plan.value("memory_mode") == "resident"


def release(exc: BaseException) -> None:
    """Drop the frames a failed build's traceback holds, so the half-placed
    pipeline they reference is freed before the fallback loads."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_weightless_components(source: ModelSource) -> None:
    """Build a pipeline folder's weightless transformers components (its
    processors) now, before anything is evicted: they read a few config and
    tokenizer files, and one that cannot be built here (a library it needs is
    missing, a config is corrupt) is then refused with the library's own words
    instead of failing mid-load. An edit model's processor builds without
    torchvision (:mod:`engine.runtime.processors`)."""
    from pathlib import Path

    from engine.runtime.processors import build_processor, processor_entries

    if source.kind != "pipeline":
        return
    folder = Path(source.location)
    for name, class_name in processor_entries(folder).items():  # none without a readable index
        try:
            build_processor(folder / name, class_name)
        except (ImportError, AttributeError, OSError, ValueError, TypeError) as exc:
            said = " ".join(str(exc).split()).split(". ")[0]  # its first sentence names what is missing
            raise LoadFailed(
                f"the {name} ({class_name}) of {folder} cannot be built here: {said}; "
                "install what it names into this environment (matching the installed torch), "
                "or repair the file it names, then load again"
            ) from exc
