"""Write arrays as a GGUF file the way community checkpoints ship (numpy only, no torch).

Q8_0 for 2-D weights whose inner dim is a multiple of 32 (the Q8_0 block), F32
for everything else. Used by :func:`engine.testing.checkpoints.write_gguf` (a tiny
pipeline's denoiser) and by families writing the files stable-diffusion.cpp reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np


def write_gguf_arrays(arrays: Mapping[str, np.ndarray], target: Path, arch: str = "diffusion") -> Path:
    import gguf

    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(target), arch)
    for name, array in arrays.items():
        data = np.ascontiguousarray(array, dtype=np.float32)
        if data.ndim == 2 and data.shape[1] % 32 == 0:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
