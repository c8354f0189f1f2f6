"""A stored pre-quantised folder is judged before anything is evicted.

``diffusion-engine quantize`` writes a real int8 folder of a tiny Z-Image; seven broken
copies of it (what a copied, edited or planted folder can hold) are each refused with
``corrupt_quantised_model``, naming the file and the field, from headers alone: through
Python's load with a host model resident, ``generate --model`` at the terminal (exit 2),
and a real server's load and a request's ``model`` field (400). The host's model and the
loaded pipeline stay where they were every time, and the intact folder still loads."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from engine.cli import main
from engine.contract.plugins import load_registry
from engine.errors import EngineError
from engine.hardware.probe import probe
from engine.preflight.quantised_folder import MARKER, WEIGHTS
from engine.server.app import ServerSettings, create_app
from engine.service.facade import Engine
from tests.support import HostModel, LiveServer

REGISTRY = load_registry()
HARDWARE = probe(verify=False)
TOKEN = "stored-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _rewrite_weights(folder: Path, change: Callable[[dict, dict], None]) -> None:
    """Write the denoiser's weights again with ``change(tensors, metadata)`` applied."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = folder / "transformer" / WEIGHTS
    with safe_open(str(path), framework="pt") as opened:
        metadata = dict(opened.metadata() or {})
    tensors = load_file(str(path))
    change(tensors, metadata)
    save_file(tensors, str(path), metadata=metadata)


def _quantised_names(metadata: dict) -> list[str]:
    return [k for k, v in metadata.items() if k != "tensor_names" and json.loads(v)["_type"] == "Int8Tensor"]


def _dense_under_marker(folder: Path, base: Path) -> None:
    shutil.copy(base / "transformer" / WEIGHTS, folder / "transformer" / WEIGHTS)


def _half_the_metadata(folder: Path, base: Path) -> None:
    def change(tensors: dict, metadata: dict) -> None:
        for name in list(metadata)[: len(metadata) // 2]:
            del metadata[name]
    _rewrite_weights(folder, change)


def _bad_dtype(folder: Path, base: Path) -> None:
    def change(tensors: dict, metadata: dict) -> None:
        name = _quantised_names(metadata)[0]
        entry = json.loads(metadata[name])
        entry["_data"]["dtype"]["_data"] = "float1024"
        metadata[name] = json.dumps(entry)
    _rewrite_weights(folder, change)


def _os_system_type(folder: Path, base: Path) -> None:
    def change(tensors: dict, metadata: dict) -> None:
        name = _quantised_names(metadata)[0]
        entry = json.loads(metadata[name])
        entry["_data"]["act_quant_kwargs"] = {"_type": "os.system", "_data": "touch /tmp/owned"}
        metadata[name] = json.dumps(entry)
    _rewrite_weights(folder, change)


def _auto_model(folder: Path, base: Path) -> None:
    index = json.loads((folder / "model_index.json").read_text())
    index["transformer"] = ["diffusers", "AutoModel"]
    (folder / "model_index.json").write_text(json.dumps(index))
    config = json.loads((folder / "transformer" / "config.json").read_text())
    config.update(_class_name="AutoModel", auto_map={"AutoModel": "evil.EvilModel"})
    (folder / "transformer" / "config.json").write_text(json.dumps(config))


def _another_class(folder: Path, base: Path) -> None:
    index = json.loads((folder / "model_index.json").read_text())
    index["transformer"] = ["diffusers", "UNet2DConditionModel"]
    (folder / "model_index.json").write_text(json.dumps(index))
    config = json.loads((folder / "transformer" / "config.json").read_text())
    config["_class_name"] = "UNet2DConditionModel"
    (folder / "transformer" / "config.json").write_text(json.dumps(config))


def _marker_on_dense(folder: Path, base: Path) -> None:
    marker = (folder / "transformer" / MARKER).read_bytes()
    shutil.rmtree(folder)
    shutil.copytree(base, folder)
    (folder / "transformer" / MARKER).write_bytes(marker)


#: name -> (how a copy is broken, what the refusal names).
BROKEN: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "dense-weights-under-the-marker": (_dense_under_marker, "tensor_names"),
    "half-the-metadata-removed": (_half_the_metadata, "__metadata__"),
    "a-bad-dtype": (_bad_dtype, "float1024"),
    "automodel-with-auto-map": (_auto_model, "model_index.json"),
    "another-class-in-model-index": (_another_class, "UNet2DConditionModel"),
    "a-type-of-os-system": (_os_system_type, "os.system"),
    "a-marker-planted-on-a-dense-folder": (_marker_on_dense, "tensor_names"),
}


