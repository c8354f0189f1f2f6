"""Training clips read as the trainer reads them: real MP4s written with PyAV, probed and windowed.

The probe and the trainer share :mod:`engine.preflight.clips`, so what a
dataset's preflight accepts is exactly what the trainer decodes: the window
sampled at the family's fps by timestamp, the display rotation applied, a
short clip refused or padded, a long one cut, and every broken clip named.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import pytest
from PIL import Image

from engine.preflight.clips import ClipProblem, ClipWindow, probe_clip, read_window
from engine.preflight.dataset import DatasetError, discover_dataset
from engine.testing.datasets import write_clip, write_dataset

BIG = 10**8


def _numbered(path: Path, frames: int, fps: int, size: tuple[int, int] = (64, 32),
              times: list[float] | None = None) -> Path:
    """A clip whose frame ``n`` is a flat grey of level ``20 n`` (readable back after H.264)."""
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        if times is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        for number in range(frames):
            frame = av.VideoFrame.from_image(Image.new("RGB", size, (20 * number,) * 3))
            if times is not None:
                frame.pts, frame.time_base = round(times[number] * 1000), Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def _levels(frames: list[Image.Image]) -> list[int]:
    return [round(frame.convert("L").getpixel((4, 4)) / 20) for frame in frames]


def test_the_window_samples_by_timestamp_at_the_family_fps(tmp_path: Path) -> None:
    clip = _numbered(tmp_path / "thirty.mp4", frames=12, fps=30)
    info = probe_clip(clip, BIG, ClipWindow(5, 16))
    assert info.fps == 30 and info.size == (64, 32) and info.window_frames == 5 and not info.variable_rate
    # At 16 fps the window shows the 30 fps frames on screen at 0, 1/16, 2/16, 3/16, 4/16 s.
    assert _levels(read_window(clip, ClipWindow(5, 16))) == [0, 1, 3, 5, 7]
    # A slower source holds each frame: 8 fps trained at 16 fps repeats every frame twice.
    slow = _numbered(tmp_path / "eight.mp4", frames=4, fps=8)
    assert _levels(read_window(slow, ClipWindow(5, 16))) == [0, 0, 1, 1, 2]


def test_a_variable_frame_rate_clip_is_sampled_by_its_timestamps_and_noted(tmp_path: Path) -> None:
    times = [0.0, 0.05, 0.3, 0.35, 0.4, 0.6]
    clip = _numbered(tmp_path / "vfr.mp4", frames=6, fps=20, times=times)
    assert probe_clip(clip, BIG).variable_rate
    # At 10 fps: 0 s frame 0, 0.1 s still frame 1 (shown from 0.05 until 0.3), 0.3 frame 2, 0.4 frame 4.
    assert _levels(read_window(clip, ClipWindow(5, 10)))[:4] == [0, 1, 1, 2]
    report = discover_dataset(_folder(tmp_path / "data", clip), window=ClipWindow(5, 10))
    assert report.variable_rate == ("vfr.mp4",)
    assert any("variable frame rate" in line for line in report.warnings())


def test_the_display_rotation_is_applied_and_the_size_is_upright(tmp_path: Path) -> None:
    path = tmp_path / "portrait.mp4"
    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(16))
        stream.width, stream.height, stream.pix_fmt = 64, 32, "yuv420p"
        stream.set_display_rotation(-90)  # a phone held upright: turn the stored frame clockwise
        for _ in range(5):
            image = Image.new("RGB", (64, 32), (255, 0, 0))
            image.paste((0, 255, 0), (0, 0, 32, 32))  # the stored frame's left half is green
            for packet in stream.encode(av.VideoFrame.from_image(image)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    assert probe_clip(path, BIG).size == (32, 64)
    first = read_window(path, ClipWindow(5, 16))[0]
    assert first.size == (32, 64)
    top, bottom = first.getpixel((16, 8)), first.getpixel((16, 56))
    assert top[1] > 200 > top[0] and bottom[0] > 200 > bottom[1], (top, bottom)  # left went to the top


def test_a_short_clip_is_refused_or_padded_and_a_long_one_cut(tmp_path: Path) -> None:
    (tmp_path / "short").mkdir()
    short = _numbered(tmp_path / "short" / "short.mp4", frames=3, fps=16)
    with pytest.raises(DatasetError) as refused:
        discover_dataset(tmp_path / "short", window=ClipWindow(5, 16))
    assert refused.value.code == "short_clips" and "short.mp4" in str(refused.value)
    assert "--short-clips pad" in str(refused.value)
    padded = discover_dataset(tmp_path / "short", window=ClipWindow(5, 16, "pad"))
    assert [name for name, _ in padded.padded] == ["short.mp4"]
    assert _levels(read_window(short, ClipWindow(5, 16, "pad"))) == [0, 1, 2, 2, 2]  # the last frame held
    (tmp_path / "long").mkdir()
    _numbered(tmp_path / "long" / "long.mp4", frames=12, fps=16)
    cut = discover_dataset(tmp_path / "long", window=ClipWindow(5, 16))
    assert [name for name, _ in cut.cut] == ["long.mp4"] and cut.items[0].clip is not None
    assert cut.items[0].clip.frames <= 7, "decoded only as far as the window reaches"


def _folder(folder: Path, *clips: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for clip in clips:
        (folder / clip.name).write_bytes(clip.read_bytes())
    return folder


def test_every_broken_clip_is_named_in_one_refusal_beside_the_broken_images(tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "data", count=1)
    write_clip(data / "good.mp4", 9)
    (data / "empty.mp4").write_bytes(b"")
    cut = write_clip(tmp_path / "whole.mp4", 9).read_bytes()
    (data / "truncated.mp4").write_bytes(cut[: len(cut) // 3])
    (data / "noise.webm").write_bytes(b"\x1aE\xdf\xa3 not really a matroska file" * 10)
    with av.open(str(data / "sound.m4v"), mode="w", format="mp4") as container:  # audio only
        audio = container.add_stream("aac", rate=16000)
        frame = av.AudioFrame(format="fltp", layout="mono", samples=1024)
        for plane in frame.planes:
            plane.update(bytes(plane.buffer_size))
        frame.sample_rate = 16000
        for packet in audio.encode(frame):
            container.mux(packet)
        for packet in audio.encode():
            container.mux(packet)
    (data / "broken.png").write_bytes(b"")
    with pytest.raises(DatasetError) as refused:
        discover_dataset(data, window=ClipWindow(5, 16))
    reasons = dict(refused.value.problems)
    assert set(reasons) == {"empty.mp4", "truncated.mp4", "noise.webm", "sound.m4v", "broken.png"}, reasons
    assert "0 bytes" in reasons["empty.mp4"] and "no video stream" in reasons["sound.m4v"]
    assert refused.value.code == "bad_dataset"


def test_an_absurd_header_is_refused_before_a_frame_is_decoded(tmp_path: Path) -> None:
    clip = write_clip(tmp_path / "clip.mp4", 9, (64, 64))
    with pytest.raises(ClipProblem, match="absurd size: 64x64 frames are over the 1,000-pixel limit"):
        probe_clip(clip, max_pixels=1000)
    assert probe_clip(clip, max_pixels=64 * 64).size == (64, 64)  # at the cap: read


def test_an_image_beside_clips_is_a_one_frame_example(tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "data", count=1)
    write_clip(data / "a.mp4", 9)
    report = discover_dataset(data, window=ClipWindow(5, 16))
    kinds = {item.relative: item.is_clip for item in report.items}
    assert kinds == {"a.mp4": True, "image_000.png": False}
    assert report.to_dict()["clips"] == 1 and report.to_dict()["images"] == 1


def test_an_avi_clip_is_read_as_the_earlier_system_read_it(tmp_path: Path) -> None:
    """A camera's ``.avi`` is a clip like an ``.mp4``: found in a dataset folder, probed, windowed."""
    folder = tmp_path / "clips"
    folder.mkdir()
    write_clip(folder / "walk.avi", frames=17, fps=16)
    (folder / "walk.txt").write_text("a walk")
    info = probe_clip(folder / "walk.avi", BIG, ClipWindow(9, 16))
    assert info.size == (64, 64) and info.window_frames == 9
    assert len(read_window(folder / "walk.avi", ClipWindow(9, 16))) == 9
    found = discover_dataset(folder)
    assert [(item.relative, item.caption, item.clip is not None) for item in found.items] == [("walk.avi", "a walk", True)]
    assert not found.skipped


