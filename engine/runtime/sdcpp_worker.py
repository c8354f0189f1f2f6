"""The stable-diffusion.cpp worker: one process holding one sd.cpp context.

The earlier system ran sd.cpp as a persistent server beside the app; this is
that server, spoken to over pipes by :mod:`engine.runtime.sdcpp`. A process
of its own, because the library cannot be stopped mid-call (a cancel kills
the process after the step it reported) and because it aborts the whole
process on a file it cannot read (a ``GGML_ASSERT``): the engine survives
either and records why.

Run as ``python -m engine.runtime.sdcpp_worker FD``: requests are JSON lines
on stdin; events are JSON lines written to file descriptor ``FD`` (the
library prints its log on stdout and stderr, which the parent keeps apart).
Imports no torch: it starts in a fraction of a second.

Requests: ``{"op": "load", "files": {argument: path}, "threads": N}``, then
``{"op": "generate", "arguments": {...}, "init_image": PNG-base64 | null}``.
Events: ``loaded`` (with ``seconds``), ``step`` (``step``, ``steps``),
``images`` (``width``, ``height``, base64 RGB bytes each), ``error``.
"""

from __future__ import annotations

import base64
import io
import json
import os
import sys
import time
from typing import Any


def main(argv: list[str]) -> int:
    events = os.fdopen(int(argv[1]), "w", buffering=1)

    def send(event: str, **fields: object) -> None:
        events.write(json.dumps({"event": event, **fields}) + "\n")

    context: Any = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "load":
                context, seconds = _load(request)
                if context is None:
                    send("error", message="sd.cpp could not load these files (its log says which tensor)")
                else:
                    send("loaded", seconds=seconds)
            elif request["op"] == "generate":
                if context is None:
                    send("error", message="no model is loaded in the sd.cpp worker")
                    continue
                send("images", images=_generate(context, request, send))
        except Exception as exc:  # the library's Python-side errors: reported, the worker lives on
            send("error", message=f"{type(exc).__name__}: {exc}")
    return 0


def _load(request: dict[str, Any]) -> tuple[Any, float]:
    """The context (None where the library refused the files: a NULL context) and the seconds it took."""
    from stable_diffusion_cpp import StableDiffusion

    started = time.perf_counter()
    context = StableDiffusion(**request["files"], n_threads=int(request["threads"]), verbose=False)
    return (context if context._model.model else None), round(time.perf_counter() - started, 3)


def _generate(context: Any, request: dict[str, Any], send: Any) -> list[dict[str, object]]:
    from PIL import Image

    arguments = dict(request["arguments"])
    steps = int(arguments["sample_steps"])
    if request.get("init_image"):
        arguments["init_image"] = Image.open(io.BytesIO(base64.b64decode(request["init_image"]))).convert("RGB")

    def progress(step: int, total: int, _seconds: float) -> None:
        if total == steps and step > 0:  # denoising steps (loading and decoding report their own counts)
            send("step", step=step, steps=total)

    images = context.generate_image(**arguments, progress_callback=progress)
    out = []
    for image in images:
        rgb = image.convert("RGB")
        out.append({"width": rgb.width, "height": rgb.height,
                    "data": base64.b64encode(rgb.tobytes()).decode("ascii")})
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv))
