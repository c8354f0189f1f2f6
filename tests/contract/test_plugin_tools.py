"""Tools for plugin authors: who implements a hook, and who answered each call."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.contract.hookspecs import hookimpl
from engine.contract.plugins import TRACE_ENV, load_registry
from engine.contract.types import ComponentSizes, FamilySpec
from tests.support import run_cli


class Sizer:
    """A third-party plugin overriding one family's sizes (a firstresult hook)."""

    @hookimpl
    def engine_component_sizes(self, family: FamilySpec, checkpoint: object) -> ComponentSizes | None:
        return ComponentSizes(1.0, 2.0, 0.5) if family.name == "flux" else None


def test_the_trace_names_the_plugin_that_answered_each_hook_call(capsys: pytest.CaptureFixture[str]) -> None:
    registry = load_registry(plugins=[("sizer", Sizer())], env={TRACE_ENV: "1"})
    flux, sdxl = registry.family("flux"), registry.family("sdxl")
    assert registry.component_sizes(flux).total_gb == 3.5
    registry.component_sizes(sdxl)
    err = capsys.readouterr().err.splitlines()
    assert any(line.startswith("trace[plugins]: engine_component_sizes answered by sizer ") and "1.0" in line
               for line in err), err
    # sdxl's sizes came from the engine's own table plugin: the trace says so.
    assert any("engine_component_sizes answered by engine.table_plugin" in line for line in err), err


def test_without_the_switch_nothing_is_traced(capsys: pytest.CaptureFixture[str]) -> None:
    registry = load_registry(plugins=[("sizer", Sizer())], env={})
    registry.component_sizes(registry.family("flux"))
    assert "trace[plugins]" not in capsys.readouterr().err


def test_hook_implementations_come_in_call_order() -> None:
    registry = load_registry(plugins=[("sizer", Sizer())], env={})
    rows = registry.hook_implementations("engine_component_sizes")
    assert [r["plugin"] for r in rows][0] == "sizer" and rows[-1]["plugin"] == "engine.table_plugin"
    assert rows[-1]["order"] == "trylast" and all(r["firstresult"] for r in rows)


def test_families_hook_at_the_terminal(install_example: Callable[[], Path]) -> None:
    install_example()
    done = run_cli("families", "--hook", "engine_quant_deny", "--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["implementations"]
    assert [(r["plugin"], r["package"]) for r in rows][:1] == [("sd3", "diffusion-engine-sd3")]
    unknown = run_cli("families", "--hook", "engine_nope")
    assert unknown.returncode == 2 and "error[unknown_hook]" in unknown.stderr
    assert "engine_component_sizes" in unknown.stderr  # the valid names are listed
    traced = run_cli("plan", "--family", "sd3", "--hardware", "rtx4090", env={TRACE_ENV: "1"})
    assert traced.returncode == 0, traced.stderr
    assert "trace[plugins]: engine_quant_deny answered by sd3 (diffusion-engine-sd3" in traced.stderr
