"""A clip's sound: the samples of its audio track, their rate and channels (torch-free).

An audio-video family (``VideoSpec.audio``) renders a track beside its frames: its pipeline's
output carries it (diffusers' audio-video pipelines give ``result.audio``, a tensor of
``(batch, channels, samples)`` at the vocoder's rate), the engine's default reader turns it
into a :class:`Sound` per clip, and a plugin whose pipeline gives it otherwise answers
``engine_pipeline_sound``. The clip's MP4 then carries it as AAC beside the H.264 picture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Sound:
    """One clip's audio track: ``samples`` (a float32 array of ``(channels, n)`` in -1..1) at
    ``sample_rate`` samples a second."""

    #: The track: a float32 array of ``(channels, n)``, each sample in -1..1.
    samples: Any
    #: Samples a second (the vocoder's output rate).
    sample_rate: int

    @property
    def channels(self) -> int:
        return int(self.samples.shape[0])

    @property
    def seconds(self) -> float:
        return int(self.samples.shape[1]) / self.sample_rate

    def to_dict(self) -> dict[str, object]:
        """What a record says of it: its rate, channels and length (never the samples)."""
        return {"sample_rate": self.sample_rate, "channels": self.channels, "seconds": round(self.seconds, 3)}


__all__ = ["Sound"]
