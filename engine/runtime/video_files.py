"""MP4 in and out through PyAV (its wheels carry ffmpeg): H.264, ``yuv420p``, any player plays it,
and a clip's sound as AAC beside it (or alone, as WAV).

H.264 in 4:2:0 needs even sides; every size a video family takes is a multiple
of 16, so no frame is ever cropped. A clip's frames are also offered as images
(PNG), and its thumbnail is its middle frame.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import numpy as np
from PIL import Image

from engine.contract.sound import Sound

#: The encoder's quality (x264's constant rate factor): visually lossless at 18.
CRF = 18


def write_mp4(frames: Sequence[Image.Image], fps: int, target: Path | io.BytesIO,
              sound: Sound | None = None) -> Path | io.BytesIO:
    """Encode ``frames`` at ``fps`` as H.264 MP4 into ``target`` (a path or a buffer), with
    ``sound`` as an AAC track beside it (both start at zero: in sync)."""
    import av

    if not frames:
        raise ValueError("a clip needs at least one frame")
    width, height = frames[0].size
    with av.open(target if isinstance(target, io.BytesIO) else str(target), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": str(CRF)}
        layout = _layout(sound) if sound is not None else ""
        track = container.add_stream("aac", rate=sound.sample_rate, layout=layout) if sound is not None else None
        for frame in frames:
            picture = av.VideoFrame.from_image(frame.convert("RGB"))
            for packet in stream.encode(picture):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if track is not None and sound is not None:
            audio = av.AudioFrame.from_ndarray(np.ascontiguousarray(sound.samples, dtype=np.float32),
                                               format="fltp", layout=layout)
            audio.sample_rate = sound.sample_rate
            for packet in (*track.encode(audio), *track.encode()):
                container.mux(packet)
    return target


def _layout(sound: Sound) -> str:
    if sound.channels not in (1, 2):
        raise ValueError(f"an MP4 track here is mono or stereo (got {sound.channels} channels)")
    return "mono" if sound.channels == 1 else "stereo"


def mp4_bytes(frames: Sequence[Image.Image], fps: int, sound: Sound | None = None) -> bytes:
    buffer = io.BytesIO()
    write_mp4(frames, fps, buffer, sound)
    return buffer.getvalue()


def read_sound(source: Path | bytes) -> Sound | None:
    """A clip's audio track, decoded (None: it has none)."""
    import av

    opened = io.BytesIO(source) if isinstance(source, bytes) else str(source)
    with av.open(opened) as container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        chunks = [frame.to_ndarray() for frame in container.decode(stream)]
        rate = int(stream.rate or stream.codec_context.sample_rate)
    samples = np.concatenate(chunks, axis=1) if chunks else np.zeros((1, 0), dtype=np.float32)
    return Sound(samples.astype(np.float32), rate)


def wav_bytes(sound: Sound) -> bytes:
    """The track alone as 16-bit PCM WAV (any player, any editor)."""
    import wave

    pcm = (np.clip(sound.samples, -1.0, 1.0) * 32767.0).round().astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(sound.channels)
        out.setsampwidth(2)
        out.setframerate(sound.sample_rate)
        out.writeframes(pcm.T.tobytes())  # interleaved: one sample of each channel in turn
    return buffer.getvalue()


def read_mp4(source: Path | bytes) -> tuple[list[Image.Image], float]:
    """A clip's frames (RGB) and its frame rate, decoded."""
    import av

    opened = io.BytesIO(source) if isinstance(source, bytes) else str(source)
    with av.open(opened) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate or stream.base_rate or 0)
        frames = [frame.to_image().convert("RGB") for frame in container.decode(stream)]
    return frames, rate


def thumbnail(frames: Sequence[Image.Image]) -> Image.Image:
    """The clip's middle frame: more telling than the first, which an image-to-video run was given."""
    return frames[len(frames) // 2]


def spritesheet(frames: Sequence[Image.Image], columns: int = 8) -> Image.Image:
    """Up to ``columns`` frames spread over the clip, side by side (a scrubbing preview)."""
    count = min(columns, len(frames))
    picked = [frames[round(i * (len(frames) - 1) / max(1, count - 1))] for i in range(count)]
    width, height = picked[0].size
    sheet = Image.new("RGB", (width * count, height))
    for index, frame in enumerate(picked):
        sheet.paste(frame, (index * width, 0))
    return sheet


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
