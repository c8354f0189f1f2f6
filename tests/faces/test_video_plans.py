"""The frames asked for reach the plan, at every door.

The plan of a clip is sized by its clip: on an A100-40G, Wan 2.1 I2V-14B plans resident for
81 frames and needs offload at 121; on an RTX 4090, TI2V-5B offloads its default 121 frames
and plans resident at 97. ``plan`` (``--frames --width --height --count``), ``POST
/v1/images/plan`` and ``engine.images.plan`` answer the same for the same request, and
``info``'s hint is a request that plans what it says.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import httpx
import pytest

from engine import Engine
from engine.requests import InferenceRequest, MachineRequest
from tests.support import LiveServer

I2V = {"family": "wan", "checkpoint": "wan2.1-i2v-14b"}


@pytest.fixture(scope="module")
def a100() -> Iterator[tuple[str, Engine]]:
    from engine.server.app import create_app

    engine = Engine(hardware=MachineRequest(preset="a100-40g"))
    with LiveServer(create_app(engine)) as url:
        yield url, engine


@pytest.mark.parametrize(("frames", "memory"), [(81, "resident"), (121, "model_offload"), (33, "resident")])
def test_a_clips_frames_size_its_plan_the_same_at_every_door(
    a100: tuple[str, Engine], cli_json: Callable[..., object], frames: int, memory: str,
) -> None:
    url, engine = a100
    python = engine.images.plan(**I2V, request=InferenceRequest(frames=frames)).to_dict()
    http = httpx.post(f"{url}/v1/images/plan", json={**I2V, "frames": frames}, timeout=60).json()
    cli = cli_json("plan", "--family", "wan", "--checkpoint", "wan2.1-i2v-14b", "--hardware", "a100-40g",
                   "--frames", str(frames))["plan"]  # type: ignore[index]
    assert python["resolved"]["memory_mode"]["value"] == memory, python["resolved"]["memory_mode"]  # type: ignore[index]
    assert _decisions(python) == _decisions(http) == _decisions(cli)


def test_a_121_and_a_33_frame_request_get_different_plans_where_the_memory_says_so(
    a100: tuple[str, Engine]) -> None:
    url, _ = a100
    long, short = (httpx.post(f"{url}/v1/images/plan", json={**I2V, "frames": n}, timeout=60).json()
                   for n in (121, 33))
    assert long["estimate"] != short["estimate"]
    assert (long["resolved"]["memory_mode"]["value"], short["resolved"]["memory_mode"]["value"]) == (
        "model_offload", "resident")


def test_infos_hint_is_a_request_that_plans_what_it_says(cli_json: Callable[..., object]) -> None:
    """On an RTX 4090 TI2V-5B's default clip offloads; the hint names a clip that plans resident."""
    info = cli_json("info", "--hardware", "rtx4090")
    hint = info["families"]["wan"]["video"]["wan2.2-ti2v-5b"]["hint"]  # type: ignore[index]
    frames = int(re.search(r"--frames (\d+)", hint)[1])  # type: ignore[index]
    assert "resident" in hint
    planned = cli_json("plan", "--family", "wan", "--checkpoint", "wan2.2-ti2v-5b", "--hardware", "rtx4090",
                       "--frames", str(frames))["plan"]  # type: ignore[index]
    default = cli_json("plan", "--family", "wan", "--checkpoint", "wan2.2-ti2v-5b", "--hardware", "rtx4090")["plan"]  # type: ignore[index]
    assert planned["resolved"]["memory_mode"]["value"] == "resident"
    assert default["resolved"]["memory_mode"]["value"] != "resident"


def _decisions(plan: dict[str, object]) -> dict[str, object]:
    """Every control's value and the estimate: what a door may not answer differently."""
    return {"resolved": {k: v["value"] for k, v in plan["resolved"].items()},  # type: ignore[attr-defined]
            "estimate": plan["estimate"]}
