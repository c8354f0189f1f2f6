"""``engine.loaded``: the one loaded model, which ``engine.images``, ``engine.videos`` and the
server's queue share.

It holds the runtime session, the ticket it was loaded with, the load's phase, the
generate lock and the running generate's cancel event, and the keep-alive clock: the
state of "what is in memory now". The doors (:mod:`engine.service.images`,
:mod:`engine.service.videos`) are thin over it: they check a request into a
:class:`~engine.service.tickets.GenerateTicket` and hand it here to run, each naming
its own medium in its refusals.

A load runs in one order, so nothing is evicted before the last cheap check passed:
resolve the model -> diffusers' refusal (a lone single file, an uncached hub model) ->
the LoRA and ControlNet files -> plan -> reserve the job slot
(:class:`~engine.errors.Busy` if another job holds it) -> evict -> load. A generate is a
GPU job too: while one runs, a training start, a load or an unload is Busy; concurrent
generates queue on a lock and run one after another.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from engine.contract.plugins import Registry
from engine.errors import Busy, Cancelled, EngineError
from engine.policy.available import Releasable
from engine.policy.inference import Plan
from engine.runtime.protocol import Session, cancellable
from engine.service.keep_alive import KeepAlive
from engine.service.load_checks import LoadChecks
from engine.service.machine import Machine
from engine.service.residency import Resident
from engine.service.slot import PIPELINE, JobSlot
from engine.service.tickets import GenerateTicket, LoadTicket, Target

if TYPE_CHECKING:
    from engine.requests.bodies import GenerateBody
    from engine.runtime.sdcpp import SdcppSession

class LoadedModel:
    """The loaded pipeline of one engine: its session, its load ticket, its phase and generate queue."""

    def __init__(self, registry: Registry, machine: Machine, slot: JobSlot, *,
                 allow_download: Callable[[], bool]) -> None:
        self.registry = registry
        self._slot = slot
        self._session: Session | None = None
        #: The ticket the loaded pipeline was loaded with: a job queued for it reloads it from there.
        self._ticket: LoadTicket | None = None
        self._phase = "idle"
        #: Serialises generates; never held while reserving other jobs.
        self._generate_lock = threading.Lock()
        #: The running generate's cancel event (see :meth:`cancel`).
        self._cancel: threading.Event | None = None
        self.checks = LoadChecks(registry, machine, allow_download, id(self))
        self.keep_alive = KeepAlive(self.unload, lambda: self._slot.job is not None or self._generate_lock.locked())

    # -- load -------------------------------------------------------------------

    def load(self, ticket: LoadTicket) -> dict[str, object]:
        """Load the ticket's model (re-checked only where something can have changed since);
        every check runs before anything is evicted. The session's status."""
        from engine.runtime.engines import start_session

        ticket = self.checks.recheck(ticket)
        self._slot.reserve("loading")
        try:
            self._phase = "evicting"
            self.drop()
            self._slot.residency.acquire(PIPELINE)
            self._phase = "loading"
            session = start_session(self.registry, ticket.source, ticket.plan, ticket.request,
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

    def ensure(self, chosen: Target) -> bool:
        """Load ``chosen`` unless it is the loaded model; True when it loaded."""
        loaded = self.target()
        if loaded is not None and loaded.key == chosen.key:
            return False
        self.load(chosen.ticket)
        return True

    def target(self) -> Target | None:
        """The loaded model as a target (its load's ticket), or None."""
        ticket = self._ticket if self._session is not None else None
        return Target(ticket) if ticket is not None else None

    def means(self, name: str | None) -> bool:
        """Whether a request's ``model`` means the loaded model (none, one of its names, OpenAI's)."""
        from engine.service.targets import means_loaded

        return means_loaded(self.target(), name)

    # -- generate ---------------------------------------------------------------

    def run(self, ticket: GenerateTicket, progress: Callable[[int, int], None] | None = None,
            cancel: threading.Event | None = None) -> list[Any]:
        """Run a checked request on its model (loaded first when another is in): what the
        pipeline gave back (images, or one clip's frames). It holds the ``generating``
        reservation throughout; ``cancel``, set from any thread, stops it with
        :class:`Cancelled` before it starts or before the next block of its step."""
        from engine.runtime.engines import fall_back_from
        from engine.runtime.sdcpp import SdcppFailed
        from engine.service.generating import MEDIUM, call_for

        cancel = cancel or threading.Event()
        step = cancellable(progress, cancel)
        with self._generate_lock:
            self.ensure(ticket.target)  # its model, if another came in since the check
            self._slot.reserve("generating")
            self._cancel = cancel
            try:
                session = self._session
                if session is None or session.source.location != ticket.target.key:
                    raise EngineError(f"the {MEDIUM[ticket.output]} this request was checked for is not loaded "
                                      "(another load took its place); send the request again", code="not_loaded")
                if cancel.is_set():
                    raise Cancelled("the generate was cancelled before it started")
                call = call_for(ticket)
                try:
                    return session.generate(call, step, cancel)
                except SdcppFailed as exc:  # the CPU engine failed: diffusers takes the model over
                    self._session = fall_back_from(cast("SdcppSession", session), exc)
                    return self._session.generate(call, step, cancel)
            finally:
                self._cancel = None
                self._slot.release("generating")
                self.keep_alive.touch(ticket.body.keep_alive)

    def run_split(self, ticket: GenerateTicket, progress: Callable[[int, int], None] | None = None,
                  cancel: threading.Event | None = None) -> Any:
        """Run a ticket whose plan splits it across ranks (:mod:`engine.service.ranks`): fresh
        ranks load its model, render, and rank 0's result comes back (images, or a clip). The
        loaded model is dropped first where the ranks take the GPUs; on a CPU it stays."""
        from engine.service.ranks import rank_job, run_on_ranks

        cancel = cancel or threading.Event()
        with self._generate_lock:
            self._slot.reserve("generating")
            self._cancel = cancel
            try:
                if ticket.plan.parallel.device == "cuda":
                    self.drop()
                return run_on_ranks(rank_job(ticket, self.checks.allow_download()), progress, cancel)
            finally:
                self._cancel = None
                self._slot.release("generating")

    def cancel(self) -> bool:
        """Stop the running generate before the next block of its step (it raises
        :class:`Cancelled` to its caller); False when none runs. Queued ones still run."""
        cancel = self._cancel
        if cancel is None:
            return False
        cancel.set()
        return True

    def recipes(self, body: GenerateBody, images: list[Any]) -> list[dict[str, object]]:
        """What replays each of ``images`` (just made for ``body`` on the loaded pipeline): the
        request as it ran and what engaged (:mod:`engine.service.recipes`); [] when none is loaded."""
        from engine.service.recipes import image_recipes

        session = self._session
        return image_recipes(body, session, images) if session is not None else []

    # -- state ------------------------------------------------------------------

    @property
    def session(self) -> Session | None:
        """The loaded runtime session (the :class:`~engine.runtime.protocol.Session` protocol), or None."""
        return self._session

    @property
    def job(self) -> str | None:
        """The job holding the engine's slot now (``loading``, ``generating``, ``training``), or None."""
        return self._slot.job

    @property
    def phase(self) -> str:
        """``idle``, ``evicting``, ``loading``, ``ready`` or ``failed``."""
        return self._phase

    def plan(self) -> Plan | None:
        """The loaded pipeline's plan as the runtime recorded it (a kernel or
        quantised build that fell back included), or None when none is loaded."""
        session = self._session
        return session.plan if session is not None else None

    def status(self) -> dict[str, object] | None:
        """The loaded pipeline's status (model, plan, LoRAs, its keep-alive clock...), or None."""
        session = self._session
        return {**session.status(), "keep_alive": self.keep_alive.status()} if session is not None else None

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


def _held_gb(plan: Plan) -> float:
    """Device GB a loaded pipeline holds between calls: its weights when
    resident (or when the device is the host), little when offloaded; sd.cpp's files as stored."""
    if plan.sdcpp is not None:
        return plan.sdcpp.gb
    if plan.value("memory_mode") == "resident" or plan.device == "cpu":
        return plan.estimate.resident_gb
    return 0.0
