"""The measuring half of the training-memory tool: build a family's denoiser, count a step's bytes.

:mod:`engine.testing.memory_figures` derives a family's ``TrainingMemoryFigures`` and checks
the engine's estimate from what this module measures: the denoiser built at real widths
and a reduced depth from the family's ``MemoryProbe`` (:class:`Denoiser`), one LoRA
training step as the trainer runs it, under fake tensors, with every storage's bytes
counted (:class:`LiveBytes`, :func:`measure_step`). The method and its validation are there.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import tempfile
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from engine.training.levers import adamw_kernel
from engine.testing.memory_models import Denoiser, _blocks, _conditioning, _config, _pipe_shim

RANK = 16  # the probe LoRA's rank

# -- measuring ---------------------------------------------------------------


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


@dataclass
class _TrainStep:
    """One LoRA training step on random latents: forward, MSE, backward, clip, AdamW."""

    d: Denoiser
    pipe: Any
    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    cond: Any
    #: The latent batch's shape: [1, C, h, w], or [1, C, f, h, w] for a video family's clip.
    shape: tuple[int, ...]
    dtype: torch.dtype
    flow: bool

    def __call__(self, m: Measured, tracker: LiveBytes | None) -> None:
        """Take the step; with ``tracker``, record what the forward keeps for backward in ``m``."""
        x0 = torch.randn(self.shape, dtype=self.dtype)
        noise = torch.randn_like(x0)
        if self.flow:
            t = torch.rand(1)
            noisy, target = (1 - t.to(self.dtype)) * x0 + t.to(self.dtype) * noise, noise - x0
        else:
            t = torch.randint(0, 1000, (1,))
            noisy, target = x0 + noise, noise
        start = tracker.live if tracker else 0
        prediction = self.d.runtime.predict(self.pipe, self.model, noisy, t, self.cond)
        loss = torch.nn.functional.mse_loss(prediction.float(), target.float())
        if tracker:
            m.forward_kept = tracker.live - start
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def inference_peak(self) -> int:
        """Live bytes of one forward without gradients, the adapter in."""
        self.model.eval()
        inference = LiveBytes()
        with torch.no_grad(), inference:
            self.d.runtime.predict(
                self.pipe, self.model, torch.randn(self.shape, dtype=self.dtype),
                torch.rand(1) if self.flow else torch.randint(0, 1000, (1,)), self.cond,
            )
        return inference.peak


class _BlockRecorder:
    """Hooks on the repeated blocks that record, while on, what each block's forward keeps.

    Off during backward: recomputation under checkpointing is not forward."""

    def __init__(self, blocks: Iterable[torch.nn.Module], m: Measured, tracker: LiveBytes) -> None:
        self.m, self.tracker, self.on = m, tracker, False
        self.hooks: list[Any] = []
        for module in blocks:
            self.hooks.append(module.register_forward_pre_hook(self._pre))
            self.hooks.append(module.register_forward_hook(self._post))

    def _pre(self, module: torch.nn.Module, *_: Any) -> None:
        if self.on:
            module._bench_live = self.tracker.live  # type: ignore[attr-defined]

    def _post(self, module: torch.nn.Module, *_: Any) -> None:
        if self.on and hasattr(module, "_bench_live"):
            self.m.blocks.append(self.tracker.live - module._bench_live)  # type: ignore[attr-defined]
            del module._bench_live

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the forward of the step run inside; stop at its ``backward``."""
        self.on = True
        original_backward = torch.Tensor.backward

        def backward(tensor: torch.Tensor, *a: Any, **k: Any) -> None:
            self.on = False
            original_backward(tensor, *a, **k)

        torch.Tensor.backward = backward  # type: ignore[method-assign]
        try:
            yield
        finally:
            torch.Tensor.backward = original_backward  # type: ignore[method-assign]

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


def measure_step(
    d: Denoiser, overrides: dict[str, Any], resolution: int, text: int, checkpointing: bool,
    *, dtype: torch.dtype = torch.bfloat16, fake: bool = True, profile: bool = False, frames: int = 1,
    inference: bool = True,
) -> tuple[Measured, dict[str, Any]]:
    """Build the denoiser, take a warm-up step with the trainer's AdamW, measure the second one
    (``frames``: a video family's clip, as latent frames; ``inference``: a no-grad forward too)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    config = _config(d, overrides)
    started = time.perf_counter()
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    m = Measured()
    with mode, gpu_rms_norm() as fused_norm, _fake_safe_conversion():
        model, params = _build(d, config, dtype, checkpointing)
        optimizer = torch.optim.AdamW(params, lr=1e-4, **adamw_kernel(params))
        # Data the runtime reads on the host cannot be fake: a family's
        # probe_conditioning gives it as plain values (one prompt, no padding).
        step = _TrainStep(
            d, _pipe_shim(d, model), model, params, optimizer, _conditioning(d, config, text, dtype),
            shape=latent_shape(d, resolution, frames), dtype=dtype,
            flow=d.spec.training.objective.prediction == "flow_matching",  # type: ignore[union-attr]
        )
        for p in params:  # AdamW's moments made as a first step makes them, without its forward and backward
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        frozen = [t for t in [*model.parameters(), *model.buffers()] if not t.requires_grad]
        m.weights = _storage_bytes(frozen)
        m.lora_params = _storage_bytes(params)
        moments = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        m.lora_state = m.lora_params * 2 + _storage_bytes(moments)  # + one fp32 grad per param
        baseline = m.lora_params + _storage_bytes(moments)

        tracker = LiveBytes()
        recorder = _BlockRecorder(_blocks(d, model), m, tracker)
        for p in params:
            p.register_post_accumulate_grad_hook(lambda p: _add_grad(tracker, p))
        prof = _profiler() if profile else contextlib.nullcontext()
        with prof as profiler, tracker, recorder.recording():
            step(m, tracker)
        recorder.remove()
        m.activations_peak = tracker.peak_less_grads
        m.peak = m.weights + baseline + tracker.peak
        m.ops = dict(tracker.ops)
        if fused_norm.calls:
            m.ops["rms_norm (fused, as on CUDA)"] = fused_norm.calls
        extra: dict[str, Any] = {"tracker_peak": tracker.peak}
        if profile:
            extra["profiler_peak"] = _profiler_peak(profiler)
        m.inference_peak = m.weights + m.lora_params + step.inference_peak() if inference else 0
        extra["base_shapes"] = _base_shapes(model)
    m.seconds = time.perf_counter() - started
    return m, extra


def latent_shape(d: Denoiser, resolution: int, frames: int = 1) -> tuple[int, ...]:
    """The latents one example is: [1, C, h, w] for an image family, [1, C, f, h, w] for a video one."""
    geometry = d.spec.rendering.geometry
    side = geometry.latent_side(resolution)
    if d.spec.rendering.output == "frames":
        return (1, d.latent_channels, geometry.latent_frames(frames), side, side)
    return (1, d.latent_channels, side, side)


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
