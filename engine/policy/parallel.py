"""One request across several GPUs: how it splits, decided before anything loads.

Two splits exist, and they compose (SGLang Diffusion's and xDiT's order: CFG first):

* **CFG parallel**: guidance above 1 runs the denoiser twice a step, condition then
  uncondition. On two GPUs each runs one of them and they swap results: the step's work
  halves with one exchange a step, whatever the model's width. Only where the family's
  pipeline makes the two calls back to back (``SpeedRules.cfg_parallel``) and every step
  runs both (guidance above 1 on each expert).
* **Context parallel** (diffusers' ``ContextParallelConfig``): the token sequence is split
  across GPUs inside attention. *Ulysses* trades all-to-alls for whole heads per GPU, so it
  needs the heads to divide (``ulysses_anything`` pads them, and the sequence); *Ring* passes
  key/value blocks round the GPUs and needs no head count (``ring_anything`` for a sequence
  that does not divide). Only where the denoiser's class declares a plan for it
  (``SpeedRules.context_parallel``).

Every rank holds the whole model: the split divides the activations and the work, not
the weights, so the memory plan is the one-GPU plan on each of them. A split that cannot
work is refused with the reason (:class:`~engine.errors.PreflightError`, ``parallel_unsupported``);
torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.contract.types import Checkpoint, FamilySpec
from engine.errors import PreflightError
from engine.hardware.profile import HardwareProfile
from engine.policy.plan import ModelFacts, Plan
from engine.policy.resolved import Resolved, auto, explicit
from engine.requests.inference import InferenceRequest

__all__ = ["ParallelChoice", "ParallelUnsupported", "resolve_parallel", "sequence_tokens", "split_plan"]

#: The side an image request renders at when it names none and its family says nothing else.
_IMAGE_SIDE = 1024


class ParallelUnsupported(PreflightError):
    """A request asked for a split of itself across GPUs that cannot work here."""

    code = "parallel_unsupported"


@dataclass(frozen=True)
class ParallelChoice:
    """How one request runs on ``ranks`` processes: ``cfg`` groups (1 or 2), each splitting
    the sequence ``ulysses`` x ``ring`` ways (``anything``: the variant that pads what does not divide)."""

    ranks: int
    cfg: int = 1
    ulysses: int = 1
    ring: int = 1
    anything: bool = False
    #: ``cuda`` (NCCL, one GPU a rank) or ``cpu`` (gloo, CPU processes sharing the cores).
    device: str = "cuda"

    @property
    def sequence(self) -> int:
        """How many ways each rank's sequence is split."""
        return self.ulysses * self.ring

    @property
    def label(self) -> str:
        """What the plan prints: ``cfg 2 x ulysses 4``, ``ring_anything 2``, ``off``."""
        if self.ranks <= 1:
            return "off"
        parts = [f"cfg {self.cfg}"] if self.cfg > 1 else []
        kind = "ulysses" if self.ulysses > 1 else "ring"
        if self.sequence > 1:
            parts.append(f"{kind}{'_anything' if self.anything else ''} {self.sequence}")
        return " x ".join(parts)

    def to_dict(self) -> dict[str, object]:
        return {"ranks": self.ranks, "cfg": self.cfg, "ulysses": self.ulysses, "ring": self.ring,
                "anything": self.anything, "device": self.device, "label": self.label}


def sequence_tokens(family: FamilySpec, checkpoint: Checkpoint | None, request: InferenceRequest) -> int:
    """The tokens one denoiser call sees at the request's shape (a clip's every latent frame)."""
    geometry = family.geometry_of(checkpoint)
    video = family.video_of(checkpoint)
    if video is not None:
        width, height = video.default_size
        frames = request.frames or video.default_frames
        latents = video.latent_frames(frames)
    else:
        width = height = family.rendering.native_side or _IMAGE_SIDE
        latents = 1
    return latents * geometry.image_tokens(request.width or width, request.height or height)


