"""Every training preflight rule, asked through ``diffusion-engine train --dry-run``.

Each case runs the real CLI in a child process with a real tiny pipeline and
real files; only the machine is a preset (``--hardware``) where the rule is
about a GPU this machine does not have.
"""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from engine.testing.datasets import write_dataset
from tests.support import run_cli


@pytest.fixture(scope="module")
def good_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("good"), count=2)


def dry_run(base: Path | str, data: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, object], str]:
    result = run_cli("train", "--base", str(base), "--data", str(data), "--dry-run", "--json", *args, env=env)
    payload = json.loads(result.stdout) if result.stdout.strip() else {}
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, payload, result.stderr


def refused(code: int, payload: dict[str, object], stderr: str) -> str:
    assert code == 2, (payload, stderr)
    return payload["error"]["code"]  # type: ignore[index]


@pytest.mark.parametrize("preset", ["t4", "v100", "rtx2080ti"])
@pytest.mark.parametrize("family", ["flux", "qwen_image", "zimage"])
def test_dit_without_native_bf16_is_refused_even_in_nf4(
    preset: str, family: str, tiny_pipeline: Callable[[str], Path], good_data: Path
) -> None:
    outcome = dry_run(tiny_pipeline(family), good_data, "--hardware", preset, "--base-precision", "nf4")
    assert refused(*outcome) == "no_native_bf16"


def test_sdxl_ignores_an_explicit_base_precision_and_trains_with_auto(tiny_pipeline: Callable[[str], Path], good_data: Path) -> None:
    code, payload, _ = dry_run(tiny_pipeline("sdxl"), good_data, "--hardware", "t4", "--base-precision", "fp8")
    assert code == 0, payload
    resolved = payload["plan"]["resolved"]["base_precision"]
    assert resolved["value"] == "none" and "base_precision=fp8 is ignored" in resolved["reason"]
    code, payload, _ = dry_run(tiny_pipeline("sdxl"), good_data, "--hardware", "t4")
    assert code == 0
    plan = payload["plan"]
    assert plan["resolved"]["base_precision"]["value"] == "none"  # type: ignore[index]
    assert plan["resolved"]["weight_dtype"]["value"] == "fp16"  # type: ignore[index]


def test_dense_modes_need_cuda_unless_device_cpu(tiny_pipeline: Callable[[str], Path], good_data: Path) -> None:
    base = tiny_pipeline("zimage")
    assert refused(*dry_run(base, good_data, "--hardware", "cpu", "--base-precision", "bf16")) == "needs_cuda"
    code, payload, _ = dry_run(base, good_data, "--hardware", "cpu", "--base-precision", "auto", "--device", "cpu")
    assert code == 0 and payload["plan"]["resolved"]["base_precision"]["value"] == "bf16"  # type: ignore[index]
    assert refused(*dry_run(base, good_data, "--hardware", "cpu", "--base-precision", "nf4", "--device", "cpu")) == "needs_cuda"


def test_a_dry_run_reports_a_missing_dataset_together_with_what_the_machine_refuses(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path,
) -> None:
    """The newcomer's dry run on a machine without CUDA, dataset path mistyped: both at once."""
    missing = tmp_path / "no-such-dataset"
    code, payload, stderr = dry_run(tiny_pipeline("zimage"), missing, "--hardware", "cpu", "--base-precision", "bf16")
    assert refused(code, payload, stderr) == "dataset_not_found"
    also = [error["code"] for error in payload["error"]["also"]]  # type: ignore[index]
    assert also == ["needs_cuda"], payload
    assert str(missing) in stderr and "also error[needs_cuda]" in stderr
    # One refusal alone stays one refusal.
    code, payload, _ = dry_run(tiny_pipeline("zimage"), missing, "--hardware", "cpu", "--device", "cpu")
    assert refused(code, payload, "") == "dataset_not_found" and "also" not in payload["error"]  # type: ignore[operator]


