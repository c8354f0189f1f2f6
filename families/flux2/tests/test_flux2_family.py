"""FLUX.2: the built-in family passes the contract kit on klein and on dev (each tiny pipeline
runs through the engine: the images equal plain diffusers' in tests/runtime/test_stock_diffusers.py),
and FLUX.2 dev's plan on the cards people run it on says what fits and why."""

from __future__ import annotations

from tests.support import table_plan

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.contract.plugins import load_registry
from engine.hardware.presets import preset
from engine.testing import FamilyContract

REGISTRY = load_registry()
FLUX2 = REGISTRY.family("flux2")


class TestFlux2Kit(FamilyContract):
    family_name = "flux2"


class TestFlux2DevKit(FamilyContract):
    """dev's own pipeline class (Flux2Pipeline, a Mistral-3 encoder, the guidance embedding)
    runs the same checks: its tiny pipeline loads, generates, trains and reloads its LoRA."""

    family_name = "flux2"
    checkpoint_name = "flux.2-dev"




def test_flux2_dev_on_a_24_gb_card_streams_its_blocks_because_nothing_else_fits() -> None:
    """64.5 GB of transformer and a 24B text encoder (26 GB even in fp8): no scheme makes
    either resident on an RTX 4090, so the plan streams blocks (group offload) and says so."""
    chosen = table_plan("flux2", "rtx4090", "flux.2-dev")
    assert chosen.value("memory_mode") == "group_offload" and chosen.value("transformer_quant") is None
    assert "does not fit" in chosen["memory_mode"].reason
    assert "quantising would not improve the plan" in chosen["transformer_quant"].reason


def test_flux2_dev_on_an_l40s_holds_an_fp8_transformer_and_streams_its_encoder() -> None:
    """fp8 at the family's own factor (0.501 of 64.5 GB) fits the 48 GB card resident; the
    fp8 text encoder then goes to the GPU per prompt."""
    chosen = table_plan("flux2", "l40s", "flux.2-dev")
    assert chosen.value("transformer_quant") == "fp8" and chosen.value("memory_mode") == "resident"
    assert chosen.value("text_encoder_memory") == "streamed"
    assert 30 < chosen.estimate.peak_gb < 0.85 * preset("l40s").total_memory_gb
    assert "fp8 > int8 on sm89" in chosen["transformer_quant"].reason


def test_flux2_dev_on_an_h100_is_fp8_and_wholly_resident() -> None:
    chosen = table_plan("flux2", "h100", "flux.2-dev")
    assert (chosen.value("transformer_quant"), chosen.value("memory_mode"), chosen.value("text_encoder_memory")) == (
        "fp8", "resident", "resident")
    assert "the whole pipeline fits resident" in chosen["text_encoder_memory"].reason


def test_flux2_dev_on_a_b200_runs_dense_bf16() -> None:
    chosen = table_plan("flux2", "b200", "flux.2-dev")
    assert (chosen.value("dtype"), chosen.value("transformer_quant"), chosen.value("memory_mode")) == (
        "bf16", None, "resident")
    assert "quantising would not improve the plan" in chosen["transformer_quant"].reason


@pytest.mark.parametrize("hardware", ["rtx4090", "l40s", "h100", "b200"])
def test_flux2_klein_is_resident_dense_on_every_card(hardware: str) -> None:
    """klein 4B (7.8 + 8.0 GB) is the FLUX.2 for one consumer card: dense and resident."""
    chosen = table_plan("flux2", hardware, "flux.2-klein-4b")
    assert (chosen.value("transformer_quant"), chosen.value("memory_mode")) == (None, "resident")
    assert chosen.default_steps == 4


