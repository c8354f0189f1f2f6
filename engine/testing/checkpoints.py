"""Write a pipeline's denoiser as the files users download: GGUF or one safetensors.

For tests, demos and benchmarks: the tiny pipelines are saved as diffusers
folders; these helpers export their denoiser the way community checkpoints
ship (a ``.gguf`` file, or a lone ``.safetensors`` in a folder), with
diffusers key names, which diffusers' single-file loaders accept.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from engine.contract.types import FamilySpec


def denoiser_state_dict(pipeline_dir: Path, denoiser: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted((Path(pipeline_dir) / denoiser).glob("*.safetensors")):
        state.update(load_file(file))
    return state


def write_single_file(pipeline_dir: Path, denoiser: str, target: Path) -> Path:
    """``target`` (a ``.safetensors`` path) holding the denoiser's weights."""
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    save_file(denoiser_state_dict(pipeline_dir, denoiser), str(target))
    return target


def fp8_rounded(weight: torch.Tensor, *, per_row: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` as float8_e4m3fn codes, their fp32 scale (its absolute maximum over 448, for the
    tensor or per row) and the values they hold in ``weight``'s dtype (the dense twin)."""
    peak = weight.abs().amax(dim=1) if per_row else weight.abs().amax()
    scale = peak.clamp(min=1e-12).float() / torch.finfo(torch.float8_e4m3fn).max
    codes = (weight.float() / (scale[:, None] if per_row else scale)).to(torch.float8_e4m3fn)
    return codes, scale, (codes.float() * (scale[:, None] if per_row else scale)).to(weight.dtype)


def write_fp8_scaled(pipeline_dir: Path, denoiser: str, target: Path, dense: Path | None = None) -> Path:
    """``target``: the denoiser as ComfyUI's ``fp8_scaled`` files lay it out: every 2-D weight of
    its blocks in float8_e4m3fn with a scalar ``scale_weight`` (its absolute maximum over 448) and
    the empty ``scaled_fp8`` marker; the rest as stored. ``dense``: the same model as a dense file
    (each of those weights rounded through its scale), so the two hold one model."""
    from safetensors.torch import save_file

    state = denoiser_state_dict(pipeline_dir, denoiser)
    stored: dict[str, torch.Tensor] = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    held: dict[str, torch.Tensor] = {}
    for name, weight in state.items():
        if not (name.endswith(".weight") and weight.ndim == 2 and "blocks" in name):
            stored[name] = held[name] = weight
            continue
        codes, scale, held[name] = fp8_rounded(weight, per_row=False)
        stored[name], stored[name.removesuffix(".weight") + ".scale_weight"] = codes, scale
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file(stored, str(target))
    if dense is not None:
        dense.parent.mkdir(parents=True, exist_ok=True)
        save_file(held, str(dense))
    return target


def write_gguf(pipeline_dir: Path, denoiser: str, target: Path, arch: str = "diffusion") -> Path:
    """A GGUF of the denoiser (see :func:`engine.testing.gguf_files.write_gguf_arrays`)."""
    from engine.testing.gguf_files import write_gguf_arrays

    arrays = {name: tensor.detach().to(torch.float32).numpy()
              for name, tensor in denoiser_state_dict(pipeline_dir, denoiser).items()}
    return write_gguf_arrays(arrays, target, arch)


def write_sized_pipeline(tiny_dir: Path, spec: FamilySpec, target: Path) -> Path:
    """A pipeline folder that *is* the family's full size, without its weights.

    The configs, tokenizers and ``model_index.json`` come from the tiny
    pipeline at ``tiny_dir``; each weights file is a safetensors header
    declaring the full-size model (the table's LoRA target Linears at their
    real shapes, the rest as one filler matrix, to the table's GB) over a
    sparse file of the declared length. The engine's preflight reads only
    headers and file sizes, so this sizes, plans and refuses like the real
    download, while using no disk and no time; loading it would fail.
    """
    import json
    import shutil

    shutil.copytree(tiny_dir, target, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    figures = spec.training.memory
    targets = figures.lora_targets if figures else ()
    width = max((t.in_features for t in targets), default=4096)
    denoiser: list[tuple[str, tuple[int, ...]]] = [
        (f"blocks.{i}.{t.target}.weight", (t.out_features, t.in_features))
        for t in targets for i in range(t.count)
    ]
    parts = {spec.pipeline.denoiser: (spec.training.dense_gb, denoiser), "vae": (spec.sizes.vae_gb, [])}
    encoders = sorted(p.name for p in target.iterdir() if p.name.startswith("text_encoder"))
    for name in encoders:
        parts[name] = (spec.sizes.text_encoders_gb / len(encoders), [])
    for name, (gb, shapes) in parts.items():
        folder = target / name
        if not folder.is_dir():
            continue
        declared = sum(2 * a * b for _, (a, b) in shapes)
        rows = max(1, int((gb * 1e9 - declared) / (2 * width)))
        _write_sparse_safetensors(folder / "model.safetensors", [*shapes, ("filler.weight", (rows, width))])
    (target / "SIZED_WITHOUT_WEIGHTS").write_text(json.dumps({"family": spec.name}), encoding="utf-8")
    return target


def _write_sparse_safetensors(file: Path, shapes: list[tuple[str, tuple[int, ...]]]) -> None:
    import json
    import struct

    header: dict[str, object] = {}
    offset = 0
    for name, shape in shapes:
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with file.open("wb") as handle:
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)
        handle.truncate(8 + len(raw) + offset)


def write_sized_controlnet(class_name: str, gb: float, target: Path, width: int = 3072) -> Path:
    """A ControlNet folder of ``class_name`` that *is* ``gb`` (bf16) in size,
    without its weights: a config naming the class and a safetensors header
    over a sparse file, as :func:`write_sized_pipeline` does for pipelines."""
    import json

    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps({"_class_name": class_name}), encoding="utf-8")
    rows = max(1, int(gb * 1e9 / (2 * width)))
    _write_sparse_safetensors(target / "diffusion_pytorch_model.safetensors", [("filler.weight", (rows, width))])
    return target


def refused_beside_resident(registry: object, base: Path, broken: Path) -> object:
    """The error a load of ``broken`` (a single file on ``base``) raises while ``base`` is
    loaded, after checking the resident pipeline stayed: the 0-eviction proof for a file."""
    import pytest

    from engine.errors import EngineError
    from engine.service.facade import Engine

    with Engine(registry=registry) as engine:  # type: ignore[arg-type]
        engine.images.load(str(base))
        resident = engine.images.session
        with pytest.raises(EngineError) as refused:
            engine.images.load(str(broken), base=str(base))
        assert engine.images.session is resident, "the resident pipeline was evicted before the refusal"
    return refused.value
