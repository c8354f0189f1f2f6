"""``Engine``: the facade apps embed and the HTTP server serves, composed of its parts.

    engine = Engine()
    ticket = engine.images.check_generate(GenerateBody(prompt="a lighthouse", model="./my-model"))
    images = engine.images.generate(ticket)            # every check above, nothing re-decided
    images = engine.images.generate("a lighthouse at dusk", steps=20)   # on the loaded model
    clip = engine.videos.generate("waves at dawn", frames=81)     # a video model: one clip
    run = engine.training.start({"base_model": "./my-model", "dataset_dir": "./cats"})
    engine.datasets.list(); engine.catalog.families()

Each part owns its state and shares two things: the :class:`~engine.service.slot.JobSlot`
(one GPU job at a time, and the device's arbiter) and the
:class:`~engine.service.machine.Machine` (the profile decisions are made for). Every load
and every training start runs in one order:

    validate -> precision preflight -> base / model checks -> dataset decode
    -> reserve (a Busy error if another job holds the engine)
    -> acquire the GPU (evict residents) -> start

so nothing is evicted before the last cheap check passed. One GPU job at a time:
starting a training run evicts a loaded image pipeline (and the host's residents);
loading a pipeline while a run trains is refused with :class:`Busy` (HTTP 409), as is
a second training start. A generate is a GPU job too.

The methods the engine had before its parts (``engine.load``, ``engine.start_training``,
``engine.datasets()``...) still work for one release: each warns with
:class:`~engine.deprecation.EngineDeprecationWarning`, naming its new spelling and the
release that removes it (``docs/migration.md`` lists them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from engine.contract.plugins import Registry, load_registry
from engine.deprecation import moved
from engine.errors import Busy, Cancelled, EngineError
from engine.hardware.profile import HardwareProfile
from engine.places import default_datasets_dir, default_runs_dir
from engine.requests.machine import MachineRequest
from engine.service.machine import Machine
from engine.service.residency import Residency, Resident
from engine.service.slot import PIPELINE, TRAINER, JobSlot

if TYPE_CHECKING:
    from engine.policy.available import AvailableMemory, Releasable
    from engine.service.catalog import Catalog
    from engine.service.datasets import Datasets
    from engine.service.gallery import Gallery
    from engine.service.images import Images
    from engine.service.loaded import LoadedModel
    from engine.service.quantize import Quantizer
    from engine.service.training import Training
    from engine.service.videos import Videos

__all__ = ["Busy", "Cancelled", "Engine", "PIPELINE", "TRAINER"]


def _Moved(part: str, name: str, adapt: Callable[[Any], Any] | None = None) -> moved:
    """A method that moved into a part: ``Engine.load`` -> ``Engine.images.load``."""
    return moved(None, f"Engine.{part}.{name}()", f"{part}.{name}", adapt)


P = TypeVar("P")


class _Part(Generic[P]):
    """A part of the engine built on its first use, its module imported then: a command that
    asks the catalog (``info``) or plans (``plan``) imports no loader, trainer or gallery.
    Built once per engine under the engine's lock (two threads asking first get one part)."""

    def __init__(self, build: Callable[[Engine], P]) -> None:
        self.build = build

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, engine: Engine | None, owner: type) -> P:
        if engine is None:
            return self  # type: ignore[return-value]
        parts = engine.__dict__
        if self.name not in parts:
            with engine._parts_lock:
                if self.name not in parts:
                    parts[self.name] = self.build(engine)
        return parts[self.name]  # type: ignore[no-any-return]


def _loaded(engine: Engine) -> LoadedModel:
    from engine.service.loaded import LoadedModel

    consent = lambda: engine.allow_download  # noqa: E731 - read at each check: an app may change it
    return LoadedModel(engine.registry, engine.machine, engine.slot, allow_download=consent)


def _images(engine: Engine) -> Images:
    from engine.service.images import Images

    return Images(engine.loaded, engine.machine)


def _videos(engine: Engine) -> Videos:
    from engine.service.videos import Videos

    return Videos(engine.loaded, engine.images)


def _training(engine: Engine) -> Training:
    from engine.service.training import Training

    return Training(engine.registry, engine.machine, engine.slot, engine.runs_dir,
                    allow_download=lambda: engine.allow_download, drop_pipeline=engine._drop_pipeline)


