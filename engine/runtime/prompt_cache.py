"""Prompt embeddings on disk, reused across runs and loads.

Training caches its captions here (one ``encode_prompts`` call of the
family's runtime module per dataset and base); inference caches each
pipeline call's embedding arguments (:class:`CallPrompts`, through the
family module's ``prompt_inputs`` / ``encode_prompt_inputs``), so a second
load of the same pipeline, or a streamed-encoder load, does not run a text
encoder for a prompt it has seen: on a hit, streamed encoders are never
brought in. An entry is a dict of tensors for an exact list of prompts,
keyed by:

- the encoders' identity: every file of the pipeline's ``text_encoder*`` and
  ``tokenizer*`` folders by relative path, size and modification time (a
  re-downloaded or edited encoder is a different key; no weights are read);
- the exact prompt texts, in order (a trigger word, a dropped or shuffled
  caption is a different prompt);
- the settings that change the numbers: dtype, the family's encode function,
  and this format's version; for inference also the call's prompt inputs as
  the family names them (negative prompts as used, the guidance flags that
  decide whether they are encoded, the maximum length), the encoders'
  scheme and device, and the LoRAs applied (by file identity and scale).

Entries are safetensors files written atomically (temporary file, then
rename), so a crash never leaves a half entry under a real key. The cache is
bounded: past ``max_bytes`` the least recently used entries are deleted.
It is safe to delete at any time: a missing or unreadable entry is encoded
again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine import stored
from engine.contract.family_helpers import call_value, prompt_list, true_cfg_prompt_inputs  # noqa: F401  (their home)

import torch

log = logging.getLogger(__name__)

#: Bump when what an entry holds changes meaning.
FORMAT_VERSION = 1
#: Where entries live unless a config or ``DIFFUSION_ENGINE_PROMPT_CACHE`` says.
ENV_DIR = "DIFFUSION_ENGINE_PROMPT_CACHE"
DEFAULT_MAX_BYTES = 4 * 1024**3

Encode = Callable[[list[str]], Mapping[str, torch.Tensor]]


def default_dir() -> Path:
    """``$DIFFUSION_ENGINE_PROMPT_CACHE``, else the user's cache folder."""
    explicit = os.environ.get(ENV_DIR)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "diffusion-engine" / "prompt-embeddings"


