"""``engine.videos``: clips from a loaded video pipeline, through the same request as images.

A video model loads like any other (``engine.images.check_load`` / ``load``: one
pipeline slot, one plan, the same refusals before anything is evicted); what
differs is the call and what it gives back. :meth:`Videos.check_generate` runs
the shape gate (:mod:`engine.policy.video`: frames on the lattice, a size the
model takes) and the input image's header check before the GPU is touched;
:meth:`Videos.generate` renders one clip per call as a :class:`Video`, whose
frames are images too and which writes itself as MP4 with its recipe beside it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import EngineError
from engine.policy.video import SnappedFrames, VideoShape, check_output, frames_for_seconds, video_shape
from engine.requests.bodies import GenerateBody
from engine.requests.loras import LoraLike

if TYPE_CHECKING:
    from PIL import Image

    from engine.contract.types import Checkpoint, FamilySpec
    from engine.service.images import Images
    from engine.service.targets import Target


@dataclass(frozen=True)
class Video:
    """One rendered clip: its frames, its shape, and the recipe that replays it."""

    frames: tuple[Image.Image, ...]
    shape: VideoShape
    recipe: dict[str, object]

    @property
    def fps(self) -> int:
        return self.shape.fps

    def mp4(self) -> bytes:
        """The clip as H.264 MP4 bytes."""
        from engine.runtime.video_files import mp4_bytes

        return mp4_bytes(self.frames, self.fps)

    def thumbnail(self) -> Image.Image:
        from engine.runtime.video_files import thumbnail

        return thumbnail(self.frames)

    def files(self) -> dict[str, object]:
        """What a server keeps of a finished clip: the MP4, a thumbnail and a spritesheet (PNG), its shape."""
        from engine.runtime.video_files import png_bytes, spritesheet

        return {"mp4": self.mp4(), "thumbnail": png_bytes(self.thumbnail()),
                "spritesheet": png_bytes(spritesheet(self.frames)), "shape": self.shape.to_dict()}

    def save(self, path: str | Path) -> Path:
        """Write the MP4 at ``path`` and its recipe beside it (``clip.mp4`` -> ``clip.json``)."""
        from engine.runtime.video_files import write_mp4

        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_mp4(self.frames, self.fps, target)
        recipe_path(target).write_text(json.dumps(self.recipe, indent=2, default=str) + "\n")
        return target


def recipe_path(mp4: Path) -> Path:
    """Where a clip's recipe lives: beside it, same stem, ``.json``."""
    return mp4.with_suffix(".json")


