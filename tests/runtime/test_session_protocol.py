"""Both runtimes are Sessions: every member of the protocol, with the protocol's parameters.

The facade holds a diffusers or an sd.cpp session and calls them alike; a method one of
them lacked, or took with another signature (``generate``'s ``cancel`` was added to one
only, once), failed in a server at run time. Checked here from the classes themselves,
and on the real loaded sessions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import Engine
from engine.runtime.protocol import Session
from engine.runtime.sdcpp import SdcppSession
from engine.runtime.session import InferenceSession

METHODS = [name for name, member in vars(Session).items() if inspect.isfunction(member) and not name.startswith("_")]


def parameters(function: Callable[..., object]) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]


def test_the_protocol_names_the_lifecycle() -> None:
    assert sorted(METHODS) == ["generate", "load", "set_loras", "status", "unload"]


@pytest.mark.parametrize("runtime", [InferenceSession, SdcppSession], ids=lambda c: c.__name__)
@pytest.mark.parametrize("method", METHODS)
def test_each_runtime_has_every_method_with_the_protocols_parameters(runtime: type, method: str) -> None:
    assert parameters(getattr(runtime, method)) == parameters(getattr(Session, method))


@pytest.mark.slow
def test_a_loaded_session_of_either_runtime_is_a_session(tiny_pipeline: Callable[[str], Path], sdcpp_model: Path) -> None:
    from engine.policy.plan import InferenceRequest

    engine = Engine()
    engine.images.load(str(tiny_pipeline("sdxl")))
    assert isinstance(engine.images.session, InferenceSession) and isinstance(engine.images.session, Session)
    engine.images.load(str(sdcpp_model), request=InferenceRequest(engine="sdcpp"))
    assert isinstance(engine.images.session, SdcppSession) and isinstance(engine.images.session, Session)
    engine.images.unload()
