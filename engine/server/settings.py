"""What the operator configured for a server, checked before it binds.

Kept free of FastAPI and torch so ``diffusion-engine serve`` can refuse a
bad configuration (an empty token, a public bind without one) in a fraction
of a second, before anything heavy is imported or any port is opened.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.deprecation import deprecate, register
from engine.errors import EngineError
from engine.network import is_loopback
from engine.requests.choices import MAX_KEEP_ALIVE_S

#: Default cap on a request body. The largest legitimate body (a generate
#: request with two 4000-character prompts, every character escaped) is
#: under 64 KiB, so 1 MiB leaves ample room and bounds what a client can
#: make the server hold.
DEFAULT_MAX_BODY_BYTES = 1024 * 1024
#: Default cap on one dataset upload (a few photos from a phone at once).
DEFAULT_MAX_UPLOAD_BYTES = 64 * 1024 * 1024
#: Default bound on waiting generate jobs: 128 lets a burst of 32 clients with
#: 4 requests each queue whole, and bounds what clients can make the server hold.
DEFAULT_QUEUE_SIZE = 128
#: The gallery's default size bound, GB: the oldest unpinned outputs go past it.
DEFAULT_GALLERY_GB = 2.0


class InsecureServer(EngineError):
    """A configuration that would expose the engine without meaning to."""

    code = "insecure_server"


#: The gallery's age bound under its name from when URL images were kept apart: a register row.
KEEP_URL_IMAGES = register("ServerSettings.keep_url_images_s", "ServerSettings.gallery_max_age_s", kind="setting")


@dataclass(frozen=True)
class ServerSettings:
    model_roots: tuple[Path, ...] = ()
    dataset_roots: tuple[Path, ...] = ()
    output_roots: tuple[Path, ...] = ()
    #: Bearer token every route but the schema and docs requires; ``None``
    #: serves without one (loopback only, unless ``insecure_no_token``).
    token: str | None = None
    #: Accept hub repo ids for models (the server may download them).
    allow_hub: bool = False
    #: Where LoRA files may be read from (``serve --loras DIR``).
    lora_roots: tuple[Path, ...] = ()
    #: Where input images (img2img / inpaint / edit) may be read from (``serve --inputs DIR``).
    input_roots: tuple[Path, ...] = ()
    #: Let a non-loopback bind run without a token (an explicit opt-out).
    insecure_no_token: bool = False
    #: Requests whose body is larger are refused with 413 before it is held.
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: The cap on a dataset upload's body (``serve --max-upload-mb``).
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    #: Generate jobs that may wait behind the running one (``serve --queue-size``);
    #: one more is refused with 429 and ``Retry-After``.
    queue_size: int = DEFAULT_QUEUE_SIZE
    #: The address the server binds (``serve --host``): a loopback bind answers only
    #: requests whose ``Host`` names loopback (DNS rebinding: see :meth:`allowed_hosts`).
    bind_host: str = "127.0.0.1"
    #: More names a ``Host`` header may give (``serve --allow-host``: a reverse proxy's
    #: public name); ``*`` turns the check off.
    extra_hosts: tuple[str, ...] = ()
    extra: dict[str, str] = field(default_factory=dict)
    #: Deprecated: the gallery's age bound under its old name (``serve --keep-url-images``,
    #: when URL images were kept apart); it sets ``gallery_max_age_s``.
    keep_url_images_s: float | None = None
    #: The gallery's bounds (``serve --gallery-max-gb``, ``--gallery-max-age``): past either,
    #: the oldest unpinned outputs are removed; None: no bound of that kind.
    gallery_max_gb: float | None = DEFAULT_GALLERY_GB
    gallery_max_age_s: float | None = None
    #: The name of a serving replica (``serve --replicas``): the suffix of its job ids. Empty: one server.
    replica: str = ""
    #: Seconds a loaded model may sit idle before it is unloaded (``serve --keep-alive``); None: until told.
    keep_alive_s: float | None = None

    def __post_init__(self) -> None:
        if self.token is not None and not self.token.strip():
            # ``--token "$TOKEN"`` with TOKEN unset lands here: serving without
            # auth would be the silent opposite of what the operator asked for.
            raise InsecureServer(
                "the bearer token is empty (--token \"\" or an empty DIFFUSION_ENGINE_TOKEN, "
                "often an unset shell variable); give a non-empty token, or leave --token "
                "out to serve loopback without one",
                code="empty_token",
            )
        if self.keep_alive_s is not None and not 0 <= self.keep_alive_s <= MAX_KEEP_ALIVE_S:
            raise EngineError(
                f"--keep-alive is the seconds an idle model stays loaded, 0 to {MAX_KEEP_ALIVE_S} (a week; "
                f"got {self.keep_alive_s:g}); leave it out to keep the model until told",
                code="invalid_config",
            )
        if self.keep_url_images_s is not None:
            deprecate(KEEP_URL_IMAGES, stacklevel=4)
        if self.queue_size < 1:
            raise EngineError(
                f"the generate queue size must be at least 1 (got {self.queue_size}); "
                "set --queue-size to a positive number",
                code="invalid_config",
            )
        for flag, value in (("--keep-url-images", self.keep_url_images_s), ("--gallery-max-gb", self.gallery_max_gb),
                            ("--gallery-max-age", self.gallery_max_age_s)):
            if value is not None and not 0 < value < float("inf"):
                raise EngineError(f"{flag} must be a positive number (got {value}); leave it out for the default",
                                  code="invalid_config")
        if self.max_body_bytes < 1:
            raise EngineError(
                f"max body size must be at least 1 byte (got {self.max_body_bytes}); "
                "set --max-body-mb to a positive number",
                code="invalid_config",
            )

    @property
    def gallery_limits(self) -> dict[str, float | int | None]:
        """The gallery's bounds as ``engine.open_gallery`` takes them."""
        age = self.gallery_max_age_s if self.gallery_max_age_s is not None else self.keep_url_images_s
        size = None if self.gallery_max_gb is None else int(self.gallery_max_gb * 1024**3)
        return {"max_bytes": size, "max_age_s": age}

    def check_bind(self, host: str) -> None:
        """Refuse to serve ``host`` beyond loopback without a token, unless opted out."""
        if self.token is None and not is_loopback(host) and not self.insecure_no_token:
            raise InsecureServer(
                f"refusing to serve {host!r} (beyond loopback) without a bearer token: anyone "
                "who can reach it could load models, write runs and use the GPU; give --token "
                "(or DIFFUSION_ENGINE_TOKEN), bind 127.0.0.1, or pass --insecure-no-token to "
                "accept the risk",
                code="token_required",
            )


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def allowed_hosts(settings: ServerSettings) -> frozenset[str] | None:
    """The host names a request's ``Host`` (and a state-changing request's ``Origin``) may give; None: any.

    A web page on another site can make the browser talk to a loopback
    server by re-pointing its own name at 127.0.0.1 (DNS rebinding): the
    request then carries that site's name in ``Host``. So a loopback server
    answers only loopback names and the operator's ``--allow-host`` names, as
    Jupyter does. A server bound beyond loopback is reached by names nobody
    can list here: it needs its token anyway, and checks only the names given.
    """
    extra = {h.lower() for h in settings.extra_hosts}
    if "*" in extra:
        return None
    if is_loopback(settings.bind_host) or extra:
        return frozenset({*LOOPBACK_NAMES, settings.bind_host.lower().strip("[]"), *extra})
    return None
