"""Plugin API 2's sections of :class:`~engine.contract.types.FamilySpec`: the fields that
stood loose beside the sections of plugin API 1, grouped by the concern that reads them.

- :class:`PipelineLayout`: how the family's diffusers pipeline is put together and called
  (its denoiser and experts, the guidance argument, the workflows' pipeline classes, the
  ControlNet classes, which pipelines open a cache context);
- :class:`SpeedRules`: what the speed levers may touch (compile regions, fused eager sites,
  optimisations denied);
- :class:`Rendering`: what a call gives back and the latent geometry that shapes it (the
  output kind, a video family's clips, the VAE's compression and patches, the side multiple,
  the decoder's peak per pixel).

The flat spellings (``FamilySpec(denoiser="unet")``, ``family.compile_regions``) are rows of
the register of old spellings: still read, with a warning naming these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.contract.family_sections import FusionSite, LatentGeometry

if TYPE_CHECKING:
    from engine.contract.types import OptimizationDeny, Workflow
    from engine.contract.video_spec import OutputKind, VideoSpec


@dataclass(frozen=True)
class BorrowedComponent:
    """A component the family's repos name in their index without shipping it (a gated
    encoder the publisher leaves to the user), and the repo the engine takes it
    from (plugin API 2, additive). A folder that holds the component is used as it is; one that
    lacks it gets it from ``repo`` (found in the hub cache, or downloaded with consent), or is
    refused before anything is evicted, naming what is missing and from where.
    """

    #: The pipeline component (``text_encoder_4``, ``tokenizer_4``).
    component: str
    #: The hub repo holding it at its root (an ungated mirror).
    repo: str
    #: Its bf16 GB, counted with the text encoders where a folder lacks it (0 for a tokenizer).
    gb: float = 0.0


@dataclass(frozen=True)
class PipelineLayout:
    """How the family's diffusers pipeline is put together and called."""

    #: The pipeline component that denoises (``transformer`` or ``unet``).
    denoiser: str = "transformer"
    #: How messages name the denoiser ("transformer", "UNet").
    denoiser_label: str = "transformer"
    #: Components that denoise beside ``denoiser`` (a two-expert model's low-noise
    #: ``transformer_2``): quantisation and the other optimisations apply to all of them or none.
    experts: tuple[str, ...] = ()
    #: The pipeline call's guidance argument (``true_cfg_scale`` for real CFG).
    guidance_kwarg: str = "guidance_scale"
    #: Workflows of the family's checkpoints and the diffusers pipeline class serving each;
    #: a checkpoint may override. A video family that declares none serves text to video.
    workflows: tuple[tuple[Workflow, str], ...] = ()
    #: diffusers ControlNet model classes this family's pipelines take.
    controlnet_classes: tuple[str, ...] = ()
    #: Pipeline classes whose call opens a cache context around the denoiser
    #: (First-Block-Cache needs one); None when undeclared.
    cache_context_pipelines: tuple[str, ...] | None = None
    #: Pipeline classes whose call SeaCache can follow: it hands the cache context the schedule
    #: (step index, sigma, step count) and diffusers has a SeaCache adapter for the denoiser
    #: (``--step-cache seacache``; plugin API 2, additive). Empty: not offered.
    sea_cache_pipelines: tuple[str, ...] = ()
    #: Components of the family's repos that none of its workflows calls (a
    #: transformer partition of a workflow the engine does not serve): never required of a
    #: folder, sized or loaded.
    unused_components: tuple[str, ...] = ()
    #: Components the family's repos name without shipping, and where the engine takes them.
    borrowed: tuple[BorrowedComponent, ...] = ()
    #: A modular pipeline's steps that run only where the folder holds their component:
    #: ``(step, component)`` pairs (a prompt upsampler). Where it is absent the step
    #: is left out of the blocks and the prompt is encoded as given.
    optional_steps: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class SpeedRules:
    """What the speed levers may touch."""

    #: Class names of the repeated blocks that regional compile targets.
    compile_regions: tuple[str, ...] = ()
    #: Blocks whose modulation and gated residuals run fused (``torch.addcmul``).
    eager_fusions: tuple[FusionSite, ...] = ()
    #: Optimisations denied to the family, each with its reason.
    optimization_deny: tuple[OptimizationDeny, ...] = ()
    #: Modules (name endings) whose output depends on the prompt's embeddings alone (the text
    #: projection, each cross-attention's key and value projections and key norm): computed
    #: once per prompt per call, an exact cache (plugin API 2, additive; ``engine.runtime.text_kv``).
    text_kv_sites: tuple[str, ...] = ()
    #: The denoiser's diffusers class declares a context-parallel plan (``_cp_plan``): one request
    #: may split its sequence across GPUs (Ulysses or Ring attention). None: undeclared, so the
    #: engine splits no sequence of it. (Plugin API 2, additive; :mod:`engine.policy.parallel`.)
    context_parallel: bool | None = None
    #: Guidance above 1 runs the denoiser twice a step, condition then uncondition, back to back
    #: with nothing read between (separate calls, not one batch of two): each may run on its own
    #: GPU (CFG parallel). (Plugin API 2, additive.)
    cfg_parallel: bool = False


@dataclass(frozen=True)
class Rendering:
    """What a call gives back, and the latent geometry that shapes it."""

    #: ``images``, or ``frames`` (a clip, sized by ``video``).
    output: OutputKind = "images"
    #: A video family's lattice, fps and sizes; None for images.
    video: VideoSpec | None = None
    #: The VAE's compression and the denoiser's patch size.
    geometry: LatentGeometry = LatentGeometry()
    #: Image sides the denoiser takes are multiples of this; None: the geometry's token side
    #: (VAE stride x patch), which the engine derives. Declare it only where the denoiser takes
    #: another (a UNet that pads odd latent sides takes 8).
    side_multiple: int | None = None
    #: Elements the VAE decoder holds live per output pixel at its peak; 0: unknown.
    vae_decode_per_pixel: float = 0.0
    #: The model reads and writes RGBA (a four-channel VAE): an input image keeps its alpha, and
    #: the images come back RGBA (saved as PNG with their alpha). False: RGB, an input's alpha
    #: flattened away. (Plugin API 2.)
    alpha: bool = False
    #: The side the pipeline renders at when a request names no size, where that is not
    #: 1024 px (a 2K-native model's 2048): what the activation guard sizes such a request for.
    #: (Plugin API 2, additive.)
    native_side: int | None = None

    @property
    def sides(self) -> int:
        """The multiple image sides are taken at: the one declared, else the geometry's token side."""
        return self.side_multiple or self.geometry.token_pixels

    def derived_declarations(self) -> list[str]:
        """What this section declares that the engine derives anyway (a plugin is told once)."""
        if self.side_multiple is not None and self.side_multiple == self.geometry.token_pixels:
            return ["side_multiple"]
        return []