def test_checkpoints_are_told_apart_by_name() -> None:
    assert FLUX2.checkpoint("black-forest-labs/FLUX.2-klein-base-4B").name == "flux.2-klein-base-4b"
    assert FLUX2.checkpoint("black-forest-labs/FLUX.2-klein-4B").name == "flux.2-klein-4b"
    assert FLUX2.checkpoint("black-forest-labs/FLUX.2-klein-9B").name == "flux.2-klein-9b"
    assert FLUX2.checkpoint("~/models/FLUX.2-klein-base-9B").name == "flux.2-klein-base-9b"
    assert FLUX2.checkpoint("black-forest-labs/FLUX.2-dev").pipeline_class == "Flux2Pipeline"
    assert REGISTRY.component_sizes(FLUX2, FLUX2.checkpoint("flux.2-dev")).transformer_gb == 64.5


@pytest.mark.slow
def test_a_lora_trained_on_klein_base_deploys_on_the_distilled_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    """LoRAs train on klein's undistilled base; the one trained here loads onto the 4-step
    distilled model through the engine's LoRA door and changes its image."""
    import numpy as np

    from engine.hardware.probe import probe
    from engine.service.facade import Engine
    from engine.testing.run import run_model
    from families.flux2.tiny import build_tiny_pipeline

    base = build_tiny_pipeline(tmp_path_factory.mktemp("klein") / "flux.2-klein-base-tiny", distilled=False)
    distilled = build_tiny_pipeline(tmp_path_factory.mktemp("klein") / "flux.2-klein-tiny")
    report = run_model(REGISTRY, FLUX2, tmp_path_factory.mktemp("run"), folder=base)
    assert report.failure is None and report.lora is not None, report.failure
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False))
    images = {}
    for name, loras in (("plain", []), ("lora", [f"{report.lora}:1.0"])):
        engine.images.load(str(distilled), loras=loras)
        [image] = engine.images.generate("a red fox", steps=2, width=64, height=64, seed=3)
        images[name] = np.asarray(image, dtype=np.int16)
        assert engine.images.loaded_plan().checkpoint == "flux.2-klein-4b"  # type: ignore[union-attr]
        engine.images.unload()
    assert np.abs(images["lora"] - images["plain"]).max() > 0, "the LoRA changed nothing on the distilled model"


def test_klein_9b_on_a_24_gb_card_is_int8_resident_with_its_encoder_streamed() -> None:
    """18 GB of transformer and the 16.4 GB Qwen3-8B embedder do not sit together on an RTX 4090
    (dense, its blocks would stream): int8 keeps the transformer resident and the fp8 encoder is
    streamed per prompt. On an L40S the dense transformer and the encoder are both resident."""
    small = table_plan("flux2", "rtx4090", "flux.2-klein-9b")
    assert (small.value("transformer_quant"), small.value("memory_mode"), small.value("text_encoder_memory")) == (
        "int8", "resident", "streamed")
    assert "the dense transformer plans group_offload" in small["transformer_quant"].reason
    large = table_plan("flux2", "l40s", "flux.2-klein-9b")
    assert (large.value("transformer_quant"), large.value("memory_mode"), large.value("text_encoder_memory")) == (
        None, "resident", "resident")


def test_a_folder_is_the_checkpoint_its_pipeline_class_says_whatever_its_name() -> None:
    """A folder named by its owner (``mine``) is read by its model_index.json class: dev's
    Flux2Pipeline is dev (its 28 steps, its sizes), klein's class stays the default, and a
    name that matches is kept where the class agrees."""
    assert FLUX2.checkpoint_of_folder("mine", "Flux2Pipeline").name == "flux.2-dev"  # type: ignore[union-attr]
    assert FLUX2.checkpoint_of_folder("mine", "Flux2KleinPipeline") is None
    assert FLUX2.checkpoint_of_folder("flux.2-klein-base-4b", "Flux2KleinPipeline").name == "flux.2-klein-base-4b"  # type: ignore[union-attr]
    assert FLUX2.checkpoint_of_folder("flux.2-dev-copy", "Flux2KleinPipeline").name == "flux.2-klein-4b"  # type: ignore[union-attr]


