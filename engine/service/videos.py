"""``engine.videos``: clips from a loaded video pipeline, through the same request as images.

A video model loads like any other (one loaded-model slot,
:mod:`engine.service.loaded`; one plan; the same refusals before anything is evicted);
what differs is the call and what it gives back. :meth:`Videos.check_generate` makes the
request's ticket (:mod:`engine.service.generating`): the model, the clip's shape
(:mod:`engine.policy.video`: frames on the lattice, a size the model takes) and the input
image's header check, once, before the GPU is touched; :meth:`Videos.generate` renders one
clip per call as a :class:`Video`, whose frames are images too and which writes itself as
MP4 with its recipe beside it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.deprecation import moved
from engine.errors import EngineError
from engine.policy.video import SnappedFrames, VideoShape, frames_for_seconds, video_shape
from engine.requests.bodies import GenerateBody
from engine.requests.inference import InferenceRequest
from engine.requests.loras import LoraLike
from engine.service.generating import GenerateChecks, load_options
from engine.service.ranks import splits
from engine.service.tickets import GenerateTicket, LoadTicket, Target

if TYPE_CHECKING:
    from PIL import Image

    from engine.contract.sound import Sound
    from engine.contract.types import Checkpoint, FamilySpec
    from engine.service.images import Images
    from engine.service.loaded import LoadedModel


@dataclass(frozen=True)
class Video:
    """One rendered clip: its frames, its shape, and the recipe that replays it."""

    frames: tuple[Image.Image, ...]
    shape: VideoShape
    recipe: dict[str, object]
    #: The clip's sound (an audio-video family's track); None: a silent clip.
    sound: Sound | None = None

    @property
    def fps(self) -> int:
        return self.shape.fps

    @property
    def audio(self) -> dict[str, object] | None:
        """What the sound is (rate, channels, seconds), as records carry it; None for a silent clip."""
        return self.sound.to_dict() if self.sound is not None else None

    def mp4(self) -> bytes:
        """The clip as H.264 MP4 bytes, its sound as AAC beside the picture."""
        from engine.runtime.video_files import mp4_bytes

        return mp4_bytes(self.frames, self.fps, self.sound)

    def wav(self) -> bytes | None:
        """The sound alone as WAV bytes; None for a silent clip."""
        from engine.runtime.video_files import wav_bytes

        return wav_bytes(self.sound) if self.sound is not None else None

    def thumbnail(self) -> Image.Image:
        from engine.runtime.video_files import thumbnail

        return thumbnail(self.frames)

    def files(self) -> dict[str, object]:
        """What a server keeps of a finished clip: the MP4, a thumbnail and a spritesheet (PNG), its
        shape, and its sound (what it is, and the track alone as WAV; None for a silent clip)."""
        from engine.runtime.video_files import png_bytes, spritesheet

        return {"mp4": self.mp4(), "thumbnail": png_bytes(self.thumbnail()),
                "spritesheet": png_bytes(spritesheet(self.frames)), "shape": self.shape.to_dict(),
                "audio": self.audio, "wav": self.wav()}

    def save(self, path: str | Path) -> Path:
        """Write the MP4 at ``path`` and its recipe beside it (``clip.mp4`` -> ``clip.json``)."""
        from engine.runtime.video_files import write_mp4

        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_mp4(self.frames, self.fps, target, self.sound)
        recipe_path(target).write_text(json.dumps(self.recipe, indent=2, default=str) + "\n")
        return target


def recipe_path(mp4: Path) -> Path:
    """Where a clip's recipe lives: beside it, same stem, ``.json``."""
    return mp4.with_suffix(".json")


