"""LoRA files, checked cheaply before anything is loaded or evicted.

A LoRA argument is ``PATH[:SCALE]``: a ``.safetensors`` file, or a folder
holding ``pytorch_lora_weights.safetensors`` (a training run's folder). Its
safetensors header (no weights, no torch) says which keys it has, its
largest rank and its size, which the planner uses, and which family's key
markers it matches best, which a refusal names. Whether every key lands on a
module of the model is checked against the model's own module tree by
:func:`engine.runtime.lora_check.check_loras` (also before anything is evicted).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine import stored
from engine.errors import EngineError, PreflightError
from engine.contract.plugins import Registry
from engine.requests.inference import LoraModules, LoraPlanInput
from engine.preflight.headers import nonfinite_tensors, read_safetensors_file
# How a request names a LoRA: the request vocabulary's (re-exported for older imports).
from engine.requests.loras import MAX_SCALE, LoraChoice, LoraLike, lora_choices, parse_lora_arg  # noqa: F401
from engine.requests.references import LORA_COMPONENT_KEY, RUN_LORA_FILE, SECOND_EXPERT_FOLDER
from engine.contract.types import FamilySpec

#: Key suffixes of the "down" (A) matrix in the spellings diffusers converts.
_DOWN = (".lora_A.weight", ".lora_down.weight", ".lora.down.weight", "_lora.down.weight")


class LoraNotFound(EngineError, FileNotFoundError):
    """A LoRA path that does not exist, or a folder with no LoRA file in it."""

    code = "lora_not_found"


class LoraMismatch(PreflightError):
    """A LoRA whose keys do not all land on the model: refused, never half-applied."""

    code = "lora_mismatch"


@dataclass(frozen=True)
class LoraFile:
    """A LoRA file read from its header: what the planner and the loader need."""

    path: Path
    scale: float
    keys: tuple[str, ...]
    #: The largest rank among its adapted modules.
    rank: int
    #: Parameters in its LoRA matrices.
    params: int
    #: The pipeline component it adapts where that is not the family's denoiser (a second
    #: expert's LoRA names it in its metadata); None: the denoiser.
    component: str | None = None
    #: (steps, guidance, shift) it says it samples at (``sampling`` in its metadata: a few-step LoRA).
    sampling: tuple[int | None, float | None, float | None] | None = None
    #: ``lora`` (low-rank pairs, DoRA's included), or LyCORIS' ``lokr`` (Kronecker factors) or
    #: ``loha`` (Hadamard products), told from its tensor names.
    adapter_type: str = "lora"
    #: Asked to load partially (``--lora-partial``): the modules that match, the rest skipped.
    partial: bool = False
    #: What the pre-eviction check found: how many of its adapted modules match the model, and
    #: the ones that match nothing (skipped: only a partial LoRA gets this far with any).
    matched: int = field(default=0, compare=False)
    unmatched: tuple[str, ...] = field(default=(), compare=False)

    @property
    def name(self) -> str:
        """Its name for reports: the file's stem, or the run folder's name."""
        return self.path.parent.name if self.path.name == RUN_LORA_FILE else self.path.stem

    def to_dict(self) -> dict[str, object]:
        return {"path": str(self.path), "name": self.name, "scale": self.scale, "rank": self.rank}


def read_lora(choice: LoraChoice) -> LoraFile:
    """The LoRA file ``choice`` names, read from its header; refused if absent or unreadable."""
    path = Path(choice.path).expanduser()
    if path.is_dir():
        inside = path / RUN_LORA_FILE
        if not inside.is_file():
            raise LoraNotFound(
                f"{path} holds no {RUN_LORA_FILE}; give the .safetensors file itself or a "
                "training run's folder"
            )
        path = inside
    elif not path.is_file():
        raise LoraNotFound(f"LoRA {choice.path} does not exist; give a .safetensors file or a run folder")
    if path.suffix != ".safetensors":
        raise PreflightError(
            f"LoRA {path} is not a .safetensors file; convert it (pickled .bin/.pt LoRAs are not loaded)",
            code="invalid_lora",
        )
    shapes, metadata = _header_shapes(path)
    kind = adapter_type(shapes)
    lora_shapes = {k: s for k, s in shapes.items() if "lora" in k.lower() or k.endswith(".alpha") or kind != "lora"}
    ranks = ([s[0] for k, s in shapes.items() if k.endswith(_DOWN) and s] if kind == "lora"
             else [min(s) for k, s in shapes.items() if k.rpartition(".")[2] in _LYCORIS_FACTORS and s])
    if not ranks:
        raise PreflightError(
            f"{path} holds no LoRA matrices (no lora_A / lora_down keys); is it a full checkpoint? "
            "Load full checkpoints as model=PATH",
            code="invalid_lora",
        )
    return LoraFile(
        path=path.resolve(),
        scale=choice.scale,
        keys=tuple(shapes),
        rank=max(ranks),
        params=sum(math.prod(s) for s in lora_shapes.values()),
        component=_component(metadata),
        sampling=_sampling(path, metadata),
        adapter_type=kind,
        partial=choice.partial,
    )


#: The tensor names of LyCORIS' adapters (peft's names too), by type.
LYCORIS_PARAMS: dict[str, tuple[str, ...]] = {
    "lokr": ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"),
    "loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"),
}
#: The low-rank factors whose smaller side is the rank.
_LYCORIS_FACTORS = ("lokr_w1_a", "lokr_w2_a", "hada_w1_a", "hada_w2_a", "lokr_w1", "lokr_w2")


def adapter_type(shapes: Iterable[str]) -> str:
    """``lokr`` or ``loha`` where a tensor has one of their names, else ``lora``."""
    params = {key.rpartition(".")[2] for key in shapes}
    return next((kind for kind, names in LYCORIS_PARAMS.items() if params & set(names)), "lora")


#: A LoRA's own word on how it samples: ``{"steps": 4, "guidance": 1.0}`` in its metadata.
SAMPLING_KEY = "sampling"


def _sampling(path: Path, metadata: dict[str, str]) -> tuple[int | None, float | None, float | None] | None:
    """The (steps, guidance, shift) its metadata says, each checked; refused where malformed."""
    if SAMPLING_KEY not in metadata:
        return None
    try:
        said = stored.parse_json(metadata[SAMPLING_KEY], path)
    except ValueError:  # UnreadableRecord is one
        said = None
    steps, guidance, shift = (said.get("steps"), said.get("guidance"), said.get("shift")) \
        if isinstance(said, dict) else (0, "", None)
    if not ((steps is None or (isinstance(steps, int) and not isinstance(steps, bool) and 1 <= steps <= 1000))
            and _number_in(guidance, 0, 100) and _number_in(shift, 0.01, 100)):
        raise PreflightError(f"{path}: its metadata's {SAMPLING_KEY!r} must be a JSON object of steps (1-1000), "
                             "guidance (0-100) and shift (0.01-100); remove or fix it", code="invalid_lora")
    return steps, float(guidance) if guidance is not None else None, float(shift) if shift is not None else None


def _number_in(value: object, low: float, high: float) -> bool:
    """None, or a number (not a bool) within ``low..high``."""
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high)


def with_family(family: FamilySpec, files: Sequence[LoraFile]) -> tuple[LoraFile, ...]:
    """``files`` with the expert each lands on where its metadata names none and the family's
    few-step table does (the low-noise half of a two-expert pair, published as its own file)."""
    from engine.policy.lora_sampling import table_entry

    placed = []
    for file in files:
        entry = table_entry(family, file.path) if file.component is None else None
        placed.append(dataclasses.replace(file, component=entry.component) if entry and entry.component else file)
    return tuple(placed)


def _component(metadata: dict[str, str]) -> str | None:
    value = metadata.get(LORA_COMPONENT_KEY)
    return value if value is not None and value.isidentifier() else None


def read_loras(choices: Iterable[LoraChoice]) -> tuple[LoraFile, ...]:
    """Every LoRA read; the same file twice is refused (its adapters would collide). A two-expert
    run's folder brings its second expert's LoRA too (``low_noise/``), at the same scale."""
    files = tuple(file for c in choices for file in _with_second_expert(c))
    seen: set[Path] = set()
    for file in files:
        if file.path in seen:
            raise PreflightError(f"LoRA {file.path} is given twice; give it once with one scale", code="invalid_request")
        seen.add(file.path)
    return files


def _with_second_expert(choice: LoraChoice) -> tuple[LoraFile, ...]:
    first = read_lora(choice)
    second = Path(choice.path).expanduser() / SECOND_EXPERT_FOLDER / RUN_LORA_FILE
    if not Path(choice.path).expanduser().is_dir() or not second.is_file():
        return (first,)
    return first, read_lora(LoraChoice(str(second), choice.scale))


def looks_like(registry: Registry, keys: Sequence[str]) -> FamilySpec | None:
    """The family whose LoRA key markers match the most keys (None: no marker matches)."""
    best, best_hits = None, 0
    for family in registry.families.values():
        hits = sum(1 for key in keys if any(marker in key for marker in family.lora.key_markers))
        if hits > best_hits:
            best, best_hits = family, hits
    return best


def mismatch_error(
    registry: Registry, family: FamilySpec, file: LoraFile, unmatched: Sequence[str], total: int
) -> LoraMismatch:
    """The refusal for a LoRA whose keys do not all land on ``family``'s model."""
    guess = looks_like(registry, file.keys)
    if guess is not None and guess.name != family.name:
        kind = f"it looks like a {guess.label} LoRA"
    else:
        kind = f"its keys do not match this {family.label} model's modules or shapes"
    examples = ", ".join(unmatched[:3])
    return LoraMismatch(
        f"LoRA {file.path} does not fit the loaded {family.label} model: {kind}; "
        f"{len(unmatched)} of {total} adapted modules match nothing here (e.g. {examples}). "
        f"Nothing was applied; give a LoRA trained for {family.label}, or ask for the modules that match "
        f"with --lora-partial (\"partial\": true)"
    )


