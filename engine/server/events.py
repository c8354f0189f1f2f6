"""Server-Sent Events: a job's progress and the training run's, as ``text/event-stream``.

Plain SSE over starlette's ``StreamingResponse``; a browser reads it with
``EventSource``. Every event's ``data`` is one JSON object. A comment line
(``: keep-alive``) goes out every :data:`KEEP_ALIVE_S` seconds of silence so
proxies do not cut an idle stream.

``GET /v1/images/jobs/{id}/events`` (404 JSON error for an unknown id)::

    event: queued     data: {"id", "position"}         # at once if queued, then at every move
    event: running    data: {"id", "step", "steps"}    # the job started
    event: step       data: {"id", "step", "steps"}    # after each denoising step
    event: done | failed | cancelled                   # the job's JSON (as GET gives it, images
                      data: {...}                      #   included), then the stream ends

``GET /v1/training/events`` stays open until the client closes it, across runs::

    event: state      data: {"run_id", "status", "phase", "step", "steps", "error"}
                      # at once ({"status": "idle", ...} before any run), then on every change
    event: step       data: {"run_id", "step", "steps", "loss", "lr"}
                      # each new step the run published (loss / lr: the latest values, or null);
                      # a run's last step comes before the state event that ends it

A page closes its ``EventSource`` on the final job event: a browser
reconnects to a stream the server ended, and would get that event again.
An open stream holds uvicorn's graceful shutdown until it closes (the
server's ``timeout_graceful_shutdown`` bounds that wait).

A step event can stand for several steps (the run's status is published
every 0.2 s, a fast job's steps may outpace a slow reader): ``step`` is
always the newest. Like every route, both need the bearer token; as the
browser's ``EventSource`` cannot send headers, these two routes (and only
these) also take it as ``?token=`` (see :mod:`engine.server.guard`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse

from engine.server.jobs import TERMINAL, Job

#: Seconds of silence before a keep-alive comment.
KEEP_ALIVE_S = 15.0
#: Seconds between reads of the training status (its watcher publishes every 0.2 s).
TRAINING_POLL_S = 0.2
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=HEADERS)


def sse(event: str, data: dict[str, Any]) -> str:
    """One SSE message: its event name and its JSON data on one line."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def job_events(job: Job) -> AsyncIterator[str]:
    """The job's events from now on, ending with its final state. A done job's stream always
    holds ``running`` and its last ``step`` before ``done``, however fast it ran (the loop
    reads the job's state when it is signalled, so quick steps may coalesce)."""
    sent: tuple[object, ...] = ()
    while True:
        seen = job.signal.version
        state, position, step, steps = job.state, job.position, job.step, job.steps
        if state in TERMINAL:
            if state == "done":  # a job faster than this loop still shows it ran, to its last step
                if sent[:1] != ("running",):
                    yield sse("running", {"id": job.id, "step": 0, "steps": steps})
                if steps and (not sent or sent[2] != step):
                    yield sse("step", {"id": job.id, "step": step, "steps": steps})
            yield sse(state, job.to_dict())
            return
        now = (state, position, step, steps)
        if now != sent:
            if state == "queued":
                yield sse("queued", {"id": job.id, "position": position})
            elif sent[:1] != ("running",):
                yield sse("running", {"id": job.id, "step": step, "steps": steps})
            else:
                yield sse("step", {"id": job.id, "step": step, "steps": steps})
            sent = now
        else:
            yield ": keep-alive\n\n"
        await job.signal.wait(seen, KEEP_ALIVE_S)


async def training_events(status: Callable[[], dict[str, Any] | None]) -> AsyncIterator[str]:
    """The training run's state and steps, read from ``status`` (the engine's
    published run status) every :data:`TRAINING_POLL_S` seconds."""
    last_state: dict[str, Any] | None = None
    last_step: tuple[object, object] | None = None
    quiet = 0.0
    while True:
        current = status() or {"status": "idle"}
        state = {"run_id": current.get("run_id"), "status": current.get("status"), "phase": current.get("phase"),
                 "step": current.get("step", 0), "steps": current.get("steps", 0), "error": current.get("error")}
        step = (current.get("run_id"), current.get("step", 0))
        messages: list[str] = []
        if step != last_step and state["step"]:
            messages.append(sse("step", {"run_id": state["run_id"], "step": state["step"], "steps": state["steps"],
                                         "loss": _latest(current, "loss"), "lr": _latest(current, "lr")}))
        if _without_step(state) != _without_step(last_state):
            # The state first when the stream opens; else after the step (a run's last
            # step and its completion often land in one published status).
            messages.insert(len(messages) if last_state is not None else 0, sse("state", state))
            last_state = state
        last_step = step
        for message in messages:
            yield message
        changed = bool(messages)
        quiet = 0.0 if changed else quiet + TRAINING_POLL_S
        if quiet >= KEEP_ALIVE_S:
            yield ": keep-alive\n\n"
            quiet = 0.0
        await asyncio.sleep(TRAINING_POLL_S)


def _without_step(state: dict[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (state or {}).items() if k != "step"}


def _latest(status: dict[str, Any], metric: str) -> float | None:
    """The newest value of a metric in a published run status (its history's last point)."""
    points = (status.get("metrics") or {}).get(metric) or []
    return float(points[-1][1]) if points else None
