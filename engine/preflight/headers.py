"""Sizes and completeness of checkpoint files, read from their headers alone.

A safetensors header is a few KB: it names every tensor with its dtype, shape
and byte range, so the denoiser's size under every scheme, each pipeline
part's bf16 GB and whether the file is complete (its data offsets cover the
file exactly, so a truncated download fails here and not in the loader) are
all known without reading a weight or importing torch. GGUF files give their
tensor names the same way (through the ``gguf`` reader, numpy only).
"""

from __future__ import annotations

import collections
import math
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from engine import stored
from engine.errors import PreflightError
from engine.policy.quant_filter import LAYOUTS, dense_gb, quantised_gb
from engine.preflight.model_errors import NotAPipeline
from engine.contract.types import ComponentSizes, FamilySpec

#: (name, shape) of tensors, as read from a header.
Shapes = list[tuple[str, tuple[int, ...]]]
#: Bytes per element of safetensors dtypes, to count parameters.
_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
    "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}


def measured_sizes(
    folder: Path, spec: FamilySpec, components: dict[str, list[str]]
) -> tuple[ComponentSizes | None, dict[str, Shapes]]:
    """bf16 GB per part from the safetensors headers (None if a part has none), the denoiser's
    counting every expert beside it (a two-expert model's pair, a conditional and an
    unconditional transformer), and each denoiser's tensor shapes, so its headers are read once."""
    totals = {"denoiser": 0.0, "text": 0.0, "vae": 0.0}
    denoisers: dict[str, Shapes] = {}
    complete = True
    for name in components:
        files = sorted((folder / name).glob("*.safetensors"))
        shapes = tensor_shapes(files)  # every component: a truncated file fails here
        if not (name in spec.denoisers or decodes(name) or name.startswith("text_encoder")):
            continue
        if not files:
            complete = False
            continue
        if name in spec.denoisers:
            denoisers[name] = shapes
        part = "denoiser" if name in spec.denoisers else "vae" if decodes(name) else "text"
        totals[part] += dense_gb(shapes)
    sizes = ComponentSizes(totals["denoiser"], totals["text"], totals["vae"]) if complete else None
    return sizes, denoisers


def decodes(component: str) -> bool:
    """Whether a pipeline component is counted with the VAE: the VAE, an audio VAE beside it
    (``audio_vae``) and a vocoder all decode what the denoiser made."""
    return component in ("vae", "vocoder") or component.endswith("_vae")


def sizes_by_scheme(shapes: Shapes, dense_modules: Sequence[str] = ()) -> dict[str, float]:
    """A denoiser's GB under each scheme, from tensor names and shapes alone, as the inference
    build holds it (``dense_modules``: the family's ``int8_dense_modules``, which it keeps bf16)."""
    return {scheme: quantised_gb(shapes, scheme, tuple(dense_modules)) for scheme in LAYOUTS}


def tensor_shapes(files: list[Path]) -> Shapes:
    """(name, shape) of every tensor in ``files``, from their headers (no weights read)."""
    return [(name, shape) for file in files for name, _, shape in tensor_layout(file)]


def tensor_storage(files: list[Path]) -> list[tuple[str, str, int, int]]:
    """(name, safetensors dtype, element count, stored bytes) of every tensor
    in ``files``, from their headers: how a checkpoint is stored (a pre-cast
    fp8 text encoder, for one) without reading a weight."""
    found = []
    for file in files:
        for name, info in _safetensors_header(file).items():  # checked: int shapes, two int offsets
            begin, stop = cast("list[int]", info["data_offsets"])
            found.append((name, str(info.get("dtype")), math.prod(cast("list[int]", info["shape"])), stop - begin))
    return found