@pytest.mark.slow
def test_int8_with_a_stub_torchao_is_refused(
    tiny_pipeline: Callable[[str], Path], good_data: Path, tmp_path: Path
) -> None:
    stub = tmp_path / "stub"
    (stub / "torchao" / "quantization").mkdir(parents=True)
    (stub / "torchao" / "__init__.py").write_text("", encoding="utf-8")
    (stub / "torchao" / "quantization" / "__init__.py").write_text(
        "class Int8WeightOnlyConfig:\n    pass\n\ndef quantize_(model, config, filter_fn=None):\n    return model\n",
        encoding="utf-8",
    )
    base = tiny_pipeline("flux")
    # This machine, really probed: the stub imports fine, and quantises nothing.
    outcome = dry_run(base, good_data, "--device", "cpu", "--base-precision", "int8", env={"PYTHONPATH": str(stub)})
    assert refused(*outcome) == "torchao_unavailable"
    code, _, _ = dry_run(base, good_data, "--device", "cpu", "--base-precision", "int8")
    assert code == 0  # the real torchao passes the same check
    assert refused(*dry_run(base, good_data, "--hardware", "h100", "--no-torchao", "--base-precision", "int8")) == "torchao_unavailable"


@pytest.mark.slow
def test_capability_gated_modes(tiny_pipeline: Callable[[str], Path], good_data: Path) -> None:
    base = tiny_pipeline("flux")
    assert refused(*dry_run(base, good_data, "--hardware", "a100-80g", "--base-precision", "fp8")) == "fp8_unsupported"
    assert refused(*dry_run(base, good_data, "--hardware", "h100", "--base-precision", "mxfp8")) == "mxfp8_unsupported"
    assert dry_run(base, good_data, "--hardware", "b200", "--base-precision", "mxfp8")[0] == 0
    assert refused(*dry_run(base, good_data, "--hardware", "h100", "--base-precision", "int4")) == "invalid_base_precision"


def test_family_deny_refuses_fp8_on_qwen_image(tiny_pipeline: Callable[[str], Path], good_data: Path) -> None:
    code, payload, stderr = dry_run(tiny_pipeline("qwen_image"), good_data, "--hardware", "h100", "--base-precision", "fp8")
    assert refused(code, payload, stderr) == "quant_denied" and "black" in stderr


def test_prequantised_base_trains_nf4_only_and_names_the_dense_base(
    tiny_pipeline: Callable[[str], Path], good_data: Path, tmp_path: Path
) -> None:
    base = tmp_path / "qwen-image-bnb-4bit"
    shutil.copytree(tiny_pipeline("qwen_image"), base)
    code, payload, stderr = dry_run(base, good_data, "--hardware", "h100", "--base-precision", "bf16")
    assert refused(code, payload, stderr) == "prequantised_base" and "Qwen/Qwen-Image" in stderr
    code, payload, _ = dry_run(base, good_data, "--hardware", "h100", "--base-precision", "auto")
    assert code == 0 and payload["plan"]["resolved"]["base_precision"]["value"] == "nf4"  # type: ignore[index]


def test_fp16_mixed_precision_on_a_bf16_family_is_refused(tiny_pipeline: Callable[[str], Path], good_data: Path) -> None:
    outcome = dry_run(tiny_pipeline("zimage"), good_data, "--hardware", "h100", "--mixed-precision", "fp16")
    assert refused(*outcome) == "fp16_on_bf16_family"


def test_base_that_is_not_a_pipeline_is_refused_naming_it(good_data: Path, tmp_path: Path) -> None:
    folder = tmp_path / "not-a-pipeline"
    folder.mkdir()
    code, payload, stderr = dry_run(folder, good_data, "--family", "flux", "--hardware", "h100")
    assert refused(code, payload, stderr) == "not_a_pipeline" and str(folder) in stderr


def test_dataset_with_bad_files_lists_all_of_them(tiny_pipeline: Callable[[str], Path], tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "data", count=2)
    (data / "zero.png").write_bytes(b"")
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(buffer, format="PNG")
    (data / "cut.png").write_bytes(buffer.getvalue()[:60])
    (data / "text.jpg").write_text("hello", encoding="utf-8")
    code, payload, stderr = dry_run(tiny_pipeline("sdxl"), data, "--hardware", "h100")
    assert refused(code, payload, stderr) == "bad_dataset"
    for name in ("zero.png", "cut.png", "text.jpg"):
        assert name in stderr


def test_a_good_dry_run_reports_the_plan_without_loading(tiny_pipeline: Callable[[str], Path], good_data: Path) -> None:
    code, payload, _ = dry_run(tiny_pipeline("flux"), good_data, "--hardware", "h100", "--steps", "7")
    assert code == 0
    plan = payload["plan"]
    assert plan["steps"] == 7 and plan["device"] == "cuda"  # type: ignore[index]
    resolved = plan["resolved"]  # type: ignore[index]
    assert resolved["base_precision"]["value"] == "bf16" and resolved["compile"]["value"] == "regional"
    assert plan["dataset"]["images"] == 2  # type: ignore[index]


