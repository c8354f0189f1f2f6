"""Quiet the libraries' import-time chatter in the engine's own processes.

torch, torchao, transformers and diffusers log at import time about optional
kernels and backends this machine does not use (torchao's CUDA extensions on
a CPU build, torchvision-backed image processors), and warn about
deprecations the user cannot act on. The CLI (unless ``-v``) and the trainer
child show their own progress; they call this before the heavy imports. An
app embedding the engine keeps its own logging untouched.
"""

from __future__ import annotations

import logging
import os
import warnings

NOISY_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes", "diffusers", "transformers",
                 "huggingface_hub", "accelerate", "peft")


def quiet_library_logs(*, progress_bars: bool = True, warnings_too: bool = False) -> None:
    """Env vars and logger levels only, unless ``progress_bars=False``, which
    also imports diffusers and transformers to switch their loading bars off
    (for processes that load a model anyway). ``warnings_too`` also hides
    Python warnings (deprecations inside the libraries)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    if warnings_too:
        warnings.filterwarnings("ignore")
    if not progress_bars:
        import diffusers
        import transformers

        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
