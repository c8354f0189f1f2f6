"""Plugin API 2, additive: what an outside LTX-2 author needed and did not have.

- checkpoints that share one hub repo (a dev and a distilled pipeline in folders of it, or at
  two revisions), each named alone and loaded from its own folder;
- the request's shape (size, a clip's frames and fps) handed to ``engine_generate_kwargs``, so
  a pipeline that spells fps its own way is passed it;
- a video family serves text to video without a ``workflows`` entry.

Plugins written against API 0 and 1 load unchanged (tests/contract/test_plugin_api.py, the kit on
the example plugin); a plugin that declares API 2 loads here, and API 3 is refused.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import Engine
from engine.contract.hookspecs import hookimpl
from engine.contract.plugin_api import PLUGIN_API_VERSION, version_refusal
from engine.contract.plugins import load_registry
from engine.contract.types import CallShape, Checkpoint
from engine.hardware.probe import probe
from engine.preflight.hub import hub_root
from engine.preflight.model import resolve_model
from engine.runtime.workflows import choose_workflow


def test_the_api_is_2_and_plugins_of_0_to_2_load() -> None:
    assert PLUGIN_API_VERSION == 2
    assert [version_refusal(v) for v in (None, 0, 1, 2)] == [None] * 4
    assert "upgrade diffusion-engine" in str(version_refusal(3))


def _shared_repo_family() -> Any:
    """A Wan-shaped family (its own name) with three checkpoints in one repo: one at the root,
    one in ``distilled/``, one at revision ``v1``."""
    wan = load_registry().family("wan")
    base = dataclasses.replace(wan.checkpoint("wan2.2-ti2v-5b"), name="shared-5b", label="Shared 5B",
                               repo="someone/shared-5b", matches=("*shared-5b*",))
    distilled = dataclasses.replace(base, name="shared-5b-distilled", label="Shared 5B distilled",
                                    subfolder="distilled", default_steps=4, matches=("*shared-5b-distilled*",))
    pinned = dataclasses.replace(base, name="shared-5b-v1", label="Shared 5B v1", revision="v1", matches=())
    family = dataclasses.replace(wan, name="shared-wan", label="Shared Wan", aliases=(),
                                 checkpoints=(base, distilled, pinned))
    return family, base, distilled, pinned


def test_checkpoints_sharing_a_repo_are_each_named_alone_by_their_reference() -> None:
    family, base, distilled, pinned = _shared_repo_family()
    assert distilled.repo == base.repo == pinned.repo
    assert distilled.reference == f"{base.repo}/distilled" and pinned.reference == f"{base.repo}@v1"
    assert [family.checkpoint(c.reference) for c in (base, distilled, pinned)] == [base, distilled, pinned]
    assert family.checkpoint(base.repo) == base  # the repo alone: its root on the default branch


def _hub_cache(root: Path, repo: str, files: Path, subfolder: str) -> Path:
    """A real hub cache (huggingface_hub's layout) holding ``files`` as ``subfolder`` of ``repo``."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    cached = root / f"models--{repo.replace('/', '--')}"
    (cached / "refs").mkdir(parents=True)
    (cached / "refs" / "main").write_text(commit)
    shutil.copytree(files, cached / "snapshots" / commit / subfolder)
    return cached / "snapshots" / commit / subfolder


def test_a_checkpoint_in_a_subfolder_loads_from_that_folder_of_its_repo(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    family, base, distilled, _ = _shared_repo_family()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    folder = _hub_cache(tmp_path / "hub", base.repo, tiny_pipeline("wan"), "distilled")
    class Shared:
        @hookimpl
        def engine_register_families(self, register: Callable[[Any], None]) -> None:
            register(family)

    registry = load_registry(plugins=[("shared-wan", Shared())])
    source = resolve_model(registry, distilled.name)
    assert (source.kind, source.location, source.checkpoint) == ("hub", base.repo, distilled)
    assert Path(hub_root(source)) == folder
    assert json.loads((Path(hub_root(source)) / "model_index.json").read_text())["_class_name"] == "WanPipeline"
    root = resolve_model(registry, base.name)
    assert root.checkpoint == base and hub_root(root) == base.repo  # the root checkpoint: its repo, as before


def test_a_video_family_serves_text_to_video_without_a_workflows_entry() -> None:
    wan = load_registry().family("wan")
    bare = dataclasses.replace(wan, pipeline=dataclasses.replace(wan.pipeline, workflows=()),
                               checkpoints=tuple(dataclasses.replace(c, workflows=None) for c in wan.checkpoints))
    assert choose_workflow(bare, None, image=False, mask=False) == ("txt2img", bare.pipeline_class)
    assert dict(wan.pipeline.workflows)  # the built-in table still declares its own
    image_only = wan.checkpoint("wan2.2-i2v-a14b")
    if image_only is not None and image_only.workflows is not None and "txt2img" not in dict(image_only.workflows):
        from engine.runtime.workflows import UnsupportedWorkflow

        with pytest.raises(UnsupportedWorkflow, match="needs an input image"):
            choose_workflow(wan, image_only, image=False, mask=False)  # declared image-only: still refused


def test_the_call_inputs_hook_is_given_the_clips_frames_and_fps(tiny_pipeline: Callable[[str], Path]) -> None:
    seen: list[CallShape] = []

    class FrameRate:
        """An LTX-2-shaped answer: the pipeline takes ``frame_rate``, the request says ``fps``."""

        @hookimpl
        def engine_generate_kwargs(self, family: Any, pipeline: object, kwargs: dict[str, Any],
                                   shape: CallShape) -> dict[str, Any] | None:
            seen.append(shape)
            return None

    registry = load_registry()
    registry._pm.register(FrameRate(), name="frame-rate")  # noqa: SLF001
    with Engine(registry=registry, hardware=probe(verify=False)) as engine:
        engine.videos.generate("a fox", model=str(tiny_pipeline("wan")), frames=5, fps=12, steps=1,
                               width=64, height=64)
    assert [(s.frames, s.fps, s.width, s.height, s.count) for s in seen] == [(5, 12, 64, 64, 1)]


def test_checkpoint_rows_keep_their_api_1_shape() -> None:
    """A checkpoint written before API 2 (no subfolder, no revision) is its repo, as it was."""
    row = Checkpoint("x", "X", "org/x", 20, 5.0)
    assert (row.subfolder, row.revision, row.reference) == ("", None, "org/x")
