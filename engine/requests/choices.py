"""What each control of a request may be set to: the choice tuples, defined once.

The request models, the CLI's ``choices=``, the docs' tables and the policy that
decides each control all read these. They are the vocabulary, not a decision:
``auto`` leaves a control to the policy (:mod:`engine.policy`), which imports
them from here. The quantisation schemes themselves are the plugin contract's
(:mod:`engine.contract.schemes`), since a family's deny lists name them.
"""

from __future__ import annotations

from engine.contract.schemes import ENCODER_SCHEMES, QUANT_REQUESTS, STORED_SCHEMES, TRAINING_PRECISIONS
from engine.contract.types import ATTENTION_KERNELS

#: The runtime that runs a load: diffusers (torch), stable-diffusion.cpp (the CPU engine), or decided.
ENGINES: tuple[str, ...] = ("auto", "diffusers", "sdcpp")
DTYPES: tuple[str, ...] = ("auto", "bf16", "fp16", "fp32")
#: How the denoiser is kept in memory (``auto`` is decided from the card and the sizes).
MEMORY_MODES: tuple[str, ...] = ("resident", "model_offload", "group_offload", "sequential_offload")
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "native", *ATTENTION_KERNELS)
SPEED_TIERS: tuple[str, ...] = ("off", "eager", "default", "max")
#: What ``speed`` takes: a tier, or ``auto`` (off for a dense transformer, default for a quantised one).
SPEED_REQUESTS: tuple[str, ...] = ("auto", *SPEED_TIERS)
STEP_CACHES: tuple[str, ...] = ("auto", "off", "fbcache", "taylorseer", "magcache", "seacache")
#: How one request splits across GPUs (``--parallel``): ``ulysses`` and ``ring`` split the
#: sequence (diffusers' context parallel), ``cfg`` runs condition and uncondition on their own GPUs.
PARALLEL_REQUESTS: tuple[str, ...] = ("auto", "ulysses", "ring", "cfg")
COMPILE_REQUESTS: tuple[str, ...] = ("auto", "on", "off")
TEXT_ENCODER_QUANT_REQUESTS: tuple[str, ...] = ("auto", *ENCODER_SCHEMES)
TEXT_ENCODER_MEMORY_REQUESTS: tuple[str, ...] = ("auto", "resident", "streamed", "host")
VAE_TILING_REQUESTS: tuple[str, ...] = ("auto", "on", "off")
#: Where a training run computes.
DEVICES: tuple[str, ...] = ("auto", "cuda", "cpu")

#: A tiny random-weight pipeline's own size and steps: small and quick for every family
#: (written beside it, so a request that names no size stays tiny; ``--tiny`` fills them too).
TINY_DEFAULTS: dict[str, int] = {"width": 64, "height": 64, "steps": 4}

#: The longest keep-alive, in seconds (a week): ``serve --keep-alive`` and a request's ``keep_alive``.
MAX_KEEP_ALIVE_S = 7 * 24 * 3600


__all__ = [
    "MAX_KEEP_ALIVE_S",
    "TINY_DEFAULTS",
    "ATTENTION_BACKENDS", "COMPILE_REQUESTS", "DEVICES", "DTYPES", "ENGINES", "MEMORY_MODES", "QUANT_REQUESTS",
    "PARALLEL_REQUESTS", "SPEED_REQUESTS", "SPEED_TIERS", "STORED_SCHEMES", "STEP_CACHES", "TEXT_ENCODER_MEMORY_REQUESTS", "TEXT_ENCODER_QUANT_REQUESTS",
    "TRAINING_PRECISIONS", "VAE_TILING_REQUESTS",
]
