"""``engine.images``: plan, load, generate and unload an image pipeline.

A load runs in one order, so nothing is evicted before the last cheap check
passed: resolve the model -> diffusers' refusal (a lone single file, an
uncached hub model) -> the LoRA and ControlNet files -> plan -> reserve the
job slot (:class:`~engine.errors.Busy` if another job holds it) -> evict ->
load. :meth:`Images.check_load` runs the checks and returns them as a
:class:`~engine.service.tickets.LoadTicket`; :meth:`Images.load` takes that
ticket (or runs the checks itself) and re-checks only what can change.

A generate is a GPU job too: while one runs, a training start, a load or an
unload is Busy; concurrent generates queue and run one after another.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from engine.errors import Busy, Cancelled, EngineError, UnknownName
from engine.contract.plugins import Registry
from engine.policy.available import Releasable
from engine.policy.inference import ModelFacts, Plan, plan_inference
from engine.policy.info import images_info
from engine.preflight.hub import weights_report
from engine.preflight.lora import read_loras
from engine.preflight.model import resolve_model
from engine.requests.bodies import GenerateBody
from engine.requests.inference import InferenceRequest
from engine.requests.loras import LoraLike, lora_choices
from engine.runtime.protocol import Session, cancellable
from engine.service.keep_alive import KeepAlive
from engine.service.machine import Machine
from engine.service.residency import Resident
from engine.service.slot import PIPELINE, JobSlot
from engine.service.load_checks import LoadChecks
from engine.service import targets
from engine.service.targets import Target
from engine.service.tickets import LoadTicket
from engine.policy.video import check_output

if TYPE_CHECKING:
    from PIL import Image


class Images:
    """The image pipeline of one engine: its session, its load phase, its generate queue."""

    def __init__(self, registry: Registry, machine: Machine, slot: JobSlot, *,
                 allow_download: Callable[[], bool]) -> None:
        self._registry = registry
        self._machine = machine
        self._slot = slot
        self._allow_download = allow_download
        self._session: Session | None = None
        #: The ticket the loaded pipeline was loaded with: a job queued for it reloads it from there.
        self._ticket: LoadTicket | None = None
        self._phase = "idle"
        #: Serialises generates; never held while reserving other jobs.
        self._generate_lock = threading.Lock()
        #: The running generate's cancel event (see :meth:`cancel`).
        self._cancel: threading.Event | None = None
        self._checks = LoadChecks(registry, machine, allow_download, id(self))
        self.keep_alive = KeepAlive(self.unload, lambda: self._slot.job is not None or self._generate_lock.locked())

    # -- questions --------------------------------------------------------------

    def plan(self, model: str | None = None, *, family: str | None = None, checkpoint: str | None = None,
             base: str | None = None, request: InferenceRequest = InferenceRequest(),
             controlnet: str | None = None) -> Plan:
        """The plan a load would make (``controlnet``: a ControlNet folder loaded
        beside ``model``, sized in like any component).

        A question, not a load: a single file without its base is planned with its
        other components sized from the family's table, and a hub model that is not
        here from its table too; :meth:`check_load` refuses both (``base_required``,
        ``download_not_allowed``), as the load would."""
        if model is not None:
            facts = resolve_model(self._registry, model, family=family, base=base).facts(self._registry)
        elif family is not None:
            spec = self._registry.family(family)
            chosen = spec.checkpoint(checkpoint) if checkpoint else spec.default_checkpoint
            if chosen is None:
                raise UnknownName("checkpoint", str(checkpoint), [c.name for c in spec.checkpoints])
            facts = ModelFacts(spec, chosen, self._registry.component_sizes(spec, chosen))
        else:
            raise EngineError("give a model path or a family", code="invalid_request")
        if controlnet is not None:
            from engine.preflight.controlnet import check_controlnet, with_controlnet

            facts = with_controlnet(facts, check_controlnet(facts.family, controlnet))
        return plan_inference(self._registry, facts, self._machine.hardware(), request,
                              available=self._machine.available_memory())

    def plans(self, request: InferenceRequest = InferenceRequest()) -> dict[str, dict[str, object]]:
        """Each family's default checkpoint planned for this machine, or the refusal a
        load would give (``{"error": {"code", "message"}}``): why it cannot run here is an answer too."""
        answers: dict[str, dict[str, object]] = {}
        for name in self._registry.families:
            try:
                answers[name] = self.plan(family=name, request=request).to_dict()
            except EngineError as error:
                answers[name] = {"error": {"code": error.code, "message": error.message}}
        return answers

    def info(self) -> dict[str, object]:
        """Each family's component sizes and resident GB per scheme, from the
        tables alone: torch-free (the machine from the light probe, never the
        torch-verified one), so a panel can show the trade-off before loading."""
        return {
            "hardware": self._machine.hardware(verify=False).to_dict(),
            "families": {f.name: images_info(self._registry, f).to_dict() for f in self._registry.families.values()},
        }

    def check_generate(self, request: Any) -> None:
        """Refuse, before anything loads, a generate whose input images are missing,
        unreadable or beyond the caps (each named by its request field)."""
        from engine.preflight.images import named_images

        for name in ("image", "mask_image", "control_image"):
            for field, value in named_images(getattr(request, name), name):  # a list: each by its place
                self.check_image(value, field)

    def check_image(self, value: Any, field: str) -> tuple[int, int]:
        """An input image's (width, height) from its header, within the engine's caps;
        nothing decoded, so a bomb is refused (``invalid_image``, naming ``field``) for nothing."""
        from engine.preflight.images import image_size

        return image_size(value, field)

    # -- load -------------------------------------------------------------------

    def check_load(self, model: str, *, base: str | None = None, family: str | None = None,
                   request: InferenceRequest = InferenceRequest(), loras: Sequence[LoraLike] = (),
                   switching: bool = False, controlnet: str | None = None) -> LoadTicket:
        """Every check :meth:`load` makes, loading nothing: a ticket with the plan it would
        load with (and what it resolved), or the refusal it would give (a single file without
        its base, an uncached hub model without consent, a LoRA that is missing or for another
        model...). Pass the ticket to :meth:`load`."""
        return self._checks.check((model, base, family, switching), request, loras, controlnet, verify=False)

    def load(self, model: str | LoadTicket, *, base: str | None = None, family: str | None = None,
             request: InferenceRequest = InferenceRequest(), loras: Sequence[LoraLike] = (),
             switching: bool = False, controlnet: str | None = None) -> dict[str, object]:
        """Load a pipeline (a model reference, or the ticket :meth:`check_load` gave);
        every check runs before anything is evicted.

        ``controlnet``: a diffusers ControlNet folder of a class the family
        declares, loaded beside the pipeline for ``control_image`` generates.
        ``loras`` (``PATH[:SCALE]`` strings, ``{"path", "scale"}`` mappings or
        :class:`~engine.requests.loras.LoraChoice`) are applied at load; each
        is checked against the model's module tree first. ``switching`` says
        LoRAs will be changed later (they then stay unfused)."""
        from engine.runtime.engines import start_session

        if isinstance(model, LoadTicket):
            ticket = self._checks.recheck(model)
        else:
            ticket = self._checks.check((model, base, family, switching), request, loras, controlnet, verify=True)
        self._slot.reserve("loading")
        try:
            self._phase = "evicting"
            self.drop()
            self._slot.residency.acquire(PIPELINE)
            self._phase = "loading"
            session = start_session(self._registry, ticket.source, ticket.plan, ticket.request,
                                    loras=ticket.loras, controlnet=ticket.controlnet,
                                    diffusers_refusal=ticket.refusal)
            self._session, self._ticket = session, ticket
            self._slot.residency.register(Resident(PIPELINE, self.drop))
            self._phase = "ready"
            self.keep_alive.loaded()
            return session.status()
        except BaseException:
            self._phase = "failed"
            self._slot.residency.release_if(lambda owner: owner == PIPELINE)
            raise
        finally:
            self._slot.release("loading")

    # -- the model a request names ------------------------------------------------

    def target(self, model: str | None, body: Any, output: str = "images", *,
               uploads: bytes | list[bytes] | None = None) -> Target:
        """The model ``body`` runs on (``model``: its reference, or None for the loaded one),
        judged against that model before anything is evicted (:mod:`engine.service.targets`;
        ``uploads``: input images uploaded beside the body, judged in place of its ``image``)."""
        return targets.target(self, model, body, output, uploads=uploads)

    def ensure(self, chosen: Target) -> bool:
        """Load ``chosen`` unless it is the loaded model; True when it loaded."""
        return targets.ensure(self, chosen)

    def switch_for(self, body: GenerateBody, output: str = "images") -> GenerateBody:
        """Load the model ``body`` names (judged first, as :meth:`target` judges it) unless it is
        in; the body for the loaded model (``model`` dropped). Both doors call it before they run."""
        if body.model is None:
            return body
        self.ensure(self.target(body.model, body, output))
        return body.model_copy(update={"model": None})

    def serves(self, name: str | None) -> bool:
        """Whether a request's ``model`` means the loaded model (none, one of its names, OpenAI's)."""
        return targets.means_loaded(self, name)

    def loaded_target(self) -> Target | None:
        """The loaded model as a target (its load's ticket), or None."""
        ticket = self._ticket if self._session is not None else None
        return Target(ticket) if ticket is not None else None

    @property
    def registry(self) -> Registry:
        return self._registry

    def prepare_runtime(self) -> float:
        """Import the runtime stack (torch, diffusers, transformers, peft) now; seconds it took
        (0 when already imported), so a face can report start-up apart from loading."""
        import importlib
        import sys
        import time

        started = time.perf_counter()
        if "engine.runtime.session" not in sys.modules:
            importlib.import_module("engine.runtime.session")
        return time.perf_counter() - started

    # -- generate ---------------------------------------------------------------

    def generate(self, prompt: str | GenerateBody, *, progress: Callable[[int, int], None] | None = None,
                 loras: Sequence[LoraLike] | None = None, cancel: threading.Event | None = None,
                 **options: object) -> list[Image.Image]:
        """Images for a :class:`~engine.requests.GenerateBody` (the request every face builds), or
        a ``prompt`` with keyword options (steps, guidance, width, height, seed, count, image...);
        ``progress(step, total)`` after each step. ``loras`` (as for :meth:`load`) replaces the
        loaded LoRAs or their scales without reloading the base (``[]`` removes them; None keeps them).
        It holds the ``generating`` reservation throughout; concurrent generates queue on a lock.
        ``cancel``, set from any thread, stops the call with :class:`Cancelled` before it starts or
        after the running step; :meth:`cancel` sets it."""
        return self.run("images", prompt, progress=progress, loras=loras, cancel=cancel, **options)

    def run(self, output: str, prompt: str | GenerateBody, *, progress: Callable[[int, int], None] | None = None,
            loras: Sequence[LoraLike] | None = None, cancel: threading.Event | None = None,
            **options: object) -> list[Any]:
        """The generate both doors share (``engine.images`` and ``engine.videos``): the loaded
        pipeline's outputs, refused (``wrong_output``) where its family's ``output`` is not
        ``output`` (a video model asked for images through the images door, say)."""
        from engine.runtime.engines import fall_back_from
        from engine.runtime.sdcpp import SdcppFailed
        from engine.runtime.session import GenerateRequest

        if isinstance(prompt, GenerateBody):  # the typed request: its model, options and LoRAs
            prompt = self.switch_for(prompt, output)
            options = {**prompt.options(), **options}
            if loras is None and prompt.loras is not None:
                loras = [{"path": lo.path, "scale": lo.scale} for lo in prompt.loras]
            prompt = prompt.prompt
        keep = options.pop("keep_alive", None)  # how long the model stays after this call
        cancel = cancel or threading.Event()
        step = cancellable(progress, cancel)
        for name in ("prompts", "seeds"):
            if name in options:  # a request model's list (or None: unset)
                options[name] = tuple(options[name] or ())  # type: ignore[call-overload]
        with self._generate_lock:
            self._slot.reserve("generating")
            self._cancel = cancel
            try:
                session = self._session
                if session is None:
                    raise EngineError("no image pipeline is loaded; load one first", code="not_loaded")
                check_output(session.source.family, output)
                targets.check_references(session.source.family, session.source.checkpoint, options.get("image"))
                files = None if loras is None else read_loras(lora_choices(loras))
                if cancel.is_set():
                    raise Cancelled("the generate was cancelled before it started")
                call = GenerateRequest(prompt=prompt, loras=files, **options)  # type: ignore[arg-type]
                try:
                    return session.generate(call, step, cancel)
                except SdcppFailed as exc:  # the CPU engine failed: diffusers takes the model over
                    self._session = fall_back_from(session, exc)
                    return self._session.generate(call, step, cancel)
            finally:
                self._cancel = None
                self._slot.release("generating")
                self.keep_alive.touch(keep)  # type: ignore[arg-type]

    def recipes(self, body: GenerateBody, images: Sequence[Any]) -> list[dict[str, object]]:
        """What replays each of ``images`` (just made for ``body`` on the loaded pipeline): the
        request as it ran and what engaged (:mod:`engine.service.recipes`); [] when none is loaded."""
        from engine.service.recipes import image_recipes

        session = self._session
        return image_recipes(body, session, list(images)) if session is not None else []

    def cancel(self) -> bool:
        """Stop the running generate after its current denoising step (it raises
        :class:`Cancelled` to its caller); False when none runs. Queued ones still run."""
        cancel = self._cancel
        if cancel is None:
            return False
        cancel.set()
        return True

    # -- state ------------------------------------------------------------------

    def loaded_plan(self) -> Plan | None:
        """The loaded pipeline's plan as the runtime recorded it (a kernel or
        quantised build that fell back included), or None when none is loaded."""
        session = self._session
        return session.plan if session is not None else None

    def status(self) -> dict[str, object] | None:
        """The loaded pipeline's status (model, plan, LoRAs, its keep-alive clock...), or None."""
        session = self._session
        return {**session.status(), "keep_alive": self.keep_alive.status()} if session is not None else None

    @property
    def phase(self) -> str:
        """``idle``, ``evicting``, ``loading``, ``ready`` or ``failed``."""
        return self._phase

    @property
    def session(self) -> Session | None:
        """The loaded runtime session (the :class:`~engine.runtime.protocol.Session` protocol), or None."""
        return self._session

    def held(self) -> Releasable | None:
        """What evicting the loaded pipeline would release, for the memory a new job would have."""
        session = self._session
        if session is None:
            return None
        return Releasable(PIPELINE, _held_gb(session.plan), "the engine's loaded pipeline (its plan)")

    def unload(self, *, cancel: bool = False) -> bool:
        """Release the loaded pipeline. A running generate is not pulled from
        under: this waits for it to finish (``cancel``: stops it at its next
        step first); a load in progress is :class:`Busy`."""
        busy = "the engine is busy loading; unload when it is done"
        self._slot.refuse_if("loading", busy)
        if cancel:
            self.cancel()
        with self._generate_lock:  # held by a running generate: wait for it
            with self._slot.lock:
                if self._slot.job == "loading":
                    raise Busy(busy)
                dropped = self.drop()
        self._slot.residency.release_if(lambda owner: owner == PIPELINE)
        return dropped

    def drop(self) -> bool:
        """Release the session now (an eviction, or a training start); True when one was loaded."""
        session, self._session = self._session, None
        self.keep_alive.stop()
        self._slot.residency.unregister(PIPELINE)
        if session is None:
            return False
        session.unload()
        self._phase = "idle"
        return True

    def weights(self, ticket: LoadTicket) -> dict[str, object]:
        """Whether a ticket's weights are here (if not: the download a load needs)."""
        return weights_report(ticket.source,
                              self._registry.component_sizes(ticket.source.family, ticket.source.checkpoint))


def _held_gb(plan: Plan) -> float:
    """Device GB a loaded pipeline holds between calls: its weights when
    resident (or when the device is the host), little when offloaded; sd.cpp's files as stored."""
    if plan.sdcpp is not None:
        return plan.sdcpp.gb
    if plan.value("memory_mode") == "resident" or plan.device == "cpu":
        return plan.estimate.resident_gb
    return 0.0
