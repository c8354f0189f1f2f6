"""A model loaded in stable-diffusion.cpp: the CPU engine, behind the same session API.

:class:`SdcppSession` has :class:`~engine.runtime.session.InferenceSession`'s
lifecycle (``load`` / ``generate`` / ``status`` / ``unload``), so ``Engine``,
its faces, the job queue and the PNG metadata see one kind of session. The
context lives in a worker process (:mod:`engine.runtime.sdcpp_worker`, the
persistent server of the earlier system): loaded once, reused by every
generate, stopped at unload. A one-shot CLI generate is the same path, run
once.

- threads: the plan's ``threads`` control (one per physical core);
- cancel: honoured after the step the worker reported, or at once while it
  computes one: the worker is stopped (the library has no cancel) and
  restarted, reloading, at the next generate;
- watchdog: a worker that reports nothing for ``step_timeout`` seconds (a
  load, or one step: the library stuck in a call, the process stopped) is
  killed and the call raises :class:`SdcppStalled`; nothing waits on it for
  ever, so an unload or the next generate always gets the engine back;
- failure: a file the library refuses, a crash or an out-of-memory raise
  :class:`SdcppFailed` with the library's last log lines; ``Engine`` then
  falls back to diffusers where the model loads there, with the reason kept.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from PIL import Image

from engine.errors import Cancelled, EngineError
from engine.places import child_environment
from engine.contract.plugins import Registry
from engine.policy.activations import DEFAULT_SIDE_PX
from engine.requests.batch import batch_items
from engine.policy.plan import Plan
from engine.requests.inference import InferenceRequest
from engine.preflight.images import decode_image
from engine.preflight.lora import LoraFile
from engine.preflight.source import ModelSource
from engine.runtime.generation import GenerateRequest

Progress = Callable[[int, int], None]

#: Seconds a worker may go without a word (a load, or one denoising step) before it is
#: killed: far above a 1024 px step of a 12B model on two cores, far below "for ever".
STEP_TIMEOUT_S = 900.0
#: Where a user with a slower machine (or a test) sets it.
STEP_TIMEOUT_ENV = "DIFFUSION_ENGINE_SDCPP_STEP_TIMEOUT"
#: How often a wait looks at the cancel event and the clock.
_POLL_S = 0.1


class SdcppFailed(EngineError):
    """stable-diffusion.cpp refused the files, crashed or ran out of memory."""

    code = "sdcpp_failed"
    #: The worker's exit status when it died (negative: the signal), else None.
    exit_status: int | None = None


class SdcppFilesRefused(SdcppFailed):
    """stable-diffusion.cpp refused the model's files, or crashed reading them: the files are at fault."""

    code = "sdcpp_files_refused"


class SdcppStalled(EngineError):
    """The sd.cpp worker said nothing within its step timeout; it was killed."""

    code = "sdcpp_stalled"


class UnsupportedOnSdcpp(EngineError):
    """A generate input the sd.cpp engine does not run for this family (a mask, a ControlNet...)."""

    code = "unsupported_on_sdcpp"