def tensor_layout(file: Path) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every tensor in ``file``, from its header."""
    return [(name, str(info.get("dtype")), tuple(cast("list[int]", info["shape"])))  # checked: a list of ints
            for name, info in _safetensors_header(file).items()]


def read_safetensors_header(file: Path) -> tuple[dict[str, dict[str, object]], int]:
    """The tensor entries of a complete safetensors file and where its data starts
    (:func:`read_safetensors_file` gives its ``__metadata__`` too)."""
    header, start, _ = read_safetensors_file(file)
    return header, start


def read_safetensors_file(file: Path) -> tuple[dict[str, dict[str, object]], int, dict[str, str]]:
    """The tensor entries of a complete safetensors file, where its data starts, and its
    ``__metadata__`` strings ({} where it has none).

    Complete means what a loader needs: a bounded JSON header, every entry
    with a dtype, a shape and a byte range its shape fills, and tensor data
    that fills the rest of the file exactly (a truncated or padded file is
    refused here, never half-read later). Reads the header only.

    :raises ValueError: naming what is wrong (an ``OSError`` reading it included).
    """
    try:
        size = file.stat().st_size
        with file.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > 100_000_000:
                raise ValueError("header too large")
            if 8 + length > size:
                raise ValueError(f"its {length}-byte header runs past the end of the {size}-byte file")
            header = stored.parse_json(handle.read(length), file)
    except (OSError, struct.error) as exc:
        raise ValueError(getattr(exc, "strerror", None) or str(exc) or type(exc).__name__) from None
    except stored.UnreadableRecord as exc:  # not UTF-8 JSON, or nested past the parser's bound
        raise ValueError(f"its header: {exc.problem}") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    metadata = {str(k): v for k, v in metadata.items() if isinstance(v, str)} if isinstance(metadata, dict) else {}
    end, data = _data_end(header), size - 8 - length
    if end != data:
        raise ValueError(
            f"truncated or padded: its header describes {end:,} bytes of tensor data, "
            f"the file holds {data:,}"
        )
    return header, 8 + length, metadata


def _safetensors_header(file: Path) -> dict[str, dict[str, object]]:
    """The header of a complete safetensors file (its tensor data fills the file exactly)."""
    return complete_safetensors_file(file)[0]


def complete_safetensors_file(file: Path) -> tuple[dict[str, dict[str, object]], int, dict[str, str]]:
    """:func:`read_safetensors_file` of a file the user gave as a checkpoint: one that is not a
    complete safetensors file is refused (``corrupt_checkpoint``), saying what is wrong."""
    try:
        return read_safetensors_file(file)
    except ValueError as exc:
        raise NotAPipeline(
            f"{file} is not a complete safetensors file ({exc}); re-download or re-export it",
            code="corrupt_checkpoint",
        ) from None


#: How each float dtype marks NaN and infinity: (unsigned view, exponent mask); a value whose
#: exponent bits are all set is not finite. (E4M3 has no infinity: its NaN is 0x7f / 0xff.)
_NONFINITE = {"F64": ("<u8", 0x7FF0000000000000), "F32": ("<u4", 0x7F800000), "F16": ("<u2", 0x7C00),
              "BF16": ("<u2", 0x7F80), "F8_E5M2": ("u1", 0x7C), "F8_E4M3": ("u1", 0x7F)}

#: ``(shift, exponent mask, exponent)`` of a value of magnitude 2**64 or more, per float type that can hold
#: one: the product of two such weights (B @ A) overflows every float type a pipeline runs in.
_HUGE = {"F64": (52, 0x7FF, 1023 + 64), "F32": (23, 0xFF, 127 + 64), "BF16": (7, 0xFF, 127 + 64)}


def nonfinite_tensors(file: Path, header: dict[str, dict[str, object]], data_start: int) -> list[str]:
    """The names of the float tensors in ``file`` holding NaN or infinity, or values of
    magnitude 2**64 or more (applied, B @ A overflows to infinity: a black image, as NaN).

    Reads the data through a memory map with numpy, by bit pattern (numpy
    has no bfloat16 or fp8), so it needs neither torch nor a copy of the file.
    """
    import numpy as np

    floats = [(name, _NONFINITE[str(info.get("dtype"))], info["data_offsets"])
              for name, info in header.items() if str(info.get("dtype")) in _NONFINITE]
    if not floats:
        return []
    data = np.memmap(file, dtype=np.uint8, mode="r")
    bad = []
    for name, (view, mask), (begin, end) in floats:  # type: ignore[misc]
        bits = data[data_start + int(begin):data_start + int(end)].view(view)
        huge = _HUGE.get(str(header[name].get("dtype")))
        if np.any((bits & mask) == mask) or huge is not None and np.any(((bits >> huge[0]) & huge[1]) >= huge[2]):
            bad.append(str(name))
    return bad


def _data_end(header: dict[str, object]) -> int:
    """Where the last tensor's bytes end; ValueError for an entry that cannot be read.

    Checked with ``type(...) is`` (JSON makes exact ints and lists; a ``true`` is no
    dimension) in one plain loop per entry: a real header has thousands of them, read
    at every load and training start."""
    end = 0
    for name, info in header.items():
        if type(info) is not dict:
            raise _unreadable(name)
        offsets, shape = info.get("data_offsets"), info.get("shape")
        if type(offsets) is not list or len(offsets) != 2 or type(shape) is not list:
            raise _unreadable(name)
        begin, stop = offsets
        if type(begin) is not int or type(stop) is not int or not 0 <= begin <= stop:
            raise _unreadable(name)
        count = 1
        for dim in shape:
            if type(dim) is not int or dim < 0:
                raise _unreadable(name)
            count *= dim
        width = _DTYPE_BYTES.get(str(info.get("dtype")))
        if width is not None and count * width != stop - begin:
            raise ValueError(f"tensor {name!r} ({shape}) does not fill its {stop - begin} bytes")
        if stop > end:
            end = stop
    return end


def _unreadable(name: str) -> ValueError:
    return ValueError(f"tensor {name!r} has no valid shape and data_offsets")


#: The most tensors and metadata entries a GGUF header may claim (a real 12B denoiser has about 800).
MAX_GGUF_ENTRIES = 1_000_000


def check_gguf_counts(file: Path) -> None:
    """Refuse a GGUF whose fixed header claims more tensors or entries than could fit in it
    (a header bomb: ``2**62`` tensors), before any reader allocates for them."""
    with open(file, "rb") as source:
        head = source.read(24)
        size = os.fstat(source.fileno()).st_size
    if len(head) < 24 or head[:4] != b"GGUF":
        raise ValueError("it does not start with a GGUF header")
    _version, tensors, entries = struct.unpack("<IQQ", head[4:24])
    # Each tensor's record takes at least 24 bytes and each entry at least 12: a claim the file cannot hold is false.
    if tensors > MAX_GGUF_ENTRIES or entries > MAX_GGUF_ENTRIES or tensors * 24 + entries * 12 > size:
        raise ValueError(f"its header claims {tensors:,} tensors and {entries:,} entries in {size:,} bytes")


def gguf_shapes(file: Path) -> Shapes:
    """(name, shape) of every tensor of a complete GGUF file (each tensor's bytes inside the
    file; names tell its family), through the ``gguf`` reader (numpy, a memory map: no weights read)."""
    from gguf import GGUFReader  # numpy only; no torch

    try:
        check_gguf_counts(file)
        size = file.stat().st_size
        shapes: Shapes = []
        for tensor in GGUFReader(str(file)).tensors:
            if int(tensor.data_offset) + int(tensor.n_bytes) > size:
                raise ValueError(f"tensor {tensor.name!r} runs past the end of the {size:,}-byte file")
            shapes.append((tensor.name, tuple(int(d) for d in reversed(tensor.shape))))
        return shapes
    except (OSError, ValueError, OverflowError, MemoryError, IndexError, KeyError, TypeError) as exc:
        raise NotAPipeline(f"{file} is not a readable GGUF file ({exc})", code="corrupt_checkpoint") from None


def main_width(shapes: Shapes) -> int | None:
    """The width that most of a denoiser's tensors share (its hidden size), whatever the
    layout names them: the same weights in diffusers' or the original layout, or a GGUF's."""
    counts = collections.Counter(d for _, shape in shapes for d in shape if d > 1)
    return counts.most_common(1)[0][0] if counts else None


def check_same_model(file: Path, shapes: Shapes, base: str, base_shapes: Shapes) -> None:
    """Refuse a denoiser file whose main width is not its base denoiser's: another model's
    base, which would fail mid-load, after the eviction. (A layout fuses or splits some
    projections, which moves counts, never which width most tensors share.)"""
    mine, theirs = main_width(shapes), main_width(base_shapes)
    if mine is not None and theirs is not None and mine != theirs:
        raise PreflightError(
            f"{file} is a denoiser {mine} wide but the denoiser of base {base} is {theirs} wide: they are "
            "different models; give the base pipeline this file was made from",
            code="base_mismatch",
        )


def whole_pipeline_sizes(spec: FamilySpec, shapes: Shapes) -> ComponentSizes | None:
    """bf16 GB per part of a file holding the family's whole pipeline, or None
    when the family's files are denoiser-only or this one lacks a part."""
    if not spec.single_file.whole_pipeline or not spec.single_file.parts:
        return None
    groups: dict[str, Shapes] = {"denoiser": [], "text_encoders": [], "vae": []}
    for name, shape in shapes:
        part = next((p for prefix, p in spec.single_file.parts if name.startswith(prefix)), None)
        if part is not None:
            groups[part].append((name, shape))
    if not all(groups.values()):
        return None
    return ComponentSizes(dense_gb(groups["denoiser"]), dense_gb(groups["text_encoders"]), dense_gb(groups["vae"]))
