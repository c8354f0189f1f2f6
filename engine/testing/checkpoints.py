"""Write a pipeline's denoiser as the files users download: GGUF or one safetensors.

For tests, demos and benchmarks: the tiny pipelines are saved as diffusers
folders; these helpers export their denoiser the way community checkpoints
ship (a ``.gguf`` file, or a lone ``.safetensors`` in a folder), with
diffusers key names, which diffusers' single-file loaders accept.
"""

from __future__ import annotations

from pathlib import Path

import torch


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


def write_gguf(pipeline_dir: Path, denoiser: str, target: Path, arch: str = "diffusion") -> Path:
    """A GGUF of the denoiser: Q8_0 for 2-D weights whose inner dim is a
    multiple of 32 (the Q8_0 block), F32 for everything else."""
    import gguf
    import numpy as np

    target.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(target), arch)
    for name, tensor in denoiser_state_dict(pipeline_dir, denoiser).items():
        data = tensor.detach().to(torch.float32).numpy()
        if data.ndim == 2 and data.shape[1] % 32 == 0:
            quantised = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, quantised, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