def plan_input(files: Sequence[LoraFile], *, switching: bool = False,
               family: FamilySpec | None = None) -> LoraPlanInput:
    """What the torch-free planner needs to know about ``files`` (``family``: whose few-step
    table names them, for the sampling they set)."""
    from engine.policy.lora_sampling import sampling_of

    return LoraPlanInput(
        count=len(files),
        max_rank=max((f.rank for f in files), default=0),
        params=sum(f.params for f in files),
        switching=switching,
        sampling=sampling_of(family, files) if family is not None else None,
        modules=LoraModules(sum(f.matched for f in files), tuple(m for f in files for m in f.unmatched))
        if files and any(f.matched or f.unmatched for f in files) else None,
    )


def _header_shapes(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Every tensor's shape and the file's metadata, once the file is known complete and every
    value finite.

    The finite check reads the data (a LoRA is megabytes): a NaN or inf weight
    would turn every image black, so it is refused before anything is loaded
    or evicted, naming the tensors."""
    try:
        header, start, metadata = read_safetensors_file(path)
    except ValueError as exc:
        raise PreflightError(
            f"LoRA {path} is not a complete safetensors file ({exc}); re-download or re-export it",
            code="lora_unreadable",
        ) from None
    bad = nonfinite_tensors(path, header, start)
    if bad:
        raise PreflightError(
            f"LoRA {path} holds NaN, infinite or overflowing (2**64 or more) values in {len(bad)} tensor(s) (e.g. {', '.join(bad[:3])}); "
            "it would turn every image black. Use an earlier checkpoint of the run, or retrain with a lower "
            "learning rate",
            code="lora_not_finite",
        )
    return {
        str(name): tuple(int(d) for d in info.get("shape", []))  # type: ignore[union-attr]
        for name, info in header.items() if isinstance(info, dict)
    }, metadata