@pytest.fixture(scope="module")
def models(tiny_pipeline: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """models/: the dense tiny Z-Image, its int8 folder as quantize writes it, and each broken copy."""
    root = tmp_path_factory.mktemp("stored") / "models"
    base = root / "dense"
    shutil.copytree(tiny_pipeline("zimage"), base)
    Engine(registry=REGISTRY, hardware=HARDWARE).quantize(str(base), "int8", root / "int8")
    for name, (breaks, _) in BROKEN.items():
        shutil.copytree(root / "int8", root / name)
        breaks(root / name, base)
    return root


@pytest.mark.parametrize("variant", list(BROKEN))
def test_a_broken_stored_folder_is_refused_before_the_host_model_is_evicted(models: Path, variant: str) -> None:
    engine = Engine(registry=REGISTRY, hardware=HARDWARE)
    host = HostModel(engine)
    with pytest.raises(EngineError) as refused:
        engine.images.load(str(models / variant))
    assert refused.value.code == "corrupt_quantised_model", refused.value
    assert BROKEN[variant][1] in refused.value.message and str(models / variant) in refused.value.message
    assert host.evicted == 0 and engine.images.session is None
    assert not Path("/tmp/owned").exists()


@pytest.mark.slow
def test_the_intact_folder_still_loads_and_its_marker_names_its_class(models: Path) -> None:
    marker = json.loads((models / "int8" / "transformer" / MARKER).read_text())
    assert marker["model_class"] == "ZImageTransformer2DModel"
    engine = Engine(registry=REGISTRY, hardware=HARDWARE)
    engine.images.load(str(models / "int8"))
    session = engine.images.session
    assert session is not None and session.source.prequantised_scheme == "int8"


@pytest.mark.parametrize("variant", ["a-type-of-os-system", "a-marker-planted-on-a-dense-folder"])
def test_generate_at_the_terminal_refuses_it_with_exit_2(models: Path, variant: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["generate", "--model", str(models / variant), "--prompt", "a fox", "-o", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert status == 2 and "error[corrupt_quantised_model]" in err and "Traceback" not in err, err
    assert not (tmp_path / "x.png").exists()


@pytest.fixture(scope="module")
def served(models: Path) -> Iterator[tuple[str, Engine, HostModel]]:
    engine = Engine(registry=REGISTRY, hardware=HARDWARE, runs_dir=models.parent / "runs")
    host = HostModel(engine)
    engine.images.load(str(models / "dense"))
    settings = ServerSettings(model_roots=(models,), output_roots=(models.parent / "runs",), token=TOKEN)
    with LiveServer(create_app(engine, settings)) as url:
        yield url, engine, host


def test_the_server_refuses_each_through_its_load_and_a_requests_model(
        served: tuple[str, Engine, HostModel], models: Path) -> None:
    url, engine, host = served
    loaded, evicted = engine.images.session, host.evicted  # the setup's own load counts once
    for variant in BROKEN:
        for route, body in (("load", {"model": variant}),
                            ("jobs", {"prompt": "a fox", "model": variant, "steps": 1, "width": 64, "height": 64})):
            answer = httpx.post(f"{url}/v1/images/{route}", json=body, headers=AUTH, timeout=60)
            assert answer.status_code == 400 and answer.json()["error"]["code"] == "corrupt_quantised_model", \
                (variant, route, answer.text)
    assert host.evicted == evicted and engine.images.session is loaded
    assert httpx.get(f"{url}/v1/images/jobs", headers=AUTH).json()["jobs"] == []
