"""Prompt embeddings on disk, reused across runs and loads.

An entry is the output of one ``encode_prompts`` call (a dict of tensors,
batch first) for an exact list of prompts, keyed by:

- the encoders' identity: every file of the pipeline's ``text_encoder*`` and
  ``tokenizer*`` folders by relative path, size and modification time (a
  re-downloaded or edited encoder is a different key; no weights are read);
- the exact prompt texts, in order (a trigger word, a dropped or shuffled
  caption is a different prompt);
- the settings that change the numbers: dtype, the family's encode function,
  and this format's version.

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
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

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
            stat = file.stat()
            digest.update(f"{file.relative_to(folder)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
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
        self, identity: str, prompts: Sequence[str], settings: Mapping[str, object], encode: Encode
    ) -> tuple[dict[str, torch.Tensor], bool]:
        """The embeddings of ``prompts`` (on the CPU), and whether they came from disk."""
        path = self.folder / f"{self.key(identity, prompts, settings)}.safetensors"
        cached = self._read(path)
        if cached is not None:
            return cached, True
        fresh = {k: v.detach().to("cpu").contiguous() for k, v in encode(list(prompts)).items()}
        self._write(path, fresh)
        return fresh, False

    def _read(self, path: Path) -> dict[str, torch.Tensor] | None:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        if not path.is_file():
            return None
        try:
            tensors = load_file(str(path))
            os.utime(path)  # recently used: the last to be evicted
        except (OSError, SafetensorError) as exc:
            log.warning("prompt cache entry %s is unreadable (%s); encoding again", path.name, exc)
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
        try:
            entries = sorted(
                (p.stat().st_mtime_ns, p.stat().st_size, p) for p in self.folder.glob("*.safetensors")
            )
        except OSError:
            return 0
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