class SdcppSession:
    """One model in an sd.cpp worker process. Generates are serialised by a lock."""

    def __init__(self, registry: Registry, source: ModelSource, plan: Plan,
                 request: InferenceRequest = InferenceRequest()) -> None:
        if plan.sdcpp is None:
            raise EngineError("this plan does not run on sd.cpp (its engine control is not sdcpp)",
                              code="incompatible_plan")
        self.registry = registry
        self.source = source
        self.plan = plan
        self.request = request
        self.files = dict(plan.sdcpp.files)
        self.threads = int(plan.value("threads") or 1)  # the plan's: one per physical core (engine.policy.speed)
        #: Why this session replaced another (unused here; diffusers sessions record their fallback).
        self.fallback: dict[str, object] | None = None
        self.loras: Any = None
        #: Why diffusers could not take the model over if sd.cpp fails (None: it can).
        self.diffusers_refusal: EngineError | None = None
        self.load_seconds: float | None = None
        self.restarts = 0
        self.step_timeout = step_timeout()
        self._worker: subprocess.Popen[str] | None = None
        self._events: _EventPipe | None = None
        self._log: Any = None
        self._lock = threading.Lock()

    # -- lifecycle ----------------------------------------------------------------

    def load(self, progress: Progress | None = None) -> None:
        """Start the worker and load the files into its context."""
        read_fd, write_fd = os.pipe()
        if self._log is not None:  # a restart: the last worker's log is not needed any more
            self._log.close()
        self._log = tempfile.TemporaryFile(mode="w+")
        env = child_environment(OMP_NUM_THREADS=str(self.threads))
        self._worker = subprocess.Popen(
            [sys.executable, "-m", "engine.runtime.sdcpp_worker", str(write_fd)],
            stdin=subprocess.PIPE, stdout=self._log, stderr=self._log, text=True,
            pass_fds=(write_fd,), env=env,
        )
        os.close(write_fd)
        self._events = _EventPipe(read_fd)
        self._send({"op": "load", "files": self.files, "threads": self.threads})
        try:
            event = self._next_event("loading the files")
        except SdcppFailed as exc:
            if exc.exit_status == -signal.SIGKILL:  # killed: out of memory, not the files' fault
                raise
            raise self._refused(exc.message) from None
        if event["event"] != "loaded":
            self.unload()
            raise self._refused(event["message"])
        self.load_seconds = float(event["seconds"])

    def _refused(self, why: str) -> SdcppFilesRefused:
        named = ", ".join(f"{argument}={path}" for argument, path in self.files.items())
        return SdcppFilesRefused(f"stable-diffusion.cpp could not read the files of {self.source.location} "
                                 f"({named}): {why}")

    def unload(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait()
        if self._events is not None:
            self._events.close()
            self._events = None
        if worker is not None and worker.stdin is not None:
            with contextlib.suppress(OSError):
                worker.stdin.close()

    @property
    def loaded(self) -> bool:
        return self._worker is not None and self._worker.poll() is None

    def set_loras(self, files: Sequence[LoraFile]) -> None:
        if files:
            raise UnsupportedOnSdcpp("LoRAs run on diffusers only; load with engine=diffusers to apply them")

    def status(self) -> dict[str, object]:
        return {
            "loaded": self.loaded,
            "engine": "sdcpp",
            "model": self.source.to_dict(),
            "plan": self.plan.to_dict(),
            "sdcpp": {"files": self.files, "threads": self.threads, "load_seconds": self.load_seconds,
                      "worker_pid": self._worker.pid if self._worker else None, "restarts": self.restarts},
            "fallback": self.fallback,
            "loras": None,
            "workflows": sorted(self.source.family.sdcpp.workflows),
        }

    # -- generate -----------------------------------------------------------------

    def generate(self, request: GenerateRequest, progress: Progress | None = None,
                 cancel: threading.Event | None = None) -> list[Image.Image]:
        """The request's images: one sd.cpp call per prompt/seed pair (``count`` images of a
        prompt use seeds ``seed, seed + 1...`` as the diffusers path does). ``cancel``, set
        from any thread, stops the worker at once, even in the middle of a step."""
        arguments, init_image = self._arguments(request)
        with self._lock:
            if not self.loaded:  # stopped by a cancel (or a crash): start it again
                self.restarts += 1
                self.load()
            images: list[Image.Image] = []
            items = batch_items(request.prompt, prompts=request.prompts, seeds=request.seeds,
                                seed=request.seed, count=request.count, negative_prompt=request.negative_prompt)
            for item in items:
                self._send({"op": "generate", "arguments": {**arguments, "prompt": item.prompt, "seed": item.seed},
                            "init_image": init_image})
                while True:
                    event = self._next_event("computing a step", cancel)
                    if event["event"] == "step":
                        try:
                            if progress is not None:
                                progress(int(event["step"]), int(event["steps"]))
                        except Cancelled:
                            self.unload()  # the library has no cancel: stop its process after this step
                            raise
                    elif event["event"] == "images":
                        images.extend(_decode(item) for item in event["images"])
                        break
                    else:
                        raise SdcppFailed(f"stable-diffusion.cpp failed to generate: {event['message']}")
            return images

    def _arguments(self, request: GenerateRequest) -> tuple[dict[str, object], str | None]:
        """The binding's arguments for ``request``; an input it does not run is refused here,
        before the worker is asked anything."""
        family = self.source.family
        support = family.sdcpp
        for name, given in (("mask_image", request.mask_image), ("control_image", request.control_image)):
            if given is not None:
                raise UnsupportedOnSdcpp(f"{name} runs on diffusers only; load with engine=diffusers for it")
        if request.loras:
            self.set_loras(request.loras)
        init_image = None
        if request.image is not None:
            if "img2img" not in support.workflows:
                raise UnsupportedOnSdcpp(f"image-to-image on {family.label} runs on diffusers only here; "
                                         "load with engine=diffusers")
            init_image = _encode(request.image)
        checkpoint = self.source.checkpoint or family.default_checkpoint
        guidance = request.guidance if request.guidance is not None else checkpoint.default_guidance
        width = request.width or DEFAULT_SIDE_PX  # the diffusers pipelines' default too
        height = request.height or DEFAULT_SIDE_PX
        multiple = family.rendering.sides
        if width % multiple or height % multiple:
            raise EngineError(f"width and height must be multiples of {multiple} for {family.label} "
                              f"(got {width}x{height})", code="invalid_request")
        arguments: dict[str, object] = {
            "negative_prompt": request.negative_prompt or "",
            "width": width, "height": height,
            "sample_steps": request.steps or self.plan.default_steps,
        }
        if support.guidance_argument == "guidance":  # distilled guidance: no CFG pass
            arguments.update(guidance=float(guidance), cfg_scale=1.0)
        else:
            arguments["cfg_scale"] = float(guidance)
        if init_image is not None:
            arguments["strength"] = 0.75 if request.strength is None else float(request.strength)
        return arguments, init_image

    # -- the worker's pipes -------------------------------------------------------

    def _send(self, message: dict[str, object]) -> None:
        """Write one request; a worker that stops reading (its pipe full) is a stall like any other."""
        worker = self._worker
        if worker is None or worker.stdin is None:
            raise SdcppFailed("the sd.cpp worker is not running")
        fd = worker.stdin.fileno()
        os.set_blocking(fd, False)
        data = memoryview((json.dumps(message) + "\n").encode())
        deadline = time.monotonic() + self.step_timeout
        while data:
            self._check_clock(deadline, "reading a request")
            _, writable, _ = select.select([], [fd], [], _POLL_S)
            if writable:
                try:
                    data = data[os.write(fd, data):]
                except BlockingIOError:
                    continue
                except BrokenPipeError:
                    break  # it died: the next event says how

    def _next_event(self, doing: str, cancel: threading.Event | None = None) -> dict[str, Any]:
        """The worker's next event, within ``step_timeout`` seconds; ``cancel`` looked at meanwhile."""
        events = self._events
        deadline = time.monotonic() + self.step_timeout
        while events is not None:
            if cancel is not None and cancel.is_set():
                self.unload()  # the library has no cancel: its process goes
                raise Cancelled("the generate was cancelled while sd.cpp computed a step")
            self._check_clock(deadline, doing)
            line = events.line(_POLL_S)
            if line is not None:
                if line:
                    return json.loads(line)
                break  # end of file: the worker exited
        code = self._worker.wait() if self._worker is not None else None
        self.unload()
        failed = SdcppFailed(f"the sd.cpp worker stopped (exit status {code}): {self.log_tail()}")
        failed.exit_status = code
        raise failed

    def _check_clock(self, deadline: float, doing: str) -> None:
        if time.monotonic() < deadline:
            return
        self.unload()
        raise SdcppStalled(
            f"the sd.cpp worker said nothing for {self.step_timeout:g} s while {doing} and was stopped; "
            f"set {STEP_TIMEOUT_ENV} to a larger number of seconds if this machine needs longer per step")

    def log_tail(self, lines: int = 6) -> str:
        """The library's last log lines (what it said before failing)."""
        if self._log is None:
            return ""
        self._log.seek(0)
        tail = collections.deque((line.rstrip() for line in self._log if line.strip()), maxlen=lines)
        return " | ".join(tail)


def step_timeout() -> float:
    """:data:`STEP_TIMEOUT_S`, or the positive number of seconds in :data:`STEP_TIMEOUT_ENV`."""
    given = os.environ.get(STEP_TIMEOUT_ENV, "").strip()
    if not given:
        return STEP_TIMEOUT_S
    try:
        seconds = float(given)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise EngineError(f"{STEP_TIMEOUT_ENV}={given!r} is not a positive number of seconds",
                          code="invalid_request")
    return seconds


class _EventPipe:
    """The worker's event lines, read from the raw descriptor so that a wait can time out
    (a buffered file's ``readline`` would block, and hide buffered lines from ``select``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._pending = bytearray()
        self._eof = False

    def line(self, timeout: float) -> str | None:
        """The next line; ``""`` at end of file; None when none came within ``timeout``."""
        while True:
            end = self._pending.find(b"\n")
            if end >= 0:
                line = bytes(self._pending[:end + 1])
                del self._pending[:end + 1]
                return line.decode()
            if self._eof:
                return ""
            ready, _, _ = select.select([self.fd], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(self.fd, 1 << 16)
            if chunk:
                self._pending += chunk
            else:
                self._eof = True
                if self._pending:  # a last line without its newline
                    line = bytes(self._pending)
                    self._pending.clear()
                    return line.decode()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _encode(image: Any) -> str:
    buffer = io.BytesIO()
    picture = image if isinstance(image, Image.Image) else decode_image(image, "image")
    picture.convert("RGB").save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _decode(item: dict[str, Any]) -> Image.Image:
    return Image.frombytes("RGB", (int(item["width"]), int(item["height"])), base64.b64decode(item["data"]))
