"""The files stable-diffusion.cpp would read for a model, found before anything loads.

sd.cpp reads what its users download: a GGUF or an original-layout
``.safetensors`` of the denoiser with its companions (the autoencoder, the
text encoders) in the same folder, or a whole checkpoint in one file. The
family's table (:class:`~engine.contract.types.SdcppSupport`) says which kinds it reads
and which companions, by file-name pattern; this module looks for them beside
the model file (a directory listing, no weights read) and sizes them from the
disk, which is what sd.cpp holds in RAM (it keeps a GGUF's quantised types).

The library trusts its files: an empty, truncated or foreign companion
aborts or crashes its process mid-load. So each companion's header is read
here first (a complete safetensors file, a GGUF whose header fits in it), and
a companion found through a symlink must lead back to the model's own place
(its folder, or where the model file itself lives: a hub cache's blobs), never
elsewhere on the disk. A companion that fails is a refusal naming the file.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

from engine.places import real, within
from engine.policy.runtime_engine import SdcppFiles
from engine.contract.types import FamilySpec

#: Why a kind of model argument cannot go to sd.cpp, whatever the family.
KIND_REFUSALS = {
    "pipeline": "a diffusers folder is not a file sd.cpp reads (it takes a GGUF or an original-layout "
                ".safetensors)",
    "hub": "a hub repo id is not a local file sd.cpp reads",
}


def sdcpp_files(family: FamilySpec, kind: str, location: str) -> SdcppFiles:
    """What sd.cpp would read for the model at ``location`` of ``kind``, or why it cannot."""
    support = family.sdcpp
    if not support.kinds:
        return SdcppFiles(refusal=f"{family.label} has no stable-diffusion.cpp support in its table")
    if kind not in support.kinds:
        reason = KIND_REFUSALS.get(kind) or f"sd.cpp does not read a {kind.replace('_', ' ')} of {family.label}"
        if support.note:
            reason += f" ({support.note})"
        return SdcppFiles(refusal=reason)
    model = Path(location)
    argument = "model_path" if kind == "single_file_pipeline" else "diffusion_model_path"
    files: list[tuple[str, str]] = [(argument, str(model))]
    degraded: list[str] = []
    names = sorted(p.name for p in model.parent.iterdir() if p.is_file() and p != model)
    for companion in support.companions:
        found = next((n for pattern in companion.patterns for n in names if fnmatch.fnmatch(n.lower(), pattern)),
                     None)
        if found is not None:
            problem = companion_problem(model, model.parent / found)
            if problem:
                return SdcppFiles(refusal=f"{companion.label} {model.parent / found} {problem}")
            files.append((companion.argument, str(model.parent / found)))
        elif companion.required:
            return SdcppFiles(refusal=f"sd.cpp needs {companion.label} beside {model.name} "
                                      f"(a file named like {companion.patterns[0]} in {model.parent})")
        else:
            degraded.append(f"no {companion.label} beside the model: {companion.missing}")
    gb = sum(Path(path).stat().st_size for _, path in files) / 1e9
    return SdcppFiles(files=tuple(files), gb=gb, degraded=tuple(degraded))


def companion_problem(model: Path, companion: Path) -> str:
    """Why sd.cpp must not read ``companion`` beside ``model`` ("" when it may): it leads out of
    the model's place through a symlink, or its header is not that of a complete file."""
    from engine.errors import EngineError
    from engine.preflight.headers import gguf_shapes, read_safetensors_header

    target = real(companion)
    if not any(within(place, target) for place in (model.parent, real(model).parent)):
        return (f"leads to {target}, outside the model's folder; put the file itself beside "
                f"{model.name} (or link the whole folder)")
    try:
        if target.suffix.lower() == ".gguf":
            gguf_shapes(target)
        else:
            read_safetensors_header(target)
    except EngineError as exc:  # the GGUF reader's refusal names the file already
        return f"is not usable: {exc.message}"
    except (OSError, ValueError) as exc:
        return f"is not a complete safetensors file ({exc}); re-download it"
    return ""
