"""Optional attention kernels engage or say why: floors from the installed diffusers, and
an install that runs before diffusers is imported, proven with a stand-in package.

The stand-in ``sageattention`` is a real wheel written here (its ``sageattn`` runs torch's
SDPA and counts its calls); the real pip installs it from a local folder into a target
directory (``PIP_TARGET``, ``PIP_FIND_LINKS``, ``PIP_NO_INDEX``: pip's own settings, so
the engine's install command runs unchanged) in a fresh interpreter, which then loads a
tiny pipeline through the engine's router and generates.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.hardware.kernel_floors import installed_attention_floors, parse_floors
from engine.hardware.presets import preset
from engine.policy.attention import install_requirement, resolve_attention


def test_the_floors_are_the_installed_dispatchers_own() -> None:
    """Compared with the constants the imported dispatcher holds, not with our parser."""
    from diffusers.models import attention_dispatch as dispatch

    floors = dict(installed_attention_floors())
    assert floors["sage"] == dispatch._REQUIRED_SAGE_VERSION
    assert floors["flash"] == dispatch._REQUIRED_FLASH_VERSION
    assert floors["xformers"] == dispatch._REQUIRED_XFORMERS_VERSION
    args, _ = install_requirement("sage", preset("rtx4090"))
    assert args == f"sageattention>={dispatch._REQUIRED_SAGE_VERSION} --no-deps"


def test_an_unreadable_dispatcher_leaves_the_floor_out_and_says_so() -> None:
    assert parse_floors("nothing here") == {}
    card = preset("rtx4090").replace(attention_floors=())
    args, why = install_requirement("sage", card)
    assert args == "sageattention --no-deps" and "floor could not be read" in why


def test_an_installed_sage_below_the_floor_is_not_used_and_is_upgraded() -> None:
    card = preset("rtx4090").replace(
        attention_packages=("sageattention",), attention_versions=(("sageattention", "1.0.6"),)
    )
    floor = dict(card.attention_floors)["sage"]
    resolved, args = resolve_attention("sage", card, {}, {})
    assert args == f"sageattention>={floor} --no-deps"
    assert "sageattention 1.0.6 is older than" in resolved.reason
    current, install = resolve_attention("sage", card.replace(attention_versions=(("sageattention", floor),)), {}, {})
    assert current.value == "sage" and install is None


def test_a_pinned_xformers_below_the_floor_is_refused_before_any_install() -> None:
    """torch 2.4.1's xformers (0.0.28.post1) is older than the dispatcher's 0.0.29."""
    card = preset("rtx4090").replace(torch_version="2.4.1+cu124")
    resolved, args = resolve_attention("xformers", card, {}, {})
    assert args is None and resolved.value == "native"
    assert "0.0.28.post1" in resolved.reason and "older than" in resolved.reason


# -- the stand-in package, installed and engaged ---------------------------------------

STANDIN = '''"""A stand-in for sageattention: torch SDPA behind its entry points, counting calls."""
import torch

calls = 0


def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, return_lse=False, **_):
    global calls
    calls += 1
    if tensor_layout == "NHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=sm_scale)
    return out.transpose(1, 2) if tensor_layout == "NHD" else out


sageattn_varlen = sageattn_qk_int8_pv_fp16_cuda = sageattn_qk_int8_pv_fp16_triton = sageattn
sageattn_qk_int8_pv_fp8_cuda = sageattn_qk_int8_pv_fp8_cuda_sm90 = sageattn
'''


def write_standin_wheel(folder: Path, version: str) -> Path:
    """A pure-Python ``sageattention`` wheel of ``version`` (dist-info and RECORD as pip reads them)."""
    dist = f"sageattention-{version}.dist-info"
    files = {
        "sageattention/__init__.py": STANDIN,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: sageattention\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist}/top_level.txt": "sageattention\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"sageattention-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return wheel


#: Plans sage as a 4090 would (floor and install from the policy), loads the tiny model on
#: this CPU through the router, generates, and reports what engaged.
SCRIPT = '''
import dataclasses, json, sys
if sys.argv[2] == "import-first":
    import diffusers  # a process that imported diffusers before the install (a server's second load)
from engine.contract.plugins import load_registry
from engine.hardware.presets import preset
from engine.hardware.probe import probe
from engine.policy.attention import resolve_attention
from engine.policy.inference import InferenceRequest, plan_inference
from engine.preflight.model import resolve_model
from engine.runtime.engines import start_session

registry = load_registry()
imported_before = "diffusers" in sys.modules
resolved, args = resolve_attention("sage", preset("rtx4090"), {}, {})
source = resolve_model(registry, sys.argv[1])
request = InferenceRequest()
plan = plan_inference(registry, source.facts(registry), probe(verify=False), request)
plan = dataclasses.replace(plan.with_control("attention_backend", resolved), attention_install=args)
session = start_session(registry, source, plan, request)
from engine.runtime.session import GenerateRequest
session.generate(GenerateRequest("a lighthouse at dusk", steps=1, seed=0, width=64, height=64))
try:
    import sageattention
    calls, version = sageattention.calls, __import__("importlib.metadata").metadata.version("sageattention")
except ImportError:
    calls, version = None, None
attention = session.plan["attention_backend"]
print(json.dumps({"args": args, "imported_before": imported_before, "attention": attention.value,
                  "reason": attention.reason, "calls": calls, "version": version}))
'''


def run_with_wheels(tmp_path: Path, model: Path, versions: list[str], mode: str = "fresh") -> dict[str, object]:
    wheels, target = tmp_path / "wheels", tmp_path / "target"
    target.mkdir()
    for version in versions:
        write_standin_wheel(wheels, version)
    env = {
        **os.environ, "PIP_TARGET": str(target), "PIP_FIND_LINKS": str(wheels), "PIP_NO_INDEX": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONPATH": os.pathsep.join([str(target), *sys.path]),
    }
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(model), mode], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    result["installed"] = sorted(p.name for p in target.iterdir())
    return result


@pytest.mark.slow
def test_a_standin_sage_at_the_floor_engages_in_the_process_it_was_installed_for(
    tmp_path: Path, tiny_pipeline: Callable[[str], Path]
) -> None:
    result = run_with_wheels(tmp_path, tiny_pipeline("flux"), ["1.0.6", "2.2.0"])
    assert result["imported_before"] is False
    assert result["version"] == "2.2.0"
    assert result["attention"] == "sage", result["reason"]
    assert isinstance(result["calls"], int) and result["calls"] > 0  # the denoiser's attention ran through it


@pytest.mark.slow
def test_a_standin_sage_below_the_floor_is_never_installed(
    tmp_path: Path, tiny_pipeline: Callable[[str], Path]
) -> None:
    result = run_with_wheels(tmp_path, tiny_pipeline("flux"), ["1.0.6"])
    assert result["installed"] == [] and result["calls"] is None
    assert result["attention"] == "native" and "failed" in str(result["reason"])


@pytest.mark.slow
def test_an_install_after_diffusers_was_imported_says_it_engages_next_start(
    tmp_path: Path, tiny_pipeline: Callable[[str], Path]
) -> None:
    result = run_with_wheels(tmp_path, tiny_pipeline("flux"), ["2.2.0"], mode="import-first")
    assert result["imported_before"] is True and result["version"] == "2.2.0"
    assert result["attention"] == "native" and result["calls"] == 0
    assert "next start" in str(result["reason"])
