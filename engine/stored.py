"""Files the engine reads back to decide something, read one way: found where they lie, judged by what is on disk.

The engine keeps records beside what it makes (gallery entries, run records and
their lock, compile-cache manifests, quantisation markers, dataset manifests) and
reads them back later, maybe after someone else changed them: a copied data
folder, a shared outputs folder, a planted file. Every such read goes through here:

* **where, not what it says.** A record's identity and every path it leads to come
  from where it was found (its file name inside its root), passed in as ``identity``
  and written over whatever the file claims; a record never names another file.
* **confined.** A file is read only when it is a regular file that stays inside its
  root once every symlink is followed (:func:`confined_file`); a root that is itself
  a symlink leading out of its parent is refused at start (:func:`confined_root`).
* **bounded.** A file over ``max_bytes`` is not read (its size is the file system's,
  before a byte is read); JSON nested deeper than :data:`MAX_NESTING` levels (the bound
  pydantic-core's parser keeps) is refused as malformed, never a ``RecursionError``.
* **typed.** Every field is validated (types, ranges, lengths) by pydantic in strict
  mode against the record's own type; a field that fails makes the record unreadable
  (:class:`UnreadableRecord`, naming the file and the field), which a listing logs
  and skips (:func:`records_in`): one bad record never breaks the rest.

Sizes and times a limit acts on (a gallery's bytes and ages) are read from the file
system by their users, never from a record. Standard library and pydantic only (the
base room: everything may import it); pydantic is imported when a record is first
validated, so the light paths that only parse one (the hardware probe's GEMM figures) stay
free of it.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from engine.errors import EngineError
from engine.places import within

if TYPE_CHECKING:
    from pydantic import TypeAdapter

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The largest record any engine writer makes is a run record with 500 points of five
#: metrics (about 100 kB); 4 MiB leaves room and keeps a planted giant unread.
MAX_RECORD_BYTES = 4 * 2**20
#: Containers a record may nest (pydantic-core's parser refuses deeper, and its serializer,
#: which validation goes through, fails on deeper still).
MAX_NESTING = 200
#: A plain file name: one component, no separator (``.`` and ``..`` are refused apart).
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.\-]{0,254}")


class UnreadableRecord(EngineError, ValueError):
    """A record on disk that cannot be trusted: outside its root, too large, not JSON,
    or a field of the wrong type or out of range (``field`` names it). A ``ValueError``
    too, so a reader that skipped malformed records before skips these."""

    code = "unreadable_record"
    http_status = 500

    def __init__(self, path: Path, problem: str, *, field: str | None = None) -> None:
        where = f"{path}" + (f" (field {field!r})" if field else "")
        super().__init__(f"the record {where} cannot be used: {problem}")
        self.path, self.field, self.problem = path, field, problem


class UnsafeRoot(EngineError):
    """A folder the engine keeps records in that leads somewhere else (a symlink out)."""

    code = "unsafe_root"


def plain_name(name: str) -> bool:
    """Whether ``name`` is one plain file name (no separator; not ``.`` or ``..``)."""
    return bool(_PLAIN_NAME.fullmatch(name)) and name not in (".", "..")


def confined_root(root: Path | str, parent: Path | str, *, create: bool = True, what: str = "folder") -> Path:
    """``root``, created when missing (``create``); refused when it (or a symlink on its
    way) leads outside ``parent``: the engine would write and delete somewhere else."""
    root, parent = Path(root), Path(parent)
    if not within(parent, root):
        raise UnsafeRoot(f"the {what} {root} leads outside {parent} (a symlink to "
                         f"{os.path.realpath(root)}); make it a plain folder inside {parent}")
    if create:
        root.mkdir(parents=True, exist_ok=True)
    if root.exists() and not root.is_dir():
        raise UnsafeRoot(f"the {what} {root} is not a folder; remove it or pick another")
    return root


def confined_file(root: Path | str, name: str) -> Path | None:
    """``root / name`` when it is a regular file that stays inside ``root`` once every
    symlink is followed; else None (missing, a folder, a device, a link leading out)."""
    if not plain_name(name):
        return None
    path = Path(root) / name
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    if not stat.S_ISREG(info.st_mode) or not within(root, path, strictly=True):
        return None
    return path


def read_json(path: Path | str, *, root: Path | str | None = None, max_bytes: int = MAX_RECORD_BYTES) -> Any:
    """The JSON value in ``path`` (inside ``root`` when given, see :func:`confined_file`),
    its size bounded before it is read and its nesting by the parser.
    Raises :class:`UnreadableRecord`."""
    path = Path(path)
    if root is not None and (Path(root) / path.name != path or confined_file(root, path.name) is None):
        raise UnreadableRecord(path, f"it is not a regular file inside {root}")
    try:
        with open(path, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise UnreadableRecord(path, "it is not a regular file")
            if info.st_size > max_bytes:
                raise UnreadableRecord(path, f"it holds {info.st_size} bytes, more than the {max_bytes} "
                                       "such a record may")
            data = handle.read(max_bytes + 1)
    except OSError as exc:
        raise UnreadableRecord(path, f"it cannot be read ({exc.strerror or exc})") from None
    return parse_json(data, path)


def parse_json(data: bytes | str, path: Path | str = "<record>") -> Any:
    """``data`` as JSON, its nesting bounded by :data:`MAX_NESTING` and its text valid Unicode (a
    :class:`UnreadableRecord` for ``path``). The standard library's parser, held to what
    pydantic-core's refused (deeper nesting, lone surrogates): no pydantic import for a record
    that is only read."""
    import json

    if isinstance(data, str):
        try:
            data = data.encode("utf-8")
        except UnicodeEncodeError:
            raise UnreadableRecord(Path(path), _LONE_SURROGATE) from None
    try:
        value = json.loads(data)
    except RecursionError:
        raise UnreadableRecord(Path(path), _TOO_DEEP) from None
    except ValueError as exc:  # JSONDecodeError, and bytes that are no Unicode text
        raise UnreadableRecord(Path(path), f"it is not JSON ({str(exc)[:120]})") from None
    problem = _malformed(data, value, MAX_NESTING)
    if problem:
        raise UnreadableRecord(Path(path), problem)
    return value


_TOO_DEEP = "it nests deeper than any record this engine writes"
_LONE_SURROGATE = "it holds a lone surrogate (an unpaired \\ud800-\\udfff escape), not Unicode text"
#: An escape of half a surrogate pair; a pair becomes one character, a lone half stays one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _malformed(data: bytes, value: Any, limit: int) -> str | None:
    """What makes ``value`` (parsed from ``data``) no record: nesting past ``limit`` containers,
    or a lone surrogate; None where neither. Each is walked for only where ``data`` could hold
    it: more than ``limit`` containers opened, half a surrogate pair escaped (every small
    record skips both)."""
    if data.count(b"[") + data.count(b"{") > limit and _deeper_than(value, limit):
        return _TOO_DEEP
    if _SURROGATE_ESCAPE.search(data) and lone_surrogate_in(value):
        return _LONE_SURROGATE
    return None


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether a container in ``value`` sits deeper than ``limit`` (``value`` itself at depth 1).

    Walked a level at a time, keeping only containers: a safetensors header of
    thousands of tensors (each a dict of two short lists) is walked in a few list
    comprehensions, with no stack entry for a number."""
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(limit):
        level = [child for item in level for child in (item.values() if isinstance(item, dict) else item)
                 if isinstance(child, (dict, list))]
        if not level:
            return False
    return bool(level)