def _datasets(engine: Engine) -> Datasets:
    from engine.service.datasets import Datasets

    return Datasets(engine.dataset_roots, engine.runs_dir, lambda: engine.training.current)


def _catalog(engine: Engine) -> Catalog:
    from engine.service.catalog import Catalog

    return Catalog(engine.registry, engine.machine)


def _quantizer(engine: Engine) -> Quantizer:
    from engine.service.quantize import Quantizer

    return Quantizer(engine.registry, engine.machine, engine.slot)


class Engine:
    """One engine per process. Thread-safe: jobs are reserved in one slot under a lock.

    Its parts: :attr:`images` (plan, load, generate images), :attr:`videos` (clips),
    :attr:`loaded` (the one loaded model both share), :attr:`training` (plan, start,
    follow and list runs), :attr:`datasets` (the dataset folders a run trains on),
    :attr:`catalog` (installed families and plugins, model references, tiny builders).
    Each part is built on its first use."""

    #: The one loaded model (its session, phase, generate queue, keep-alive) both doors share.
    loaded = _Part(_loaded)
    images = _Part(_images)
    #: Clips from a loaded video model: the same loaded-model slot as ``images``.
    videos = _Part(_videos)
    training = _Part(_training)
    datasets = _Part(_datasets)
    catalog = _Part(_catalog)
    _quantizer = _Part(_quantizer)

    def __init__(
        self,
        *,
        registry: Registry | None = None,
        hardware: HardwareProfile | MachineRequest | None = None,
        runs_dir: Path | str | None = None,
        residency: Residency | None = None,
        allow_download: bool = True,
        dataset_roots: Sequence[Path | str] | None = None,
    ) -> None:
        """``allow_download``: whether a hub model missing from the local cache may
        be downloaded (many GB); False refuses it with ``download_not_allowed``
        before anything is evicted. The CLI passes the user's ``--allow-download``,
        the server its ``--allow-hub``. ``runs_dir``: where training runs are kept
        (default: $DIFFUSION_ENGINE_HOME/runs, else the per-user data folder).
        ``dataset_roots``: where :attr:`datasets` looks (default: the
        ``datasets`` folder beside the runs folder). ``residency``: the GPU arbiter
        to share with the host (default: the engine's own)."""
        self.allow_download = allow_download
        self.registry = registry or load_registry()
        #: One runs folder for every face: the CLI's ``--runs-dir`` and the server's ``--outputs`` default here.
        self.runs_dir = Path(runs_dir) if runs_dir is not None else default_runs_dir()
        self.dataset_roots = tuple(Path(r) for r in dataset_roots) if dataset_roots is not None else (
            default_datasets_dir(),
        )
        self.slot = JobSlot(residency)
        #: Engines of one process share the GPU: their arbiters hand it over (engine.service.residency).
        self.residency = self.slot.residency
        self._parts_lock = threading.RLock()  # a part's build may ask for another part
        self.machine = Machine(hardware, self.residency, held=self._held)

    def _held(self) -> Releasable | None:
        """What evicting the loaded model would release (nothing before the loaded part exists)."""
        loaded = self.__dict__.get("loaded")
        return loaded.held() if loaded is not None else None

    def _drop_pipeline(self) -> bool:
        """Drop the loaded pipeline for a training start; False where none was loaded."""
        loaded = self.__dict__.get("loaded")
        return loaded.drop() if loaded is not None else False

    # -- its life ---------------------------------------------------------------------

    def close(self) -> None:
        """Unload the loaded model (a running generate stopped before its next block first)."""
        loaded = self.__dict__.get("loaded")
        if loaded is not None:
            loaded.unload(cancel=True)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the engine's own questions -------------------------------------------------

    @staticmethod
    def prewarm_training() -> None:
        """Start the trainer fork server now (Linux; see :mod:`engine.training.forkserver`),
        so its imports of torch and diffusers overlap the caller's own start-up (``train``
        calls it before it builds its Engine); elsewhere, nothing."""
        from engine.training.forkserver import prewarm

        prewarm()

    def quantize(self, model: str, scheme: str, output: str | Path, *, device: str = "auto") -> dict[str, object]:
        """Write ``output``: ``model``'s pipeline with its denoiser stored ``scheme`` (int8 / fp8) as
        torchao tensors in safetensors, which loads with no dense transient and no quantising
        (:mod:`engine.service.quantize`). Every check runs first; holds the job slot while it writes."""
        return self._quantizer.quantize(model, scheme, output, device=device)

    def open_gallery(self, folder: str | Path, *, max_bytes: int | None = None,
                     max_age_s: float | None = None) -> Gallery:
        """The gallery kept in ``folder`` (its entries read back), bounded by ``max_bytes`` and
        ``max_age_s``: the oldest unpinned outputs go first (:mod:`engine.service.gallery`)."""
        from engine.service.gallery import Gallery

        return Gallery(folder, max_bytes=max_bytes, max_age_s=max_age_s)

    def hardware(self, *, verify: bool | None = None) -> HardwareProfile:
        """The machine decisions are made for: the one given, else a probe (see
        :class:`~engine.service.machine.Machine`)."""
        return self.machine.hardware(verify=verify)

    def available_memory(self, *, verify: bool | None = None) -> AvailableMemory:
        """The memory a new job would have: free now plus what evicting the
        engine's pipeline and every registered resident would release."""
        return self.machine.available_memory(verify=verify)

    def status(self) -> dict[str, object]:
        """The job holding the engine, the GPU's owner, the load phase and the loaded pipeline."""
        return {
            "job": self.slot.job,
            "gpu_owner": self.residency.owner,
            "load_phase": self.loaded.phase,
            "pipeline": self.loaded.status(),
        }

    def doctor(self, *, as_json: bool = False) -> str:
        """Versions, then one verdict per family for inference and training (probes with torch)."""
        from engine.service.doctor import run_doctor

        return run_doctor(self, as_json=as_json)

    def register_resident(self, name: str, evict: Callable[[], None], size_gb: float = 0.0) -> Resident:
        """Register a host-owned model the engine may evict when it needs the GPU."""
        _check_host_name(name)
        resident = Resident(name, evict, size_gb)
        self.residency.register(resident)
        return resident

    def unregister_resident(self, name: str) -> bool:
        """Forget a host-owned model (the host freed it itself); True when it was registered."""
        _check_host_name(name)
        return self.residency.unregister(name)

    # -- the spellings before the parts (one release, each warning) -----------------

    plan = _Moved("images", "plan")
    plans = _Moved("images", "plans")
    images_info = _Moved("images", "info")
    check_generate = _Moved("images", "check_generate")
    check_image = _Moved("images", "check_image")
    check_load = _Moved("images", "check_load", adapt=lambda ticket: ticket.plan)
    prepare_runtime = _Moved("images", "prepare_runtime")
    load = _Moved("images", "load")
    generate = _Moved("images", "generate")
    cancel_generation = _Moved("images", "cancel")
    loaded_plan = _Moved("images", "loaded_plan")
    unload = _Moved("images", "unload")

    plan_training = _Moved("training", "plan")
    start_training = _Moved("training", "start")
    training_status = _Moved("training", "status")
    stop_training = _Moved("training", "stop")
    cancel_training = _Moved("training", "cancel")
    wait_training = _Moved("training", "wait")
    runs = _Moved("training", "runs")
    run = _Moved("training", "run")
    run_files = _Moved("training", "files")
    remove_run = _Moved("training", "remove")
    resume_point = _Moved("training", "resume_point")
    train_info = _Moved("training", "info")

    dataset = _Moved("datasets", "get")
    dataset_thumbnail = _Moved("datasets", "thumbnail")
    add_dataset_images = _Moved("datasets", "add_images")
    set_caption = _Moved("datasets", "set_caption")
    remove_dataset_image = _Moved("datasets", "remove_image")
    dataset_in_use = _Moved("datasets", "in_use")

    families = _Moved("catalog", "families")
    family = _Moved("catalog", "family")
    hook_implementations = _Moved("catalog", "hook_implementations")
    plugins = _Moved("catalog", "plugins")
    info = _Moved("catalog", "info")
    check_model = _Moved("catalog", "check_model")
    tiny_pipeline = _Moved("catalog", "tiny_pipeline")
    tiny_dataset = _Moved("catalog", "tiny_dataset")


def _check_host_name(name: str) -> None:
    if name in (PIPELINE, TRAINER):
        raise EngineError(
            f"{name!r} is the engine's own job name; register host models under another name",
            code="invalid_request",
        )
