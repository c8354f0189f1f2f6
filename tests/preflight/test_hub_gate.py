"""A gated hub base is named with its licence page before anything is downloaded or evicted.

The hub is a local stand-in on loopback (``HF_ENDPOINT``) that answers as the
Hugging Face hub does for a gated repo: 401 with ``X-Error-Code: GatedRepo``. The
CLI runs as a user runs it (a child process, an empty hub cache, downloads
allowed), so the library's own request and error mapping are what is tested.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from engine.testing.datasets import write_dataset

GATED = "black-forest-labs/FLUX.1-dev"  # flux.1-dev's repo: gated on the real hub too
MISSING = "nobody/no-such-model"


class StandInHub(BaseHTTPRequestHandler):
    """The hub's ``auth-check`` answers; every path asked is recorded."""

    asked: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - the http.server spelling
        StandInHub.asked.append(self.path)
        if self.path == f"/api/models/{GATED}/auth-check":
            self._answer(401, {"X-Error-Code": "GatedRepo",
                               "X-Error-Message": f"Access to model {GATED} is restricted. You must have access to it "
                                                  "and be authenticated to access it. Please log in."})
        elif self.path == f"/api/models/{MISSING}/auth-check":
            self._answer(401, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})
        else:
            self._answer(404, {"X-Error-Code": "EntryNotFound", "X-Error-Message": "not served by the stand-in"})

    def _answer(self, status: int, headers: dict[str, str]) -> None:
        body = b'{"error": "' + headers["X-Error-Message"].encode() + b'"}'
        self.send_response(status)
        for name, value in {**headers, "Content-Type": "application/json", "Content-Length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:  # quiet
        return


@pytest.fixture
def hub() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandInHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    StandInHub.asked = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(10)


def cli(hub: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_ENDPOINT": hub, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0",
           "DIFFUSION_ENGINE_HOME": str(tmp_path / "home"), "HF_TOKEN": ""}
    env.pop("TRANSFORMERS_OFFLINE", None)
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.slow
def test_a_gated_base_is_named_with_its_licence_page_before_any_download(hub: str, tmp_path: Path) -> None:
    """``generate`` and ``train`` on a gated base with downloads allowed: refused with
    ``gated_repo`` naming the repo's page on the hub they use and what to do, after
    asking only the hub's auth-check (no file is fetched, nothing is loaded)."""
    page = f"{hub}/{GATED}"
    generated = cli(hub, tmp_path, "generate", "--model", GATED, "--allow-download", "--prompt", "a fox",
                    "-o", str(tmp_path / "fox.png"))
    assert generated.returncode == 2, generated.stderr
    assert "error[gated_repo]" in generated.stderr and f"request access at {page}" in generated.stderr
    assert "add a token" in generated.stderr and "Traceback" not in generated.stderr
    assert not (tmp_path / "fox.png").exists()
    # The command it advises is one the pinned huggingface_hub installs (`hf`, not huggingface-cli).
    advised = re.search(r"`(hf [a-z ]+)`", generated.stderr)
    assert advised is not None, generated.stderr
    helped = subprocess.run([str(Path(sys.executable).parent / "hf"), *advised.group(1).split()[1:], "--help"],
                            capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0, helped.stderr
    data = write_dataset(tmp_path / "data", count=1)
    trained = cli(hub, tmp_path, "train", "--base", "flux.1-dev", "--data", str(data), "--allow-download",
                  "--device", "cpu", "--steps", "1")
    assert trained.returncode == 2, trained.stderr
    assert "error[gated_repo]" in trained.stderr and f"request access at {page}" in trained.stderr
    # Asked once per command; never a file (the hub serves files under /{repo}/resolve/...).
    assert StandInHub.asked.count(f"/api/models/{GATED}/auth-check") == 2
    assert not [path for path in StandInHub.asked if "/resolve/" in path], StandInHub.asked
    assert not list((tmp_path / "hf").rglob("*.safetensors"))


def test_a_repo_the_hub_does_not_show_is_refused_as_not_found(hub: str, tmp_path: Path) -> None:
    missing = cli(hub, tmp_path, "generate", "--model", MISSING, "--family", "flux", "--allow-download",
                  "--prompt", "a fox")
    assert missing.returncode == 2 and "error[repo_not_found]" in missing.stderr, missing.stderr
    assert f"{hub}/{MISSING}" in missing.stderr
