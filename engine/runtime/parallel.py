"""A loaded pipeline's denoisers split across the ranks of one request (inside each rank).

The split is the policy's :class:`~engine.policy.parallel.ParallelChoice`; this applies it to
the denoisers of a pipeline every rank has loaded alike, after the process group is up
(:mod:`engine.service.ranks` starts the ranks):

* the sequence split is diffusers' own (``ModelMixin.enable_parallelism`` with a
  ``ContextParallelConfig``: its hooks split the inputs its class's ``_cp_plan`` names,
  run Ulysses or Ring attention, and gather the output);
* the CFG split (:class:`CfgSplit`) wraps each denoiser's ``forward``: a step's condition
  call runs on the first CFG group, its uncondition call on the second, and the two
  swap results after the second call, so every rank returns both and steps on alike.

One device mesh ``(cfg, ring, ulysses)`` carries both. Two things diffusers assumes that a
CPU (gloo) rank breaks, both mended here for the CPU alone: its mesh setup indexes the
accelerators (``rank % device_count()``, zero on a CPU), so the engine builds the mesh and
the config itself; and Ring attention asks the attention kernel for its log-sum-exp, which
torch's CPU SDPA does not give, so a CPU rank computes it with aten's CPU flash kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.errors import EngineError

__all__ = ["CfgSplit", "split_denoisers"]


def split_denoisers(pipeline: Any, choice: Any, denoisers: Sequence[str]) -> list[str]:
    """Split ``pipeline``'s ``denoisers`` (component names) as ``choice`` says, on this rank of
    the default process group; the names split."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    if world != choice.ranks:
        raise EngineError(f"{world} ranks joined a request planned for {choice.ranks}", code="rank_lost")
    device = torch.device("cpu") if choice.device == "cpu" else torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh(device.type, (choice.cfg, choice.ring, choice.ulysses),
                            mesh_dim_names=("cfg", "ring", "ulysses"))
    if choice.ring > 1 and device.type == "cpu":
        _lse_attention_on_cpu()
    pairing = _Pairing(mesh["cfg"]) if choice.cfg > 1 else None
    split = []
    for name in denoisers:
        module = getattr(pipeline, name, None)
        if module is None:
            continue
        if choice.sequence > 1:
            _context_parallel(module, choice, rank, world, device, mesh)
        if pairing is not None:
            CfgSplit(module, pairing).install()
        split.append(name)
    if not split:
        raise EngineError(f"the pipeline has none of the components {list(denoisers)} to split", code="parallel_unsupported")
    return split


def _context_parallel(module: Any, choice: Any, rank: int, world: int, device: torch.device, mesh: Any) -> None:
    """diffusers' context parallel on ``module``, its config set up on the engine's mesh."""
    from diffusers import ContextParallelConfig
    from diffusers.models._modeling_parallel import ParallelConfig

    if getattr(type(module), "_cp_plan", None) is None:
        raise EngineError(f"{type(module).__name__} declares no context-parallel plan in this diffusers; run it "
                          "with --parallel cfg or on one GPU", code="parallel_unsupported")
    config = ContextParallelConfig(ring_degree=choice.ring, ulysses_degree=choice.ulysses,
                                   ulysses_anything=choice.anything and choice.ulysses > 1,
                                   ring_anything=choice.anything and choice.ring > 1)
    resolved = ParallelConfig(context_parallel_config=config)
    resolved.setup(rank, world, device, mesh=mesh)

    def _resolve(_asked: object) -> ParallelConfig:  # diffusers' own would index the accelerators
        module._parallel_config = resolved
        return resolved

    module._resolve_parallel_config = _resolve
    try:
        module.enable_parallelism(config=config)
    finally:
        del module._resolve_parallel_config


class _Pairing:
    """The call count shared by every denoiser of one pipeline (a two-expert model's experts
    alternate within one step), and the CFG group that swaps results."""

    def __init__(self, mesh: Any) -> None:
        self.group = mesh.get_group()
        self.half = mesh.get_local_rank()  # 0: runs the condition calls; 1: the unconditions
        self.calls = 0
        self.shapes: dict[tuple[Any, ...], tuple[tuple[torch.Size, torch.dtype], ...]] = {}
        self.pending: tuple[Any, ...] | None = None
        self.asked: tuple[Any, ...] | None = None