def encoder_identity(pipeline_dir: Path | str) -> str:
    """The text encoders and tokenizers of a pipeline folder, as a digest of
    their files' paths, sizes and modification times (hub ids: the id)."""
    folder = Path(pipeline_dir)
    if not folder.is_dir():
        return f"id:{pipeline_dir}"
    digest = hashlib.sha256()
    for part in sorted(folder.iterdir()):
        if not part.is_dir() or not part.name.startswith(("text_encoder", "tokenizer")):
            continue
        for file in sorted(p for p in part.rglob("*") if p.is_file()):
            info = file.stat()
            digest.update(f"{file.relative_to(folder)}:{info.st_size}:{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class PromptCache:
    """One cache folder, bounded to ``max_bytes``."""

    folder: Path
    max_bytes: int = DEFAULT_MAX_BYTES

    def key(self, identity: str, prompts: Sequence[str], settings: Mapping[str, object]) -> str:
        payload = json.dumps(
            {"v": FORMAT_VERSION, "encoders": identity, "prompts": list(prompts), "settings": dict(settings)},
            sort_keys=True, ensure_ascii=False,
        )
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()

    def get_or_encode(
        self, identity: str, prompts: Sequence[str], settings: Mapping[str, object], encode: Encode,
        fits: Callable[[Mapping[str, torch.Tensor]], bool] | None = None, *, refresh: bool = False,
    ) -> tuple[dict[str, torch.Tensor], bool]:
        """The embeddings of ``prompts`` (on the CPU), and whether they came from disk.

        ``fits``: whether a cached entry has the shape its user needs; one that
        does not (a file replaced, an older writer) is encoded again and rewritten.
        ``refresh``: encode again and rewrite whatever is on disk (an entry its
        call failed with)."""
        path = self.folder / f"{self.key(identity, prompts, settings)}.safetensors"
        cached = None if refresh else self._read(path)
        if cached is not None and (fits is None or fits(cached)):
            return cached, True
        if cached is not None:
            log.warning("prompt cache entry %s has the wrong shape for its prompts; encoding again", path.name)
        fresh = {k: v.detach().to("cpu").contiguous() for k, v in encode(list(prompts)).items()}
        self._write(path, fresh)
        return fresh, False

    def _read(self, path: Path) -> dict[str, torch.Tensor] | None:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        if not path.exists() and not path.is_symlink():
            return None
        if path.is_symlink() or stored.confined_file(self.folder, path.name) is None:
            log.warning("prompt cache entry %s is not a file of the cache (a link?); encoding again", path.name)
            return None
        try:
            # Copied out of the file's memory map: a writer truncating it meanwhile would be a SIGBUS.
            tensors = {name: tensor.clone() for name, tensor in load_file(str(path)).items()}
            problem = _entry_problem(tensors)
            if problem:
                raise ValueError(problem)
            os.utime(path)  # recently used: the last to be evicted
        except (OSError, SafetensorError, ValueError) as exc:
            log.warning("prompt cache entry %s is unusable (%s); encoding again", path.name, exc)
            return None
        return tensors

    def _write(self, path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write atomically, then trim the folder; a full or read-only disk only costs the reuse."""
        from safetensors.torch import save_file

        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.folder, suffix=".partial")
            os.close(handle)
            try:
                save_file(dict(tensors), temporary)
                os.replace(temporary, path)
            finally:
                if os.path.exists(temporary):
                    os.unlink(temporary)
            self.trim()
        except OSError as exc:
            log.warning("could not write the prompt cache entry in %s (%s); continuing without it", self.folder, exc)

    def trim(self) -> int:
        """Delete the least recently used entries past ``max_bytes``; returns how many."""
        entries = []
        for p in self.folder.glob("*.safetensors"):
            try:
                info = os.lstat(p)  # a link's own size: nothing outside the cache is counted or followed
                if not stat.S_ISREG(info.st_mode):
                    p.unlink()  # not an entry this cache wrote: the link goes, never what it points at
                    continue
            except OSError:
                continue
            entries.append((info.st_mtime_ns, info.st_size, p))
        entries.sort()
        total = sum(size for _, size, _ in entries)
        removed = 0
        for _, size, path in entries:
            if total <= self.max_bytes:
                break
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            total -= size
            removed += 1
        return removed


# -- inference: a pipeline call's prompt arguments, as cached embeddings ------------------

#: Call arguments that cached embeddings replace (a pipeline refuses both).
PROMPT_ARGUMENTS = ("prompt", "prompt_2", "negative_prompt", "negative_prompt_2")
#: Separates a list-valued argument's name from the item's index in an entry.
_ITEM = "#"


def _entry_problem(tensors: Mapping[str, torch.Tensor]) -> str:
    """What makes an entry unusable whoever wrote it ("" when nothing): no tensors, a name
    :func:`unpack` cannot read, a list item out of order, a float that is not finite."""
    if not tensors:
        return "it holds no tensors"
    items: dict[str, set[int]] = {}
    for key, tensor in tensors.items():
        name, _, index = key.partition(_ITEM)
        if index:
            if not index.isdigit() or int(index) >= len(tensors):
                return f"{key!r} is not a list item"
            items.setdefault(name, set()).add(int(index))
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"{key!r} holds NaN or infinity"
    for name, indices in items.items():
        if indices != set(range(len(indices))) or name in tensors:
            return f"the list {name!r} has gaps or is also a tensor"
    return ""


def one_row_per_prompt(count: int) -> Callable[[Mapping[str, torch.Tensor]], bool]:
    """The ``fits`` rule of an entry whose every tensor holds one row per prompt (the trainer's)."""
    return lambda cached: bool(cached) and all(t.dim() > 0 and t.shape[0] == count for t in cached.values())


def pack(values: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """Embedding arguments as flat tensors: a list (one tensor per prompt, as
    some pipelines take them) becomes ``name#0``, ``name#1``...; None and empty
    lists are left out (the pipeline's default for them is None)."""
    flat: dict[str, torch.Tensor] = {}
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            flat[name] = value
        elif isinstance(value, (list, tuple)):
            flat.update({f"{name}{_ITEM}{i}": item for i, item in enumerate(value)})
        elif value is not None:
            raise TypeError(f"prompt embedding {name!r} is a {type(value).__name__}, not a tensor or a list of them")
    return flat


def unpack(flat: Mapping[str, torch.Tensor], device: object) -> dict[str, object]:
    """The inverse of :func:`pack`, on ``device``."""
    values: dict[str, object] = {}
    items: dict[str, dict[int, torch.Tensor]] = {}
    for key, tensor in flat.items():
        name, _, index = key.partition(_ITEM)
        if index:
            items.setdefault(name, {})[int(index)] = tensor.to(device)
        else:
            values[name] = tensor.to(device)
    for name, found in items.items():
        values[name] = [found[i] for i in sorted(found)]
    return values


@dataclass(frozen=True)
class CallPrompts:
    """Encodes a pipeline call's prompts through the family's runtime module,
    via the cache.

    The family module (``FamilySpec.runtime_module``) opts in with two functions:

    * ``prompt_inputs(pipe, kwargs) -> dict | None``: everything the
      pipeline's own prompt encoding depends on in this call (prompts,
      negative prompts as used, the guidance flags that decide whether they
      are encoded, the maximum length), JSON-able; None where this call
      cannot take embeddings (the cache is skipped);
    * ``encode_prompt_inputs(pipe, inputs, device) -> dict``: the embedding
      arguments (``prompt_embeds``, ``pooled_prompt_embeds``, masks...) the
      pipeline's call would have computed from those inputs, through the
      pipeline's own ``encode_prompt``.

    ``settings`` (dtype, encoder scheme, LoRAs...) join the key.
    """

    cache: PromptCache
    identity: str
    runtime: object
    settings: Mapping[str, object]

    def supported(self) -> bool:
        return callable(getattr(self.runtime, "prompt_inputs", None)) and callable(
            getattr(self.runtime, "encode_prompt_inputs", None)
        )

    def replace(
        self, pipe: object, kwargs: Mapping[str, object], before_encode: Callable[[], None], *, refresh: bool = False,
    ) -> tuple[dict[str, object], bool] | None:
        """``kwargs`` with the prompts replaced by their embeddings, and whether
        they came from disk; None when this call keeps its prompts.

        ``before_encode`` runs only on a miss, right before the encoders are
        needed (streamed encoders are brought in there, never on a hit).
        ``refresh``: encode again, replacing the entry on disk (the call failed with it).
        """
        if not self.supported():
            return None
        inputs = self.runtime.prompt_inputs(pipe, kwargs)  # type: ignore[attr-defined]
        if inputs is None:
            return None
        device = getattr(pipe, "_execution_device", "cpu")

        def encode(_prompts: list[str]) -> dict[str, torch.Tensor]:
            before_encode()
            return pack(self.runtime.encode_prompt_inputs(pipe, inputs, device))  # type: ignore[attr-defined]

        prompts = [str(p) for p in inputs.get("prompt", [])]
        flat, hit = self.cache.get_or_encode(self.identity, prompts, {**self.settings, "inputs": inputs}, encode,
                                             refresh=refresh)
        replaced = {k: v for k, v in kwargs.items() if k not in PROMPT_ARGUMENTS}
        replaced.update(unpack(flat, device))
        return replaced, hit


def for_pipeline(
    runtime_module: str, root: str, settings: Mapping[str, object], loras: Sequence[object] = (),
    folder: Path | None = None, identity: str | None = None,
) -> CallPrompts:
    """The cache of a loaded pipeline: its encoders' folder ``root`` (or hub id),
    the family's runtime module, and what else changes the numbers (dtype,
    encoder scheme, device; LoRAs applied, by file identity and scale: a LoRA
    may reach the text encoders, so another set is another key). ``identity``:
    :func:`encoder_identity` of ``root``, when the caller already has it."""
    import importlib

    applied = []
    for lora in loras:
        path = Path(str(getattr(lora, "path", "")))
        try:
            info = path.stat()
            applied.append(f"{path.resolve()}:{info.st_size}:{info.st_mtime_ns}:{getattr(lora, 'scale', 1.0)}")
        except OSError:
            applied.append(f"{path}:{getattr(lora, 'scale', 1.0)}")
    return CallPrompts(
        cache=PromptCache(folder or default_dir()),
        identity=identity or encoder_identity(root),
        # A family with no runtime module (the contract's default) encodes its own prompts: nothing to cache.
        runtime=importlib.import_module(runtime_module) if runtime_module else None,
        settings={**settings, "runtime": runtime_module, "loras": applied},
    )
