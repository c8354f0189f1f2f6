"""Aspect-ratio buckets: train each image at about the training area, in its own shape.

Pure (no torch): the dry run prints the same table the trainer uses.

Each image gets the bucket whose sides are multiples of the family's
``side_multiple`` (VAE stride x patch, from its table), whose area is at
most ``resolution ** 2`` (what the memory estimate sized), and whose aspect
ratio is the nearest such to the image's. It is resized to *cover* the
bucket and centre-cropped: the crop is only the rounding remainder, never a
square cut of a wide image. Images with the same bucket form one group, and
every batch is drawn from one group (tensors in a batch share a shape).

A video family's examples are clips of the run's window and images (one
frame each): a bucket is (frames, width, height), so a clip and an image of
one shape never share a batch.

Aspect ratios past :data:`MAX_ASPECT` are cut to it (a 10:1 strip at 64 px
would leave one latent row), a bucket that changes an image's aspect (a 3:2 clip
trained at 2:1 where the sides' multiple is coarse beside the resolution) is named
with the share it crops, and an image that must be enlarged more than
:data:`UPSCALE_LIMIT` times to cover its bucket is trained anyway, with a
warning naming it: both are in :attr:`BucketPlan.warnings`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

#: The widest (or tallest) aspect ratio a bucket takes; wider images are cropped to it.
MAX_ASPECT = 4.0
#: Enlarging an image more than this to cover its bucket is warned (blurry training data).
UPSCALE_LIMIT = 2.0
#: A bucket that crops more than this share of a side changed the image's aspect: warned.
RESHAPED_CROP = 0.1


@dataclass(frozen=True)
class Fit:
    """How one image becomes its bucket's pixels: resize to ``resized``, then crop ``box``."""

    source: tuple[int, int]
    bucket: tuple[int, int]
    resized: tuple[int, int]
    #: (left, top, right, bottom) in the resized image.
    box: tuple[int, int, int, int]

    @property
    def scale(self) -> float:
        """The resize factor (above 1: the image is enlarged)."""
        return max(self.bucket[0] / self.source[0], self.bucket[1] / self.source[1])

    @property
    def cropped(self) -> tuple[int, int]:
        """Pixels cut (width, height) from the resized image."""
        return self.resized[0] - self.bucket[0], self.resized[1] - self.bucket[1]


@dataclass(frozen=True)
class Bucket:
    width: int
    height: int
    #: Indices of the images (dataset order) trained at this size.
    images: tuple[int, ...]
    #: Frames of each example (a clip's window; 1 for an image).
    frames: int = 1


@dataclass(frozen=True)
class BucketPlan:
    """Every image's bucket and fit, the buckets in size order, and what to warn about."""

    resolution: int
    multiple: int
    buckets: tuple[Bucket, ...]
    fits: tuple[Fit, ...]
    warnings: tuple[str, ...] = ()

    def groups(self) -> list[list[int]]:
        return [list(b.images) for b in self.buckets]

    def to_dict(self) -> dict[str, object]:
        return {
            "resolution": self.resolution,
            "side_multiple": self.multiple,
            "buckets": [{"width": b.width, "height": b.height, "frames": b.frames, "images": len(b.images)}
                        for b in self.buckets],
            "warnings": list(self.warnings),
        }

    def lines(self) -> list[str]:
        """The bucket table as text: one line per bucket, then the warnings."""
        lines = [f"{len(self.buckets)} aspect bucket(s), about {self.resolution}x{self.resolution} pixels each, "
                 f"sides multiples of {self.multiple}:"]
        lines += [f"  {b.width}x{b.height} ({b.width / b.height:.2f}:1)"
                  + (f" x {b.frames} frames  {len(b.images)} clip(s)" if b.frames > 1 else f"  {len(b.images)} image(s)")
                  for b in self.buckets]
        lines += [f"  warning: {w}" for w in self.warnings]
        return lines


def bucket_size(width: int, height: int, resolution: int, multiple: int) -> tuple[int, int]:
    """The bucket (width, height) for an image of ``width`` x ``height``.

    Sides are multiples of ``multiple`` (at least one), the area is at most
    ``resolution ** 2`` where any candidate allows it, and the aspect ratio is
    the nearest to the image's (clamped to :data:`MAX_ASPECT`); ties go to
    the larger area.
    """
    area = resolution * resolution
    aspect = min(max(width / height, 1 / MAX_ASPECT), MAX_ASPECT)
    ideal_w, ideal_h = math.sqrt(area * aspect), math.sqrt(area / aspect)

    def sides(ideal: float) -> set[int]:
        low = max(multiple, math.floor(ideal / multiple) * multiple)
        return {low, max(multiple, math.ceil(ideal / multiple) * multiple)}

    candidates = [(w, h) for w in sides(ideal_w) for h in sides(ideal_h)]
    fitting = [c for c in candidates if c[0] * c[1] <= area] or [min(candidates, key=lambda c: c[0] * c[1])]
    return min(fitting, key=lambda c: (abs(math.log(c[0] / c[1] / aspect)), -c[0] * c[1], c))


