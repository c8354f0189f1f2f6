"""Every route that takes a file, an image or a path, fed a bomb, a truncation and a
traversal: each is refused with a 4xx and its code, never a 500; nothing is
evicted, the loaded pipeline stays, and no bomb is decoded. A real server on loopback."""

from __future__ import annotations

import io
import json
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.server.app import ServerSettings, create_app
from engine.service.facade import Engine
from engine.testing.datasets import write_dataset
from engine.training.records import RunRecord
from tests.support import HostModel, LiveServer

TOKEN = "hostile"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def bomb_png() -> bytes:
    """12000x12000 pixels in a few KB: 144 megapixels once decoded."""
    out = io.BytesIO()
    Image.new("1", (12000, 12000)).save(out, format="PNG", optimize=True)
    return out.getvalue()


def small_png(size: tuple[int, int] = (64, 64)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


def header_bomb(path: Path) -> Path:
    """A safetensors file whose header claims to be 2**40 bytes long."""
    path.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    return path


class World:
    def __init__(self, base: Path) -> None:
        self.models, self.datasets, self.outputs, self.loras, self.inputs, self.outside = (
            base / n for n in ("models", "datasets", "outputs", "loras", "inputs", "outside"))
        for folder in (self.models, self.datasets, self.outputs, self.loras, self.inputs, self.outside):
            folder.mkdir(parents=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_pipeline: Callable[[str], Path]) -> Iterator[
        tuple[str, Engine, World, HostModel]]:
    w = World(tmp_path_factory.mktemp("hostile"))
    shutil.copytree(tiny_pipeline("sdxl"), w.models / "tiny-sdxl")
    # A pipeline folder whose denoiser file is truncated, and one whose header is a bomb.
    shutil.copytree(tiny_pipeline("sdxl"), w.models / "truncated")
    weights = next((w.models / "truncated" / "unet").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-100])
    shutil.copytree(tiny_pipeline("sdxl"), w.models / "bomb")
    header_bomb(next((w.models / "bomb" / "unet").glob("*.safetensors")))
    # GGUF headers claiming 2**62 tensors, and 2**62 metadata entries, in 24 bytes.
    (w.models / "bomb.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**62, 0))
    (w.models / "entries.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1, 2**62) + b"\0" * 64)
    # LoRAs: truncated, a header bomb, NaN weights, infinite bf16 weights.
    good = {"unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight": torch.zeros(2, 32),
            "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.weight": torch.zeros(32, 2)}
    save_file(good, str(w.loras / "whole.safetensors"))
    (w.loras / "truncated.safetensors").write_bytes((w.loras / "whole.safetensors").read_bytes()[:-7])
    header_bomb(w.loras / "bomb.safetensors")
    save_file({**good, next(iter(good)): torch.full((2, 32), float("nan"))}, str(w.loras / "nan.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in {**good, next(iter(good)): torch.full((2, 32), float("inf"))}.items()},
              str(w.loras / "inf.safetensors"))
    save_file({**good, next(iter(good)): torch.full((2, 32), 3e38)}, str(w.loras / "huge.safetensors"))
    # Images: a bomb, a truncated PNG, a good one; outside the roots, and a symlink that leads out.
    (w.inputs / "bomb.png").write_bytes(bomb_png())
    (w.inputs / "truncated.png").write_bytes(small_png()[:60])
    (w.inputs / "box.png").write_bytes(small_png())
    (w.outside / "secret.png").write_bytes(small_png())
    (w.inputs / "escape.png").symlink_to(w.outside / "secret.png")
    (w.loras / "escape.safetensors").symlink_to(w.loras / ".." / "outside" / "secret.png")
    # Datasets: one with a bomb, one with a truncated image.
    for name, payload in (("bombed", bomb_png()), ("cut", small_png()[:60])):
        folder = write_dataset(w.datasets / name, count=2)
        (folder / "odd.png").write_bytes(payload)
    write_dataset(w.datasets / "fine", count=2)
    (w.datasets / "escape").symlink_to(w.outside)
    # A finished run with a symlink inside its folder that leads out.
    run = w.outputs / "done"
    run.mkdir()
    RunRecord(run_id="done", folder=run, family="sdxl", base_model="x", config={}, plan={}, status="completed").save()
    (run / "leak.png").symlink_to(w.outside / "secret.png")
    # Planted runs: records whose "folder" names the outside folder, the outputs root and "/",
    # and a run folder that is a symlink leading out.
    (w.outside / "victim.txt").write_text("must survive")
    for name, folder in (("planted-out", w.outside), ("planted-root", w.outputs), ("planted-slash", Path("/"))):
        (w.outputs / name).mkdir()
        record = {"run_id": name, "folder": str(folder), "family": "sdxl", "base_model": "x", "config": {},
                  "plan": {}, "status": "completed"}
        (w.outputs / name / "run.json").write_text(json.dumps(record), encoding="utf-8")
    (w.outside / "run.json").write_text(json.dumps({"run_id": "linked", "folder": str(w.outside), "family": "sdxl",
                                                    "base_model": "x", "config": {}, "plan": {},
                                                    "status": "completed"}), encoding="utf-8")
    (w.outputs / "linked").symlink_to(w.outside)
    gguf_companions(w, tiny_pipeline("flux"))
    engine = Engine(registry=load_registry(), hardware=probe(verify=False), runs_dir=w.outputs)
    host = HostModel(engine, name="host.llm", size_gb=0.0)
    engine.images.load(str(w.models / "tiny-sdxl"))
    assert host.evicted == 1
    settings = ServerSettings(model_roots=(w.models,), dataset_roots=(w.datasets,), output_roots=(w.outputs,),
                              lora_roots=(w.loras,), input_roots=(w.inputs,), token=TOKEN, max_body_bytes=8 * 2**20)
    with LiveServer(create_app(engine, settings)) as url:
        yield url, engine, w, host


def gguf_companions(w: World, flux: Path) -> None:
    """GGUF transformers (sd.cpp's kind) beside broken companions: an empty autoencoder, a
    truncated one, a header bomb, CLIP-L as a symlink to /etc/passwd and to a good file
    outside the roots; and a good GGUF with a base of another width (the tiny diffusers FLUX)."""
    from families.flux.sdcpp_files import write_tiny

    good = write_tiny(w.outside / "flux-files", gguf=True, companions=False)  # broken companions below
    small = w.outside / "small.safetensors"
    save_file({"weight": torch.zeros(4, 4)}, str(small))
    for name in ("ae-empty", "ae-cut", "ae-bomb", "clip-passwd", "clip-out", "wide"):
        folder = w.models / name
        folder.mkdir()
        shutil.copy(good["diffusion_model_path"], folder / "flux-tiny.gguf")
        shutil.copy(small, folder / "ae.safetensors")
        shutil.copy(small, folder / "clip_l.safetensors")
    (w.models / "ae-empty" / "ae.safetensors").write_bytes(b"")
    (w.models / "ae-cut" / "ae.safetensors").write_bytes(small.read_bytes()[:-10])
    header_bomb(w.models / "ae-bomb" / "ae.safetensors")
    for name, target in (("clip-passwd", Path("/etc/passwd")), ("clip-out", small)):
        (w.models / name / "clip_l.safetensors").unlink()
        (w.models / name / "clip_l.safetensors").symlink_to(target)
    shutil.copytree(flux, w.models / "tiny-flux")


def post(url: str, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=120)


def assert_refused(response: httpx.Response, status: int, code: str, world: tuple[str, Engine, World, HostModel]) -> None:
    assert response.status_code == status and response.json()["error"]["code"] == code, response.text[:500]
    _, engine, _, host = world
    assert host.evicted == 1 and engine.status()["pipeline"] is not None  # nothing evicted, the pipeline stays


GENERATE = {"prompt": "a box", "steps": 1, "width": 64, "height": 64}


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files whose pixels PIL decodes while the test runs (the server is in this process):
    "refused from its header" means its name never shows up here."""
    from PIL import ImageFile

    seen: list[str] = []
    load = ImageFile.ImageFile.load

    def counted(image: ImageFile.ImageFile) -> object:
        seen.append(Path(str(getattr(image, "filename", "") or "")).name)
        return load(image)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counted)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("route", ["/v1/images/generate", "/v1/images/jobs"])
@pytest.mark.parametrize(("field", "name", "status", "code"), [
    ("image", "bomb.png", 400, "invalid_image"),
    ("mask_image", "bomb.png", 400, "invalid_image"),
    ("control_image", "bomb.png", 400, "invalid_image"),
    ("image", "../outside/secret.png", 400, "path_outside_roots"),
    ("image", "escape.png", 400, "path_outside_roots"),
])
def test_generate_image_paths(world: tuple[str, Engine, World, HostModel], route: str, field: str, name: str,
                              status: int, code: str, decoded: list[str]) -> None:
    """Bombs and traversals are refused before the job is queued (a 202 never comes)."""
    url, *_ = world
    body = {**GENERATE, field: name, **({"image": "box.png"} if field == "mask_image" else {})}
    response = post(url, route, body)
    assert_refused(response, status, code, world)
    if name == "bomb.png":  # refused from its header: never decoded
        assert "declares 12000x12000" in response.json()["error"]["message"]
        assert "bomb.png" not in decoded, decoded


def test_a_truncated_input_image_is_refused_by_the_job(world: tuple[str, Engine, World, HostModel]) -> None:
    url, *_ = world
    response = post(url, "/v1/images/generate", {**GENERATE, "image": "truncated.png"})
    assert_refused(response, 400, "invalid_image", world)
    assert "truncated.png" in response.json()["error"]["message"]


@pytest.mark.parametrize(("files", "code", "status"), [
    ({"image": ("a.png", bomb_png(), "image/png")}, "invalid_image", 400),
    ({"image": ("a.png", small_png(), "image/png"), "mask": ("m.png", bomb_png(), "image/png")}, "invalid_image", 400),
    ({"image": ("a.png", small_png()[:60], "image/png")}, "invalid_image", 400),
    ({"image": ("a.png", small_png(), "image/png"), "mask": ("m.png", b"GIF89a\x00", "image/gif")}, "invalid_image", 400),
    ({"image": ("../../etc/passwd", small_png()[:60], "image/png")}, "invalid_image", 400),
])
def test_edit_uploads(world: tuple[str, Engine, World, HostModel], files: dict[str, object], code: str, status: int) -> None:
    url, *_ = world
    response = httpx.post(f"{url}/v1/images/edits", headers=AUTH, files=files, data={"prompt": "x", "size": "64x64"},
                          timeout=120)
    assert_refused(response, status, code, world)


def test_a_malformed_multipart_body_is_422(world: tuple[str, Engine, World, HostModel]) -> None:
    url, *_ = world
    response = httpx.post(f"{url}/v1/images/edits", content=b"--x\r\nContent-Disposition: form-data; name=\"image\"\r\n",
                          headers={**AUTH, "Content-Type": "multipart/form-data; boundary=x"})
    assert_refused(response, 422, "invalid_request", world)


@pytest.mark.parametrize("route", ["/v1/images/plan", "/v1/images/load"])
@pytest.mark.parametrize(("model", "status", "code"), [
    ("truncated", 400, "corrupt_checkpoint"),
    ("bomb", 400, "corrupt_checkpoint"),
    ("bomb.gguf", 400, "corrupt_checkpoint"),
    ("entries.gguf", 400, "corrupt_checkpoint"),
    ("../outside", 400, "path_outside_roots"),
    ("/etc", 400, "path_outside_roots"),
])
def test_model_paths(world: tuple[str, Engine, World, HostModel], route: str, model: str, status: int, code: str) -> None:
    url, *_ = world
    assert_refused(post(url, route, {"model": model}), status, code, world)


@pytest.mark.parametrize("route", ["/v1/images/plan", "/v1/images/load"])
@pytest.mark.parametrize(("folder", "says"), [
    ("ae-empty", "ae.safetensors is not a complete safetensors file"),
    ("ae-cut", "truncated or padded"),
    ("ae-bomb", "header too large"),
    ("clip-passwd", "leads to /etc/passwd, outside the model's folder"),
    ("clip-out", "small.safetensors, outside the model's folder"),
])
def test_gguf_companions_are_checked_before_sdcpp_reads_them(
    world: tuple[str, Engine, World, HostModel], route: str, folder: str, says: str,
) -> None:
    """sd.cpp trusts its files (it crashed on these, after the eviction): each is refused from its
    header or its link, naming the file, and the pipeline that was loaded stays."""
    url, *_ = world
    response = post(url, route, {"model": f"{folder}/flux-tiny.gguf", "engine": "sdcpp"})
    assert_refused(response, 400, "sdcpp_unavailable", world)
    assert says in response.json()["error"]["message"], response.text


@pytest.mark.parametrize("route", ["/v1/images/plan", "/v1/images/load"])
def test_a_gguf_with_the_base_of_another_model_is_refused_before_eviction(
    world: tuple[str, Engine, World, HostModel], route: str,
) -> None:
    url, *_ = world
    response = post(url, route, {"model": "wide/flux-tiny.gguf", "base": "tiny-flux", "engine": "diffusers"})
    assert_refused(response, 400, "base_mismatch", world)
    assert "256 wide" in response.json()["error"]["message"]


@pytest.mark.parametrize(("lora", "code"), [
    ("truncated.safetensors", "lora_unreadable"),
    ("bomb.safetensors", "lora_unreadable"),
    ("nan.safetensors", "lora_not_finite"),
    ("inf.safetensors", "lora_not_finite"),
    ("huge.safetensors", "lora_not_finite"),
    ("../outside/secret.png", "path_outside_roots"),
    ("escape.safetensors", "path_outside_roots"),
])
@pytest.mark.parametrize("route", ["/v1/images/load", "/v1/images/generate"])
def test_lora_paths(world: tuple[str, Engine, World, HostModel], lora: str, code: str, route: str) -> None:
    url, *_ = world
    body = {"model": "tiny-sdxl"} if route.endswith("load") else dict(GENERATE)
    assert_refused(post(url, route, {**body, "loras": [{"path": lora}]}), 400, code, world)


@pytest.mark.parametrize("route", ["/v1/training/plan", "/v1/training/start"])
@pytest.mark.parametrize(("field", "value", "status", "code"), [
    ("dataset_dir", "bombed", 400, "bad_dataset"),
    ("dataset_dir", "cut", 400, "bad_dataset"),
    ("dataset_dir", "../outside", 400, "path_outside_roots"),
    ("dataset_dir", "escape", 400, "path_outside_roots"),
    ("base_model", "truncated", 400, "corrupt_checkpoint"),
    ("base_model", "bomb", 400, "corrupt_checkpoint"),
    ("base_model", "../../", 400, "path_outside_roots"),
    ("output_dir", "../outside/run", 400, "path_outside_roots"),
    ("resume_from", "../outside", 400, "path_outside_roots"),
    ("resume_from", "done", 400, "checkpoint_unreadable"),
])
def test_training_paths(world: tuple[str, Engine, World, HostModel], route: str, field: str, value: str,
                        status: int, code: str) -> None:
    url, *_ = world
    body = {"base_model": "tiny-sdxl", "dataset_dir": "fine", "resolution": 64, "device": "cpu", "steps": 1,
            field: value}
    assert_refused(post(url, route, body), status, code, world)


@pytest.mark.parametrize("name", ["../../outside/secret.png", "..%2F..%2Foutside%2Fsecret.png", "leak.png",
                                  "run.json/../../outside/secret.png"])
def test_run_files_stay_inside_the_run(world: tuple[str, Engine, World, HostModel], name: str) -> None:
    url, *_ = world
    response = httpx.get(f"{url}/v1/training/runs/done/files/{name}", headers=AUTH)
    assert response.status_code == 404, response.text
    assert b"secret" not in response.content or response.json()["error"]["code"] in ("unknown_run_file", "not_found")
    listed = httpx.get(f"{url}/v1/training/runs/done/files", headers=AUTH).json()
    assert [f["path"] for f in listed] == ["run.json"]


@pytest.mark.parametrize("run", ["planted-out", "planted-root", "planted-slash"])
def test_a_planted_run_record_points_nowhere_but_its_own_folder(
    world: tuple[str, Engine, World, HostModel], run: str,
) -> None:
    """A record's "folder" is ignored: its files are its own folder's, a file named through it is a
    404, and nothing outside (nor the runs beside it) is listed or read."""
    url, _, w, _ = world
    listed = httpx.get(f"{url}/v1/training/runs/{run}/files", headers=AUTH)
    assert listed.status_code == 200 and [f["path"] for f in listed.json()] == ["run.json"], listed.text
    for name in ("victim.txt", "passwd", "etc/passwd", "done/run.json"):
        assert httpx.get(f"{url}/v1/training/runs/{run}/files/{name}", headers=AUTH).status_code == 404
    shown = httpx.get(f"{url}/v1/training/runs/{run}", headers=AUTH).json()
    assert Path(shown["folder"]) == (w.outputs / run).resolve(), shown["folder"]
    assert (w.outside / "victim.txt").read_text() == "must survive"


def test_deleting_planted_runs_deletes_only_their_own_folders(world: tuple[str, Engine, World, HostModel]) -> None:
    url, engine, w, host = world
    for run in ("planted-root", "planted-slash"):
        response = httpx.delete(f"{url}/v1/training/runs/{run}", headers=AUTH)
        assert response.status_code == 200, response.text
        assert not (w.outputs / run).exists()
    linked = httpx.delete(f"{url}/v1/training/runs/linked", headers=AUTH)
    assert linked.status_code in (404, 409), linked.text  # a symlink that leads out is not a run to remove
    assert (w.outside / "victim.txt").read_text() == "must survive" and (w.outside / "run.json").exists()
    assert (w.outputs / "done" / "run.json").exists() and (w.outputs / "planted-out" / "run.json").exists()
    assert host.evicted == 1 and engine.status()["pipeline"] is not None
    ids = {r["run_id"] for r in httpx.get(f"{url}/v1/training/runs", headers=AUTH).json()}
    assert "linked" not in ids and {"done", "planted-out"} <= ids, ids


@pytest.mark.parametrize(("dataset", "files", "status", "code"), [
    ("escape", {"files": ("a.png", small_png(), "image/png")}, 400, "path_outside_roots"),
    ("fine", {"files": ("a.png", bomb_png(), "image/png")}, 400, "invalid_image"),
    ("fine", {"files": ("a.png", small_png()[:60], "image/png")}, 400, "invalid_image"),
    ("fine", {"files": ("../../outside/a.png", small_png(), "image/png")}, 400, "path_outside_roots"),
])
def test_dataset_uploads(world: tuple[str, Engine, World, HostModel], dataset: str, files: dict[str, object],
                         status: int, code: str) -> None:
    """A symlinked dataset name, a bomb, a truncation, a traversal: refused, nothing written anywhere."""
    url, _, w, _ = world
    before = sorted(p.name for p in w.outside.rglob("*")), sorted(p.name for p in (w.datasets / "fine").iterdir())
    response = httpx.post(f"{url}/v1/datasets/{dataset}/images", headers=AUTH, files=files, timeout=60)
    assert_refused(response, status, code, world)
    assert (sorted(p.name for p in w.outside.rglob("*")), sorted(p.name for p in (w.datasets / "fine").iterdir())) == before


def test_a_thumbnail_of_a_bomb_is_refused_from_its_header(world: tuple[str, Engine, World, HostModel],
                                                          decoded: list[str]) -> None:
    url, *_ = world
    response = httpx.get(f"{url}/v1/datasets/bombed/thumbnails/odd.png", headers=AUTH, timeout=60)
    assert_refused(response, 400, "invalid_image", world)
    assert "144000000 pixels" in response.json()["error"]["message"]  # its header's size
    assert "odd.png" not in decoded, decoded  # never decoded


def test_the_decode_record_sees_a_decode(tmp_path: Path, decoded: list[str]) -> None:
    """The record above is not empty by construction: a decoded image shows up in it."""
    from PIL import Image

    Image.new("RGB", (4, 4)).save(tmp_path / "seen.png")
    with Image.open(tmp_path / "seen.png") as image:
        image.load()
    assert decoded == ["seen.png"]


def test_roots_never_list_a_symlink_that_leads_out(world: tuple[str, Engine, World, HostModel]) -> None:
    url, _, w, _ = world
    roots = httpx.get(f"{url}/v1/roots", headers=AUTH).json()
    shown = json.dumps(roots)
    assert str(w.outside) not in shown and "escape" not in shown
    assert {d["name"] for d in roots["datasets"]} == {"bombed", "cut", "fine"}
    assert "whole.safetensors" in {entry["name"] for entry in roots["loras"]}


@pytest.mark.parametrize(("lora", "code"), [("truncated.safetensors", "lora_unreadable"),
                                            ("nan.safetensors", "lora_not_finite")])
def test_the_cli_refuses_a_broken_lora_without_a_traceback(
    world: tuple[str, Engine, World, HostModel], tmp_path: Path, lora: str, code: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The CLI in-process (its own error handling, exit code and stderr, as a terminal sees them)."""
    from engine.cli import main

    _, _, w, _ = world
    capsys.readouterr()
    status = main(["generate", "--tiny", "sdxl", "--prompt", "a box", "--lora", str(w.loras / lora),
                   "-o", str(tmp_path / "out.png")])
    err = capsys.readouterr().err
    assert status == 2 and f"error[{code}]" in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "out.png").exists()
