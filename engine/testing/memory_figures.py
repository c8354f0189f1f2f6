"""Training memory figures for any installed family: derived from a measured LoRA step, and checked.

The supported tool for a family author: ``python -m engine.testing.memory_figures
--derive --families NAME`` prints the ``TrainingMemoryFigures`` literal the
family's table carries (``training=TrainingSpec(memory=...)``), and without
``--derive`` it checks the engine's estimate against what it measures. It
works for every installed family whose table has a ``MemoryProbe``
(``training=TrainingSpec(probe=...)``): the diffusers class, the real
config, two reduced depths and how prompts are fed. A family whose runtime
``predict`` needs more than ``prompt_embeds`` (and ``pooled_prompt_embeds``
when ``pooled_dim`` is set) defines ``probe_conditioning(config,
text_tokens, dtype)`` in its runtime module, and ``probe_pipeline(model)``
where ``predict`` reads helpers from the pipeline.

Each family's denoiser is built with its diffusers class at the real widths
and a reduced depth, and runs one LoRA training step the way
``engine/training/trainer.py`` does it: the frozen base in bf16, a peft LoRA
(rank 16, the family's default targets, fp32 adapter weights, gaussian init),
AdamW on the adapter, the family runtime's own ``predict`` (packing, ids,
timestep conventions), MSE in fp32, backward, gradient clipping, an optimiser
step. The step measured is the *second* one, so AdamW's moments exist, as in
every step of a real run after the first.

How memory is measured. This machine's CPU has no native bf16 matrix unit
(bf16 GEMM runs at well under 1 GFLOP/s here), so a real-width bf16 step
cannot be computed on it. The step therefore runs under torch's
``FakeTensorMode``: every op of the real code runs with its real shapes,
dtypes, autograd graph, SDPA kernel choice, gradient checkpointing and
optimiser, but no data is computed. A ``TorchDispatchMode`` (``LiveBytes``)
counts the bytes of every tensor storage the step creates and frees them
when the storage dies: the live total and its peak, i.e. what a caching
allocator's "allocated" figure reports, less its block rounding. The
``--validate`` pass (also part of the default mode) checks that counter on
real tensors against torch's own CPU allocator accounting (the profiler's
``profile_memory`` "Total Allocated" running figure), at narrow widths in
fp32 where real compute is affordable, and checks that the counter reads the
same under fake tensors as under real ones.

Where the CPU path differs from the GPU trainer, the GPU path is reproduced:
the trainer routes diffusers' ``RMSNorm`` through the fused CUDA
``rms_norm`` (saves its input and an fp32 ``rstd``); torch's CPU ``rms_norm``
is a decomposition that saves fp32 intermediates, so the bench runs a
stand-in with the fused kernel's saved tensors. SDPA without a mask takes
torch's CPU flash kernel, which saves what CUDA flash saves (q, k, v, out
and an fp32 log-sum-exp); the ops taken are printed.

Modes:

``--derive``: solves the per-token figures (``ActivationFigures``) of each
family from the step's activation peak at two resolutions (256, 512 px) and
two prompt lengths, with and without gradient checkpointing. What one block
adds is the difference between two reduced depths (a family whose probe has
no ``deeper`` depth, a UNet that keeps its channel mix at one reduced depth
only: hooks around each block); the rest is "outside", the backward's transient at the peak included.
The full-size LoRA target shapes are read from the full config on the meta
device. Prints the literals the family tables carry.

default: the accuracy check, at a third reduced depth (not one the figures
came from) and at full size, 256/512 px (512/1024 full size), with and
without checkpointing: measured vs
``engine.policy.training_memory.estimate_training_memory`` per component
(the estimate given this model's block count, LoRA shapes and measured
weight bytes), plus one no-grad inference forward (measured only).

    nice -n 10 python -m engine.testing.memory_figures --derive [--families NAME ...]
    nice -n 10 python -m engine.testing.memory_figures [--families NAME ...] [--validate | --skip-validation]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import inspect
import json
import os
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from engine.errors import EngineError
from engine.policy.training_memory import (
    BaseFacts,
    TrainingShape,
    estimate_training_memory,
    lora_target_shapes,
)
from engine.types import ActivationFigures, FamilySpec, LoraTargetShape, MemoryProbe, TrainingMemoryFigures

RANK = 16
#: Whether ActivationFigures carries its own outside figures under checkpointing.
SEPARATE_CHECKPOINTED_OUTSIDE = any(
    f.name == "checkpointed_outside_per_image_token" for f in dataclasses.fields(ActivationFigures)
)
PATCH = 16  # pixels per image token, as in engine.policy.training_memory
GB = 1e9

# ---------------------------------------------------------------------------
# families: the real architecture, and how to feed it (the family's probe)
# ---------------------------------------------------------------------------


class NoProbe(Exception):
    """A family whose table has no ``MemoryProbe``: the tool cannot build its denoiser."""


@dataclass(frozen=True)
class Denoiser:
    """One family's denoiser as the tool builds and feeds it, from its table's probe."""

    spec: FamilySpec
    probe: MemoryProbe

    @classmethod
    def of(cls, spec: FamilySpec) -> Denoiser:
        if spec.training.probe is None:
            raise NoProbe(
                f"{spec.name}: its table has no memory probe; add training=TrainingSpec(probe=MemoryProbe("
                "model_class=..., blocks=..., text_tokens=..., text_dim=..., derive=..., deeper=...)) "
                "(docs/plugins.md, 'Training memory figures')"
            )
        return cls(spec, spec.training.probe)

    @property
    def family(self) -> str:
        return self.spec.name

    @property
    def model_class(self) -> str:
        return self.probe.model_class

    @property
    def full(self) -> dict[str, Any]:
        return dict(self.probe.full)

    @property
    def derive(self) -> dict[str, Any]:
        return dict(self.probe.derive)

    @property
    def deeper(self) -> dict[str, Any] | None:
        return None if self.probe.deeper is None else dict(self.probe.deeper)

    @property
    def check(self) -> dict[str, Any]:
        return dict(self.probe.check)

    @property
    def narrow(self) -> dict[str, Any]:
        return dict(self.probe.narrow)

    @property
    def blocks(self) -> tuple[str, ...]:
        return self.probe.blocks

    @property
    def latent_channels(self) -> int:
        return self.probe.latent_channels

    @property
    def half_blocks(self) -> tuple[str, ...]:
        return self.probe.half_blocks

    @property
    def text_tokens(self) -> int:
        return self.probe.text_tokens

    @property
    def text_dim(self) -> str:
        return self.probe.text_dim

    @property
    def pooled_dim(self) -> int:
        return self.probe.pooled_dim

    @property
    def runtime(self) -> Any:
        from engine.family_runtime import load_runtime

        return load_runtime(self.spec)


def _config(d: Denoiser, overrides: dict[str, Any]) -> dict[str, Any]:
    import diffusers

    signature = inspect.signature(getattr(diffusers, d.model_class).__init__)
    defaults = {k: v.default for k, v in signature.parameters.items()
                if v.default is not inspect.Parameter.empty}
    return {**defaults, **d.full, **overrides}


def _pipe_shim(d: Denoiser, model: torch.nn.Module) -> Any:
    """What the runtime's ``predict`` reads from a pipeline: the family's ``probe_pipeline``
    where it has one, else the denoiser and the VAE scale."""
    own = getattr(d.runtime, "probe_pipeline", None)
    if own is not None:
        return own(model)
    return SimpleNamespace(vae_scale_factor=8, transformer=model, unet=model)


def _conditioning(
    d: Denoiser, config: dict[str, Any], text: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """What the runtime's ``encode_prompts`` returns, for a prompt of ``text`` positions:
    the family's ``probe_conditioning`` where it has one, else ``prompt_embeds`` (and the
    pooled embedding where the probe names its width)."""
    own = getattr(d.runtime, "probe_conditioning", None)
    if own is not None:
        return own(config, text, dtype)  # type: ignore[no-any-return]
    conditioning = {"prompt_embeds": torch.randn(1, text, config[d.text_dim], dtype=dtype)}
    if d.pooled_dim:
        conditioning["pooled_prompt_embeds"] = torch.randn(1, d.pooled_dim, dtype=dtype)
    return conditioning


# ---------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages created while active that are still alive.

    Each output storage of every op is counted once, when first seen, and
    uncounted by a finaliser when it dies: the figure a caching allocator
    reports as "allocated" (without its 512-byte rounding). Storages that
    existed before (the weights) are not counted. Hooks read ``live``;
    ``peak`` is the high-water mark and ``peak_less_grads`` the highest
    ``live`` less the LoRA gradients then alive (``grads``, kept by the
    caller's gradient hooks).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.grads = 0
        self.peak_less_grads = 0
        self.ops: dict[str, int] = {}
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __enter__(self) -> LiveBytes:
        # Storages alive before (weights, moments, inputs, cached tables) are not
        # the step's: an op returning one (a view of a weight, an in-place
        # update) must not count it as new.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # isinstance() on deprecated torch aliases warns
            alive = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
        for obj in alive:
            with contextlib.suppress(RuntimeError, NotImplementedError):
                self._seen[obj.untyped_storage()] = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.__name__
        if "attention" in name or "rms_norm" in name or "layer_norm" in name:
            self.ops[name] = self.ops.get(name, 0) + 1
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._count(value)
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage in self._seen:
            return
        size = storage.nbytes()
        self._seen[storage] = size
        weakref.finalize(storage, self._free, size)
        self.live += size
        self.peak = max(self.peak, self.live)
        self.peak_less_grads = max(self.peak_less_grads, self.live - self.grads)

    def _free(self, size: int) -> None:
        self.live -= size


@contextlib.contextmanager
def gpu_rms_norm() -> Iterator[Any]:
    """diffusers' RMSNorm as the trainer runs it on CUDA: one fused kernel
    (``rms_norm_patch``), which keeps its input and an fp32 ``rstd`` per row.
    torch's CPU ``rms_norm`` decomposes into fp32 ops that keep more, so the
    bench uses this stand-in with the CUDA kernel's saved tensors."""
    from diffusers.models import normalization

    class FusedRMSNorm(torch.autograd.Function):
        calls = 0

        @staticmethod
        def forward(ctx, x, weight, eps):  # type: ignore[no-untyped-def]
            FusedRMSNorm.calls += 1
            rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
            out = (x.float() * rstd).to(x.dtype)
            if weight is not None:
                out = out * weight
            ctx.save_for_backward(x, weight, rstd)
            return out

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            x, weight, rstd = ctx.saved_tensors
            g = (grad * weight if weight is not None else grad).float()
            xf = x.float()
            dx = rstd * (g - xf * rstd.pow(2) * (g * xf).mean(-1, keepdim=True))
            return dx.to(x.dtype), None, None

    norm = normalization.RMSNorm
    original = norm.forward

    def forward(self: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        weight = getattr(self, "weight", None)
        if getattr(self, "bias", None) is not None or (weight is not None and weight.dtype != hidden.dtype):
            return original(self, hidden)
        return FusedRMSNorm.apply(hidden, weight, self.eps)

    norm.forward = forward  # type: ignore[method-assign]
    try:
        yield FusedRMSNorm
    finally:
        norm.forward = original  # type: ignore[method-assign]


@dataclass
class Measured:
    """One step's memory, in bytes."""

    weights: int = 0
    lora_params: int = 0
    lora_state: int = 0  # params + grads + AdamW moments
    forward_kept: int = 0  # alive at the end of forward
    activations_peak: int = 0  # the step's own peak, less the LoRA grads alive
    peak: int = 0  # weights + adapter + moments + the step's high-water mark
    inference_peak: int = 0  # weights + a no-grad forward's high-water mark
    blocks: list[int] = field(default_factory=list)  # kept per block in forward
    ops: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once)."""
    storages = {id(s): s for s in (t.untyped_storage() for t in tensors)}
    return sum(s.nbytes() for s in storages.values())


@contextlib.contextmanager
def _fake_safe_conversion() -> Iterator[None]:
    """``Module.to`` swaps fake parameters; a no-op ``.to`` (same dtype and
    device, which returns the tensor itself) cannot swap a tensor with itself.
    Skip exactly that case."""
    original = torch.utils.swap_tensors

    def swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
        try:
            original(t1, t2)
        except RuntimeError:
            same = (t1.shape, t1.dtype, t1.device) == (t2.shape, t2.dtype, t2.device)
            if not same:
                raise

    torch.utils.swap_tensors = swap  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.utils.swap_tensors = original


def _build(
    d: Denoiser, config: dict[str, Any], dtype: torch.dtype, checkpointing: bool
) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """The denoiser as the trainer holds it: frozen base, peft LoRA in fp32."""
    import diffusers
    from peft import LoraConfig

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    # Built in the dtype (peft matches its adapter to the base's): under fake
    # tensors a dtype-changing Module.to() cannot swap the parameters.
    torch.set_default_dtype(dtype)
    try:
        model = getattr(diffusers, d.model_class).from_config(config)
        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=RANK, lora_alpha=RANK, lora_dropout=0.0, init_lora_weights="gaussian",
                                     target_modules=list(d.spec.lora.targets)))
    finally:
        torch.set_default_dtype(previous)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    return model, params


def measure_step(
    d: Denoiser, overrides: dict[str, Any], resolution: int, text: int, checkpointing: bool,
    *, dtype: torch.dtype = torch.bfloat16, fake: bool = True, profile: bool = False,
) -> tuple[Measured, dict[str, Any]]:
    """Build the denoiser, take a warm-up step, measure the second one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    config = _config(d, overrides)
    runtime = d.runtime
    started = time.perf_counter()
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    m = Measured()
    with mode, gpu_rms_norm() as fused_norm, _fake_safe_conversion():
        model, params = _build(d, config, dtype, checkpointing)
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        pipe = _pipe_shim(d, model)
        side = resolution // 8
        # Data the runtime reads on the host cannot be fake: a family's
        # probe_conditioning gives it as plain values (one prompt, no padding).
        cond = _conditioning(d, config, text, dtype)
        flow = d.spec.training.objective.prediction == "flow_matching"  # type: ignore[union-attr]

        def step(tracker: LiveBytes | None) -> None:
            x0 = torch.randn(1, d.latent_channels, side, side, dtype=dtype)
            noise = torch.randn_like(x0)
            if flow:
                t = torch.rand(1)
                noisy, target = (1 - t.to(dtype)) * x0 + t.to(dtype) * noise, noise - x0
            else:
                t = torch.randint(0, 1000, (1,))
                noisy, target = x0 + noise, noise
            start = tracker.live if tracker else 0
            prediction = runtime.predict(pipe, model, noisy, t, cond)
            loss = torch.nn.functional.mse_loss(prediction.float(), target.float())
            if tracker:
                m.forward_kept = tracker.live - start
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step(None)  # AdamW's moments now exist, as in every later step
        frozen = [t for t in [*model.parameters(), *model.buffers()] if not t.requires_grad]
        m.weights = _storage_bytes(frozen)
        m.lora_params = _storage_bytes(params)
        moments = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        m.lora_state = m.lora_params * 2 + _storage_bytes(moments)  # + one fp32 grad per param
        baseline = m.lora_params + _storage_bytes(moments)

        recording = {"on": False}
        hooks = []

        def pre(module: torch.nn.Module, *_: Any) -> None:
            if recording["on"]:
                module._bench_live = tracker.live  # type: ignore[attr-defined]

        def post(module: torch.nn.Module, *_: Any) -> None:
            if recording["on"] and hasattr(module, "_bench_live"):
                m.blocks.append(tracker.live - module._bench_live)  # type: ignore[attr-defined]
                del module._bench_live

        for module in _blocks(d, model):
            hooks.append(module.register_forward_pre_hook(pre))
            hooks.append(module.register_forward_hook(post))
        for p in params:
            p.register_post_accumulate_grad_hook(lambda p: _add_grad(tracker, p))

        tracker = LiveBytes()
        prof = _profiler() if profile else contextlib.nullcontext()
        with prof as profiler, tracker:
            recording["on"] = True
            original_backward = torch.Tensor.backward

            def backward(self: torch.Tensor, *a: Any, **k: Any) -> None:
                recording["on"] = False  # recomputation under checkpointing is not forward
                original_backward(self, *a, **k)

            torch.Tensor.backward = backward  # type: ignore[method-assign]
            try:
                step(tracker)
            finally:
                torch.Tensor.backward = original_backward  # type: ignore[method-assign]
        m.activations_peak = tracker.peak_less_grads
        m.peak = m.weights + baseline + tracker.peak
        m.ops = dict(tracker.ops)
        if fused_norm.calls:
            m.ops["rms_norm (fused, as on CUDA)"] = fused_norm.calls
        extra: dict[str, Any] = {"tracker_peak": tracker.peak}
        if profile:
            extra["profiler_peak"] = _profiler_peak(profiler)
        for h in hooks:
            h.remove()
        model.eval()
        inference = LiveBytes()
        with torch.no_grad(), inference:
            runtime.predict(pipe, model, torch.randn(1, d.latent_channels, side, side, dtype=dtype),
                            torch.rand(1) if flow else torch.randint(0, 1000, (1,)), cond)
        m.inference_peak = m.weights + m.lora_params + inference.peak
        extra["base_shapes"] = _base_shapes(model)
    m.seconds = time.perf_counter() - started
    return m, extra