def test_the_windows_sound_is_resampled_to_the_familys_rate_and_cut_or_padded_to_the_window(tmp_path: Path) -> None:
    """A camera's 44.1 kHz track read at 32 kHz stereo for the window's length: a longer track
    cut, a shorter one padded with silence (a padded picture's window), a silent clip None."""
    import numpy as np

    from engine.preflight.clips import read_window_sound
    from engine.testing.datasets import CLIP_SOUND_RATE

    toned = write_clip(tmp_path / "tone.mp4", frames=48, fps=24, tone_hz=440.0)
    silent = write_clip(tmp_path / "quiet.mp4", frames=48, fps=24)
    short = ClipWindow(frames=24, fps=24.0, sound_rate=32000)
    track = read_window_sound(toned, short)
    assert track is not None and track.shape == (2, 32000) and track.dtype == np.float32
    assert 0.1 < float(np.abs(track).max()) <= 1.0
    heard = np.abs(np.fft.rfft(track[0]))
    assert abs(int(heard.argmax()) - 440) <= 2  # the tone's pitch survives the resampling (1 Hz bins: 1 s)
    long = ClipWindow(frames=72, fps=24.0, short="pad", sound_rate=32000)
    padded = read_window_sound(toned, long)
    assert padded is not None and padded.shape == (2, 96000)
    assert float(np.abs(padded[:, 66000:]).max()) == 0.0 and float(np.abs(padded[:, :60000]).max()) > 0.1
    assert read_window_sound(silent, short) is None
    assert read_window_sound(toned, ClipWindow(frames=24, fps=24.0)) is None  # the run trains no sound
    assert probe_clip(toned, BIG, short).sound and not probe_clip(silent, BIG, short).sound
    assert CLIP_SOUND_RATE == 44100


def test_a_clip_whose_sound_cannot_be_decoded_is_named_before_the_run(tmp_path: Path) -> None:
    """Where the run trains sound, the probe reads the window's track too: a broken one is refused by name."""
    data = tmp_path / "data"
    data.mkdir()
    clip = write_clip(data / "tone.mp4", frames=48, fps=24, tone_hz=440.0)
    raw = bytearray(clip.read_bytes())
    at = raw.find(bytes([0x05, 0x80, 0x80, 0x80]), raw.find(b"esds")) + 5  # the AAC decoder's own config
    assert at > 5
    raw[at:at + 2] = b"\xff\xff"  # an audio object type no decoder knows
    clip.write_bytes(bytes(raw))
    window = ClipWindow(frames=24, fps=24.0, sound_rate=32000)
    with pytest.raises(DatasetError) as refused:
        discover_dataset(data, window=window)
    assert "tone.mp4: its sound cannot be decoded" in refused.value.message
    assert discover_dataset(data, window=ClipWindow(frames=24, fps=24.0)).items  # a run that trains no sound reads it
