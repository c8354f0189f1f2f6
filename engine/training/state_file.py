"""A checkpoint's training state in files that cannot execute anything.

A pickle runs whatever code its author put in it, so a run folder someone
else could write to (a shared disk, a downloaded run, the server's outputs
root) must never be unpickled. The state is written as two files instead:

- ``state.safetensors``: every tensor (the LoRA's trainable weights, the
  optimizer's moments, the RNG states, the EMA's shadow weights), read by
  safetensors, which parses a JSON header and copies bytes;
- ``state.json``: everything else (steps, the batch order, the scheduler's
  and the optimizer's numbers), as plain JSON in which a tensor is a
  reference ``{"$tensor": "t12"}`` into the safetensors file.

The JSON layer knows three tags besides plain values: ``$tensor``, ``$tuple``
(the optimizer's ``betas``) and ``$items`` (a dict whose keys are not all
strings: the optimizer's per-parameter state is keyed by int). Nothing else
is ever turned into an object, so the decoder is a data reader, not an
interpreter.

:func:`check_state` reads both headers without torch, so a resume's
checkpoint is refused (``checkpoint_unreadable``) before anything is
evicted; :func:`read_state` loads it in the trainer. Checkpoints written
before this format (``state.pt``) are read with ``torch.load(weights_only=True)``:
torch's restricted unpickler, which builds only tensors and plain containers
and refuses every other global.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine import stored
from engine.errors import EngineError
from engine.preflight.headers import read_safetensors_header

TENSORS = "state.safetensors"
STRUCTURE = "state.json"
LEGACY = "state.pt"
#: What a state must hold for the trainer to continue from it.
REQUIRED = ("trainable", "optimizer", "scheduler", "torch_rng", "generator", "order", "step")
#: The most bytes of ``state.json`` read (the batch order of a large dataset is the bulk: 64 MB is millions of images).
MAX_STRUCTURE_BYTES = 64 * 1024 * 1024
FORMAT = 1
#: The deepest nesting a state holds (the optimizer's per-parameter state is 5 deep); deeper is refused.
MAX_DEPTH = 32
#: The largest step a state may claim.
MAX_STEP = 10**9


class CheckpointUnreadable(EngineError):
    """A checkpoint's state is missing, malformed, or in a form the engine will not execute."""

    code = "checkpoint_unreadable"


def has_state(folder: Path) -> bool:
    """Whether ``folder`` holds a complete state (either format)."""
    folder = Path(folder)
    return (folder / STRUCTURE).is_file() and (folder / TENSORS).is_file() or (folder / LEGACY).is_file()


# -- writing ------------------------------------------------------------------------------------


def write_state(folder: Path, state: Mapping[str, Any]) -> None:
    """``state`` as ``state.safetensors`` + ``state.json`` in ``folder`` (both fsynced)."""
    from safetensors.torch import save_file

    tensors: dict[str, Any] = {}
    structure = {"format": FORMAT, "state": _encode(dict(state), tensors)}
    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}, str(folder / TENSORS))
    with open(folder / TENSORS, "rb") as written:
        os.fsync(written.fileno())
    with open(folder / STRUCTURE, "w", encoding="utf-8") as out:
        json.dump(structure, out, allow_nan=True)
        out.flush()
        os.fsync(out.fileno())


