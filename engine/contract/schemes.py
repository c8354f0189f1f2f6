"""The weight schemes, one row each: the one home of what a scheme is.

Every other list of schemes derives from :data:`SCHEMES`: the request
choices (``--quant``, ``--text-encoder-quant``, ``--base-precision``), the
sizes the planner uses, the schemes the runtime quantises on the host, the
ones torchao builds, the capability each needs and what a trainer holds its
base in. A new scheme is a row here plus its build in the runtime. Torch-free
(the contract layer): the policy layer, the request table and the family
tables all read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

Backend = Literal["dense", "torchao", "bitsandbytes", "sdnq", "nunchaku"]


@dataclass(frozen=True)
class Scheme:
    name: str
    #: Steady size of the transformer as a fraction of its bf16 bytes (norms, embeddings
    #: and modulation stay bf16 and scales are stored, so above the bit ratio).
    steady: float
    #: Peak while building it, as a fraction of the bf16 bytes (dense weights load first).
    transient: float
    backend: Backend
    #: Quantised on the host block by block and moved already quantised (device peak = steady).
    host_quantised: bool
    #: The :class:`~engine.hardware.profile.HardwareProfile` flag it needs (``fp8``,
    #: ``mxfp8``), beyond what its backend needs; None: none.
    needs: str | None
    #: What that flag means, for a refusal ("an NVIDIA GPU of capability 8.9+").
    needs_text: str
    #: Whether a LoRA trainer may hold its frozen base in it (``base_precision``).
    trainable: bool
    #: Whether text encoders may be held in it (see :data:`ENCODER_SCHEME_ROWS`, the
    #: encoders' own table, which adds ``fp8_dynamic``).
    encoder: bool
    #: The scheme whose family factors it takes where a family declares none of its own (it
    #: stores the same layers alike).
    sized_as: str | None = None
    #: Whether ``--quant`` may ask for it; False: only read where a checkpoint is stored in it
    #: by another library (its folder's ``quantization_config`` names it).
    requestable: bool = True


SCHEMES: Mapping[str, Scheme] = MappingProxyType({s.name: s for s in (
    Scheme("bf16", 1.00, 1.00, "dense", False, None, "", trainable=True, encoder=False),
    Scheme("int8", 0.55, 1.00, "torchao", True, None, "", trainable=True, encoder=True),
    # int8 with ConvRot's block-Hadamard rotation of each Linear's inputs (weights stored rotated).
    Scheme("int8_convrot", 0.55, 1.00, "torchao", True, None, "", trainable=False, encoder=False, sized_as="int8"),
    Scheme("fp8", 0.55, 1.00, "torchao", True, "fp8", "an NVIDIA GPU of capability 8.9+ (Ada, Hopper, Blackwell)",
           trainable=True, encoder=True),
    Scheme("mxfp8", 0.58, 1.00, "torchao", True, "mxfp8", "a Blackwell GPU (sm100+)", trainable=True,
           encoder=False),
    Scheme("nvfp4", 0.33, 1.00, "torchao", True, "mxfp8", "a Blackwell GPU (sm100+)", trainable=False,
           encoder=True),
    Scheme("nf4", 0.30, 1.00, "bitsandbytes", False, None, "", trainable=True, encoder=True),
    # Stored by other libraries (diffusers' sdnq and nunchaku_lite quantizers), read as stored.
    Scheme("sdnq", 0.55, 0.55, "sdnq", False, None, "", trainable=False, encoder=False, requestable=False),
    Scheme("svdquant", 0.30, 0.30, "nunchaku", False, None,
           "Nunchaku's CUDA kernels: an NVIDIA GPU of Turing, Ampere, Ada or Blackwell (not Hopper)",
           trainable=False, encoder=False, requestable=False),
    Scheme("svdquant_nvfp4", 0.30, 0.30, "nunchaku", False, "nvfp4",
           "Nunchaku's nvfp4 kernels: a Blackwell GPU (sm100+)", trainable=False, encoder=False, requestable=False),
)})

#: Schemes ``quantize`` stores a denoiser folder in (torchao's safetensors support covers them).
STORED_SCHEMES: tuple[str, ...] = ("int8", "int8_convrot", "fp8")
#: Transformer weight schemes, dense first.
QUANT_SCHEMES: tuple[str, ...] = tuple(SCHEMES)
#: Schemes torchao builds (nf4 is bitsandbytes).
TORCHAO_SCHEMES: tuple[str, ...] = tuple(n for n, s in SCHEMES.items() if s.backend == "torchao")
#: Schemes quantised on the host and moved to the device already quantised.
HOST_QUANTISED: frozenset[str] = frozenset(n for n, s in SCHEMES.items() if s.host_quantised)
#: What ``--quant`` takes: a scheme, ``none`` (dense) or ``auto``.
QUANT_REQUESTS: tuple[str, ...] = ("auto", "none", *(n for n, s in SCHEMES.items() if n != "bf16" and s.requestable))
#: The ``quant_method`` of a folder's ``quantization_config`` -> the scheme it is stored in.
STORED_BY_LIBRARY: Mapping[str, str] = MappingProxyType({"bitsandbytes": "nf4", "sdnq": "sdnq",
                                                         "nunchaku_lite": "svdquant"})
#: Base precisions a DiT LoRA trainer can hold its frozen base in, ``auto`` last.
TRAINING_PRECISIONS: tuple[str, ...] = ("nf4", *(n for n, s in SCHEMES.items() if s.trainable and n != "nf4"),
                                        "auto")

EncoderBuild = Literal["dense", "layerwise", "torchao", "bitsandbytes"]


@dataclass(frozen=True)
class EncoderScheme:
    """How a text encoder may be held: one row per ``text_encoder_quant`` value.

    ``layerwise``: the Linear weights stored in fp8 (e4m3) and upcast to the
    compute dtype layer by layer at each call; plain tensors, so moving the
    encoder (offload, streaming) works. ``torchao``: a torchao tensor subclass
    (weight-only int8 or nvfp4, dynamic fp8 with the activation floor), which
    rejects ``Module.to``: skipped when the plan moves the encoders.
    ``bitsandbytes``: 4-bit at load time (CUDA only).
    """

    name: str
    #: Steady size as a fraction of the encoders' bf16 bytes.
    steady: float
    build: EncoderBuild
    #: The :class:`~engine.hardware.profile.HardwareProfile` flag it needs beyond a
    #: CUDA GPU with native bf16 (None: nothing more), and what that means.
    needs: str | None = None
    needs_text: str = ""


ENCODER_SCHEME_ROWS: Mapping[str, EncoderScheme] = MappingProxyType({e.name: e for e in (
    EncoderScheme("none", 1.00, "dense"),
    EncoderScheme("fp8", 0.55, "layerwise"),
    EncoderScheme("fp8_dynamic", 0.55, "torchao", "fp8", "an NVIDIA GPU of capability 8.9+ (Ada, Hopper, Blackwell)"),
    EncoderScheme("int8", 0.55, "torchao", "native_bf16", "a GPU of capability 8.0+"),
    EncoderScheme("nvfp4", 0.33, "torchao", "mxfp8", "a Blackwell GPU (sm100+)"),
    EncoderScheme("nf4", 0.30, "bitsandbytes"),
)})
#: Text-encoder schemes; ``none`` keeps the compute dtype.
ENCODER_SCHEMES: tuple[str, ...] = tuple(ENCODER_SCHEME_ROWS)


__all__ = ["ENCODER_SCHEMES", "ENCODER_SCHEME_ROWS", "EncoderScheme", "HOST_QUANTISED", "QUANT_REQUESTS", "QUANT_SCHEMES", "SCHEMES", "Scheme",
           "TORCHAO_SCHEMES", "TRAINING_PRECISIONS"]