def lone_surrogate_in(value: Any) -> bool:
    """Whether a string (or a key) anywhere in ``value`` holds a lone surrogate: text no UTF-8
    encoder takes (tokenizers, paths and responses would fail on it later). The request bodies
    refuse such data with this too."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return False


def validated(path: Path | str, schema: type[T], value: Any, *,
              identity: Mapping[str, object] | None = None) -> T:
    """``value`` (read from ``path``) as ``schema``, strictly; ``identity`` (what the record's
    place says it is) replaces the same fields in it. Raises :class:`UnreadableRecord`."""
    from pydantic import ValidationError
    from pydantic_core import to_json

    path = Path(path)
    if identity is not None:
        if not isinstance(value, dict):
            raise UnreadableRecord(path, "it is not a JSON object")
        value = {**value, **identity}
    try:
        return _adapter(schema).validate_json(to_json(value), strict=True)  # type: ignore[no-any-return]
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or None
        raise UnreadableRecord(path, first["msg"], field=field) from None


def read_record(path: Path | str, schema: type[T], *, root: Path | str | None = None,
                identity: Mapping[str, object] | None = None, max_bytes: int = MAX_RECORD_BYTES) -> T:
    """The record in ``path`` as ``schema`` (:func:`read_json`, then :func:`validated`)."""
    return validated(path, schema, read_json(path, root=root, max_bytes=max_bytes), identity=identity)


def records_in(root: Path | str, schema: type[T], *, suffix: str, stem: re.Pattern[str],
               identity: Callable[[str], Mapping[str, object]], max_bytes: int = MAX_RECORD_BYTES,
               ) -> Iterator[tuple[str, T]]:
    """``(stem, record)`` for each readable record ``<stem><suffix>`` in ``root`` whose stem
    matches ``stem``, its identity from :func:`identity(stem)`; each unreadable one is named
    in a log line and skipped."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return
    for name in names:
        if not name.endswith(suffix) or not stem.fullmatch(name.removesuffix(suffix)):
            continue
        key = name.removesuffix(suffix)
        try:
            yield key, read_record(Path(root) / name, schema, root=root, identity=identity(key), max_bytes=max_bytes)
        except UnreadableRecord as exc:
            log.warning("%s; skipped (remove or restore it)", exc.message)


#: One pydantic adapter per record type (building one costs more than a small record's read).
_ADAPTERS: dict[object, TypeAdapter[Any]] = {}


def _adapter(schema: Any) -> TypeAdapter[Any]:
    from pydantic import TypeAdapter

    if schema not in _ADAPTERS:
        _ADAPTERS[schema] = TypeAdapter(schema)
    return _ADAPTERS[schema]


__all__ = ["MAX_RECORD_BYTES", "UnreadableRecord", "UnsafeRoot", "confined_file", "confined_root",
           "parse_json", "plain_name", "read_json", "read_record", "records_in", "validated"]
