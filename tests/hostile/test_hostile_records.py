"""The hostile-record matrix: every kind of record the engine reads back from disk, planted
or edited as an attacker (or a careless copy) would leave it, read by the engine's own
reader, as the 0-eviction matrix proves the preflight.

Kinds: gallery entries (with their recipes), run records, the run lock, compile-cache
manifests, quantisation markers, dataset manifests and prompt-cache entries. Variants:
an identity that climbs out (``../../``), an absolute path, the record a symlink leading
out of its root, an absurd number, a field of the wrong type, its file (or companion)
missing, a huge file, and JSON nested 100,000 deep. A variant that names no field of a
kind (a prompt-cache entry is named by a hash, holds no JSON and no path) is not in its
row: :data:`NOT_APPLICABLE` says why, and a test holds that list to the kinds' fields.

Each case asserts the same promise: the reader never crashes (an engine error at most),
never reads outside the root, never returns an identity or path other than where the
record lies, never acts on a number the file system does not confirm, and leaves every
file outside the root where it was.
"""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from engine.errors import EngineError

DEEP = "[" * 100_000 + "]" * 100_000
HUGE = 5 * 2**20  # past engine.stored.MAX_RECORD_BYTES (4 MiB)


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def _edit(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    change(data)
    path.write_text(json.dumps(data), encoding="utf-8")


def _set(field: str, value: object) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        target = data
        *parents, last = field.split(".")
        for parent in parents:
            target = target[parent]
        target[last] = value
    return change


@dataclass
class Kind:
    """One kind of record: how a valid one is made in ``root``, how the engine reads it back
    (a list of what it trusted: identities and paths), and which fields the variants hit."""

    name: str
    make: Callable[[Path], Path]
    read: Callable[[Path], list[dict[str, Any]]]
    identity: str | None  # the field that names the record or a path (None: none does)
    number: str | None    # a number a limit or a decision acts on
    typed: str            # a field with a type to break
    companion: Callable[[Path], Path] | None  # a file the record needs beside it (None: the record alone)
    #: Set with a hostile identity: what makes the reader act on it (an entry old enough to sweep).
    acting: tuple[tuple[str, object], ...] = ()


# -- the kinds -----------------------------------------------------------------------------


def _gallery_make(root: Path) -> Path:
    from engine.service.gallery import Gallery

    entry = Gallery(root).add("image", _png(), recipe={"prompt": "a fox", "loras": []}, width=8, height=8)
    return root / f"{entry.id}.json"


def _gallery_read(root: Path) -> list[dict[str, Any]]:
    from engine.service.gallery import Gallery

    gallery = Gallery(root, max_bytes=10**6, max_age_s=10**6)  # opening sweeps: the dangerous path
    found = []
    for entry in gallery.page(limit=200)["data"]:
        path, _ = gallery.file(entry["id"])
        found.append({"id": entry["id"], "path": str(path), "bytes": entry["bytes"], "pinned": entry["pinned"]})
        gallery.pin(entry["id"])  # pinning rewrites the record: only ever its own
    return found


def _run_make(root: Path) -> Path:
    from engine.training.records import RunRecord

    record = RunRecord("run-1", root / "run-1", "flux", "base", {}, {}, status="completed", steps=2, step=2)
    record.save()
    return record.path


def _run_read(root: Path) -> list[dict[str, Any]]:
    from engine.training.records import find_run, list_runs

    found = [{"id": r.run_id, "path": str(r.folder), "steps": r.steps} for r in list_runs(root)]
    named = find_run(root, "run-1", paths=False)
    return found + ([{"id": named.run_id, "path": str(named.folder), "steps": named.steps}] if named else [])


def _lock_make(root: Path) -> Path:
    from engine.training.lock import RunLock

    lock = RunLock(root)
    lock.acquire("run-1", root / "run-1")
    return lock.path


def _lock_read(root: Path) -> list[dict[str, Any]]:
    from engine.training.lock import RunLock

    holder = RunLock(root).holder()
    return [] if holder is None else [{"id": holder.run_id, "pid": holder.owner.pid, "alive": holder.alive()}]


def _artifacts() -> bytes:
    from torch.compiler._cache import CacheArtifactManager

    with CacheArtifactManager.with_fresh_cache():
        CacheArtifactManager._ensure_cache_artifacts_registered()
        CacheArtifactManager.record_artifact("autotune", "ab/abcdef.best_config", {"XBLOCK": 8})
        saved = CacheArtifactManager.serialize()
    assert saved is not None
    return saved[0]


def _compile_make(root: Path) -> Path:
    from engine.runtime.compile_cache import CompileCache

    cache = CompileCache.for_model("model", {}, folder=root)
    assert cache is not None
    data = _artifacts()
    (root / f"{cache.key}.bin").write_bytes(data)
    (root / f"{cache.key}.json").write_text(json.dumps({"shapes": ["64x64x1"], "hmac": cache.sign(data)}))
    return root / f"{cache.key}.json"


def _compile_read(root: Path) -> list[dict[str, Any]]:
    from engine.runtime.compile_cache import CompileCache

    cache = CompileCache.for_model("model", {}, folder=root)
    assert cache is not None
    restored = cache.restore()
    return [{"shapes": sorted(cache.shapes)}] if restored["restored"] else []


def _marker_make(root: Path) -> Path:
    shutil.copytree(_QUANTISED["folder"], root, dirs_exist_ok=True)
    return root / "transformer" / "diffusion_engine_quantized.json"


def _marker_read(root: Path) -> list[dict[str, Any]]:
    from engine.preflight.quantised_folder import judge_stored

    index = json.loads((root / "model_index.json").read_text())
    marker = judge_stored(root / "transformer", index["transformer"], "ZImageTransformer2DModel")
    return [] if marker is None else [{"scheme": marker.scheme, "layers": marker.layers}]


def _dataset_make(root: Path) -> Path:
    (root / "a.png").write_bytes(_png())
    (root / "metadata.jsonl").write_text(json.dumps({"file_name": "a.png", "text": "a fox"}) + "\n")
    return root / "metadata.jsonl"


def _dataset_read(root: Path) -> list[dict[str, Any]]:
    from engine.preflight.dataset import discover_dataset

    report = discover_dataset(root)
    return [{"id": item.relative, "path": str(item.image), "caption": item.caption} for item in report.items]


_QUANTISED: dict[str, Path] = {}

KINDS = {kind.name: kind for kind in (
    Kind("gallery-entry", _gallery_make, _gallery_read, identity="id", number="bytes", typed="width",
         companion=lambda record: record.with_suffix(".png"), acting=(("created", 0.0), ("pinned", False))),
    Kind("run-record", _run_make, _run_read, identity="folder", number="steps", typed="step", companion=None),
    Kind("run-lock", _lock_make, _lock_read, identity="run_id", number="owner.pid", typed="token", companion=None),
    Kind("compile-manifest", _compile_make, _compile_read, identity=None, number=None, typed="hmac",
         companion=lambda record: record.with_suffix(".bin")),
    Kind("quantisation-marker", _marker_make, _marker_read, identity=None, number="layers", typed="scheme",
         companion=lambda record: record.parent / "diffusion_pytorch_model.safetensors"),
    Kind("dataset-manifest", _dataset_make, _dataset_read, identity="file_name", number=None, typed="text",
         companion=lambda record: record.parent / "a.png"),
)}

#: Variants a kind has no field for, and why (held to the kinds' fields by a test below).
NOT_APPLICABLE = {
    ("compile-manifest", "traversal-id"): "named by a hash of the model and the machine; no field names a path",
    ("compile-manifest", "absolute-path"): "named by a hash of the model and the machine; no field names a path",
    ("compile-manifest", "absurd-number"): "holds no number: its shapes are labels",
    ("quantisation-marker", "traversal-id"): "its folder is where it lies; made_from is a note no reader opens",
    ("quantisation-marker", "absolute-path"): "its folder is where it lies; made_from is a note no reader opens",
    ("dataset-manifest", "absurd-number"): "holds no number: a caption per image name",
}
VARIANTS = ("traversal-id", "absolute-path", "symlink-out", "absurd-number", "wrong-type", "missing-file",
            "huge-file", "deep-json")
CASES = [(kind, variant) for kind in KINDS for variant in VARIANTS if (kind, variant) not in NOT_APPLICABLE]


@pytest.fixture(scope="module", autouse=True)
def quantised(tiny_pipeline: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> None:
    """One real int8 folder, as ``quantize`` writes it, for the marker rows."""
    from engine.contract.plugins import load_registry
    from engine.hardware.probe import probe
    from engine.service.facade import Engine

    folder = tmp_path_factory.mktemp("quantised") / "int8"
    Engine(registry=load_registry(), hardware=probe(verify=False)).quantize(str(tiny_pipeline("zimage")), "int8",
                                                                             folder)
    _QUANTISED["folder"] = folder


def _outcome(kind: Kind, root: Path) -> list[dict[str, Any]] | str:
    try:
        return kind.read(root)
    except EngineError as refused:  # a typed refusal is an outcome; any other exception fails the case
        return f"refused: {refused.code}"


@pytest.mark.parametrize("kind_name", list(KINDS))
def test_a_valid_record_of_each_kind_reads_back(kind_name: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The matrix's baseline: untouched, each record reads back (so a row that reads nothing
    below is the reader refusing the variant, not a reader that reads nothing)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    kind, root = KINDS[kind_name], tmp_path / "root"
    root.mkdir()
    kind.make(root)
    found = _outcome(kind, root)
    assert isinstance(found, list) and found, found


@pytest.mark.parametrize(("kind_name", "variant"), CASES, ids=[f"{k}-{v}" for k, v in CASES])
def test_a_hostile_record_is_never_trusted(kind_name: str, variant: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    import engine.preflight.dataset as dataset

    monkeypatch.setattr(dataset, "MAX_METADATA_BYTES", 2**20)  # the dataset bound, scaled to the test
    kind, root = KINDS[kind_name], tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    victims = [outside / "victim.png", outside / "victim.json", outside / "victim.txt"]
    for victim in victims:
        victim.write_bytes(_png())
    record = kind.make(root)
    hostile: object = None
    if variant in ("traversal-id", "absolute-path"):
        hostile = "../outside/victim" if variant == "traversal-id" else str(outside / "victim")
        _change(kind, record, kind.identity, hostile)  # type: ignore[arg-type]
        for field, value in kind.acting:
            _change(kind, record, field, value)
    elif variant == "symlink-out":
        moved = outside / record.name
        shutil.move(record, moved)
        record.symlink_to(moved)
    elif variant == "absurd-number":
        hostile = 10**15
        _change(kind, record, kind.number, hostile)  # type: ignore[arg-type]
    elif variant == "wrong-type":
        _change(kind, record, kind.typed, {"not": ["what", "it", "should", "be"]})
    elif variant == "missing-file":
        (kind.companion(record) if kind.companion else record).unlink()
    elif variant == "huge-file":
        text = record.read_text(encoding="utf-8")
        record.write_text(text.rstrip("\n") + " " * HUGE + "\n", encoding="utf-8")
    elif variant == "deep-json":
        record.write_text(DEEP if kind.name != "dataset-manifest" else DEEP + "\n", encoding="utf-8")
    found = _outcome(kind, root)
    # Nothing outside the root was removed, rewritten or served.
    assert all(victim.read_bytes() == _png() for victim in victims), "a file outside the root was changed"
    if variant == "symlink-out":
        assert outside.joinpath(record.name).exists()
    if isinstance(found, str):
        return  # refused with a typed error: nothing was trusted
    for seen in found:
        if "path" in seen:
            assert Path(seen["path"]).resolve().is_relative_to(root.resolve()), seen
        if "id" in seen:
            assert "/" not in str(seen["id"]) and ".." not in str(seen["id"]), seen
        if hostile is not None:
            assert hostile not in seen.values(), f"{kind.name} trusted {hostile!r}: {seen}"
    if variant in ("symlink-out", "wrong-type", "huge-file", "deep-json") or (
            variant == "missing-file" and kind.name != "dataset-manifest"):
        assert found == [], f"{kind.name} read a {variant} record: {found}"


def _change(kind: Kind, record: Path, field: str, value: object) -> None:
    if kind.name == "dataset-manifest":
        line = json.loads(record.read_text(encoding="utf-8"))
        line[field] = value
        record.write_text(json.dumps(line) + "\n", encoding="utf-8")
    else:
        _edit(record, _set(field, value))


def test_the_not_applicable_cells_name_no_field_of_their_kind() -> None:
    """A kind left out of a variant holds no field that variant could hit: no path-like field
    where the identity rows are left out, no number where the number row is."""
    assert {kind for kind, _ in NOT_APPLICABLE} <= set(KINDS)
    for (kind_name, variant), _reason in NOT_APPLICABLE.items():
        kind = KINDS[kind_name]
        if variant in ("traversal-id", "absolute-path"):
            assert kind.identity is None
        if variant == "absurd-number":
            assert kind.number is None


def test_a_prompt_cache_entry_is_read_only_from_the_cache_and_trim_follows_no_link(tmp_path: Path) -> None:
    """The prompt cache's row (its entries are safetensors named by a hash: no JSON, no path):
    an entry that is a link leading out is not read, a torn or deep-headed entry is encoded
    again, and a link to a huge file outside never makes the bound delete real entries or
    touch the file it points at."""
    import torch

    from engine.runtime.prompt_cache import PromptCache

    cache = PromptCache(tmp_path / "cache", max_bytes=2**20)
    calls: list[list[str]] = []

    def encode(prompts: list[str]) -> dict[str, torch.Tensor]:
        calls.append(prompts)
        return {"prompt_embeds": torch.ones(len(prompts), 4)}

    cache.get_or_encode("enc", ["a fox"], {}, encode)
    [entry] = cache.folder.glob("*.safetensors")
    outside = tmp_path / "outside.safetensors"
    shutil.copy(entry, outside)
    for plant in ("link", "deep", "torn"):
        entry.unlink()
        if plant == "link":
            entry.symlink_to(outside)
        elif plant == "deep":
            header = DEEP.encode()
            entry.write_bytes(len(header).to_bytes(8, "little") + header)
        else:
            entry.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
        _, hit = cache.get_or_encode("enc", ["a fox"], {}, encode)
        assert hit is False, plant
    assert len(calls) == 4 and outside.is_file()
    huge = tmp_path / "huge.bin"
    with huge.open("wb") as handle:
        handle.truncate(10 * 2**30)  # sparse: 10 GiB by its size
    (cache.folder / ("0" * 64 + ".safetensors")).symlink_to(huge)
    assert cache.trim() == 0 and entry.is_file() and huge.stat().st_size == 10 * 2**30
    assert not (cache.folder / ("0" * 64 + ".safetensors")).exists()  # the planted link itself is gone


def test_a_gallery_folder_that_leads_out_is_refused_at_start(tmp_path: Path) -> None:
    from engine.service.gallery import Gallery

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "gallery").symlink_to(elsewhere)
    with pytest.raises(EngineError) as refused:
        Gallery(tmp_path / "outputs" / "gallery")
    assert refused.value.code == "unsafe_root" and str(elsewhere) in refused.value.message
    assert list(elsewhere.iterdir()) == []


def test_one_bad_gallery_record_never_breaks_the_rest(tmp_path: Path) -> None:
    """A pinned record claiming 10^15 bytes, one with a string ``created`` and one whose file is
    gone: the others list, the size bound acts on the files' real sizes (nothing is wiped),
    the server-side calls answer 404 for the broken one, never 500."""
    from engine.service.gallery import Gallery

    gallery = Gallery(tmp_path / "g", max_bytes=10**6)
    ids = [gallery.add("image", _png(), recipe={}, width=8, height=8).id for _ in range(4)]
    _edit(tmp_path / "g" / f"{ids[0]}.json", lambda d: d.update(bytes=10**15, pinned=True))
    _edit(tmp_path / "g" / f"{ids[1]}.json", lambda d: d.update(created="yesterday"))
    (tmp_path / "g" / f"{ids[2]}.png").unlink()
    reopened = Gallery(tmp_path / "g", max_bytes=10**6)
    listed = {entry["id"]: entry for entry in reopened.page()["data"]}
    assert set(listed) == {ids[0], ids[1], ids[3]}, "the bound wiped entries on a record's word"
    assert listed[ids[0]]["bytes"] == len(_png())
    with pytest.raises(EngineError) as gone:
        reopened.file(ids[2])
    assert gone.value.status == 404


def test_no_record_is_built_straight_from_json_outside_the_one_loader() -> None:
    """The engine reads every record back through engine.stored: no module but it parses a
    file's JSON itself (``json.load(s)`` over a file's text or bytes) or feeds parsed JSON
    straight into a constructor (``Cls(**json.loads(...))``, ``Cls(**data)`` after a load)."""
    import ast

    root = Path(__file__).resolve().parents[2] / "engine"
    #: Parses that read no record back: a worker's protocol line on a pipe, a flag's JSON, a
    #: user's config file handed to the CLI (each validated by its own model).
    allowed = {("runtime/sdcpp.py", "loads"), ("runtime/sdcpp_worker.py", "loads"),
               ("cli/machine.py", "loads"), ("requests/training.py", "loads")}
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative == "stored.py" or relative.startswith("testing/"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "json"
                    and func.attr in ("load", "loads") and (relative, func.attr) not in allowed):
                found.append(f"{relative}:{node.lineno} json.{func.attr}")
            for keyword in node.keywords:
                if keyword.arg is None and isinstance(keyword.value, ast.Call) and "json" in ast.unparse(keyword.value):
                    found.append(f"{relative}:{node.lineno} {ast.unparse(node)[:80]}")
    assert not found, "records read back outside engine.stored:\n" + "\n".join(found)


def test_the_gallery_over_http_never_reaches_outside_its_folder(tmp_path: Path) -> None:
    """The red team's gallery cases on a real server: records whose ``id`` climbs out, a
    ``.png`` that is a link to a file outside, then every route (file, entry, pin, delete)
    and a listing whose age bound sweeps. Nothing outside the gallery is served, rewritten
    or deleted; the planted entries answer 404 or are not listed."""
    import httpx

    from engine import Engine
    from engine.server.app import create_app
    from engine.server.settings import ServerSettings
    from engine.service.gallery import Gallery
    from tests.support import LiveServer

    outputs, outside = tmp_path / "outputs", tmp_path / "secret"
    outside.mkdir()
    for suffix in (".png", ".json", ".thumb.png", ".mp4"):
        (outside / f"victim{suffix}").write_bytes(b"not the gallery's")
    gallery = Gallery(outputs / "gallery")
    climbing = [gallery.add("image", _png(), recipe={}, width=8, height=8).id for _ in range(2)]
    linked = gallery.add("image", _png(), recipe={}, width=8, height=8).id
    honest = gallery.add("image", _png(), recipe={}, width=8, height=8).id
    for entry_id, value in zip(climbing, ("../../secret/victim", str(outside / "victim")), strict=True):
        _edit(outputs / "gallery" / f"{entry_id}.json", lambda d, v=value: d.update(id=v, created=0.0))
    (outputs / "gallery" / f"{linked}.png").unlink()
    (outputs / "gallery" / f"{linked}.png").symlink_to(outside / "victim.png")
    settings = ServerSettings(output_roots=(outputs,), gallery_max_age_s=60)
    with LiveServer(create_app(Engine(runs_dir=outputs), settings)) as url:
        listed = {entry["id"] for entry in httpx.get(f"{url}/v1/gallery").json()["data"]}
        assert listed == {honest, *climbing}, "an entry is its record's file name; the linked one is not listed"
        for entry_id in climbing:  # the entry found there, with its own file: never what its record names
            assert httpx.get(f"{url}/v1/gallery/{entry_id}/file").content == _png()
        for entry_id in (linked, "..%2F..%2Fsecret%2Fvictim"):
            assert httpx.get(f"{url}/v1/gallery/{entry_id}/file").status_code == 404
            assert httpx.post(f"{url}/v1/gallery/{entry_id}/pin", json={"pinned": True}).status_code == 404
            assert httpx.delete(f"{url}/v1/gallery/{entry_id}").status_code == 404
        for entry_id in climbing:
            assert httpx.post(f"{url}/v1/gallery/{entry_id}/pin", json={"pinned": True}).json()["id"] == entry_id
            assert httpx.delete(f"{url}/v1/gallery/{entry_id}").status_code == 200
        assert httpx.get(f"{url}/v1/gallery/{honest}/file").content == _png()
    assert all((outside / f"victim{s}").read_bytes() == b"not the gallery's"
               for s in (".png", ".json", ".thumb.png", ".mp4")), "a file outside the gallery was changed"


@pytest.mark.parametrize("depth", [200, 201, 600, 100_000])
def test_a_record_nests_at_most_two_hundred_deep_whatever_the_parser_could_take(tmp_path: Path, depth: int) -> None:
    """The standard library's parser reads about 1,000 levels and pydantic's serializer, which
    validation goes through, fails past about 500: a record is refused past 200 (its brackets
    counted first, so a small record is never walked), at every depth a file may hold."""
    from engine import stored

    path = tmp_path / "deep.json"
    path.write_text("[" * depth + "]" * depth, encoding="utf-8")
    if depth <= stored.MAX_NESTING:
        assert stored.read_json(path) is not None
        return
    with pytest.raises(stored.UnreadableRecord, match="nests deeper"):
        stored.read_json(path)
    with pytest.raises(stored.UnreadableRecord, match="nests deeper"):  # nested in an object too
        stored.parse_json('{"a": ' + '{"b": ' * depth + "1" + "}" * depth + "}")


@pytest.mark.parametrize(("text", "readable"), [
    ('{"prompt": "x\\ud800y"}', False),          # half a pair, in a value
    ('{"x\\udc00": 1}', False),                  # in a key
    ('{"prompt": "\\ud83d\\ude00"}', True),      # a whole pair: one character
    ('{"prompt": "\\\\ud800"}', True),           # an escaped backslash: the text "\ud800"
])
def test_a_record_holding_a_lone_surrogate_is_refused_a_pair_is_read(tmp_path: Path, text: str,
                                                                   readable: bool) -> None:
    """The standard library's parser makes a lone ``\\ud800`` escape a string no encoder takes
    (pydantic-core's refused it): such a record is unreadable, not served back to fail later."""
    from engine import stored

    path = tmp_path / "record.json"
    path.write_text(text, encoding="utf-8")
    if readable:
        assert isinstance(stored.read_json(path), dict)
    else:
        with pytest.raises(stored.UnreadableRecord, match="lone surrogate"):
            stored.read_json(path)