def resolve_parallel(family: FamilySpec, checkpoint: Checkpoint | None, hardware: HardwareProfile,
                     request: InferenceRequest, *, heads: int | None, lora_guidance: float | None = None,
                     ) -> tuple[Resolved[str], ParallelChoice] | None:
    """The ``parallel`` control for ``request.gpus`` ranks (its value the choice's label) and
    the :class:`ParallelChoice`; None when the request asked for no split. ``heads``: the denoiser's attention heads (a folder's config,
    else the checkpoint's table; None unknown); ``lora_guidance``: the guidance a few-step
    LoRA sets where the request names none.

    :raises ParallelUnsupported: more ranks than the machine has, a split the model cannot take.
    """
    ranks = request.gpus or 1
    if request.gpus is None and request.parallel == "auto":
        return None
    if ranks <= 1:
        if request.parallel != "auto":
            raise ParallelUnsupported(f"--parallel {request.parallel} splits a request across GPUs: give --gpus 2 "
                                      "or more", code="parallel_unsupported")
        return auto("off", "one process (--gpus 1)"), ParallelChoice(1)
    device = "cuda" if hardware.cuda else "cpu"
    _check_ranks(ranks, hardware, device)
    tokens = sequence_tokens(family, checkpoint, request)
    twice, why_not_twice = _guidance_twice(family, checkpoint, request, lora_guidance)
    cfg = 2 if twice and ranks % 2 == 0 and request.parallel in ("auto", "cfg") else 1
    if request.parallel == "cfg" and cfg == 1:
        raise ParallelUnsupported(f"--parallel cfg needs guidance that runs the {family.pipeline.denoiser_label} "
                                  f"twice a step and an even --gpus: {why_not_twice or f'{ranks} is odd'}; "
                                  "use --parallel ulysses or ring", code="parallel_unsupported")
    split = ranks // cfg
    choice, why = ParallelChoice(ranks, cfg=cfg, device=device), ""
    if split > 1:
        choice, why = _sequence_split(choice, split, family, request.parallel, heads, tokens)
    said = [f"{ranks} {'GPUs' if device == 'cuda' else 'CPU processes over gloo'}"]
    if cfg > 1:
        said.append("condition and uncondition each on its own half (guidance runs the "
                    f"{family.pipeline.denoiser_label} twice a step: the step's work halves, one exchange a step)")
    if why:
        said.append(why)
    said.append("each rank holds the whole model; the memory plan is per rank, its activations split")
    reason = "; ".join(said)
    # an asked kind is honoured as it is (its degree is the engine's to say), never "fell back"
    resolved = explicit(choice.label, reason) if request.parallel != "auto" else auto(choice.label, reason)
    return resolved, choice


def _check_ranks(ranks: int, hardware: HardwareProfile, device: str) -> None:
    if device == "cuda":
        have = max(1, len(hardware.devices))
        if ranks > have:
            raise ParallelUnsupported(f"--gpus {ranks} asks for more GPUs than this machine has ({have}); give "
                                      f"--gpus {have} or fewer", code="parallel_unsupported")
        return
    cores = hardware.physical_cores or hardware.cpu_count or 1
    if ranks > max(cores, 2):
        raise ParallelUnsupported(f"--gpus {ranks} on the CPU starts {ranks} processes over gloo, more than its "
                                  f"{cores} cores; give --gpus {max(cores, 2)} or fewer", code="parallel_unsupported")


def _guidance_twice(family: FamilySpec, checkpoint: Checkpoint | None, request: InferenceRequest,
                    lora_guidance: float | None) -> tuple[bool, str]:
    """Whether every step runs the denoiser twice (condition and uncondition), and why not."""
    label = family.pipeline.denoiser_label
    if not family.speed.cfg_parallel:
        return False, f"the {family.name} family's pipeline does not run its {label} once per condition"
    point = checkpoint or family.default_checkpoint
    asked = (*request.guidance, None, None)
    first = asked[0] if asked[0] is not None else lora_guidance if lora_guidance is not None else point.default_guidance
    scales = [first]
    if point.expert_guidance is not None:
        scales.append(asked[1] if asked[1] is not None else lora_guidance if lora_guidance is not None
                      else point.expert_guidance)
    low = min(scales)
    if low <= 1.0:
        return False, f"guidance {low:g} runs the {label} once a step"
    return True, ""


