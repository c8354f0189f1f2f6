"""Quantise once: ``diffusion-engine quantize`` writes a pipeline folder whose denoiser is stored int8.

Real tiny pipelines and real files: the folder holds no pickle (every file's
format is read), loads as pre-quantised (the plan says so and refuses
another scheme before anything is evicted), renders the very image that
quantising at load renders, and loads without the dense weights ever existing
(the CPU allocator's peak, measured with torch's profiler).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.cli import main
from engine.contract.plugins import load_registry
from engine.errors import EngineError
from engine.hardware.probe import probe
from engine.preflight.headers import read_safetensors_header
from engine.preflight.quantised_folder import MARKER, read_marker
from engine.requests.inference import InferenceRequest
from engine.service.facade import Engine
from tests.support import HostModel

REGISTRY = load_registry()
HARDWARE = probe(verify=False)
FAMILY = "zimage"
PICKLE_MAGIC = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"PK\x03\x04")  # pickle, torch's zip


@pytest.fixture(scope="module")
def stored(tiny_pipeline: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    base = tiny_pipeline(FAMILY)
    output = tmp_path_factory.mktemp("quantized") / "zimage-int8"
    written = Engine(registry=REGISTRY, hardware=HARDWARE).quantize(str(base), "int8", output)
    return base, output, written


def test_the_folder_holds_no_pickle_and_says_what_it_was_made_from(stored: tuple[Path, Path, dict]) -> None:
    base, folder, written = stored
    assert written["quantised"] == ["transformer"] and written["layers"] > 0 and written["device"] == "cpu"
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert {p.suffix for p in files} <= {".json", ".safetensors", ".jinja", ".txt", ".model"}, files
    for path in files:
        head = path.read_bytes()[:4]
        assert not head.startswith(PICKLE_MAGIC), path
        if path.suffix == ".safetensors":
            read_safetensors_header(path)  # a complete safetensors file, or this raises
        elif path.suffix == ".json":
            json.loads(path.read_text(encoding="utf-8"))
    marker = read_marker(folder / "transformer")
    assert marker is not None and marker["scheme"] == "int8" and marker["made_from"] == str(base)
    assert marker["dense_gb"] > 0 and (folder / "transformer" / MARKER).is_file()
    # Everything but the denoiser is the original's own files.
    assert (folder / "vae" / "diffusion_pytorch_model.safetensors").read_bytes() == \
        (base / "vae" / "diffusion_pytorch_model.safetensors").read_bytes()


def test_it_loads_as_stored_and_renders_what_quantising_at_load_renders(stored: tuple[Path, Path, dict]) -> None:
    base, folder, _ = stored
    engine = Engine(registry=REGISTRY, hardware=HARDWARE)
    status = engine.images.load(str(folder))
    quant = status["plan"]["resolved"]["transformer_quant"]  # type: ignore[index]
    assert (quant["value"], quant["reason"]) == ("int8", "the checkpoint is stored pre-quantised")
    assert status["quantised_layers"] == 0  # nothing quantised at this load
    stored_image = np.asarray(engine.images.generate("a fox", steps=2, width=64, height=64, seed=1)[0])
    engine.images.unload()
    engine.images.load(str(base), request=InferenceRequest(quant="int8"))
    at_load = np.asarray(engine.images.generate("a fox", steps=2, width=64, height=64, seed=1)[0])
    engine.images.unload()
    assert np.array_equal(stored_image, at_load)


#: Loads the denoiser in a fresh process and prints how far its resident memory's high-water mark
#: (VmHWM, reset first: anonymous and file-mapped pages) rose above where it stood.
_PEAK = """
import sys, torch, diffusers
from pathlib import Path
from engine.runtime import quantize
from engine.runtime.prequantised import load_quantised

def status(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1]) * 1024

cls, how, folder = diffusers.ZImageTransformer2DModel, sys.argv[1], Path(sys.argv[2])
with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")  # reset the high-water mark to the present resident size (Linux 4.0+)
before = status("VmRSS")
if how == "stored":
    model = load_quantised(cls, folder / "transformer", torch.float32)
else:  # what a load-time int8 does: the dense weights, then quantised on the host
    model = cls.from_pretrained(str(folder), subfolder="transformer", dtype=torch.float32)
    quantize.quantize_on_host_then_place(model, "int8", "cpu")
