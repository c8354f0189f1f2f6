"""The compile cache: what one process compiled is a cache hit in the next.

The cross-process test compiles with inductor for real, in two child processes
whose own inductor caches are empty and apart, so a hit in the second can only
come from the artifacts the engine saved. One compiled module holds only
Linears (inductor calls the matmul library, no C++ kernel to build: a second or
two on the CPU); the other adds a block's norm, activation and gating, which
inductor fuses into C++ kernels it generates and builds, as it does for a real
model's regions.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.runtime.compile_cache import KILL_SWITCH, CompileCache, Untrusted, private_folder, user_key

PROBE = '''
import json, sys
from pathlib import Path
import torch
from torch._dynamo.utils import counters
from engine.runtime.compile_cache import CompileCache


class Block(torch.nn.Module):
    def __init__(self, kernels):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)
        self.norm, self.kernels = torch.nn.LayerNorm(32), kernels

    def forward(self, x):
        if not self.kernels:
            return self.b(self.a(x))
        # A transformer block's pointwise and reduction work: inductor fuses it into C++ kernels.
        return self.b(torch.nn.functional.gelu(self.norm(self.a(x))) * torch.sigmoid(x.sum(-1, keepdim=True)))


cache = CompileCache.for_model(sys.argv[2], {"regions": ["Block"]}, folder=Path(sys.argv[1]))
report = {"enabled": cache is not None}
if cache is not None:
    report["restore"] = cache.restore()
torch.manual_seed(0)
block = Block(kernels=sys.argv[3] == "kernels")
x = torch.randn(4, 16)
with torch.no_grad():
    eager = block(x)
    block.compile(dynamic=True)
    report["matches_eager"] = bool(torch.allclose(block(x), eager, atol=1e-5))
if cache is not None:
    report["stored"] = cache.store("4")
    report["last"] = cache.last
report["inductor"] = dict(counters["inductor"])
print(json.dumps(report))
'''


def run_probe(tmp_path: Path, run: int, model: Path, module: str = "linears") -> dict[str, object]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "compile-cache"), str(model), module],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{run}")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_artifacts_compiled_in_one_process_are_cache_hits_in_the_next(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text("{}", encoding="utf-8")
    first = run_probe(tmp_path, 1, model)
    assert first["restore"]["restored"] is False  # type: ignore[index]
    assert first["stored"] is True and first["inductor"]["fxgraph_cache_miss"] >= 1  # type: ignore[index]
    assert first["last"]["artifacts"]["inductor"] >= 1  # type: ignore[index]
    second = run_probe(tmp_path, 2, model)  # an empty inductor cache of its own
    assert second["restore"]["restored"] is True  # type: ignore[index]
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1  # type: ignore[union-attr]
    assert "fxgraph_cache_miss" not in second["inductor"]  # type: ignore[operator]
    assert second["stored"] is False  # a shape already saved writes nothing
    # (The kill switch is checked in-process below: no cache object, nothing restored.)


@pytest.mark.slow
def test_a_module_with_generated_kernels_is_a_cache_hit_in_the_next_process(tmp_path: Path) -> None:
    """The Linears-only module above makes inductor call the matmul library and build no
    kernel; a real block's norm, activation and gating are fused into C++ kernels that are
    generated, built and loaded. Their graph comes back from the saved artifacts: the second
    process (its own empty inductor cache) hits the graph cache, misses nothing, and computes
    what eager computes. What it does not get back on the CPU is the C++ build: the shared
    objects are rebuilt from the cached source (measured here: 19.0 s against 21.8 s cold),
    as docs/architecture.md says; on CUDA, inductor bundles its Triton kernels into the graph
    entry."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text("{}", encoding="utf-8")
    first = run_probe(tmp_path, 1, model, "kernels")
    built = sorted((tmp_path / "inductor-1").rglob("*.so"))
    assert len(built) >= 1 and first["matches_eager"] is True  # real kernels, built and run
    assert first["stored"] is True and first["inductor"]["fxgraph_cache_miss"] >= 1  # type: ignore[index]
    second = run_probe(tmp_path, 2, model, "kernels")
    assert second["restore"]["restored"] is True  # type: ignore[index]
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1  # type: ignore[union-attr]
    assert "fxgraph_cache_miss" not in second["inductor"]  # type: ignore[operator]
    assert second["matches_eager"] is True
    # The kept limit: the same kernels' objects, built again from the restored source.
    assert sorted(p.name for p in (tmp_path / "inductor-2").rglob("*.so")) == [p.name for p in built]


def test_the_key_follows_the_model_and_how_it_is_compiled(tmp_path: Path) -> None:
    model = tmp_path / "model"
    (model / "transformer").mkdir(parents=True)
    (model / "transformer" / "config.json").write_text('{"num_layers": 2}', encoding="utf-8")
    compiled = {"regions": ["Block"], "dtype": "bf16"}

    def key(location: Path | str = model, **changes: object) -> str:
        cache = CompileCache.for_model(str(location), {**compiled, **changes}, folder=tmp_path / "cache")
        assert cache is not None
        return cache.key

    same = key()
    assert key() == same
    assert key(dtype="fp16") != same and key(regions=["Other"]) != same
    assert key("org/some-model") != same
    (model / "transformer" / "config.json").write_text('{"num_layers": 3}', encoding="utf-8")
    assert key() != same  # another denoiser config is another model


