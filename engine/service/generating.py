"""A generate's checks, each decision made once: the :class:`~engine.service.tickets.GenerateTicket`.

Every door (the CLI, HTTP, Python; images and clips) asks one question,
:meth:`GenerateChecks.check`, and gets one ticket or one refusal, loading nothing. In
order, cheapest first:

1. the request's own rules for its door (a clip is one clip, no mask or strength);
2. its input images, sized from their headers once (a bomb is refused for nothing);
3. its model: the loaded one, or the one it names, resolved and planned once at the
   request's real shape (size, count, a clip's frames) on this machine;
4. the door against the model (a video model through the images door, frames asked of an
   image model), a clip's shape (seconds snapped onto frames), the input images against
   what the checkpoint takes;
5. its LoRAs, read once and checked against the model's modules when it is not the loaded one.

:meth:`GenerateChecks.recheck` makes a ticket usable at its job's turn: checked again, as
asked, only when a file it read changed; the load re-checks its own ticket
(:mod:`engine.service.load_checks`). :func:`call_for` turns a ticket into the runtime's
call, field by field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import Busy, EngineError
from engine.policy.video import VideoShape, check_output, frames_for_seconds, video_shape
from engine.requests.bodies import GenerateBody
from engine.requests.inference import InferenceRequest
from engine.requests.loras import LoraLike
from engine.service.targets import check_references, means_loaded
from engine.service.tickets import GenerateTicket, LoadTicket, Target, stamp_files

if TYPE_CHECKING:
    from engine.contract.types import Checkpoint
    from engine.preflight.lora import LoraFile
    from engine.preflight.source import ModelSource
    from engine.runtime.generation import GenerateRequest
    from engine.service.loaded import LoadedModel

#: What each output kind is called in a refusal: "no image pipeline is loaded", "no video model...".
MEDIUM = {"images": "image pipeline", "frames": "video model"}

#: Keyword options of a generate that split it across ranks (``engine.videos.generate(..., gpus=2)``):
#: plan controls, not request fields, so they ride in the load's request.
SPLIT_OPTIONS = ("gpus", "parallel")

#: The request fields that carry input images.
IMAGE_FIELDS = ("image", "mask_image", "control_image")


@dataclass(frozen=True)
class LoadOptions:
    """How to load the model a request names, beyond its path: what ``engine.images.load``
    takes (the CLI's ``--base``, ``--family``, controls and ``--controlnet``). Given, the
    request's LoRAs load with the model (fused where the plan says) instead of being switched
    at the call."""

    base: str | None = None
    family: str | None = None
    request: InferenceRequest = InferenceRequest()
    controlnet: str | None = None


class GenerateChecks:
    """The generate checks of one engine's loaded-model slot."""

    def __init__(self, loaded: LoadedModel) -> None:
        self._loaded = loaded

    def check(self, body: GenerateBody, output: str, *, uploads: Mapping[str, Any] | None = None,
              load: LoadOptions | None = None, seconds: float | None = None) -> GenerateTicket:
        """The ticket for ``body`` through the ``output`` door (``images`` or ``frames``).
        ``uploads``: input images given inline (bytes or pictures), in place of the body's
        fields of those names; ``seconds``: a clip's length when ``body`` gives no frames."""
        asked = (body, output, dict(uploads or {}), load, seconds)
        if output == "frames":
            _check_clip_request(body)
        from engine.preflight.images import named_images

        inputs = _inputs(body, uploads or {})
        sizes = tuple((name, _size(one, name)) for field, value in inputs for name, one in named_images(value, field))
        decided: dict[str, Any] = {}
        target = self._target(body, output, load, seconds, decided)
        family, checkpoint = target.family, target.checkpoint
        check_output(family, output)
        if output == "images" and (body.frames is not None or body.fps is not None or body.window_frames is not None):
            check_output(family, "frames")  # frames asked of the images door: an image model refuses them
        shape: VideoShape | None = decided.get("shape")
        if shape is None and family.rendering.output == "frames":  # the loaded model: its clip decided here
            shape, decided["note"] = _clip(target.ticket.source, body, seconds)
        check_references(family, checkpoint, sizes)
        _check_sampling(checkpoint or family.default_checkpoint, body, family.pipeline.guidance_kwarg)
        loras = self._loras(body, target, load)
        if shape is not None:
            body = body.model_copy(update={"frames": shape.frames, "fps": shape.fps, "width": shape.width,
                                           "height": shape.height})
        files = [value for _, value in inputs if isinstance(value, str)]
        files += [v for _, value in inputs if isinstance(value, list) for v in value if isinstance(v, str)]
        files += [str(lora.path) for lora in loras or ()]
        return GenerateTicket(asked=asked, body=body.model_copy(update={"model": None}), output=output,
                              target=target, shape=shape, inputs=inputs, sizes=sizes, loras=loras,
                              note=decided.get("note", ""), stamps=stamp_files(files), owner=id(self._loaded))

    def ticket(self, prompt: str | GenerateBody | GenerateTicket, output: str, loras: Sequence[LoraLike] | None,
               options: Mapping[str, object]) -> GenerateTicket:
        """The ticket a generate runs: the one given (re-checked where its files changed), else
        the request's, checked once (images handed in inline ride as uploads)."""
        if isinstance(prompt, GenerateTicket):
            if loras is not None or options:
                raise EngineError("a checked ticket carries its request: give loras and options to "
                                  "check_generate, not to generate", code="invalid_request")
            return self.recheck(prompt)
        split = {name: options[name] for name in SPLIT_OPTIONS if name in options}
        body, uploads = request_body(prompt, loras, {k: v for k, v in options.items() if k not in split})
        if not split:
            return self.check(body, output, uploads=uploads)
        loaded = self._loaded.target()  # a split names its model: the loaded one where the body does not
        if body.model is None and loaded is not None:
            body = body.model_copy(update={"model": loaded.key})
        from pydantic import ValidationError

        from engine.requests.bodies import PlanControls, describe_problems

        try:
            request = PlanControls(**split).request()
        except ValidationError as exc:
            raise EngineError("; ".join(describe_problems(exc)), code="invalid_request") from None
        return self.check(body, output, uploads=uploads, load=LoadOptions(request=request))

    def recheck(self, ticket: GenerateTicket) -> GenerateTicket:
        """``ticket`` made usable now: checked again, as asked, only when a file it read changed."""
        if ticket.owner != id(self._loaded):
            raise EngineError("this generate ticket was issued by another engine; check the request on this one",
                              code="invalid_request")
        if ticket.files_changed():
            body, output, uploads, load, seconds = ticket.asked
            return self.check(body, output, uploads=uploads, load=load, seconds=seconds)
        return ticket

    def _target(self, body: GenerateBody, output: str, load: LoadOptions | None, seconds: float | None,
                decided: dict[str, Any]) -> Target:
        """The model the request runs on: the loaded one, or the one it names, checked as a load
        is and planned at the request's shape (a clip's decided on the way, into ``decided``)."""
        loaded = self._loaded.target()
        if load is None and means_loaded(loaded, body.model):
            if loaded is None:
                if self._loaded.job == "training":  # a run took the GPU (and evicted the model): say so
                    raise Busy("the engine is busy training; generate when the run is done (or stop it)")
                raise EngineError(f"no {MEDIUM[output]} is loaded; name one in the request's model field, or load "
                                  "one first (POST /v1/images/load)", code="not_loaded")
            return loaded
        assert body.model is not None
        options = load or LoadOptions()
        count = 1 if output == "frames" else len(body.images())
        sized = dataclasses.replace(options.request, width=body.width, height=body.height, count=count,
                                    guidance=(body.guidance, body.guidance_2))

        def shaped(source: ModelSource) -> InferenceRequest:
            if source.family.rendering.output != "frames" or output != "frames":
                return sized
            decided["shape"], decided["note"] = _clip(source, body, seconds)
            shape: VideoShape = decided["shape"]
            return dataclasses.replace(sized, width=shape.width, height=shape.height, frames=shape.call_frames)

        loras = [lo.model_dump() for lo in body.loras or ()] if load is not None else ()
        ticket: LoadTicket = self._loaded.checks.check((body.model, options.base, options.family, False), sized,
                                                       loras, options.controlnet, verify=False, shaped=shaped)
        if load is None and loaded is not None and loaded.key == ticket.source.location:
            return loaded
        return Target(ticket)

    def _loras(self, body: GenerateBody, target: Target, load: LoadOptions | None) -> tuple[LoraFile, ...] | None:
        """The LoRAs the call switches to, read once (None: keep the loaded ones; a request that
        loads its model with its LoRAs keeps those)."""
        if body.loras is None or load is not None:
            return None
        from engine.preflight.lora import read_loras, with_family
        from engine.requests.loras import lora_choices

        files = with_family(target.ticket.source.family,
                            read_loras(lora_choices([lo.model_dump() for lo in body.loras])))
        if files and target is not self._loaded.target():
            from engine.runtime.lora_check import check_loras

            files = check_loras(self._loaded.registry, target.ticket.source, files)  # before that model evicts another
        return files


def _check_sampling(chosen: Checkpoint, body: GenerateBody, guidance_kwarg: str = "guidance_scale") -> None:
    """Refuse sampling settings the checkpoint cannot take: a second expert's guidance on a
    one-denoiser model, a step count off a distilled checkpoint's own schedule, guidance asked of
    a guidance-distilled checkpoint whose guidance a guider would hold (it ships none)."""
    if "." in guidance_kwarg and chosen.default_guidance == 0 and body.guidance is not None and body.guidance > 1:
        raise EngineError(f"guidance={body.guidance:g}: {chosen.label} is guidance-distilled and has no guider to "
                          "take it; leave guidance out", code="invalid_request")
    if body.guidance_2 is not None and chosen.expert_guidance is None:  # a two-expert checkpoint says its own
        raise EngineError(f"guidance_2 is a two-expert model's low-noise guidance; {chosen.label} has one "
                          "denoiser: drop guidance_2 (--guidance-2)", code="invalid_request")
    if chosen.sigmas and body.steps not in (None, len(chosen.sigmas)):
        raise EngineError(f"steps={body.steps}: {chosen.label} samples the {len(chosen.sigmas)} sigmas it was "
                          f"distilled on; ask for {len(chosen.sigmas)} steps or leave steps out", code="invalid_request")


def _check_clip_request(body: GenerateBody) -> None:
    """What a clip's request may not carry, refused before anything else is read."""
    if body.count != 1 or body.prompts or body.seeds:
        raise EngineError("a video generate renders one clip; drop count / prompts / seeds and call once "
                          "per clip (vary seed)", code="invalid_request")
    for name in ("mask_image", "control_image", "strength"):
        if getattr(body, name) is not None:
            raise EngineError(f"{name} does not apply to a video; drop it", code="invalid_request")


def _clip(source: ModelSource, body: GenerateBody, seconds: float | None) -> tuple[VideoShape, str]:
    """The clip ``body`` renders on ``source``'s checkpoint (``seconds`` snapped onto frames when
    it gives none; what it leaves out, the model's own where its folder says: a tiny pipeline's
    short clip, never its checkpoint's 121 frames), and the snap's note."""
    family, checkpoint, own = source.family, source.checkpoint, source.defaults
    frames, note = body.frames, ""
    if frames is None and seconds is not None:
        snapped = frames_for_seconds(family, checkpoint, seconds, body.fps)
        frames, note = snapped.frames, snapped.note()
    sized = body.width is not None or body.height is not None
    shape = video_shape(family, checkpoint, frames=frames or own.frames, fps=body.fps,  # the model's own clip first
                        width=body.width if sized else own.width, height=body.height if sized else own.height,
                        window=body.window_frames)
    return shape, note


def _inputs(body: GenerateBody, uploads: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The request's input images by field: an upload in place of the body's path of that name."""
    inputs = []
    for field in IMAGE_FIELDS:
        value = uploads.get(field, getattr(body, field))
        if value is not None:
            inputs.append((field, value))
    unknown = sorted(set(uploads) - set(IMAGE_FIELDS))
    if unknown:
        raise EngineError(f"{', '.join(unknown)} is not an input image field; give {', '.join(IMAGE_FIELDS)}",
                          code="invalid_request")
    return tuple(inputs)


def _size(value: Any, field: str) -> tuple[int, int]:
    """An input image's (width, height): a picture's own, else its header's, within the caps."""
    if hasattr(value, "getbands"):  # a PIL image handed in by an embedding app
        return value.size  # type: ignore[no-any-return]
    from engine.preflight.images import image_size

    return image_size(value, field)


def load_options(base: str | None, family: str | None, request: InferenceRequest | None,
                  controlnet: str | None) -> LoadOptions | None:
    """How to load a request's model, when the caller said anything about it."""
    if base is None and family is None and request is None and controlnet is None:
        return None
    return LoadOptions(base=base, family=family, request=request or InferenceRequest(), controlnet=controlnet)


#: What a request body records for an input image handed in as bytes or a picture.
UPLOADED = "(uploaded)"

#: Keyword options that carry input images: a value that is not a path rides as an upload.
_IMAGE_OPTIONS = ("image", "mask_image", "control_image")


def request_body(prompt: str | GenerateBody, loras: Sequence[LoraLike] | None,
                 options: Mapping[str, object]) -> tuple[GenerateBody, dict[str, Any]]:
    """The typed request for a prompt (or body) with keyword options and LoRAs, and the input
    images handed in as bytes or pictures; refused as ``invalid_request`` naming each field."""
    from pydantic import ValidationError

    from engine.requests.bodies import describe_problems
    from engine.requests.loras import lora_choices

    fields = dict(options)
    uploads = {name: fields[name] for name in _IMAGE_OPTIONS if name in fields and not _is_path(fields[name])}
    for name, value in uploads.items():  # the body says an image was given (its rules read it); the upload is it
        fields[name] = [UPLOADED] * len(value) if isinstance(value, (list, tuple)) else UPLOADED
    if loras is not None:
        fields["loras"] = [{"path": c.path, "scale": c.scale, "partial": c.partial} for c in lora_choices(loras)]
    fields = {name: list(value) if isinstance(value, tuple) else value for name, value in fields.items()}
    try:
        if isinstance(prompt, GenerateBody):
            body = GenerateBody.model_validate({**prompt.model_dump(exclude_unset=True), **fields})
        else:
            body = GenerateBody.model_validate({"prompt": prompt, **fields})
    except ValidationError as exc:
        raise EngineError("; ".join(describe_problems(exc)), code="invalid_request") from None
    return body, uploads


def _is_path(value: object) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


def call_for(ticket: GenerateTicket) -> GenerateRequest:
    """The runtime's call for a ticket, field by field: what was decided, nothing re-derived."""
    from engine.runtime.generation import GenerateRequest

    body, inputs = ticket.body, dict(ticket.inputs)
    image = inputs.get("image")
    return GenerateRequest(
        prompt=body.prompt, steps=body.steps, guidance=body.guidance, width=body.width, height=body.height,
        seed=body.seed, count=body.count, negative_prompt=body.negative_prompt, loras=ticket.loras,
        image=tuple(image) if isinstance(image, list) else image, mask_image=inputs.get("mask_image"),
        strength=body.strength, prompts=tuple(body.prompts or ()), seeds=tuple(body.seeds or ()),
        batch=body.batch, control_image=inputs.get("control_image"), control_preprocess=body.control_preprocess,
        control_scale=body.control_scale, frames=body.frames, fps=body.fps, guidance_2=body.guidance_2,
    )