@pytest.mark.slow
def test_dev_loads_by_its_class_and_its_processor_without_torchvision_is_refused_before_eviction(
    tiny_pipeline: Callable[..., Path], tmp_path: Path
) -> None:
    """The tiny dev pipeline copied to a folder called ``mine`` loads as FLUX.2 dev. The real
    dev's tokenizer is a ``PixtralProcessor``, which transformers builds only with torchvision:
    where torchvision is missing (as here) the load names it before the host model is evicted."""
    import importlib.util
    import json
    import shutil

    from engine.errors import EngineError
    from engine.hardware.presets import PRESETS
    from engine.hardware.probe import probe
    from engine.service.facade import Engine
    from tests.support import HostModel

    mine = tmp_path / "mine"
    shutil.copytree(tiny_pipeline("flux2", "flux.2-dev"), mine)
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False))
    engine.images.load(str(mine))
    try:
        assert engine.images.loaded_plan().checkpoint == "flux.2-dev"  # type: ignore[union-attr]
    finally:
        engine.images.unload()

    assert importlib.util.find_spec("torchvision") is None, "this environment is the one without torchvision"
    index = json.loads((mine / "model_index.json").read_text())
    (mine / "model_index.json").write_text(json.dumps({**index, "tokenizer": ["transformers", "PixtralProcessor"]}))
    (mine / "tokenizer" / "processor_config.json").write_text(json.dumps(
        {"processor_class": "PixtralProcessor", "patch_size": 16, "spatial_merge_size": 2}))
    engine = Engine(registry=REGISTRY, hardware=PRESETS["h100"])
    host = HostModel(engine)
    with pytest.raises(EngineError) as refused:
        engine.images.load(str(mine))
    assert refused.value.code == "load_failed"
    assert "the tokenizer (PixtralProcessor)" in refused.value.message and "Torchvision" in refused.value.message
    assert host.evicted == 0 and engine.residency.owner is None


def test_training_dev_from_its_hub_id_is_sized_as_dev_not_klein() -> None:
    """A dev run from its hub id holds dev's 64.5 GB transformer: on an H100 auto leaves bf16
    (64.5 GB does not leave its headroom in 80), where klein's 7.8 GB trains dense."""
    from engine.policy.training import resolve_training_precision
    from engine.policy.training_fit import MemoryRequest

    h100 = preset("h100")
    chosen = {}
    for name in ("flux.2-dev", "flux.2-klein-base-4b"):
        memory = MemoryRequest.from_table(FLUX2, sizes=REGISTRY.component_sizes(FLUX2, FLUX2.checkpoint(name)))
        chosen[name] = resolve_training_precision(REGISTRY, FLUX2, h100, "auto", memory=memory)
    assert chosen["flux.2-klein-base-4b"].value == "bf16"
    assert chosen["flux.2-dev"].value in ("int8", "nf4") and "64.5 GB dense" in chosen["flux.2-dev"].reason


