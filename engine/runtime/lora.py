"""LoRA adapters on a pipeline, through diffusers' loaders and peft.

Every input format diffusers knows (diffusers / peft, kohya sd-scripts with
``lora_te*`` text-encoder keys, ai-toolkit, ComfyUI) is converted by the
pipeline class's own ``lora_state_dict``; the engine writes no key converter
of its own. Before anything is applied (and, on a load, before anything is
evicted) every converted key is checked against the model's module tree
(:mod:`engine.runtime.lora_check`): a file with any key that lands nowhere is
refused, never half-applied.

How adapters are applied follows the plan's ``lora`` control: ``fused``
(merged into the weights), ``unfused`` (peft layers beside the base, several
LoRAs, quantised and GGUF bases) or ``hotswap`` (unfused, in slots of the
largest rank declared before the denoiser is compiled, so a switch reuses
the compiled graph). Switching LoRAs or scales never reloads the base.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine.runtime import family_hooks
from engine.errors import EngineError
from engine.contract.plugins import Registry
from engine.preflight.lora import LoraFile
from engine.runtime.kohya import is_kohya
from engine.runtime.lora_check import DIFFERENCES, converted_state_dict, loadable_state
from engine.runtime.quantize import first_line
from engine.contract.types import FamilySpec

class LoraLoadFailed(EngineError):
    code = "lora_load_failed"


class LoraSet:
    """The LoRAs applied to one pipeline, and how (the plan's ``lora`` control)."""

    def __init__(self, pipe: Any, mode: str, max_rank: int, hooks: HookAdapters | None = None,
                 family: FamilySpec | None = None) -> None:
        self.pipe = pipe
        #: The family, whose kohya files with fused modules are split with the model's widths.
        self.family = family
        #: Set where the pipeline has no diffusers LoRA loader: LoRAs load
        #: through the ``engine_lora_load`` hook, unfused.
        self.hooks = hooks
        self.mode = "unfused" if hooks is not None else mode
        self.max_rank = max_rank
        self.applied: tuple[LoraFile, ...] = ()
        #: adapter name per loaded file (unfused / fused); slot names under hotswap.
        self._names: dict[Path, str] = {}
        self._slots: list[str] = []
        self._fused = False
        self._hotswap_ready = False
        self._counter = 0

    def prepare_hotswap(self) -> None:
        """Declare the slot rank before the first adapter is loaded and before compile."""
        if self.mode == "hotswap" and not self._hotswap_ready:
            self.pipe.enable_lora_hotswap(target_rank=max(self.max_rank, 1))
            self._hotswap_ready = True

    def apply(self, files: Sequence[LoraFile]) -> None:
        """Make ``files`` (with their scales) the pipeline's LoRAs; a no-op where they already are."""
        files = tuple(files)
        if files == self.applied:
            return
        try:
            self._unfuse()
            if self.mode == "hotswap":
                self._apply_hotswap(files)
            else:
                self._apply_adapters(files)
        except (ValueError, RuntimeError, KeyError, AssertionError, IndexError) as exc:
            raise LoraLoadFailed(
                f"applying LoRA(s) {', '.join(str(f.path) for f in files)} failed: "
                f"{first_line(exc)[:300]}"
            ) from exc
        self.applied = files

    def _apply_adapters(self, files: tuple[LoraFile, ...]) -> None:
        wanted = {f.path for f in files}
        stale = [name for path, name in self._names.items() if path not in wanted]
        if stale:
            if self.hooks is not None:
                self.hooks.delete(stale)
            else:
                self.pipe.delete_adapters(stale)
            self._names = {p: n for p, n in self._names.items() if p in wanted}
        for file in files:
            if file.path not in self._names:
                name = self._new_name()
                if self.hooks is not None:
                    self.hooks.load(file, name)
                elif file.adapter_type != "lora":  # LoKr / LoHa: peft's own adapter types
                    from engine.runtime.lycoris import load

                    denoiser = self.family.pipeline.denoiser if self.family is not None else "transformer"
                    load(getattr(self.pipe, file.component or denoiser), file, name)
                else:
                    self.pipe.load_lora_weights(self._loadable(file), adapter_name=name, **_into(self.pipe, file,
                                                                                                    self.family))
                self._names[file.path] = name
        if not files:
            return
        names = [self._names[f.path] for f in files]
        if self.hooks is not None:
            self.hooks.activate(names, [f.scale for f in files])
            return
        self.pipe.set_adapters(names, adapter_weights=[f.scale for f in files])
        if self.mode == "fused" and len(files) == 1:
            self.pipe.fuse_lora(components=self._lora_components(), adapter_names=names)
            self._fused = True

    def _apply_hotswap(self, files: tuple[LoraFile, ...]) -> None:
        self.prepare_hotswap()
        for index, file in enumerate(files):
            if file.rank > self.max_rank:
                raise ValueError(
                    f"{file.path} has rank {file.rank}, above the rank-{self.max_rank} hot-swap slots "
                    "declared at load; load the model again with this LoRA among its LoRAs"
                )
            if index < len(self._slots):
                self.pipe.load_lora_weights(self._loadable(file), adapter_name=self._slots[index], hotswap=True)
            else:
                name = f"slot{index}"
                self.pipe.load_lora_weights(self._loadable(file), adapter_name=name)
                self._slots.append(name)
        if self._slots:
            # Unused slots stay loaded at weight 0: removing them would recompile.
            weights = [f.scale for f in files] + [0.0] * (len(self._slots) - len(files))
            self.pipe.set_adapters(self._slots, adapter_weights=weights)

    def _loadable(self, file: LoraFile) -> str | dict[str, torch.Tensor]:
        """What ``load_lora_weights`` takes for ``file``: its path, or, for a kohya file the
        engine reads itself (fused modules split with this model's widths, where diffusers
        assumes the full-size model's; or every module the model's own by its underscored
        name), the state in diffusers' keys."""
        if file.unmatched or any(key.endswith(DIFFERENCES) for key in file.keys):  # what the check did not count in
            return loadable_state(file, converted_state_dict(type(self.pipe), file, family=self.family, denoiser=getattr(
                self.pipe, self.family.pipeline.denoiser) if self.family is not None else None))
        if self.family is None or not is_kohya(file.keys):
            return str(file.path)
        state = converted_state_dict(type(self.pipe), file, family=self.family,
                                     denoiser=getattr(self.pipe, self.family.pipeline.denoiser))
        return state if all(key.startswith(f"{self.family.pipeline.denoiser}.") for key in state) else str(file.path)

    def _unfuse(self) -> None:
        if self._fused:
            self.pipe.unfuse_lora(components=self._lora_components())
            self._fused = False

    def _lora_components(self) -> list[str]:
        return [name for name in self.pipe._lora_loadable_modules if getattr(self.pipe, name, None) is not None]

    def _new_name(self) -> str:
        self._counter += 1
        return f"lora{self._counter}"

    def status(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "fused": self._fused,
            "applied": [f.to_dict() for f in self.applied],
        }


def _into(pipe: Any, file: LoraFile, family: FamilySpec | None) -> dict[str, bool]:
    """``load_lora_weights``' switch for a LoRA of a component other than the family's denoiser
    (a second expert's: ``load_into_transformer_2``), as :mod:`engine.runtime.lora_check` checked
    it; refused where the pipeline has no such component."""
    if file.component is None or (family is not None and file.component == family.pipeline.denoiser):
        return {}
    if getattr(pipe, file.component, None) is None:
        raise ValueError(f"{file.path} is a LoRA for {file.component}, which this model does not have "
                         "(a second expert's LoRA loads on a two-expert model)")
    return {f"load_into_{file.component}": True}


class HookAdapters:
    """LoRAs on a pipeline without diffusers' LoRA loader mixin: each file is
    loaded into the denoiser through the ``engine_lora_load`` hook, and peft's
    layers are switched and scaled directly."""

    def __init__(self, registry: Registry, family: FamilySpec, pipe: Any) -> None:
        self.registry = registry
        self.family = family
        self.pipe = pipe

    @property
    def denoiser(self) -> torch.nn.Module:
        return getattr(self.pipe, self.family.pipeline.denoiser)

    def load(self, file: LoraFile, name: str) -> None:
        state = loadable_state(file, converted_state_dict(type(self.pipe), file, family=self.family, denoiser=self.denoiser))
        prefix = self.family.pipeline.denoiser + "."
        others = sorted({k.partition(".")[0] for k in state if not k.startswith(prefix)})
        if others:
            raise ValueError(
                f"{file.path} also adapts {', '.join(others)}; {type(self.pipe).__name__} has no "
                f"diffusers LoRA loader, so only {self.family.pipeline.denoiser} LoRAs load"
            )
        family_hooks.lora_load(self.registry, self.family, self.pipe, {k[len(prefix):]: v for k, v in state.items()}, name)

    def delete(self, names: list[str]) -> None:
        from engine.runtime.adapters import delete

        delete(self.denoiser, names)

    def activate(self, names: list[str], scales: list[float]) -> None:
        from engine.runtime.adapters import set_scales

        set_scales(self.denoiser, names, scales)