print(status("VmHWM") - before)
"""


@pytest.mark.slow
def test_loading_it_never_holds_the_dense_weights(stored: tuple[Path, Path, dict]) -> None:
    """The rise of the process's peak resident memory while the denoiser loads: the stored int8
    folder against load-time quantisation, which reads every fp32 weight first."""
    import subprocess
    import sys

    import diffusers

    base, folder, _ = stored
    cls = diffusers.ZImageTransformer2DModel
    dense_bytes = sum(p.numel() * 4 for p in cls.from_pretrained(str(base), subfolder="transformer").parameters())

    def rise(how: str, where: Path) -> int:
        done = subprocess.run([sys.executable, "-c", _PEAK, how, str(where)], capture_output=True, text=True,
                              check=True, timeout=300)
        return int(done.stdout.strip().splitlines()[-1])

    at_load, stored_load = rise("dense", base), rise("stored", folder)
    assert at_load >= dense_bytes, (at_load, dense_bytes)  # every fp32 weight was resident
    assert stored_load < 0.6 * dense_bytes, (stored_load, dense_bytes)


def test_refusals_come_first_and_evict_nothing(stored: tuple[Path, Path, dict], tiny_pipeline: Callable[[str], Path],
                                               tmp_path: Path) -> None:
    base, folder, _ = stored
    engine = Engine(registry=REGISTRY, hardware=HARDWARE)
    host = HostModel(engine)
    for model, scheme, output, code in (
        (str(base), "fp8", tmp_path / "a", "fp8_unsupported"),       # no fp8 on this CPU
        (str(folder), "int8", tmp_path / "b", "prequantised_model"),  # already stored quantised
        (str(base), "int8", folder, "output_exists"),                 # a folder that holds files
        (str(base), "nf4", tmp_path / "c", "invalid_request"),        # bitsandbytes' scheme, at load only
    ):
        with pytest.raises(EngineError) as refused:
            engine.quantize(model, scheme, output)
        assert refused.value.code == code, refused.value
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    for quant in ("fp8", "none"):
        with pytest.raises(EngineError) as refused:
            engine.images.load(str(folder), request=InferenceRequest(quant=quant))
        assert refused.value.code == "prequantised_model" and "stored pre-quantised as int8" in refused.value.message
    assert host.evicted == 0 and engine.images.session is None


def test_the_cli_writes_one(tiny_pipeline: Callable[[str], Path], tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quantize", "--model", str(tiny_pipeline(FAMILY)), "--scheme", "int8", "-o", str(tmp_path / "q"),
                 "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert written["scheme"] == "int8" and Path(written["output"]) == tmp_path / "q"
    assert main(["quantize", "--model", str(tmp_path / "q"), "--scheme", "int8", "-o", str(tmp_path / "r")]) == 2
    assert "prequantised_model" in capsys.readouterr().err


def test_the_server_quantises_inside_its_roots(tiny_pipeline: Callable[[str], Path], tmp_path: Path) -> None:
    import shutil

    import httpx

    from engine.server.app import ServerSettings, create_app
    from tests.support import LiveServer

    models, outputs = tmp_path / "models", tmp_path / "outputs"
    shutil.copytree(tiny_pipeline(FAMILY), models / "z")
    outputs.mkdir()
    engine = Engine(registry=REGISTRY, hardware=HARDWARE, runs_dir=outputs)
    settings = ServerSettings(model_roots=(models,), output_roots=(outputs,), token="q-token")
    auth = {"Authorization": "Bearer q-token"}
    with LiveServer(create_app(engine, settings)) as url:
        def post(body: dict[str, object]) -> httpx.Response:
            return httpx.post(f"{url}/v1/models/quantize", json=body, headers=auth, timeout=120)

        outside = post({"model": str(models / "z"), "scheme": "int8", "output": str(tmp_path / "elsewhere")})
        assert outside.json()["error"]["code"] == "path_outside_roots" and not (tmp_path / "elsewhere").exists()
        assert post({"model": str(models / "z"), "scheme": "nf4", "output": str(outputs / "q")}).status_code == 422
        done = post({"model": str(models / "z"), "scheme": "int8", "output": str(outputs / "q")})
        assert done.status_code == 200, done.text
        assert done.json()["quantised"] == ["transformer"] and read_marker(outputs / "q" / "transformer") is not None


def test_it_copies_only_what_resolves_inside_the_model_folder(tiny_pipeline: Callable[[str], Path],
                                                              tmp_path: Path) -> None:
    """A model folder holding a symlink that leads out of it (a secret, say) does not carry
    that file into the quantised output; a link that stays inside is copied as the file."""
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of any model")
    base = tmp_path / "model"
    shutil.copytree(tiny_pipeline(FAMILY), base)
    (base / "tokenizer" / "leads-out.txt").symlink_to(secret)
    (base / "tokenizer" / "stays-in.json").symlink_to(base / "model_index.json")
    output = tmp_path / "out"
    Engine(registry=REGISTRY, hardware=HARDWARE).quantize(str(base), "int8", output)
    assert not (output / "tokenizer" / "leads-out.txt").exists()
    assert (output / "tokenizer" / "stays-in.json").read_bytes() == (base / "model_index.json").read_bytes()
    assert not any("not part of any model" in p.read_text(errors="ignore") for p in output.rglob("*.txt"))