def _pictures(tmp_path: Path) -> dict[str, Path]:
    """Two noise pictures (FLUX.2's processor takes references of 64 px a side or more) and a
    mask whitening the middle square."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    made = {"a": Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)),
            "b": Image.fromarray(rng.integers(0, 255, (80, 96, 3), dtype=np.uint8))}
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (16, 16, 48, 48))
    made["mask"] = mask
    for name, picture in made.items():
        picture.save(tmp_path / f"{name}.png")
    return {name: tmp_path / f"{name}.png" for name in made}


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", [None, "flux.2-dev"])
def test_references_edit_as_plain_diffusers_does(
    checkpoint: str | None, tiny_pipeline: Callable[..., Path], tmp_path: Path
) -> None:
    """Given images, klein and dev edit from them as references (their text-to-image pipeline
    takes them as a list): one reference or two through the engine equal plain diffusers'
    call with the same pictures, pixel for pixel; five are more than klein takes, refused
    before anything loads."""
    import numpy as np
    import torch
    from diffusers import DiffusionPipeline
    from PIL import Image

    from engine.errors import EngineError
    from engine.hardware.probe import probe
    from engine.service.facade import Engine

    folder = tiny_pipeline("flux2", checkpoint)
    pictures = _pictures(tmp_path)
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False))
    engine.images.load(str(folder))
    ours = {}
    try:
        for given in (["a"], ["a", "b"]):
            [ours[len(given)]] = engine.images.generate("a red fox", steps=2, seed=3, width=64, height=64,
                                                        image=[str(pictures[n]) for n in given], guidance=2.0)
        with pytest.raises(EngineError) as refused:
            engine.images.generate("a red fox", steps=2, image=[str(pictures["a"])] * 7)
        assert refused.value.code in ("too_many_images", "invalid_request")
    finally:
        engine.images.unload()
    from engine.testing.stock import planned_dtypes

    stock = DiffusionPipeline.from_pretrained(folder, dtype=planned_dtypes(folder))
    for count, names in ((1, ["a"]), (2, ["a", "b"])):
        theirs = stock(image=[Image.open(pictures[n]).convert("RGB") for n in names], prompt=["a red fox"],
                       num_inference_steps=2, guidance_scale=2.0, width=64, height=64,
                       generator=[torch.Generator().manual_seed(3)]).images[0]
        assert np.array_equal(np.asarray(ours[count]), np.asarray(theirs)), f"{count} reference(s) differ"


@pytest.mark.slow
def test_klein_inpaints_the_masked_square_and_keeps_the_rest(tiny_pipeline: Callable[..., Path], tmp_path: Path) -> None:
    """An image with a mask on klein runs Flux2KleinInpaintPipeline over the loaded weights: the
    pixels outside the mask are the input's, the square inside is redrawn as plain diffusers'
    inpaint pipeline redraws it; dev serves no inpaint and says so."""
    import numpy as np
    import torch
    from diffusers import Flux2KleinInpaintPipeline
    from PIL import Image

    from engine.errors import EngineError
    from engine.hardware.probe import probe
    from engine.service.facade import Engine

    from engine.requests.inference import InferenceRequest

    pictures = _pictures(tmp_path)
    folder = tiny_pipeline("flux2")
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False))
    # fp32 on both sides: the input's fitting is compared here, not bf16's rounding of it, which
    # four steps of a tiny random model amplify to a dozen levels
    engine.images.load(str(folder), request=InferenceRequest(dtype="fp32"))
    try:
        [ours] = engine.images.generate("a red fox", steps=4, seed=3, image=str(pictures["a"]),
                                        mask_image=str(pictures["mask"]), guidance=1.0)
    finally:
        engine.images.unload()
    given = np.asarray(Image.open(pictures["a"]).convert("RGB"))
    mine = np.asarray(ours)
    inside = np.asarray(Image.open(pictures["mask"])) > 127
    assert np.array_equal(mine[~inside], given[~inside])
    assert np.abs(mine[inside].astype(int) - given[inside]).mean() > 10
    stock = Flux2KleinInpaintPipeline.from_pretrained(folder, dtype=torch.float32)
    theirs = np.asarray(stock(prompt="a red fox", image=Image.open(pictures["a"]).convert("RGB"),
                              mask_image=Image.open(pictures["mask"]), num_inference_steps=4, guidance_scale=1.0,
                              width=64, height=64, generator=torch.Generator().manual_seed(3)).images[0])
    assert np.abs(mine[inside].astype(int) - theirs[inside]).max() <= 1

    engine.images.load(str(tiny_pipeline("flux2", "flux.2-dev")))
    try:
        with pytest.raises(EngineError) as refused:
            engine.images.generate("a red fox", steps=2, image=str(pictures["a"]), mask_image=str(pictures["mask"]))
    finally:
        engine.images.unload()
    assert refused.value.code == "unsupported_workflow" and "no inpaint pipeline" in refused.value.message


def test_a_flux2_file_is_told_from_a_flux1_file_by_its_own_keys(tmp_path: Path) -> None:
    """FLUX.2 kept FLUX.1's block names (``double_blocks``, ``single_blocks.N.linear1``) and
    moved modulation out of the blocks: its global modulation keys claim a BFL-layout file
    for FLUX.2, while a FLUX.1 file (per-block ``img_mod``) stays FLUX.1's. Real headers."""
    import torch
    from safetensors.torch import save_file

    from engine.preflight.headers import tensor_shapes
    from engine.preflight.single_file import family_from_keys

    layouts = {
        "flux2": ["double_blocks.0.img_attn.qkv.weight", "double_blocks.0.img_mlp.0.weight",
                  "double_stream_modulation_img.lin.weight", "double_stream_modulation_txt.lin.weight",
                  "single_stream_modulation.lin.weight", "single_blocks.0.linear1.weight"],
        "flux": ["double_blocks.0.img_attn.qkv.weight", "double_blocks.0.img_mod.lin.weight",
                 "single_blocks.0.linear1.weight", "single_blocks.0.modulation.lin.weight"],
    }
    for family, keys in layouts.items():
        file = tmp_path / f"{family}.safetensors"
        save_file({key: torch.zeros(2, 2) for key in keys}, str(file))
        names = tuple(name for name, _ in tensor_shapes([file]))
        assert family_from_keys(REGISTRY, names).name == family  # type: ignore[union-attr]