class CfgSplit:
    """``module``'s forward run on one CFG group per condition.

    Calls come in pairs (condition, uncondition) on the same latents and timestep. The
    first pair of each input shape runs whole on every rank (it learns the output's shape);
    after it, the condition runs on group 0 while group 1 hands back an empty output of that
    shape, and the uncondition on group 1 while group 0 waits; then the two swap results and
    group 1 fills the empty output in place, before the pipeline reads it. A call that does
    not pair with the one before (another timestep, another shape) is refused rather than
    guessed: a pipeline that runs guidance another way is not split.
    """

    def __init__(self, module: Any, pairing: _Pairing) -> None:
        self.module = module
        self.pairing = pairing
        self.forward = module.forward

    def install(self) -> None:
        self.module.forward = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = self.pairing
        first = state.calls % 2 == 0
        state.calls += 1
        key = _signature(args, kwargs)
        if first:
            state.asked = key
            if key not in state.shapes:  # learn the output's shape: this pair runs whole here
                state.pending = None
                return self.forward(*args, **kwargs)
            if state.half == 0:
                out = self.forward(*args, **kwargs)
                state.pending = out
                return out
            state.pending = _empty_like(self.module, state.shapes[key], kwargs)
            return state.pending
        if key != state.asked:
            raise EngineError("CFG parallel lost its pairing: the pipeline called the denoiser for one condition "
                              "only; run it with --parallel ulysses or ring", code="parallel_unsupported")
        if state.pending is None:  # the learning pair
            out = self.forward(*args, **kwargs)
            state.shapes[key] = tuple((t.shape, t.dtype) for t in _tensors(out))
            return out
        mine = self.forward(*args, **kwargs) if state.half == 1 else None
        condition, mine = _swap(state, mine)
        state.pending = None
        return mine if state.half == 1 else condition

    def __getattr__(self, name: str) -> Any:  # the bound forward's attributes (``__self__``...)
        return getattr(self.forward, name)


def _signature(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What pairs a condition call with its uncondition: the latents' shape and the timestep."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    timestep = kwargs.get("timestep", args[2] if len(args) > 2 else None)
    step = tuple(timestep.flatten()[:1].tolist()) if isinstance(timestep, torch.Tensor) else timestep
    return (tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else None, step)


def _tensors(out: Any) -> tuple[torch.Tensor, ...]:
    values = out.to_tuple() if hasattr(out, "to_tuple") else out if isinstance(out, tuple) else (out,)
    return tuple(v for v in values if isinstance(v, torch.Tensor))


def _empty_like(module: Any, shapes: tuple[tuple[torch.Size, torch.dtype], ...], kwargs: dict[str, Any]) -> Any:
    """An output of the learnt shape, filled in place when the condition's result arrives."""
    device = next(module.parameters()).device
    empties = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes)
    if kwargs.get("return_dict", True):
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=empties[0])
    return empties


def _swap(state: _Pairing, mine: Any) -> tuple[Any, Any]:
    """Group 0's condition and group 1's uncondition, on every rank of the pair (gloo and
    NCCL both broadcast); group 1's empty condition output is filled in place."""
    import torch.distributed as dist

    pending = _tensors(state.pending)
    ranks = dist.get_process_group_ranks(state.group)
    for tensor in pending:  # group 0 sends its condition; group 1 receives it into its empty output
        dist.broadcast(tensor, src=ranks[0], group=state.group)
    if state.half == 0:
        shapes = [(t.shape, t.dtype) for t in pending]
        received = tuple(torch.empty(s, dtype=d, device=pending[0].device) for s, d in shapes)
        for tensor in received:
            dist.broadcast(tensor, src=ranks[1], group=state.group)
        return state.pending, _rewrapped(state.pending, received)
    for tensor in _tensors(mine):
        dist.broadcast(tensor, src=ranks[1], group=state.group)
    return state.pending, mine


def _rewrapped(like: Any, tensors: tuple[torch.Tensor, ...]) -> Any:
    if hasattr(like, "to_tuple"):
        return type(like)(*tensors)
    return tensors if isinstance(like, tuple) else tensors[0]


def _lse_attention_on_cpu() -> None:
    """Ring attention on a CPU rank: diffusers' native forward op, where asked for the log-sum-exp
    on a CPU tensor, computed by aten's CPU flash kernel (which returns it) instead of refusing."""
    from diffusers.models import attention_dispatch

    native = attention_dispatch._native_attention_forward_op
    if getattr(native, "_engine_cpu_lse", False):
        return

    def forward_op(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                   _save_ctx: bool = True, _parallel_config: Any = None) -> Any:
        if not return_lse or query.device.type != "cpu" or torch.is_grad_enabled():
            return native(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                          _save_ctx=_save_ctx, _parallel_config=_parallel_config)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *(t.transpose(1, 2) for t in (query, key, value)), dropout_p, is_causal, attn_mask=attn_mask,
            scale=scale)
        return out.transpose(1, 2).contiguous(), lse.transpose(1, 2).contiguous()

    forward_op._engine_cpu_lse = True  # type: ignore[attr-defined]
    attention_dispatch._native_attention_forward_op = forward_op
