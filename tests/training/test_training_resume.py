"""A run's written config repeats it, and a resume continues it bit for bit.

Kept apart from tests/training/test_training_runs.py (the Ctrl-C and embedding cases) so the two long
files run on different workers. The CLI runs in-process; each trainer is a real child process.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.testing.datasets import write_dataset
from tests.support import TINY, losses


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data"), count=2)


@pytest.mark.slow
def test_config_file_and_resume_reproduce_ten_steps_in_one_go_bit_for_bit(
    tiny_pipeline: Callable[[str], Path], dataset: Path, tmp_path: Path, cli_json: Callable[..., object]
) -> None:
    """Ten steps in one go; then its written config.toml (steps overridden to 5, with a
    checkpoint) and a resume to 10: the same loss at every step and the same LoRA bytes.
    The CLI runs in-process here (each trainer is still a real child process)."""

    def train(*args: str) -> dict[str, object]:
        record = cli_json("train", *args)
        assert isinstance(record, dict)
        return record

    straight = train("--base", str(tiny_pipeline("sdxl")), "--data", str(dataset), *TINY, "--steps", "10",
                     "--output", str(tmp_path / "straight"), "--runs-dir", str(tmp_path), "--export-kohya")
    assert_kohya_export(straight, cli_json)
    config = Path(straight["outputs"]["config"])  # type: ignore[index]
    assert "steps = 10" in config.read_text(encoding="utf-8")
    first = train("--config", str(config), "--steps", "5", "--save-every", "5", "--keep-checkpoints", "1",
                  "--output", str(tmp_path / "split"), "--runs-dir", str(tmp_path))
    assert first["outputs"]["checkpoint"].endswith("step-00000005")  # type: ignore[index]
    assert losses(first) == losses(straight)[:5]  # the file plus a flag repeats the run
    resumed = train("--resume", "split", "--steps", "10", "--runs-dir", str(tmp_path))
    assert resumed["run_id"] == first["run_id"] and resumed["status"] == "completed"
    # The resume's change is a new segment; the first segment's config file is not rewritten.
    assert [(s["from_step"], s["changes"]) for s in resumed["segments"]] == [(5, {"steps": [5, 10]})]  # type: ignore[union-attr]
    assert "steps = 5" in (tmp_path / "split" / "config.toml").read_text(encoding="utf-8")
    assert "steps = 10" in Path(resumed["outputs"]["config"]).read_text(encoding="utf-8")  # type: ignore[index]
    assert [s for s, _ in losses(resumed)] == list(range(1, 11))
    for (step, got), (_, want) in zip(losses(resumed), losses(straight), strict=True):
        assert got == pytest.approx(want, abs=1e-5), f"step {step}"
    # Bit for bit: every tensor and the metadata (safetensors writes its metadata map in a
    # per-process hash order, so the files' bytes are compared through their contents).
    assert lora_contents(resumed["outputs"]["lora"]) == lora_contents(straight["outputs"]["lora"])  # type: ignore[index]


def assert_kohya_export(record: dict[str, object], cli_json: Callable[..., object]) -> None:
    """``--export-kohya`` writes the kohya file beside the diffusers one, and ``runs`` lists the run."""
    from safetensors.torch import load_file

    outputs: dict[str, str] = record["outputs"]  # type: ignore[assignment]
    assert Path(outputs["lora"]).is_file()
    kohya = load_file(outputs["lora_kohya"])
    assert all(k.startswith("lora_unet_") for k in kohya)
    assert any(k.endswith(".lora_down.weight") for k in kohya) and any(k.endswith(".alpha") for k in kohya)
    runs = Path(str(record["folder"])).parent
    listed = cli_json("runs", "--runs-dir", str(runs))
    assert isinstance(listed, list)
    assert record["run_id"] in [r["run_id"] for r in listed]


def lora_contents(path: str) -> tuple[dict[str, bytes], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(path, "pt") as handle:
        tensors = {k: handle.get_tensor(k).numpy().tobytes() for k in handle.keys()}
        return tensors, dict(handle.metadata() or {})