@pytest.mark.slow
def test_a_klein_transformer_file_loads_on_its_base_and_draws_the_folders_image(
    tiny_pipeline: Callable[..., Path], tmp_path: Path
) -> None:
    """The transformer saved as one file (as people download klein) is found to be FLUX.2 by its
    keys whatever its name, loads with the folder as its base, and draws the folder's image."""
    import numpy as np

    from engine.hardware.probe import probe
    from engine.preflight.model import resolve_model
    from engine.service.facade import Engine
    from engine.testing.checkpoints import write_single_file

    base = tiny_pipeline("flux2")
    file = write_single_file(base, "transformer", tmp_path / "mystery.safetensors")
    source = resolve_model(REGISTRY, file, base=base)
    assert (source.kind, source.family.name) == ("single_file", "flux2")
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False))
    drawn = []
    for model, given in ((str(base), None), (str(file), str(base))):
        engine.images.load(model, base=given)
        try:
            [image] = engine.images.generate("a red fox", steps=2, seed=5, width=64, height=64)
            drawn.append(np.asarray(image))
        finally:
            engine.images.unload()
    assert np.array_equal(drawn[0], drawn[1])


@pytest.mark.slow
def test_a_reference_under_64_pixels_is_refused_before_anything_loads(
    tiny_pipeline: Callable[..., Path], tmp_path: Path
) -> None:
    """FLUX.2's processor takes no input image under 64 px a side: a 32 px reference is refused
    from its header, naming it, before the host model is evicted (the door) and before the
    loaded pipeline is called (Python); a 64 px one passes."""
    from PIL import Image

    from engine.errors import EngineError
    from engine.hardware.presets import PRESETS
    from engine.hardware.probe import probe
    from engine.requests import GenerateBody
    from engine.service.facade import Engine
    from tests.support import HostModel

    big, small = tmp_path / "big.png", tmp_path / "small.png"
    Image.new("RGB", (64, 64), (20, 120, 30)).save(big)
    Image.new("RGB", (96, 32), (200, 10, 10)).save(small)
    folder = tiny_pipeline("flux2")
    engine = Engine(registry=REGISTRY, hardware=PRESETS["h100"])
    host = HostModel(engine)
    engine.images.check_generate(GenerateBody(prompt="a fox", model=str(folder), image=[str(big), str(big)]))
    with pytest.raises(EngineError) as refused:
        engine.images.check_generate(GenerateBody(prompt="a fox", model=str(folder), image=[str(big), str(small)]))
    assert refused.value.code == "invalid_image" and "image[1] is 96x32" in refused.value.message
    assert "at least 64 pixels" in refused.value.message and host.evicted == 0

    engine = Engine(registry=REGISTRY, hardware=probe(verify=False))
    engine.images.load(str(folder))
    try:
        with pytest.raises(EngineError) as again:
            engine.images.generate("a fox", steps=1, image=str(small))
    finally:
        engine.images.unload()
    assert again.value.code == "invalid_image" and "image is 96x32" in again.value.message


