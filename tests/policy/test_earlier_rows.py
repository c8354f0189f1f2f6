"""The earlier system's later decisions, row by row (FACTS.md, "The earlier system's
later behaviour"): each test is named after the behaviour and quotes its rule.

Machines other than this one are hardware presets; the models are the families'
tables. Where this engine keeps a difference on purpose, the test pins the kept
behaviour and docs/architecture.md's list of kept differences says why.
"""

from __future__ import annotations

import json

import pytest

from engine.errors import PreflightError
from engine.hardware import probe as probe_module
from engine.hardware.presets import PRESETS, preset
from engine.contract.plugins import load_registry
from engine.policy.inference import CONTROLS, Plan
from engine.policy.quant import quant_ladder
from engine.policy.speed import install_requirement
from engine.policy.training import training_precision_preflight_error
from tests.support import table_plan

REGISTRY = load_registry()
FAMILIES = sorted(REGISTRY.families)


# -- speed ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_a_dense_model_with_no_speed_request_runs_on_the_off_tier_and_engages_nothing(family: str) -> None:
    """"A dense, unquantised model with no speed request loads on the `off` tier
    (bit-identical first images) ... `off` engages nothing: no compile, no fp16
    accumulation, no step cache, native attention." (RTX 4090: a consumer card, where
    every one of those would otherwise engage.) That its images are bit-identical is
    checked by pixels in tests/runtime/test_stock_diffusers.py, not by the reason's words."""
    dense = table_plan(family, "rtx4090", quant="none", steps=28)
    assert (dense["speed_tier"].value, dense["speed_tier"].source) == ("off", "auto")
    assert dense.value("compile") == "off" and dense.value("step_cache") == "off"
    assert dense.value("fp16_accumulation") is False and dense.value("attention_backend") == "native"
    # The same request with speed=default engages what the card and family allow.
    fast = table_plan(family, "rtx4090", quant="none", steps=28, speed="default")
    assert fast["speed_tier"].source == "explicit"
    denied = REGISTRY.optimization_deny(REGISTRY.family(family))
    assert fast.value("attention_backend") == ("native" if "cudnn" in denied else "cudnn")


def test_a_quantised_transformer_with_no_speed_request_runs_on_the_default_tier() -> None:
    """A quantised transformer already differs from the dense reference and its kernels
    gain from compile: ``auto`` takes the default tier there (FLUX.1 int8 on a 4090)."""
    quantised = table_plan("flux", "rtx4090")
    assert quantised.value("transformer_quant") == "int8"
    assert quantised["speed_tier"].value == "default" and quantised.value("compile") == "regional"


def test_attention_auto_stays_native_on_the_off_tier_and_on_mps() -> None:
    """"Attention `auto` stays native on `off` and on non-NVIDIA devices (MPS)"; an
    explicit kernel is still honoured on `off`."""
    assert table_plan("flux", "h100", speed="off").value("attention_backend") == "native"
    assert table_plan("flux", "apple-m3-max", speed="default").value("attention_backend") == "native"
    assert table_plan("flux", "h100", speed="off", attention="cudnn").value("attention_backend") == "cudnn"


def test_flash4_is_auto_on_blackwell_datacenter_cards_where_the_hub_kernels_are_installed() -> None:
    """flash4 beside flash3: diffusers' ``flash_4_hub`` backend, fetched by ``kernels``
    (0.12.3+), for sm100 parts; flash3 stays Hopper's."""
    from diffusers.models.attention_dispatch import _HUB_KERNELS_REGISTRY, AttentionBackendName

    from engine.runtime.attention import DIFFUSERS_BACKENDS

    assert AttentionBackendName(DIFFUSERS_BACKENDS["flash4"]) in _HUB_KERNELS_REGISTRY
    b200 = preset("b200").replace(attention_packages=("kernels",))
    assert table_plan("flux", b200, speed="default").value("attention_backend") == "flash4"
    assert table_plan("flux", preset("h100").replace(attention_packages=("kernels",)), speed="default").value(
        "attention_backend"
    ) == "flash3"
    missing = table_plan("flux", "b200", attention="flash4")
    assert missing.value("attention_backend") == "flash4" and missing.attention_install == "kernels>=0.12.3"
    hopper = table_plan("flux", "h100", attention="flash4")["attention_backend"]
    assert hopper.value == "native" and "needs sm100+" in hopper.reason