class Videos:
    """The video door of one engine, over the loaded-model slot ``engine.images`` shares."""

    def __init__(self, loaded: LoadedModel, images: Images) -> None:
        self._loaded = loaded
        self._images = images
        self._checks = GenerateChecks(loaded)

    def check_shape(self, *, frames: int | None, width: int | None, height: int | None,
                    fps: int | None, on: Target | None = None) -> VideoShape:
        """The clip of this shape on ``on`` (a ticket's target; the loaded model by default),
        or :class:`~engine.policy.video.InvalidVideoShape`."""
        family, checkpoint = self._on(on)
        return video_shape(family, checkpoint, frames=frames, width=width, height=height, fps=fps)

    def frames_for_seconds(self, seconds: float, fps: int | None = None, *, on: Target | None = None) -> SnappedFrames:
        """``seconds`` of clip on ``on`` (the loaded model by default), as frames on its lattice
        (and whether they were snapped)."""
        family, checkpoint = self._on(on)
        return frames_for_seconds(family, checkpoint, seconds, fps)

    def _on(self, on: Target | None = None) -> tuple[FamilySpec, Checkpoint | None]:
        if on is None:
            on = self._loaded.target()
        if on is None:
            raise EngineError("no video model is loaded; load one first (POST /v1/images/load)", code="not_loaded")
        return on.family, on.checkpoint

    def load(self, ticket: GenerateTicket) -> dict[str, object]:
        """Load a checked request's model now (as ``engine.images.load`` does), so a face can time
        the load apart from the clip; the generate would load it otherwise."""
        return self._images.load(ticket)

    def check_generate(self, body: GenerateBody, *, uploads: Mapping[str, Any] | None = None,
                       seconds: float | None = None, base: str | None = None, family: str | None = None,
                       request: InferenceRequest | None = None, controlnet: str | None = None) -> GenerateTicket:
        """Every check a clip of ``body`` makes, loading nothing: a ticket holding the model it
        runs on (the loaded one, or the one its ``model`` names, planned at the clip's frames and
        size), the clip's shape (``seconds``, when ``body`` gives no frames, snapped onto the
        lattice: the ticket's ``note`` says so), its input image sized from its header and its
        LoRAs read; or the refusal: a shape off the lattice or the sizes, more than one clip, an
        image model, an input image missing or unreadable. Pass it to :meth:`generate`.
        ``base``... ``controlnet``: how to load the model ``body`` names (as ``engine.images.load``)."""
        return self._checks.check(body, "frames", uploads=uploads, seconds=seconds,
                                  load=load_options(base, family, request, controlnet))

    def generate(self, prompt: str | GenerateBody | GenerateTicket, *,
                 progress: Callable[[int, int], None] | None = None, loras: Sequence[LoraLike] | None = None,
                 cancel: threading.Event | None = None, **options: object) -> Video:
        """One clip for a ticket (:meth:`check_generate`), a :class:`~engine.requests.GenerateBody`
        (or a prompt with keyword options: frames, fps, width, height, steps, guidance, seed,
        negative_prompt, image); ``progress(step, total)`` after each step, ``cancel`` stops it at
        the next step (:class:`~engine.errors.Cancelled`)."""
        ticket = self._checks.ticket(prompt, "frames", loras, options)
        if ticket.shape is not None and ticket.shape.windows is not None:
            return self._windowed(ticket, progress, cancel)
        if splits(ticket):  # several ranks: fresh ones load and render it (engine.service.ranks)
            return self._loaded.run_split(ticket, progress, cancel)  # its recipe says how the ranks split it
        clips = self._loaded.run(ticket, progress, cancel)
        session = self._loaded.session
        assert ticket.shape is not None and session is not None  # the frames door decided one; run loaded it
        frames, sound = tuple(clips[0]), getattr(clips[0], "sound", None)
        shape = _as_rendered(ticket.shape, frames) if frames else ticket.shape
        return Video(frames=frames, shape=shape, recipe=_recipe(ticket.body, shape, session, sound), sound=sound)

    def _windowed(self, ticket: GenerateTicket, progress: Callable[[int, int], None] | None,
                  cancel: threading.Event | None) -> Video:
        """A clip longer than one call, window by window (:mod:`engine.policy.video_windows`):
        each window after the first an image-to-video call from the last frame so far, that
        frame blended with the window's first; progress and ``cancel`` over the whole clip."""
        from PIL import Image

        from engine.errors import Cancelled
        from engine.service.generating import UPLOADED

        assert ticket.shape is not None and ticket.shape.windows is not None
        counts = ticket.shape.windows.counts
        asked, _, uploads, load, _ = ticket.asked
        cancel = cancel or threading.Event()
        frames: list[Image.Image] = []
        engaged: dict[str, object] | None = None  # a split window's recipe (its ranks say what engaged)
        for index, count in enumerate(counts):
            if cancel.is_set():
                raise Cancelled(f"the clip was cancelled after {index} of its {len(counts)} windows")
            body = asked.model_copy(update={"frames": count, "window_frames": None})
            given = dict(uploads)
            if index:  # continue from the last frame so far, on fresh noise
                body = body.model_copy(update={"image": UPLOADED, "seed": None if asked.seed is None
                                               else asked.seed + index})
                given["image"] = frames[-1]
            window = self._checks.check(body, "frames", uploads=given, load=load)
            step = None if progress is None else (
                lambda done, total, at=index: progress(at * total + done, len(counts) * total))
            if splits(window):  # each window on fresh ranks: what engaged is theirs to say
                split = self._loaded.run_split(window, step, cancel)
                rendered, engaged = list(split.frames), split.recipe
            else:
                rendered = list(self._loaded.run(window, step, cancel)[0])
            if index:
                frames[-1] = Image.blend(frames[-1], rendered.pop(0), 0.5)
            frames.extend(rendered)
        shape = _as_rendered(ticket.shape, frames)
        if engaged is not None:
            return Video(frames=tuple(frames), shape=shape, recipe={**engaged, **shape.to_dict()})
        session = self._loaded.session
        assert session is not None
        return Video(frames=tuple(frames), shape=shape, recipe=_recipe(ticket.body, shape, session, None))

    check_door = moved("Engine.videos.check_door()", "Engine.videos.check_generate()", "_check_door")

    def _check_door(self, ticket: LoadTicket, body: GenerateBody, *, video_file: bool) -> VideoShape | None:
        asked = body.model_copy(update={"model": ticket.source.location})
        frames = video_file or body.frames is not None or body.fps is not None
        if ticket.source.family.rendering.output == "frames" or frames:
            return self.check_generate(asked).shape
        self._images.check_generate(asked)
        return None


def _as_rendered(shape: VideoShape, frames: Sequence[Any]) -> VideoShape:
    """The shape as the pipeline rendered it (a pipeline that rounds is caught in the record)."""
    import dataclasses

    return dataclasses.replace(shape, frames=len(frames), width=frames[0].width, height=frames[0].height)


def _recipe(body: GenerateBody, shape: VideoShape, session: Any, sound: Sound | None) -> dict[str, object]:
    """What replays the clip: the request as run (with every default filled) and what engaged,
    and what its sound is (None for a silent clip)."""
    from engine.service.recipes import loaded_recipe, request_recipe

    return {"kind": "video", **request_recipe(body, session), **shape.to_dict(), **loaded_recipe(session),
            "audio": sound.to_dict() if sound is not None else None}