@pytest.mark.slow
def test_over_http_a_small_reference_is_refused_before_a_job_is_queued(
    tiny_pipeline: Callable[..., Path], tmp_path: Path
) -> None:
    """The JSON list (paths under the input roots) and OpenAI's uploaded ``image[]`` are both
    judged by their headers against FLUX.2's 64 px: 400 ``invalid_image`` naming the place,
    and no job queued."""
    import httpx
    from PIL import Image

    from engine.hardware.probe import probe
    from engine.server.app import ServerSettings, create_app
    from engine.service.facade import Engine
    from tests.support import LiveServer

    inputs = tmp_path / "inputs"
    inputs.mkdir()
    Image.new("RGB", (64, 64), (20, 120, 30)).save(inputs / "big.png")
    Image.new("RGB", (48, 48), (200, 10, 10)).save(inputs / "small.png")
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False))
    engine.images.load(str(tiny_pipeline("flux2")))
    try:
        with LiveServer(create_app(engine, ServerSettings(input_roots=(inputs,)))) as url:
            listed = httpx.post(f"{url}/v1/images/jobs", json={"prompt": "a fox", "image": ["big.png", "small.png"]})
            assert listed.status_code == 400 and listed.json()["error"]["code"] == "invalid_image", listed.text
            assert "image[1] is 48x48" in listed.json()["error"]["message"]
            uploads = [("image[]", (name, (inputs / name).read_bytes(), "image/png")) for name in ("big.png", "small.png")]
            edited = httpx.post(f"{url}/v1/images/edits", data={"prompt": "a fox"}, files=uploads, timeout=60)
            assert edited.status_code == 400 and edited.json()["error"]["code"] == "invalid_image", edited.text
            assert httpx.get(f"{url}/v1/images/jobs").json()["jobs"] == []
    finally:
        engine.images.unload()


@pytest.mark.slow
def test_klein_trains_on_its_base_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``train --base FLUX.2-klein-4B`` (the 4-step distilled model) trains on klein Base 4B, as
    the table's note says LoRAs do, and the plan names the swap (it trained the distilled model
    silently); a local distilled folder trains as given, told how to train on the base; the base
    itself is trained as named."""
    import json

    from engine.cli import main
    from engine.testing.datasets import write_dataset
    from families.flux2.tiny import build_tiny_pipeline

    data = write_dataset(tmp_path / "data", count=2)

    def dry_run(base: str, *extra: str) -> dict[str, object]:
        status = main(["train", "--base", base, "--data", str(data), "--dry-run", "--json", "--runs-dir",
                       str(tmp_path / "runs"), *extra])
        out, err = capsys.readouterr()
        assert status == 0, err
        return json.loads(out)["plan"]  # type: ignore[no-any-return]

    swapped = dry_run("black-forest-labs/FLUX.2-klein-4B", "--hardware", "rtx4090")
    base = swapped["resolved"]["base"]  # type: ignore[index]
    assert base["value"] == "black-forest-labs/FLUX.2-klein-base-4B" and "step-distilled" in base["reason"]
    assert swapped["base"]["location"] == "black-forest-labs/FLUX.2-klein-base-4B"  # type: ignore[index]
    assert "base" not in dry_run("black-forest-labs/FLUX.2-klein-base-4B", "--hardware", "rtx4090")["resolved"]  # type: ignore[operator]
    folder = build_tiny_pipeline(tmp_path / "flux.2-klein-tiny")
    local = dry_run(str(folder), "--device", "cpu", "--resolution", "64")["resolved"]["base"]  # type: ignore[index]
    assert local["value"] == str(folder) and "--base black-forest-labs/FLUX.2-klein-base-4B" in local["reason"]