def _sequence_split(choice: ParallelChoice, split: int, family: FamilySpec, asked: str, heads: int | None,
                    tokens: int) -> tuple[ParallelChoice, str]:
    """``choice`` with its sequence split ``split`` ways, and the reason."""
    import dataclasses

    label = family.pipeline.denoiser_label
    if family.speed.context_parallel is not True:
        raise ParallelUnsupported(
            f"the {family.name} family's {label} class declares no context-parallel plan, so {split} ranks cannot "
            "split its sequence" + ("; give --gpus 2 for CFG parallel" if family.speed.cfg_parallel else "")
            + "; or run it on one GPU (--gpus 1), or add replicas (serve --replicas)", code="parallel_unsupported")
    divides = tokens % split == 0
    if asked == "ring" or (asked == "auto" and heads is not None and heads < split):
        kind = "ring"
        why = (f"ring attention over {split} ranks (key/value blocks passed round; "
               + ("asked" if asked == "ring" else f"{heads} heads cannot go {split} ways") + ")")
        anything = not divides
    else:
        kind = "ulysses"
        heads_divide = heads is not None and heads % split == 0
        anything = not (heads_divide and divides)
        whole = f"{heads} heads, {(heads or 0) // split} a rank" if heads_divide else (
            f"{heads} heads do not divide {split} ways: padded" if heads is not None else "heads unknown: padded")
        why = f"Ulysses attention over {split} ranks ({whole})"
    if anything and not divides:
        why += f"; {tokens} tokens do not divide {split} ways, so the {kind}_anything variant pads them"
    else:
        why += f"; {tokens} tokens, {tokens // split} a rank"
    if kind == "ulysses":
        return dataclasses.replace(choice, anything=anything, ulysses=split), why
    return dataclasses.replace(choice, anything=anything, ring=split), why


def split_plan(planned: Plan, model: ModelFacts, hardware: HardwareProfile, request: InferenceRequest) -> Plan:
    """``planned`` with its ``parallel`` control (where the request asked for ranks), and the
    controls a split changes: no step cache (each rank would decide its skips on its own half of
    the work, and the ranks would part ways), no compile on the CPU's gloo ranks.

    :raises ParallelUnsupported: the split cannot work, or an asked step cache cannot run split.
    """
    import dataclasses

    checkpoint = model.checkpoint
    heads = model.attention_heads or (checkpoint or model.family.default_checkpoint).attention_heads
    sampling = planned.lora_sampling
    decided = resolve_parallel(model.family, checkpoint, hardware, request, heads=heads,
                               lora_guidance=getattr(sampling, "guidance", None))
    if decided is None:  # one process: said, so every plan answers every control
        gpus = len(hardware.devices)
        more = f"; --gpus N splits one request across N of its {gpus} GPUs" if gpus > 1 else ""
        return planned.with_control("parallel", auto("off", "one process" + more))
    resolved, choice = decided
    planned = dataclasses.replace(planned.with_control("parallel", resolved), parallel=choice)
    if choice.ranks <= 1:
        return planned
    if planned.value("engine") == "sdcpp":
        raise ParallelUnsupported("stable-diffusion.cpp runs one process: --gpus needs the diffusers engine "
                                  "(--engine diffusers)", code="parallel_unsupported")
    cache = planned["step_cache"]
    if cache.value not in (None, "off", False):
        if cache.source == "explicit":
            raise ParallelUnsupported(f"--step-cache {cache.value} cannot run split across ranks (each would "
                                      "skip steps on its own part of the work); give --step-cache off",
                                      code="parallel_unsupported")
        planned = planned.with_control("step_cache", auto("off", f"split across {choice.ranks} ranks ({choice.label}): "
                                                           "each would decide its skips on its own part of the work"))
    if choice.device == "cpu" and planned.value("compile") not in (None, "off", False):
        planned = planned.with_control("compile", auto("off", "the CPU's gloo ranks run eager"))
    return planned