class Videos:
    """The video door of one engine: the loaded pipeline is ``engine.images``' (one slot)."""

    def __init__(self, images: Images) -> None:
        self._images = images

    def check_door(self, ticket: Any, body: GenerateBody, *, video_file: bool) -> VideoShape | None:
        """Before a load: the request goes through the door the ticket's model serves (a video
        model writes a clip, ``video_file``; an image model takes no frames or fps), and a clip's
        shape passes the gate. The clip's shape, or None for an image model."""
        from engine.service.targets import check_references

        family = ticket.source.family
        check_references(family, ticket.source.checkpoint, body.image)  # several images: an edit that takes them
        asked_video = video_file or body.frames is not None or body.fps is not None
        check_output(family, "frames" if asked_video else "images")
        if family.output != "frames":
            return None
        return self.check_generate(body, family, ticket.source.checkpoint)

    def check_shape(self, *, frames: int | None, width: int | None, height: int | None,
                    fps: int | None, on: Target | None = None) -> VideoShape:
        """The clip of this shape on ``on`` (``engine.images.target``; the loaded model by
        default), or :class:`~engine.policy.video.InvalidVideoShape`."""
        family, checkpoint = self._loaded(on)
        return video_shape(family, checkpoint, frames=frames, width=width, height=height, fps=fps)

    def frames_for_seconds(self, seconds: float, fps: int | None = None, *, on: Target | None = None) -> SnappedFrames:
        """``seconds`` of clip on ``on`` (the loaded model by default), as frames on its lattice
        (and whether they were snapped)."""
        family, checkpoint = self._loaded(on)
        return frames_for_seconds(family, checkpoint, seconds, fps)

    def _loaded(self, on: Target | None = None) -> tuple[FamilySpec, Checkpoint | None]:
        if on is not None:
            return on.family, on.checkpoint
        session = self._images.session
        if session is None:
            raise EngineError("no video model is loaded; load one first (POST /v1/images/load)", code="not_loaded")
        return session.source.family, session.source.checkpoint

    def check_generate(self, body: GenerateBody, family: FamilySpec | None = None,
                       checkpoint: Checkpoint | None = None) -> VideoShape:
        """The clip ``body`` renders on ``family`` / ``checkpoint`` (the loaded model's by default),
        or the refusal it would get: a shape off the lattice or the sizes, more than one clip,
        an input image missing or unreadable. Nothing loads."""
        if family is None:
            family, checkpoint = self._loaded()
            check_output(family, "frames")
        if body.count != 1 or body.prompts or body.seeds:
            raise EngineError("a video generate renders one clip; drop count / prompts / seeds and call once "
                              "per clip (vary seed)", code="invalid_request")
        for name in ("mask_image", "control_image", "strength"):
            if getattr(body, name) is not None:
                raise EngineError(f"{name} does not apply to a video; drop it", code="invalid_request")
        shape = video_shape(family, checkpoint, frames=body.frames, width=body.width, height=body.height,
                            fps=body.fps)
        self._images.check_generate(body)
        return shape

    def generate(self, prompt: str | GenerateBody, *, progress: Callable[[int, int], None] | None = None,
                 loras: Sequence[LoraLike] | None = None, cancel: threading.Event | None = None,
                 **options: object) -> Video:
        """One clip for a :class:`~engine.requests.GenerateBody` (or a prompt with keyword options:
        frames, fps, width, height, steps, guidance, seed, negative_prompt, image); ``progress(step,
        total)`` after each step, ``cancel`` stops it at the next step (:class:`~engine.errors.Cancelled`)."""
        inline = {name: options.pop(name) for name in ("image",) if name in options and
                  not isinstance(options[name], str)}  # an uploaded image's bytes ride beside the body
        body = prompt if isinstance(prompt, GenerateBody) else _body(prompt, options)
        body = self._images.switch_for(body, "frames")  # the model it names, loaded first
        shape = self.check_generate(body)
        for name, value in inline.items():
            self._images.check_image(value, name)
        session = self._images.session
        assert session is not None  # check_generate refused otherwise
        clips = self._images.run("frames", body, progress=progress, loras=loras, cancel=cancel, **inline,
                                 frames=shape.frames, fps=shape.fps, width=shape.width, height=shape.height)
        frames = tuple(clips[0])
        if frames:
            shape = _as_rendered(shape, frames)
        return Video(frames=frames, shape=shape, recipe=_recipe(body, shape, session))


def _body(prompt: str, options: dict[str, object]) -> GenerateBody:
    """The request for a prompt and keyword options, refused as ``invalid_request`` naming each field."""
    from pydantic import ValidationError

    from engine.requests.bodies import describe_problems

    try:
        return GenerateBody.model_validate({"prompt": prompt, **options})
    except ValidationError as exc:
        raise EngineError("; ".join(describe_problems(exc)), code="invalid_request") from None


def _as_rendered(shape: VideoShape, frames: Sequence[Any]) -> VideoShape:
    """The shape as the pipeline rendered it (a pipeline that rounds is caught in the record)."""
    import dataclasses

    return dataclasses.replace(shape, frames=len(frames), width=frames[0].width, height=frames[0].height)


def _recipe(body: GenerateBody, shape: VideoShape, session: Any) -> dict[str, object]:
    """What replays the clip: the request as run (with every default filled) and what engaged."""
    from engine.service.recipes import loaded_recipe, request_recipe

    return {"kind": "video", **request_recipe(body, session), **shape.to_dict(), **loaded_recipe(session)}
