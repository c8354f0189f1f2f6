"""A pipeline folder whose denoiser another library stored quantised, named from its config.

diffusers saves a quantised model's ``quantization_config`` in its ``config.json`` and reads it
back through the quantizer its ``quant_method`` names: bitsandbytes (nf4), SDNQ (int8, uint4 and
more, through the ``sdnq`` package, torch kernels on any device) and Nunchaku Lite (SVDQuant
W4A4 on Nunchaku's CUDA kernels). This module names the scheme the plan treats the folder as
stored in (:data:`engine.contract.schemes.STORED_BY_LIBRARY`), refuses a method the engine does
not read, and refuses a folder whose library is not installed (``missing_extra``), before
anything is evicted; whether the machine computes the scheme is the policy's question.
Torch-free.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from engine.contract.schemes import STORED_BY_LIBRARY
from engine.errors import PreflightError

#: The package each library's quantizer imports, and how to install it.
_PACKAGES = {"sdnq": ("sdnq", "pip install 'diffusion-engine[sdnq]'"),
             "svdquant": ("kernels", "pip install kernels"), "svdquant_nvfp4": ("kernels", "pip install kernels")}


def library_scheme(config_file: Path, config: dict[str, Any]) -> str | None:
    """The scheme the denoiser whose ``config.json`` (``config_file``) is ``config`` is stored
    in by another library; None where its config names no quantisation."""
    settings = config.get("quantization_config")
    if settings is None:
        return None
    method = settings.get("quant_method") if isinstance(settings, dict) else None
    scheme = STORED_BY_LIBRARY.get(str(method))
    if scheme is None or (method == "bitsandbytes" and settings.get("load_in_8bit")):
        what = "bitsandbytes 8-bit" if method == "bitsandbytes" else repr(method)
        raise PreflightError(
            f"{config_file}: its quantization_config stores the model as {what}, which this engine does not read "
            f"(it reads {', '.join(sorted(STORED_BY_LIBRARY))}); load the dense folder, or quantise it with --quant",
            code="unsupported_format",
        )
    if scheme == "svdquant" and (settings.get("svdq_w4a4") or {}).get("precision") == "nvfp4":
        scheme = "svdquant_nvfp4"
    package, install = _PACKAGES.get(scheme, (None, ""))
    if package is not None and importlib.util.find_spec(package) is None:
        raise PreflightError(
            f"{config_file.parent.parent} stores its denoiser {scheme} ({method}), which loads through the "
            f"{package} package, not installed here: {install}",
            code="missing_extra",
        )
    return scheme