def _encode(value: Any, tensors: dict[str, Any]) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value
        return {"$tensor": key}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: _encode(v, tensors) for k, v in value.items()}
        return {"$items": [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    raise TypeError(f"a checkpoint holds tensors, numbers, strings, lists and dicts; not {type(value).__name__}")


# -- checking (torch-free) ----------------------------------------------------------------------


def check_state(folder: Path, rank: int | None = None) -> None:
    """Refuse a checkpoint whose state cannot be read safely and completely; reads headers only.

    Beyond the files' formats, the contents are validated torch-free (so a tampered
    state is refused before anything is evicted, not in the trainer): nesting depth,
    ``step`` an int in range, the batch order of ints, ``$items`` pairs with plain keys,
    every trainable weight a tensor of the recorded LoRA ``rank`` (when given), and the
    optimizer's moments shaped like the trainable weights.

    :raises CheckpointUnreadable: naming the file and what is wrong.
    """
    folder = Path(folder)
    if (folder / STRUCTURE).is_file() or (folder / TENSORS).is_file():
        _checked_state(folder, rank)
        return
    if (folder / LEGACY).is_file():
        _legacy(folder / LEGACY)  # torch's restricted unpickler: it refuses before anything runs
        return
    raise CheckpointUnreadable(
        f"{folder} holds no training state ({STRUCTURE} and {TENSORS}); give a checkpoint folder "
        "checkpoints/step-N of a run (train --resume RUN picks the newest)"
    )


def _structure_and_tensors(folder: Path) -> tuple[dict[str, Any], dict[str, dict[str, object]]]:
    structure_file, tensor_file = folder / STRUCTURE, folder / TENSORS
    for path in (structure_file, tensor_file):
        if not path.is_file():
            raise CheckpointUnreadable(f"{path} is missing; the checkpoint is incomplete: resume from an earlier one")
    try:
        if structure_file.stat().st_size > MAX_STRUCTURE_BYTES:
            raise ValueError(f"it is larger than {MAX_STRUCTURE_BYTES} bytes")
        structure = stored.read_json(structure_file, max_bytes=MAX_STRUCTURE_BYTES)
        if not isinstance(structure, dict) or not isinstance(structure.get("state"), dict):
            raise ValueError("it is not a JSON object with a 'state' object")
        if structure.get("format") != FORMAT:
            raise ValueError(f"its format is {structure.get('format')!r}; this engine reads format {FORMAT}")
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointUnreadable(f"{structure_file} is not a readable checkpoint state ({exc})") from None
    try:
        header, _ = read_safetensors_header(tensor_file)
    except ValueError as exc:
        raise CheckpointUnreadable(f"{tensor_file} is not a complete safetensors file ({exc})") from None
    state = structure["state"]
    missing = [key for key in REQUIRED if key not in state]
    if missing:
        raise CheckpointUnreadable(f"{structure_file} lacks {', '.join(missing)}; it is not a training state")
    dangling = sorted(ref for ref in _references(state) if ref not in header)
    if dangling:
        raise CheckpointUnreadable(
            f"{structure_file} refers to tensors {', '.join(dangling[:3])} that {tensor_file.name} does not hold"
        )
    return state, header


def _checked_state(folder: Path, rank: int | None = None) -> dict[str, Any]:
    """The state's JSON, its files complete and its contents validated (:func:`_validate`)."""
    state, header = _structure_and_tensors(folder)
    try:
        _validate(state, header, rank)
    except ValueError as exc:
        raise CheckpointUnreadable(f"{folder / STRUCTURE} is not a state this engine wrote: {exc}") from None
    return state


def _validate(state: dict[str, Any], header: Mapping[str, Mapping[str, object]], rank: int | None) -> None:
    """Contents a trainer could crash on, checked on the JSON and the tensor header alone."""
    stack: list[tuple[Any, int]] = [(state, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"it nests deeper than {MAX_DEPTH} levels")
        if isinstance(item, dict):
            if "$items" in item:
                pairs = item["$items"]
                if set(item) != {"$items"} or not isinstance(pairs, list) or not all(
                        isinstance(p, list) and len(p) == 2 and isinstance(p[0], (str, int, float, bool)) for p in pairs):
                    raise ValueError("an '$items' entry is not a list of [plain key, value] pairs")
            if "$tuple" in item and (set(item) != {"$tuple"} or not isinstance(item["$tuple"], list)):
                raise ValueError("a '$tuple' entry is not a list")
            if "$tensor" in item and (set(item) != {"$tensor"} or not isinstance(item["$tensor"], str)):
                raise ValueError("a '$tensor' entry is not a tensor name")
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    step = state["step"]
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"its step is {str(step)[:40]!r}, not a whole number from 0 to {MAX_STEP}")
    order = state["order"]
    if not isinstance(order, list) or not all(
            (isinstance(b, int) and not isinstance(b, bool) and b >= 0)
            or (isinstance(b, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in b))
            for b in order):
        raise ValueError("its batch order is not a list of image indices")
    trainable = state["trainable"]
    if not isinstance(trainable, dict) or not trainable:
        raise ValueError("it holds no trainable weights")
    shapes = []
    for name, ref in trainable.items():
        shape = _shape(ref, header)
        if shape is None:
            raise ValueError(f"trainable weight {name[:80]!r} is not a tensor")
        if rank is not None and ("lora_A" in name and shape[0] != rank or "lora_B" in name and shape[-1] != rank):
            raise ValueError(f"trainable weight {name[:80]!r} has shape {shape}, not of the run's LoRA rank {rank}")
        shapes.append(shape)
    moments = state["optimizer"].get("state") if isinstance(state["optimizer"], dict) else None
    entries = moments.get("$items", []) if isinstance(moments, dict) and "$items" in moments else (
        list(moments.items()) if isinstance(moments, dict) else [])
    for _, per_parameter in entries:
        for kind in ("exp_avg", "exp_avg_sq"):
            if isinstance(per_parameter, dict) and kind in per_parameter:
                shape = _shape(per_parameter[kind], header)
                if shape not in shapes:
                    raise ValueError(f"an optimizer {kind} has shape {shape}, which no trainable weight has")


def _shape(ref: Any, header: Mapping[str, Mapping[str, object]]) -> list[int] | None:
    if isinstance(ref, dict) and set(ref) == {"$tensor"} and ref["$tensor"] in header:
        shape = header[ref["$tensor"]].get("shape")
        return list(shape) if isinstance(shape, list) else None
    return None


def _references(value: Any) -> set[str]:
    found: set[str] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if set(item) == {"$tensor"}:
                found.add(str(item["$tensor"]))
            else:
                stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _legacy(path: Path) -> dict[str, Any]:
    import pickle

    import torch

    try:
        with open(path, "rb") as source:
            state = torch.load(source, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, AttributeError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointUnreadable(
            f"{path} was refused: it holds more than tensors and plain values ({first[:200]}); a checkpoint "
            "is never unpickled, as that could run code. Resume from a checkpoint this engine wrote, or start afresh"
        ) from None
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED):
        raise CheckpointUnreadable(f"{path} is not a training state (it lacks {', '.join(REQUIRED)})")
    return state


# -- reading (the trainer) ----------------------------------------------------------------------


def read_state(folder: Path) -> dict[str, Any]:
    """The state :func:`write_state` wrote (or a legacy ``state.pt``, read without unpickling code)."""
    folder = Path(folder)
    if not (folder / STRUCTURE).is_file() and (folder / LEGACY).is_file():
        return _legacy(folder / LEGACY)
    state = _checked_state(folder)
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(folder / TENSORS), device="cpu")
    except (SafetensorError, OSError) as exc:
        raise CheckpointUnreadable(f"{folder / TENSORS} cannot be read ({exc})") from None
    try:
        return _decode(state, tensors)
    except (TypeError, ValueError) as exc:  # an ``$items`` entry that is no pair, a key that cannot be one
        raise CheckpointUnreadable(f"{folder / STRUCTURE} is malformed ({exc})") from None


def _decode(value: Any, tensors: Mapping[str, Any]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if isinstance(value, dict):
        if set(value) == {"$tensor"}:
            return tensors[str(value["$tensor"])]
        if set(value) == {"$tuple"} and isinstance(value["$tuple"], list):
            return tuple(_decode(v, tensors) for v in value["$tuple"])
        if set(value) == {"$items"} and isinstance(value["$items"], list):
            return {_key(_decode(k, tensors)): _decode(v, tensors) for k, v in value["$items"]}
        return {k: _decode(v, tensors) for k, v in value.items()}
    return value


def _key(value: Any) -> Any:
    if isinstance(value, (list, dict)):
        raise TypeError("a dict keyed by a list or dict")
    return value