def _add_grad(tracker: LiveBytes | None, p: torch.Tensor) -> None:
    if tracker is not None and p.grad is not None:
        tracker.grads += p.grad.untyped_storage().nbytes()


def _base_shapes(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the frozen weights under their unwrapped names (as a file has them)."""
    shapes = []
    for name, p in model.named_parameters():
        if "lora_" in name:
            continue
        shapes.append((name.replace(".base_layer", ""), tuple(p.shape)))
    return shapes


def _profiler():  # type: ignore[no-untyped-def]
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], profile_memory=True)


def _profiler_peak(profiler: Any) -> int:
    """Highest "Total Allocated" of the CPU allocator's memory events while profiling.

    The CPU allocator counts only blocks allocated after profiling began, so
    this is the step's own high-water mark, comparable to ``LiveBytes.peak``.
    """
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path, encoding="utf-8") as handle:
            trace = json.load(handle)
    totals = [e["args"]["Total Allocated"] for e in trace.get("traceEvents", [])
              if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})]
    return max(totals, default=0)


# ---------------------------------------------------------------------------
# deriving the figures
# ---------------------------------------------------------------------------


def _solve(rows: list[tuple[float, float]], values: list[float]) -> tuple[float, float, float, float]:
    """Least squares ``value = a * image + b * text + c``; returns a, b, c and the worst residual."""
    a = torch.tensor([[i, t, 1.0] for i, t in rows], dtype=torch.float64)
    y = torch.tensor(values, dtype=torch.float64).unsqueeze(1)
    coef = torch.linalg.lstsq(a, y).solution.squeeze(1)
    residual = float((a @ coef.unsqueeze(1) - y).abs().max())
    return float(coef[0]), float(coef[1]), float(coef[2]), residual


def count_blocks(d: Denoiser, config: dict[str, Any]) -> int:
    """Repeated blocks of ``config``, as ``ActivationFigures.blocks`` counts them."""
    import diffusers

    with torch.device("meta"):
        model = getattr(diffusers, d.model_class).from_config(config)
    units = sum(0.5 if any(n.startswith(h) for h in d.half_blocks) else 1.0 for n, _ in _named_blocks(d, model))
    return int(units)


def _named_blocks(d: Denoiser, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in d.blocks]


def _blocks(d: Denoiser, model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks (their forward hooks measure what each keeps)."""
    return [m for _, m in _named_blocks(d, model)]


def full_lora_targets(d: Denoiser) -> tuple[LoraTargetShape, ...]:
    """LoRA target shapes and counts of the full-size model, read on the meta device."""
    import diffusers

    with torch.device("meta"):
        model = getattr(diffusers, d.model_class).from_config(_config(d, {}))
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    return lora_target_shapes(shapes, d.spec.lora.targets)


def derive(d: Denoiser, resolutions: tuple[int, ...], log: Callable[[str], None]) -> TrainingMemoryFigures:
    """Per-token figures from the step's activation peak at two resolutions and
    two prompt lengths (least squares over image tokens, text tokens and a
    constant, which should come out near zero).

    What a block adds is the difference between two depths where a family
    has them: a block's forward hooks would also count tensors a later block
    frees (single-stream blocks may hand on views the next one concatenates).
    A probe with no ``deeper`` depth (a UNet with no smaller depth that keeps
    its channel mix) has its blocks measured by hooks around each one.
    """
    n_blocks = count_blocks(d, _config(d, d.derive))
    n_deeper = count_blocks(d, _config(d, d.deeper)) if d.deeper is not None else 0
    texts = (d.text_tokens, d.text_tokens // 2)
    rows, per_block, kept, outside, outside_ckpt = [], [], [], [], []
    for resolution in resolutions:
        for text in texts:
            plain, _ = measure_step(d, d.derive, resolution, text, False)
            ckpt, _ = measure_step(d, d.derive, resolution, text, True)
            seconds = plain.seconds + ckpt.seconds
            if d.deeper is not None:
                plain_b, _ = measure_step(d, d.deeper, resolution, text, False)
                ckpt_b, _ = measure_step(d, d.deeper, resolution, text, True)
                seconds += plain_b.seconds + ckpt_b.seconds
                added = n_deeper - n_blocks
                block = (plain_b.activations_peak - plain.activations_peak) / added / 2  # elements (bf16)
                block_kept = (ckpt_b.activations_peak - ckpt.activations_peak) / added / 2
            else:
                block = sum(plain.blocks) / n_blocks / 2
                block_kept = sum(ckpt.blocks) / n_blocks / 2
            # Outside the blocks: what the forward keeps there plus the backward's
            # own transient at the peak (it does not grow with depth); under
            # checkpointing one block is recomputed in full on top.
            rest = plain.activations_peak / 2 - n_blocks * block
            rest_ckpt = ckpt.activations_peak / 2 - n_blocks * block_kept - block
            image = (resolution // PATCH) ** 2
            rows.append((image, text))
            per_block.append(block)
            kept.append(block_kept)
            outside.append(rest)
            outside_ckpt.append(rest_ckpt)
            tokens = image + text
            log(f"  {d.family:<10} {resolution:>4}px text {text:>3}: block {block / tokens:7.1f} el/token, "
                f"ckpt block {block_kept / tokens:6.1f}, outside {rest / tokens:7.1f} "
                f"(ckpt run {rest_ckpt / tokens:7.1f}); fwd kept {plain.forward_kept / GB:.3f} GB, "
                f"peak {plain.peak / GB:.2f} GB; ops {plain.ops} [{seconds:.0f} s]")
    fits = {}
    series = (("block", per_block), ("kept", kept), ("outside", outside), ("outside_ckpt", outside_ckpt))
    for name, values in series:
        a, b, c, residual = _solve(rows, values)
        fits[name] = (a, b)
        log(f"  {d.family:<10} fit {name:<12} {a:9.1f} el/image token {b:8.1f} el/text token, "
            f"constant {c * 2 / 1e6:7.2f} MB, worst residual {residual * 2 / 1e6:.2f} MB")
    values = dict(
        block_per_image_token=round(fits["block"][0], 1),
        block_per_text_token=round(fits["block"][1], 1),
        checkpointed_block_per_image_token=round(fits["kept"][0], 1),
        checkpointed_block_per_text_token=round(fits["kept"][1], 1),
        outside_per_image_token=round(fits["outside"][0], 1),
        outside_per_text_token=round(fits["outside"][1], 1),
        blocks=count_blocks(d, _config(d, {})),
        text_tokens=d.text_tokens,
    )
    if SEPARATE_CHECKPOINTED_OUTSIDE:
        values["checkpointed_outside_per_image_token"] = round(fits["outside_ckpt"][0], 1)
        values["checkpointed_outside_per_text_token"] = round(fits["outside_ckpt"][1], 1)
    else:
        # One outside figure serves both modes: the larger, so neither is
        # under-sized. (Where checkpointing also covers modules outside the
        # repeated blocks, a UNet's resnets, the checkpointed run is then over.)
        values["outside_per_image_token"] = round(max(fits["outside"][0], fits["outside_ckpt"][0]), 1)
        values["outside_per_text_token"] = round(max(fits["outside"][1], fits["outside_ckpt"][1]), 1)
        log(f"  {d.family:<10} checkpointed outside (no field for it in ActivationFigures): "
            f"{fits['outside_ckpt'][0]:.1f} el/image token, {fits['outside_ckpt'][1]:.1f} el/text token")
    activations = ActivationFigures(**values)
    return TrainingMemoryFigures(activations=activations, lora_targets=full_lora_targets(d))


def literal(figures: TrainingMemoryFigures) -> str:
    """The figures as the table writes them, inside ``training=TrainingSpec(...)``."""
    a = figures.activations
    fields = "\n".join(f"                {f.name}={getattr(a, f.name)!r}," for f in dataclasses.fields(a))
    targets = "\n".join(
        f"                LoraTargetShape({t.target!r}, {t.in_features}, {t.out_features}, {t.count}),"
        for t in figures.lora_targets
    )
    return (f"        memory=TrainingMemoryFigures(\n            activations=ActivationFigures(\n{fields}\n"
            f"            ),\n            lora_targets=(\n{targets}\n            ),\n        ),")


# ---------------------------------------------------------------------------
# the accuracy check
# ---------------------------------------------------------------------------


def estimate_for(d: Denoiser, config: dict[str, Any], m: Measured, extra: dict[str, Any],
                 resolution: int, text: int, checkpointing: bool):  # type: ignore[no-untyped-def]
    """The engine's estimate for this reduced model: the family's figures with
    this model's block count, prompt length and LoRA target shapes, and the
    measured weight bytes as the base."""
    spec = d.spec
    figures = spec.training.memory
    if figures is None:
        raise SystemExit(f"{d.family}: no training.memory figures in its table; run --derive first")
    targets = lora_target_shapes(extra["base_shapes"], spec.lora.targets)
    own = replace(
        figures,
        activations=replace(figures.activations, blocks=count_blocks(d, config), text_tokens=text),
        lora_targets=targets,
    )
    family = replace(spec, training=replace(spec.training, memory=own))
    base = BaseFacts(dense_gb=m.weights / GB, text_encoders_gb=0.0, vae_gb=0.0, source="measured")
    shape = TrainingShape(resolution=resolution, lora_rank=RANK, gradient_checkpointing=checkpointing)
    return estimate_training_memory(family, base, "bf16", shape)


def _err(estimated: float, measured: float) -> str:
    return f"{(estimated - measured) / measured * 100:+6.1f}%" if measured else "   n/a"


def check(d: Denoiser, depth: str, resolutions: tuple[int, ...], log: Callable[[str], None]) -> list[float]:
    overrides = d.check if depth == "reduced" else {}
    config = _config(d, overrides)
    errors = []
    for resolution in resolutions:
        for checkpointing in (False, True):
            m, extra = measure_step(d, overrides, resolution, d.text_tokens, checkpointing)
            est = estimate_for(d, config, m, extra, resolution, d.text_tokens, checkpointing)
            peak_est = est.training_peak_gb - est.overhead_gb  # allocated bytes, no CUDA context
            lora_meas = m.lora_state / GB
            cells = [
                (est.base_gb, m.weights / GB), (est.lora_gb, lora_meas),
                (est.activations_gb, m.activations_peak / GB), (peak_est, m.peak / GB),
            ]
            errors += [abs(e - me) / me * 100 for e, me in cells[2:] if me]
            text = "  ".join(f"{me:7.3f} {e:7.3f} {_err(e, me)}" for e, me in cells)
            log(f"| {d.family:<10} | {depth:<7} {count_blocks(d, config):>3} | {resolution:>4} | "
                f"{'yes' if checkpointing else 'no ':<3} | {text} | {m.inference_peak / GB:7.3f} | "
                f"{m.seconds:4.0f}s")
    return errors


def validate(d: Denoiser, log: Callable[[str], None]) -> None:
    """The counter against the CPU allocator (real tensors, fp32, narrow widths),
    and the counter on real vs fake tensors."""
    for checkpointing in (False, True):
        real, extra = measure_step(
            d, d.narrow, 128, 32, checkpointing, dtype=torch.float32, fake=False, profile=True
        )
        fake, fextra = measure_step(d, d.narrow, 128, 32, checkpointing, dtype=torch.float32, fake=True)
        log(f"  {d.family:<10} ckpt {'yes' if checkpointing else 'no '}: step high-water "
            f"profiler {extra['profiler_peak'] / 1e6:8.2f} MB, counter {extra['tracker_peak'] / 1e6:8.2f} MB "
            f"({_err(extra['tracker_peak'], extra['profiler_peak'])}), counter on fake tensors "
            f"{fextra['tracker_peak'] / 1e6:8.2f} MB ({_err(fextra['tracker_peak'], extra['tracker_peak'])}) "
            f"[{real.seconds:.0f} s]")


def main(argv: list[str] | None = None) -> None:
    from engine.plugins import load_registry

    registry = load_registry()
    probed = [name for name, spec in registry.families.items() if spec.training.probe is not None]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="*", default=probed,
                        help=f"installed families with a memory probe (default: all of them: {', '.join(probed)})")
    parser.add_argument("--derive", action="store_true", help="derive the table figures")
    parser.add_argument("--validate", action="store_true", help="only validate the counter")
    parser.add_argument("--skip-validation", action="store_true", help="check without validating the counter")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    def log(line: str) -> None:
        print(line, flush=True)

    try:
        chosen = [Denoiser.of(registry.family(name)) for name in args.families]
    except (NoProbe, EngineError) as exc:
        raise SystemExit(f"error: {exc}") from None
    log("memory counted: bytes of live tensor storages (LiveBytes, a TorchDispatchMode) over a bf16 step "
        "run under FakeTensorMode; validated against the CPU allocator's profiler 'Total Allocated'")
    if args.validate or not (args.derive or args.skip_validation):
        log("validation (real fp32 tensors, narrow widths, 128 px, 32 text tokens):")
        for d in chosen:
            validate(d, log)
        if args.validate:
            return
    if args.derive:
        for d in chosen:
            log(f"deriving {d.family} ({d.model_class}, {_describe(d.derive)}, "
                f"{count_blocks(d, _config(d, d.derive))} blocks):")
            figures = derive(d, (256, 512), log)
            log(f"# {d.family}: python -m engine.testing.memory_figures --derive\n{literal(figures)}")
        return
    log("\nGB measured / estimated / error: base weights, LoRA (params+grads+AdamW), activations "
        "(step high-water less LoRA grads), peak allocated (estimate less its runtime overhead); "
        "inference = weights + no-grad forward high-water, measured")
    log("| family | depth blocks | px | ckpt | base meas est err | LoRA meas est err | "
        "activations meas est err | peak meas est err | inference | time |")
    worst = 0.0
    for d in chosen:
        for depth, resolutions in (("reduced", (256, 512)), ("full", (512, 1024))):
            if depth == "reduced" and not d.check:
                continue
            errors = check(d, depth, resolutions, log)
            worst = max([worst, *errors])
    log(f"worst activation/peak error: {worst:.1f}%")


def _describe(overrides: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in overrides.items())


if __name__ == "__main__":
    main()