# -- memory --------------------------------------------------------------------------------


@pytest.mark.parametrize("memory", ["auto", "model_offload", "group_offload", "sequential_offload"])
def test_a_cpu_target_never_offloads(memory: str) -> None:
    """"A CPU target never offloads (host RAM is where it runs)": every memory request
    plans resident in RAM, or, for a model RAM cannot hold (LTX-2's 67.7 GB of fp32), is refused."""
    for family in FAMILIES:
        try:
            plan = table_plan(family, preset("cpu").replace(free_memory_gb=64.0), memory=memory)
        except PreflightError as refused:
            assert refused.code == "insufficient_memory" and "cannot hold it" in refused.message, family
            continue
        assert plan.value("memory_mode") == "resident", family


def test_unified_memory_compares_weights_and_base_overhead_with_the_budget_not_the_soft_headroom() -> None:
    """"Its oversize check compares weights + the 2 GiB base overhead with the safe budget
    and ignores the soft activation headroom": Z-Image (22.8 GB resident) on an M3 Max with
    50 GB free (budget 50 - 25.6 = 24.4 GB) is resident, though it exceeds 0.85 x 24.4."""
    mac = preset("apple-m3-max").replace(free_memory_gb=50.0)
    result = table_plan("zimage", mac, quant="none")
    assert result.value("memory_mode") == "resident"
    assert result.estimate.resident_gb > 0.85 * result.estimate.budget_gb
    with pytest.raises(PreflightError) as refused:  # beyond the budget itself it is refused
        table_plan("zimage", mac.replace(free_memory_gb=45.0), quant="none")
    assert refused.value.code == "insufficient_memory" and "frees nothing" in refused.value.message


def test_unified_memory_leaves_the_size_grown_activation_headroom_out_of_the_oversize_check() -> None:
    """FLUX on an M3 Max whose budget (37 GB) holds its weights and the base overhead but not
    the headroom the activation guard adds at 2048 px or four images: resident all the same,
    as the earlier system's later rule has it (a shared pool pages the soft headroom)."""
    mac = preset("apple-m3-max")
    reserve = 0.20 * 128.0  # FACTS: max(2 GiB, 20%) of a 128 GB unified pool, not the engine's own function
    # FACTS: FLUX.1-dev weights 23.8 + 9.8 + 0.2 GB with the 2 GiB base overhead: about 35.9 GB.
    mac = mac.replace(free_memory_gb=reserve + 37.0)
    for request in ({}, {"width": 2048, "height": 2048}, {"count": 4}):
        planned = table_plan("flux", mac, **request)
        assert planned.value("memory_mode") == "resident", request
    big = table_plan("flux", mac, width=2048, height=2048)
    assert "base overhead 2.1" in big["memory_mode"].reason  # the plan says what it compared
    assert big.estimate.resident_gb > big.estimate.budget_gb  # the guarded figure alone would refuse it
    with pytest.raises(PreflightError):  # beyond weights + base overhead it is still refused
        table_plan("flux", mac.replace(free_memory_gb=reserve + 34.0))


def test_unified_memory_fails_open_when_free_memory_is_unknown() -> None:
    """"... and fails open (no refusal) when free memory is unknown."""
    unknown = preset("apple-m3-max").replace(free_memory_gb=None, total_memory_gb=16.0)
    result = table_plan("qwen_image", unknown, quant="none")
    assert result.value("memory_mode") == "resident" and "free memory unknown" in result["memory_mode"].reason


def test_the_unified_oversize_check_never_refuses_a_discrete_card_or_a_plain_cpu_that_fits_ram_and_swap() -> None:
    """"It never refuses a discrete-VRAM or plain-CPU machine": Qwen-Image on a 4090 plans
    offload; on a CPU it is resident while RAM + free swap hold it (kept difference:
    beyond both it is refused, docs/architecture.md)."""
    assert table_plan("qwen_image", "rtx4090", quant="none").value("memory_mode") == "group_offload"
    cpu = preset("cpu").replace(free_memory_gb=40.0, total_memory_gb=48.0, swap_free_gb=32.0)
    assert table_plan("qwen_image", cpu).value("memory_mode") == "resident"