def test_unreadable_artifacts_are_dropped_and_never_fail(tmp_path: Path) -> None:
    cache = CompileCache.for_model(str(tmp_path), {}, folder=tmp_path / "cache")
    assert cache is not None
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / f"{cache.key}.bin").write_bytes(b"torn")
    (tmp_path / "cache" / f"{cache.key}.json").write_text('{"shapes": ["64x64x1"], "hmac": "%s"}' % ("0" * 64),
                                                          encoding="utf-8")
    reread = CompileCache.for_model(str(tmp_path), {}, folder=tmp_path / "cache")
    assert reread is not None and reread.shapes == {"64x64x1"}
    restored = reread.restore()
    assert restored["restored"] is False and "dropped" in str(restored["reason"])
    assert not (tmp_path / "cache" / f"{cache.key}.bin").exists() and reread.shapes == set()


@pytest.mark.slow
def test_a_compiling_session_restores_before_it_compiles_and_reports_it(
    tiny_pipeline: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session asks the cache before its regional compile and shows the answer in its
    status (the eager test backend saves no artifacts, so there is nothing to store)."""
    from engine.policy.plan import InferenceRequest
    from tests.support import pixels, session_for

    session = session_for(tiny_pipeline("flux"), InferenceRequest(compile="on"), compile_backend="eager")
    session.load()
    try:
        pixels(session)
        assert session.status()["compile_cache"] == {
            "restored": False, "reason": "no saved artifacts for this model and machine yet"}
    finally:
        session.unload()
    monkeypatch.setenv(KILL_SWITCH, "0")
    off = session_for(tiny_pipeline("flux"), InferenceRequest(compile="on"), compile_backend="eager")
    off.load()
    try:
        assert off.status()["compile_cache"] is None
    finally:
        off.unload()


# -- nothing planted in the cache folder runs, nothing escapes it ---------------------------------


def artifacts_file(kind: str, name: str, content: object) -> bytes:
    """A mega-cache file as torch writes one, holding one artifact ``name`` of ``kind``."""
    from torch.compiler._cache import CacheArtifactManager

    with CacheArtifactManager.with_fresh_cache():
        CacheArtifactManager._ensure_cache_artifacts_registered()
        CacheArtifactManager.record_artifact(kind, name, content)
        saved = CacheArtifactManager.serialize()
    assert saved is not None
    return saved[0]


def command_pickle(marker: Path) -> bytes:
    """A pickle that creates ``marker`` when anything unpickles it."""
    return b"cposix\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."


@pytest.mark.slow
def test_a_planted_artifacts_file_never_runs_on_a_real_compiled_generate(
    tmp_path: Path, tiny_pipeline: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``generate --compile on``, for real (inductor), finds its saved artifacts replaced by a
    file that runs a command when torch unpickles it (what ``torch.compiler.load_cache_artifacts``
    does), beside the manifest its last run signed. It drops the file unread, compiles afresh,
    writes its image and signs what it saved anew; the marker never appears. The cache's name
    is the one the engine's own session gives this model and plan at load (a load compiles
    nothing until the first call), so the planted file lies exactly where that generate looks:
    the manifest it re-signs there is the proof."""
    from engine.policy.plan import InferenceRequest
    from tests.support import session_for

    home, marker, model = tmp_path / "home", tmp_path / "marker", tiny_pipeline("flux")
    monkeypatch.setenv("DIFFUSION_ENGINE_HOME", str(home))
    session = session_for(model, InferenceRequest(compile="on"))
    session.load()
    try:
        key = session._compile_cache.key
    finally:
        session.unload()
    cache = CompileCache(home / "compile-cache", key)
    private_folder(cache.folder)  # as the engine makes it: 0700
    saved = cache.folder / f"{key}.bin"
    saved.write_bytes(artifacts_file("inductor", "fplanted", command_pickle(marker)))
    saved.with_suffix(".json").write_text(json.dumps(  # the manifest of what the last run saved
        {"shapes": ["64x64x1"], "hmac": cache.sign(b"the artifacts the last run saved")}), encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(model), "--prompt", "a box",
                           "--steps", "1", "--compile", "on", "-o", str(tmp_path / "image.png")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
                               "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert not marker.exists(), "a planted compile-cache file ran"
    assert (tmp_path / "image.png").is_file()
    manifest = json.loads(saved.with_suffix(".json").read_text(encoding="utf-8"))
    assert manifest["hmac"] == cache.sign(saved.read_bytes()), "not rebuilt and signed anew where it looked"


def signed_cache(tmp_path: Path, data: bytes) -> CompileCache:
    """A cache whose file is ``data``, signed with this user's key (as if this user's torch wrote it)."""
    cache = CompileCache.for_model(str(tmp_path), {}, folder=tmp_path / "cache")
    assert cache is not None
    signed = cache.sign(data)
    (cache.folder / f"{cache.key}.bin").write_bytes(data)
    (cache.folder / f"{cache.key}.json").write_text(json.dumps({"shapes": ["64x64x1"], "hmac": signed}),
                                                    encoding="utf-8")
    return cache


def test_an_unsigned_or_resigned_file_is_dropped_before_torch_reads_it(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    cache = signed_cache(tmp_path, artifacts_file("inductor", "fplanted", command_pickle(marker)))
    (cache.folder / f"{cache.key}.json").write_text(json.dumps({"shapes": [], "hmac": "0" * 64}), encoding="utf-8")
    restored = cache.restore()
    assert restored["restored"] is False and "not signed" in str(restored["reason"])
    assert not marker.exists() and not (cache.folder / f"{cache.key}.bin").exists()
    # Signed under another cache key's name (a file copied between keys): refused the same.
    other = signed_cache(tmp_path, artifacts_file("inductor", "fplanted", command_pickle(marker)))
    (other.folder / f"{other.key}.bin").rename(other.folder / "moved.bin")
    moved = CompileCache(other.folder, "moved")
    (other.folder / "moved.json").write_text((other.folder / f"{other.key}.json").read_text(), encoding="utf-8")
    assert moved.restore()["restored"] is False and not marker.exists()


@pytest.mark.parametrize("name", ["../../../escaped", "/tmp/escaped-absolute", "a/../../escaped", ".hidden"])
def test_an_artifact_name_that_leaves_the_cache_drops_the_whole_file(tmp_path: Path, name: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Even a file this user's key signed: an autotune artifact is written at
    ``os.path.join(cache_dir(), name)``; a name with ``..`` or a leading ``/`` is refused
    before torch joins it, and nothing of the file is restored."""
    inductor = tmp_path / "inductor" / "deep" / "er"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    cache = signed_cache(tmp_path, artifacts_file("autotune", name, {"XBLOCK": 8}))
    restored = cache.restore()
    assert restored["restored"] is False and "not a plain relative name" in str(restored["reason"])
    assert not list(tmp_path.rglob("escaped*")) and not Path("/tmp/escaped-absolute").exists()


def test_a_folder_others_can_write_is_not_used(tmp_path: Path) -> None:
    cache = signed_cache(tmp_path, artifacts_file("autotune", "ab/plain.best_config", {"XBLOCK": 8}))
    cache.folder.chmod(0o777)
    restored = cache.restore()
    assert restored["restored"] is False and "writable by others" in str(restored["reason"])
    assert cache.store("64x64x1") is False
    cache.folder.chmod(0o700)


def test_a_signed_file_of_plain_names_is_restored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check lets through what torch writes itself (an autotune entry under a two-level name)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    cache = signed_cache(tmp_path, artifacts_file("autotune", "ab/abcdef.best_config", {"XBLOCK": 8}))
    restored = cache.restore()
    assert restored["restored"] is True and restored["artifacts"] == {"autotune": 1}


def test_a_cache_folder_copied_from_elsewhere_key_and_all_is_rebuilt_not_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A user copies a whole data folder from another machine or account, as users do: the
    compile cache with its signed files, and the signing key too. Nothing in the copy is
    handed to torch (the signature covers the folder it was written in, and the key lives
    outside it): the copy is dropped and rebuilt, while the original, in place, restores."""
    from torch.compiler._cache import CacheArtifactManager

    from engine.runtime.compile_cache import key_path

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    original = signed_cache(tmp_path / "there", artifacts_file("autotune", "ab/abcdef.best_config", {"XBLOCK": 8}))
    assert not (original.folder / ".key").exists() and original.folder not in key_path().parents
    copy = tmp_path / "here" / "cache"
    shutil.copytree(original.folder, copy)
    shutil.copy2(key_path(), copy / ".key")  # the key carried along, where an older engine kept it
    shutil.copy2(key_path(), copy / key_path().name)
    populated: list[object] = []
    real_populate = CacheArtifactManager.populate_caches
    monkeypatch.setattr(CacheArtifactManager, "populate_caches",
                        lambda artifacts: populated.append(artifacts) or real_populate(artifacts))
    restored = CompileCache(copy, original.key).restore()
    assert restored["restored"] is False and "not signed" in str(restored["reason"]), restored
    assert populated == [] and not (copy / f"{original.key}.bin").exists()
    assert original.restore()["restored"] is True and len(populated) == 1  # the same bytes, where they were made
    # A key inside the folder it signs (DIFFUSION_ENGINE_KEYS pointed there) is refused outright.
    monkeypatch.setenv("DIFFUSION_ENGINE_KEYS", str(copy))
    with pytest.raises(Untrusted, match="inside the cache folder"):
        user_key(copy)
