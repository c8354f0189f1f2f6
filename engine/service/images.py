"""``engine.images``: plan, load and generate images; the image door over the loaded model.

The loaded model itself (its session, phase, generate queue and keep-alive clock) is
:class:`~engine.service.loaded.LoadedModel`, shared with ``engine.videos`` and the
server's queue. This door asks the questions that load nothing (:meth:`Images.plan`,
:meth:`Images.plans`, :meth:`Images.info`), checks a load into a
:class:`~engine.service.tickets.LoadTicket` and a generate into a
:class:`~engine.service.tickets.GenerateTicket` (:mod:`engine.service.generating`: each
decision once), and runs them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from engine.deprecation import moved
from engine.errors import EngineError, UnknownName
from engine.policy.inference import ModelFacts, Plan, plan_inference
from engine.requests.inference import InferenceRequest
from engine.service.machine import Machine

if TYPE_CHECKING:  # the generate's modules (request bodies, tickets, ranks) load with its first check
    from PIL import Image

    from engine.requests.bodies import GenerateBody
    from engine.requests.loras import LoraLike
    from engine.runtime.protocol import Session
    from engine.service.generating import GenerateChecks
    from engine.service.keep_alive import KeepAlive
    from engine.service.loaded import LoadedModel
    from engine.service.tickets import GenerateTicket, LoadTicket

class Images:
    """The image door of one engine: questions, load and generate, over the shared loaded model."""

    def __init__(self, loaded: LoadedModel, machine: Machine) -> None:
        self._loaded = loaded
        self._registry = loaded.registry
        self._machine = machine
        self._generate_checks: GenerateChecks | None = None

    @property
    def _checks(self) -> GenerateChecks:
        """The generate's checks, built on the first generate or its check (a plan needs none)."""
        if self._generate_checks is None:
            from engine.service.generating import GenerateChecks

            self._generate_checks = GenerateChecks(self._loaded)
        return self._generate_checks

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
            from engine.preflight.model import resolve_model

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
        request = _one_window(facts, request)
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
        from engine.policy.info import images_info

        return {
            "hardware": self._machine.hardware(verify=False).to_dict(),
            "families": {f.name: images_info(self._registry, f).to_dict() for f in self._registry.families.values()},
        }

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
        return self._loaded.checks.check((model, base, family, switching), request, loras, controlnet, verify=False)

    def load(self, model: str | LoadTicket | GenerateTicket, *, base: str | None = None, family: str | None = None,
             request: InferenceRequest = InferenceRequest(), loras: Sequence[LoraLike] = (),
             switching: bool = False, controlnet: str | None = None) -> dict[str, object]:
        """Load a pipeline (a model reference, or the ticket :meth:`check_load` or
        :meth:`check_generate` gave); every check runs before anything is evicted.

        ``controlnet``: a diffusers ControlNet folder of a class the family
        declares, loaded beside the pipeline for ``control_image`` generates.
        ``loras`` (``PATH[:SCALE]`` strings, ``{"path", "scale"}`` mappings or
        :class:`~engine.requests.loras.LoraChoice`) are applied at load; each
        is checked against the model's module tree first. ``switching`` says
        LoRAs will be changed later (they then stay unfused)."""
        from engine.service.ranks import split_status, splits
        from engine.service.tickets import GenerateTicket, LoadTicket

        if isinstance(model, GenerateTicket):
            if splits(model):  # its ranks load it at the generate, each its own copy: nothing loads here
                return split_status(self._checks.recheck(model))
            model = self._checks.recheck(model).target.ticket
        if not isinstance(model, LoadTicket):
            model = self._loaded.checks.check((model, base, family, switching), request, loras, controlnet,
                                              verify=True)
        return self._loaded.load(model)

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

    def check_generate(self, body: GenerateBody, *, uploads: Mapping[str, Any] | None = None,
                       base: str | None = None, family: str | None = None, request: InferenceRequest | None = None,
                       controlnet: str | None = None) -> GenerateTicket:
        """Every check a generate of ``body`` makes, loading nothing: a ticket holding the model it
        runs on (the loaded one, or the one its ``model`` names, resolved and planned at its size and
        count), its input images sized from their headers, and its LoRAs read; or the refusal
        (named by the request's field). Pass it to :meth:`generate`.

        ``uploads``: input images given inline (bytes or pictures), by field. ``base``, ``family``,
        ``request`` (the controls) and ``controlnet``: how to load the model ``body`` names, as
        :meth:`load` takes them; given, its LoRAs load with it."""
        from engine.service.generating import load_options

        return self._checks.check(body, "images", uploads=uploads, load=load_options(base, family, request, controlnet))

    def generate(self, prompt: str | GenerateBody | GenerateTicket, *,
                 progress: Callable[[int, int], None] | None = None, loras: Sequence[LoraLike] | None = None,
                 cancel: threading.Event | None = None, **options: object) -> list[Image.Image]:
        """Images for a ticket (:meth:`check_generate`), a :class:`~engine.requests.GenerateBody`,
        or a ``prompt`` with keyword options (steps, guidance, width, height, seed, count, image...);
        ``progress(step, total)`` after each step. ``loras`` (as for :meth:`load`) replaces the
        loaded LoRAs or their scales without reloading the base (``[]`` removes them; None keeps them).
        It holds the ``generating`` reservation throughout; concurrent generates queue on a lock.
        ``cancel``, set from any thread, stops the call with :class:`Cancelled` before it starts or
        before the next block of the running step; :meth:`cancel` sets it."""
        from engine.service.ranks import splits

        ticket = self._checks.ticket(prompt, "images", loras, options)
        if splits(ticket):  # several ranks: fresh ones load and render it (engine.service.ranks)
            return list(self._loaded.run_split(ticket, progress, cancel))
        return self._loaded.run(ticket, progress, cancel)

    def recipes(self, body: GenerateBody, images: Sequence[Any]) -> list[dict[str, object]]:
        """What replays each of ``images`` (just made for ``body`` on the loaded pipeline)."""
        return self._loaded.recipes(body, list(images))

    def cancel(self) -> bool:
        """Stop the running generate before the next block of its step (it raises
        :class:`Cancelled` to its caller); False when none runs. Queued ones still run."""
        return self._loaded.cancel()

    # -- state ------------------------------------------------------------------

    def loaded_plan(self) -> Plan | None:
        """The loaded pipeline's plan as the runtime recorded it (a kernel or
        quantised build that fell back included), or None when none is loaded."""
        return self._loaded.plan()

    def status(self) -> dict[str, object] | None:
        """The loaded pipeline's status (model, plan, LoRAs, its keep-alive clock...), or None."""
        return self._loaded.status()

    @property
    def phase(self) -> str:
        """``idle``, ``evicting``, ``loading``, ``ready`` or ``failed``."""
        return self._loaded.phase

    @property
    def session(self) -> Session | None:
        """The loaded runtime session (the :class:`~engine.runtime.protocol.Session` protocol), or None."""
        return self._loaded.session

    @property
    def keep_alive(self) -> KeepAlive:
        """The loaded model's idle clock (``keep_alive.seconds``: the server's ``--keep-alive``)."""
        return self._loaded.keep_alive

    def unload(self, *, cancel: bool = False) -> bool:
        """Release the loaded pipeline. A running generate is not pulled from
        under: this waits for it to finish (``cancel``: stops it at its next
        step first); a load in progress is :class:`Busy`."""
        return self._loaded.unload(cancel=cancel)

    # -- the spellings before the loaded-model slot (one release, each warning) -----

    target = moved("Engine.images.target()", "Engine.images.check_generate(body).target", "_target_of")
    ensure = moved("Engine.images.ensure()", "Engine.loaded.ensure()", "_loaded.ensure")
    serves = moved("Engine.images.serves()", "Engine.loaded.means()", "_loaded.means")
    loaded_target = moved("Engine.images.loaded_target()", "Engine.loaded.target()", "_loaded.target")
    held = moved("Engine.images.held()", "Engine.loaded.held()", "_loaded.held")
    drop = moved("Engine.images.drop()", "Engine.loaded.drop()", "_loaded.drop")
    weights = moved("Engine.images.weights()", "LoadTicket.weights", "_weights_of")

    def _target_of(self, model: str | None, body: GenerateBody, output: str = "images", *,
                   uploads: Any = None) -> Any:
        checked = body.model_copy(update={"model": model})
        return self._checks.check(checked, output, uploads={"image": uploads} if uploads is not None else None).target

    @staticmethod
    def _weights_of(ticket: LoadTicket) -> Mapping[str, object]:
        return ticket.weights


def _one_window(facts: ModelFacts, request: InferenceRequest) -> InferenceRequest:
    """A plan for a clip longer than its checkpoint renders at once is one window's
    (:mod:`engine.policy.video_windows`; refused where the family cannot chain windows)."""
    import dataclasses

    from engine.policy.video_windows import clip_windows

    spec = facts.family.video_of(facts.checkpoint)
    if request.frames is None or spec is None:
        return request
    windows = clip_windows(facts.family, facts.checkpoint, spec, request.frames)
    return request if windows is None else dataclasses.replace(request, frames=windows.counts[0])