def test_an_explicit_resident_that_does_not_fit_falls_to_the_next_tier_and_strict_refuses_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """"An explicit fast/resident request that does not fit falls to the next tier rather
    than failing"; the record keeps ``requested`` and says ``fell back``, so the
    terminal's ``--strict`` refuses it before anything loads."""
    from engine.cli import main

    fell = table_plan("flux", "rtx4090", quant="none", memory="resident")["memory_mode"].to_dict()
    assert (fell["requested"], fell["value"], fell["status"]) == ("resident", "group_offload", "fell back")
    assert main(["plan", "--family", "flux", "--hardware", "rtx4090", "--quant", "none", "--memory", "resident",
                 "--strict"]) == 2
    assert "overridden" in capsys.readouterr().err



def test_an_explicit_resident_falls_to_the_tier_auto_ranks_next_streamed_encoders_included(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """FLUX int8 on a 3090 (24 GB): the whole pipeline (int8 denoiser about 23.8 x 0.55 = 13 GB
    beside 9.8 GB of encoders) does not fit resident, but the denoiser alone does. ``auto``
    keeps the denoiser resident and streams the encoders; ``--memory resident`` falls to that
    same tier (the next that fits), not to whole-module offload, and says it fell back."""
    from engine.cli import main

    card = preset("rtx3090")
    auto_plan = table_plan("flux", card, quant="int8")
    assert (auto_plan.value("memory_mode"), auto_plan.value("text_encoder_memory")) == ("resident", "streamed")
    asked = table_plan("flux", card, quant="int8", memory="resident")
    assert (asked.value("memory_mode"), asked.value("text_encoder_memory")) == ("resident", "streamed")
    record = asked["memory_mode"].to_dict()
    assert (record["requested"], record["status"]) == ("resident", "fell back"), record
    assert main(["plan", "--family", "flux", "--hardware", "rtx3090", "--quant", "int8", "--memory", "resident",
                 "--strict"]) == 2
    assert "overridden" in capsys.readouterr().err
    # An explicit mode that fits is kept, and the encoders follow it.
    kept = table_plan("flux", card, quant="int8", memory="model_offload")
    assert (kept.value("memory_mode"), kept.value("text_encoder_memory")) == ("model_offload", "resident")

def test_z_image_int8_on_a_16_gb_card_keeps_its_denoiser_resident_and_streams_the_encoders() -> None:
    """The earlier system's case: Z-Image int8 on a 16 GB card took 48 minutes for one image
    under whole-model offload; "group offload with streamed encoders takes minutes". Here the
    int8 denoiser (6.6 GB) stays resident and the encoders stream per prompt, a tier faster
    still; the dense 12.3 GB transformer, which cannot fit with the overhead, streams its
    blocks (group offload), never whole-module offload."""
    card = preset("rtx4090").replace(total_memory_gb=16.0, free_memory_gb=15.5, device_name="GeForce RTX 4080")
    int8 = table_plan("zimage", card, quant="int8")
    assert (int8.value("memory_mode"), int8.value("text_encoder_memory")) == ("resident", "streamed")
    dense = table_plan("zimage", card, quant="none")
    assert dense.value("memory_mode") == "group_offload" and "does not fit" in dense["memory_mode"].reason



def test_z_image_int8_at_a_large_size_streams_its_encoders_instead_of_sequential_offload() -> None:
    """The same card at 1536 px with dense encoders: the activation headroom grows with the
    image, but the encoders run on the prompt and need only the base overhead. From FACTS:
    the dense encoders (8.0 GB) alone with the 2 GiB base overhead are 10.1 GB, under 0.85 of
    the 15.5 - 2.15 GB budget (11.3 GB), and the int8 denoiser (about 12.3 x 0.55) with the
    grown headroom fits too: the denoiser stays resident and the encoders stream. Charging
    the encoders the image's headroom fell to sequential offload."""
    card = preset("rtx4090").replace(total_memory_gb=16.0, free_memory_gb=15.5, device_name="GeForce RTX 4080")
    assert 8.0 + 2 * 1.073741824 <= 0.85 * (15.5 - 2 * 1.073741824)
    big = table_plan("zimage", card, quant="int8", text_encoder_quant="none", width=1536, height=1536)
    assert (big.value("memory_mode"), big.value("text_encoder_memory")) == ("resident", "streamed"), \
        big["memory_mode"].reason
    # Where the grown headroom leaves no room for the denoiser itself, nothing but sequential fits.
    huge = table_plan("zimage", card, quant="int8", text_encoder_quant="none", width=2048, height=2048)
    assert huge.value("memory_mode") == "sequential_offload" and "transformer alone" in huge["memory_mode"].reason

# -- quantisation --------------------------------------------------------------------------


def test_qwen_image_auto_takes_fp8_first_where_torchao_floors_activation_scales() -> None:
    """"With the fp8 activation floor, `auto` takes fp8 first on a card where every scheme
    is usable (B200), skipping mxfp8 and nvfp4; with fp8 unusable the deny still skips
    mxfp8/nvfp4 and int8 is picked. Training keeps fp8 denied." The reason names the floor."""
    b200 = preset("b200").replace(free_memory_gb=60.0)  # the dense 40.9 GB transformer does not fit resident
    chosen = table_plan("qwen_image", b200)["transformer_quant"]
    assert chosen.value == "fp8" and "fp8_activation_floor" in chosen.reason and "safe" in chosen.reason
    without = table_plan("qwen_image", b200.replace(fp8_activation_floor=False, free_memory_gb=65.0))["transformer_quant"]
    assert without.value == "int8"
    assert "mxfp8" in without.reason and "nvfp4" not in quant_ladder(b200)
    spec = REGISTRY.family("qwen_image")
    refused = training_precision_preflight_error(REGISTRY, spec, preset("b200"), "fp8")
    assert refused is not None and refused.code == "quant_denied"


@pytest.mark.parametrize(
    "name",
    ["NVIDIA RTX PRO 6000 Blackwell Server Edition", "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
     "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition"],
)
def test_professional_blackwell_is_datacenter_class_and_prefers_fp8(name: str) -> None:
    """"Professional Blackwell (RTX PRO 6000 ... incl. Server Edition) is datacenter-class
    and prefers fp8."""
    assert probe_module.gpu_class(name) == "datacenter" and not probe_module.consumer_class(name)
    card = preset("rtx5090").replace(device_name=name, gpu_class="datacenter", consumer=False)
    assert quant_ladder(card)[0] == "fp8"


def test_no_datacenter_card_is_classified_consumer() -> None:
    """"No datacenter card is classified consumer": every datacenter preset, and every
    name the class table knows as datacenter, keeps fp32 accumulation and fp8 first."""
    for hardware in PRESETS.values():
        if hardware.gpu_class == "datacenter":
            assert not hardware.consumer, hardware.name
            assert probe_module.gpu_class(hardware.device_name) == "datacenter"
    for name in ("NVIDIA H100 80GB HBM3", "NVIDIA B200", "NVIDIA GH200 480GB", "NVIDIA L40S", "Tesla T4"):
        assert not probe_module.consumer_class(name)


def test_optional_kernel_installs_are_wheel_only_no_deps_with_the_floor_and_the_cuda_matched_xformers() -> None:
    """"Optional attention kernels are installed wheel-only with `--no-deps`; sage carries
    the dispatcher's version floor; xformers comes as the wheel matched to the installed
    torch and CUDA."""
    from engine.runtime.attention import pip_command

    card = preset("rtx4090").replace(torch_version="2.8.0+cu128")
    assert install_requirement("sage", card)[0] == "sageattention>=2.1.1 --no-deps"
    xformers = install_requirement("xformers", card)[0]
    assert xformers == "xformers==0.0.32.post2 --index-url https://download.pytorch.org/whl/cu128 --no-deps"
    assert "--only-binary=:all:" in pip_command(str(xformers))
    cpu_torch = install_requirement("xformers", card.replace(torch_version="2.8.0+cpu"))[0]
    assert cpu_torch == "xformers==0.0.32.post2 --no-deps"  # no CUDA index for a CPU build


# -- training gates ------------------------------------------------------------------------


def test_a_broken_torchao_gates_only_int8_training() -> None:
    """"A broken torchao gates only int8 (nf4 and auto pass, and SDXL ignores the setting)."""
    broken = preset("h100").replace(torchao_functional=False)
    flux = REGISTRY.family("flux")
    codes = {mode: training_precision_preflight_error(REGISTRY, flux, broken, mode) for mode in ("int8", "nf4", "auto", "bf16")}
    assert codes["int8"] is not None and codes["int8"].code == "torchao_unavailable"
    assert codes["nf4"] is None and codes["auto"] is None and codes["bf16"] is None
    assert training_precision_preflight_error(REGISTRY, REGISTRY.family("sdxl"), broken, "int8") is None


def test_a_non_cuda_accelerator_trains_on_itself_and_its_runs_plan_there() -> None:
    """Any accelerator clears the gate: on MPS a DiT run with ``auto`` holds its base in
    nf4 and the plan's device is ``mps``; a dense mode is refused naming nf4."""
    from engine.policy.training import training_device

    mac = preset("apple-m3-max")
    assert training_device(mac) == "mps" and training_device(mac, four_bit_base=False) == "cpu"
    refused = training_precision_preflight_error(REGISTRY, REGISTRY.family("flux"), mac, "bf16")
    assert refused is not None and refused.code == "needs_cuda" and "nf4" in refused.message


# -- the resolved record -------------------------------------------------------------------


def _records(result: Plan) -> dict[str, dict[str, object]]:
    return {name: result[name].to_dict() for name in CONTROLS}


def test_the_record_keeps_requested_reports_an_honoured_off_as_engaged_and_auto_never_as_a_fallback() -> None:
    """The resolved record: ``requested`` kept beside the engaged value, an honoured
    ``off`` request reported as applied (``engaged``), ``auto`` never reported as a
    fallback, across every family and several machines and requests."""
    requests = [{}, {"speed": "default"}, {"step_cache": "off", "compile": "off", "speed": "default"},
                {"quant": "fp8", "attention": "sage"}, {"memory": "resident", "quant": "none"}]
    for family in FAMILIES:
        for hw in ("rtx4090", "h100", "a100-80g", "t4", "cpu", "apple-m3-max"):
            for request in requests:
                try:
                    result = table_plan(family, hw, **request)
                except PreflightError:
                    continue
                for name, record in _records(result).items():
                    asked = record["requested"]
                    if asked == "auto":
                        assert record["status"] in ("engaged", "not applicable"), (family, hw, name, record)
                    if asked == "off" and record["value"] in ("off", False):
                        assert record["status"] == "engaged", (family, hw, name, record)
                    if name in request:
                        assert asked == request[name], (family, hw, name, record)
    off = table_plan("flux", "h100", step_cache="off", speed="default")["step_cache"].to_dict()
    assert (off["requested"], off["value"], off["status"], off["overridden"]) == ("off", "off", "engaged", False)
    assert json.dumps(_records(table_plan("flux", "rtx4090")))  # the record serialises as the API returns it


def test_a_consumer_card_s_int8_pick_says_why_it_beats_fp8() -> None:
    """"Consumer and workstation cards move int8 first": a 4090 computes fp8 too, so
    the plan that picks int8 names the ranking it followed, not only "first usable";
    an H100's ladder is fp8 first, and says so when asked for its candidate."""
    from engine.policy.quant import quant_ladder

    consumer = preset("rtx4090")
    assert consumer.fp8 and quant_ladder(consumer) == ("int8", "fp8")
    picked = table_plan("flux", "rtx4090")["transformer_quant"]
    assert picked.value == "int8" and "int8 > fp8" in picked.reason and "consumer" in picked.reason
    assert quant_ladder(preset("h100")) == ("fp8", "int8")


def test_int8_quantised_on_the_host_builds_at_its_steady_size() -> None:
    """Kept difference: torchao int8 is quantised on the host and moved quantised, so the
    device never holds the dense transformer: the plan's build peak is the quantised size
    (the earlier system planned a dense-sized peak while building)."""
    planned = table_plan("flux", "rtx4090")
    assert planned.value("transformer_quant") == "int8"
    parts = planned.estimate.components
    assert parts.transformer_transient_gb == parts.transformer_gb < 23.8 * 0.75
