"""Hub repo ids told from local paths, and the offline hub refused up front.

A string written as a path (``./x``, ``/data/x``, ``a/b/c``) that does not
exist is a missing path, never a hub id; a hub model (or the hub base of a
single-file or GGUF model) is refused before anything is evicted when the hub
is offline and the repo is not in the local cache. Reads the cache only; never
reaches the network.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.contract.types import ComponentSizes
from engine.errors import PreflightError
from engine.policy.schemes import transformer_gb
from engine.preflight.source import ModelSource
# How a reference is written, and the download consent: the request vocabulary's (re-exported).
from engine.requests.references import (  # noqa: F401
    ALLOW_DOWNLOAD_ENV,
    TRUTHY,
    download_allowed_by_env,
    is_hub_id,
    looks_like_path,
)


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set (read now, not at import time)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in TRUTHY


def hub_access_error(source: ModelSource, *, allow_download: bool = True) -> PreflightError | None:
    """Why the hub repo ``source`` needs cannot be had now, or None.

    A hub model, or the hub base of a single-file / GGUF model, that is not in
    the local cache is refused before anything is evicted: when the hub is
    offline (``hub_offline``), and when downloading was not allowed
    (``download_not_allowed``: a download is many GB, so an app or a terminal
    user says yes to it once, with ``Engine(allow_download=True)``, the CLI's
    ``--allow-download`` or the server's ``--allow-hub``). Where a download is
    allowed and about to happen, the hub is asked whether this machine may
    have the repo (:func:`hub_gate_error`): a gated one is named with its
    licence page before anything is evicted or downloaded.
    """
    repo = hub_repo(source)
    if repo is None or in_hub_cache(repo):
        return None
    fix = (f"download it first (hf download {repo} --local-dir DIR) and pass the local "
           "folder, or try a tiny one: `diffusion-engine tiny save FAMILY DIR`")
    if hub_offline():
        return PreflightError(
            f"{repo} is a hub repo id, the hub is offline here (HF_HUB_OFFLINE is set) and the "
            f"repo is not in the local cache; {fix}",
            code="hub_offline",
        )
    if not allow_download:
        return PreflightError(
            f"{repo} is not in the local hub cache: loading it downloads it (many GB). Allow that "
            f"with --allow-download (or {ALLOW_DOWNLOAD_ENV}=1; Engine(allow_download=True) in Python), "
            f"or {fix}",
            code="download_not_allowed",
        )
    return hub_gate_error(repo)


def hub_gate_error(repo: str) -> PreflightError | None:
    """Whether the hub lets this machine download ``repo`` (its ``auth-check``), as a refusal.

    A gated repo (the hub answers 401/403 with ``X-Error-Code: GatedRepo``) is
    named with its page, where its licence is accepted: ``gated_repo``. A repo
    the hub does not know, or hides without a token: ``repo_not_found``. Any
    other failure (a network error, an old hub mirror) is left to the
    download itself, which says why it failed.
    """
    try:
        from huggingface_hub import auth_check, constants
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    except ImportError:
        return None
    page = f"{constants.ENDPOINT.rstrip('/')}/{repo}"
    try:
        auth_check(repo)
    except GatedRepoError:
        return PreflightError(
            f"{repo} is gated on the hub: request access at {page} (accept its licence there), then add a "
            "token this machine uses (`hf auth login`, or HF_TOKEN=...) and start again",
            code="gated_repo",
        )
    except RepositoryNotFoundError:
        return PreflightError(
            f"the hub has no repo {repo} that this machine may see ({page}): check the name, or, if it is "
            "private, add a token with access (`hf auth login`, or HF_TOKEN=...)",
            code="repo_not_found",
        )
    except Exception:  # noqa: BLE001 - the download reports its own failure
        return None
    return None


def hub_repo(source: ModelSource) -> str | None:
    """The hub repo ``source`` loads from: its own id, or its hub base; None when all local."""
    if source.kind == "hub":
        return source.location
    if source.base and not Path(source.base).expanduser().is_dir():
        return source.base
    return None


def hub_root(source: ModelSource) -> str:
    """Where a model loads from: its location, or, for a hub checkpoint that lives in a
    subfolder of its repo or at a revision (checkpoints sharing one repo), that folder of the
    repo's snapshot, fetched into the hub cache (or found there: offline, nothing is asked)."""
    checkpoint = source.checkpoint
    if source.kind != "hub" or checkpoint is None or not (checkpoint.subfolder or checkpoint.revision):
        return source.location
    from huggingface_hub import snapshot_download

    subfolder = checkpoint.subfolder.strip("/")
    folder = snapshot_download(source.location, revision=checkpoint.revision,
                               allow_patterns=[f"{subfolder}/**"] if subfolder else None)
    return os.path.join(folder, subfolder) if subfolder else folder


def hub_download_gb(repo: str, timeout_s: float = 10.0) -> float:
    """The size of ``repo`` on the hub, in GB, to say before downloading it (asks the hub).

    :raises PreflightError: ``hub_offline`` when the hub does not answer.
    """
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(repo, files_metadata=True, timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - any failure to ask the hub means we cannot download
        raise PreflightError(
            f"cannot reach the hub for {repo} ({type(exc).__name__}); download it elsewhere "
            f"(hf download {repo} --local-dir DIR) and pass the local folder",
            code="hub_offline",
        ) from None
    return sum(s.size or 0 for s in info.siblings or []) / 1e9


def in_hub_cache(repo: str) -> bool:
    """Whether the local hub cache holds ``repo``'s pipeline (reads the cache only)."""
    return cached_file(repo, "model_index.json") is not None


def cached_file(repo: str, file: str) -> str | None:
    """Where the local hub cache holds ``file`` of ``repo`` (None: not there); reads the cache only."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(repo, file)
    return found if isinstance(found, str) else None


def download_gb(source: ModelSource, sizes: ComponentSizes) -> float:
    """GB that fetching ``source``'s hub repo brings, from the family's table.

    A pre-quantised repo (a 4-bit or fp8 denoiser) holds its denoiser in that
    scheme, so its download is the quantised denoiser (the family's own factor
    where its table has one) plus the dense rest, not the dense repo's size;
    the base of a single file or GGUF is the dense pipeline.
    """
    scheme = source.prequantised_scheme
    if scheme is None or hub_repo(source) != source.location:
        return sizes.total_gb
    quantised, _ = transformer_gb(sizes.transformer_gb, scheme, prequantised=True,
                                  factor=source.family.quantisation.factor(scheme, inference=True))
    return sizes.total_gb - sizes.transformer_gb + quantised


def weights_report(source: ModelSource, sizes: ComponentSizes) -> dict[str, object]:
    """Whether ``source``'s weights are on this machine, and if not what a start would fetch.

    A plan or a dry run answers for a model that is not here (a hub id, a
    checkpoint name) from the family's table, downloading nothing: this says
    so, with the download's size from the table (:func:`download_gb`; the hub
    is never asked).
    """
    repo = hub_repo(source)
    if repo is None:
        return {"here": True, "repo": None, "download_gb": 0.0, "note": "local files"}
    if in_hub_cache(repo):
        return {"here": True, "repo": repo, "download_gb": 0.0, "note": f"{repo} is in the local hub cache"}
    gb = download_gb(source, sizes)
    return {
        "here": False, "repo": repo, "download_gb": round(gb, 1),
        "note": (f"{repo} is not on this machine: sized from the family's table; loading or training it downloads "
                 f"about {gb:.0f} GB (allow it with --allow-download, or pass a local folder)"),
    }


def base_required_error(source: ModelSource, *, base_given: bool) -> PreflightError | None:
    """A single denoiser file (or GGUF) given without a base whose default base is not here.

    Its text encoders and VAE come from a base pipeline; without one named,
    the family's default checkpoint repo would be fetched silently. Refused
    the same for every face (``base_required``), naming what to give; a
    default base already in the hub cache is used as is.
    """
    if source.kind not in ("single_file", "gguf") or base_given:
        return None
    if source.base is not None and in_hub_cache(source.base):
        return None
    family = source.family
    default = (source.checkpoint or family.default_checkpoint).repo
    return PreflightError(
        f"{source.location} is a single {family.label} denoiser file: it needs a base for its text "
        f"encoders and VAE; give base=DIR, a {family.label} diffusers pipeline folder "
        f"({family.pipeline_class}), e.g. `diffusion-engine tiny save {family.name} DIR` for a tiny one, "
        f"or base={default} with consent to download it",
        code="base_required",
    )


def diffusers_refusal(source: ModelSource, *, base_given: bool, allow_download: bool) -> PreflightError | None:
    """Why diffusers cannot load ``source`` here, or None: a single file without its base
    (:func:`base_required_error`), an uncached hub model without consent (:func:`hub_access_error`).
    The sd.cpp engine needs neither (it reads the files beside the model)."""
    return base_required_error(source, base_given=base_given) or hub_access_error(
        source, allow_download=allow_download)