def fit(source: tuple[int, int], bucket: tuple[int, int]) -> Fit:
    """Resize ``source`` to cover ``bucket`` (aspect kept), then centre-crop the remainder."""
    width, height = source
    scale = max(bucket[0] / width, bucket[1] / height)
    resized = (max(bucket[0], round(width * scale)), max(bucket[1], round(height * scale)))
    left, top = (resized[0] - bucket[0]) // 2, (resized[1] - bucket[1]) // 2
    return Fit(source, bucket, resized, (left, top, left + bucket[0], top + bucket[1]))


def plan_buckets(
    sizes: Sequence[tuple[int, int]], names: Sequence[str], resolution: int, multiple: int,
    warned: Collection[str] = (), frames: Sequence[int] | None = None,
) -> BucketPlan:
    """Buckets for images of ``sizes`` (upright width, height), named ``names`` in warnings.

    ``warned``: names already reported as too small (the dataset report), not warned twice.
    ``frames``: each example's frames (a video run's clips and images); None: all images.
    """
    fits = [fit(size, bucket_size(*size, resolution, multiple)) for size in sizes]
    counts = list(frames) if frames is not None else [1] * len(fits)
    members: dict[tuple[int, int, int], list[int]] = {}
    for index, item in enumerate(fits):
        members.setdefault((*item.bucket, counts[index]), []).append(index)
    buckets = tuple(Bucket(w, h, tuple(members[(w, h, n)]), n)
                    for w, h, n in sorted(members, key=lambda b: (b[0] / b[1], b)))
    warnings: list[str] = []
    for name, item in zip(names, fits):
        w, h = item.source
        if max(w / h, h / w) > MAX_ASPECT:
            warnings.append(f"{name} ({w}x{h}) is past the {MAX_ASPECT:g}:1 aspect limit and is cropped to "
                            f"{item.bucket[0]}x{item.bucket[1]}")
        elif _reshaped(item):
            cut, side = max((item.cropped[0] / item.resized[0], "width"), (item.cropped[1] / item.resized[1], "height"))
            warnings.append(f"{name} ({w}x{h}, {w / h:.2f}:1) is trained at {item.bucket[0]}x{item.bucket[1]} "
                            f"({item.bucket[0] / item.bucket[1]:.2f}:1), the nearest bucket with sides multiples of "
                            f"{multiple} at this resolution: {cut:.0%} of its {side} is cropped (a higher "
                            "--resolution keeps more of its shape)")
        if item.scale > UPSCALE_LIMIT and name not in warned:
            warnings.append(f"{name} ({w}x{h}) is enlarged {item.scale:.1f}x to {item.bucket[0]}x{item.bucket[1]} "
                            f"(over the {UPSCALE_LIMIT:g}x limit): use a larger image or a lower --resolution")
    return BucketPlan(resolution, multiple, buckets, tuple(fits), tuple(warnings))


def _reshaped(item: Fit) -> bool:
    """Whether the bucket changes the image's shape, not only rounds it: more than
    :data:`RESHAPED_CROP` of a side is cut."""
    return max(item.cropped[0] / item.resized[0], item.cropped[1] / item.resized[1]) > RESHAPED_CROP


def epoch_batches(groups: Sequence[Sequence[int]], batch_size: int, permute: Callable[[int], list[int]]) -> list[list[int]]:
    """One epoch of batches, each from one group: every image once, in a seeded order.

    ``permute(n)`` returns a permutation of ``range(n)`` (the trainer's seeded
    generator, whose state a checkpoint keeps). Each group is shuffled and cut
    into batches (its last may be smaller), then the batches are shuffled
    together, so the buckets interleave.
    """
    batches: list[list[int]] = []
    for group in groups:
        shuffled = [group[i] for i in permute(len(group))]
        batches += [shuffled[i: i + batch_size] for i in range(0, len(shuffled), batch_size)]
    return [batches[i] for i in permute(len(batches))]
