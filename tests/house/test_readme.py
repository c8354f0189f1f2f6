"""Every command block in README.md and the guide pages it links (docs/inference.md,
training.md, embedding.md, serving.md, architecture.md, benchmarks.md), and every
``$ command`` in docs/*.md, run as written (README first, then the guides in that
order, in one fresh folder, through the installed CLI in-process), or skipped for a
reason listed here: a command neither run nor matched by a reason fails the test, and so
does a reason that matches nothing (a stale skip hides nothing). A command with a
``# exits N`` comment must exit N (a refusal shown on purpose). The count of commands
run and every skip, with its reason, are printed.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from engine.cli import main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: The guide pages, in the order a reader follows them after the README's tour.
GUIDES = [ROOT / "docs" / name for name in (
    "inference.md", "training.md", "embedding.md", "serving.md", "architecture.md", "benchmarks.md")]

#: Shell commands not run here: (pattern over the command, why).
SKIPPED: list[tuple[str, str]] = [
    (r"^make (demo|test)\b", "builds .venv and runs the demo or the suite (minutes); this test runs inside that .venv"),
    (r"^\. \.venv/bin/activate", "changes the calling shell; here the CLI is called in-process"),
    (r"pip install|^python3 -m venv", "installs packages; the test runs inside the installed .venv"),
    (r"--allow-download", "downloads a real model from the hub (the tests never reach a hub)"),
    (r"^diffusion-engine serve\b", "serves until stopped; tests/faces/test_server.py runs the real app"),
    (r"^make gpu-check\b", "needs an NVIDIA GPU (bench/gpu_check.py)"),
    (r"^[^#]*RUN_ID", "names a run the user trained (a placeholder); tests/training/test_training_runs.py resumes and "
     "repeats real runs"),
    (r"^diffusion-engine train .*--steps [0-9]{3,}", "trains for hundreds of steps on the user's model; "
     "tests/training/test_training_runs.py runs the same flags on tiny runs"),
    (r"--nodes 2 ", "needs a second machine; tests/training/test_distributed.py runs two nodes over gloo on loopback"),
    (r"--lora runs/", "needs a trained run's folder and the user's LoRA file"),
]
#: Python blocks not run here: (text in the block, why).
SKIPPED_PYTHON: list[tuple[str, str]] = [
    ("register_resident",
     "starts a 1500-step run on the user's model; tests/training/test_training_runs.py runs it as a script"),
    ("OpenAI(", "needs a running server and the openai package; tests/faces/test_server.py speaks that API"),
    ("images.cancel()", "needs the user's SDXL model, ControlNet and images; tests/runtime/test_images_in.py "
     "and tests/runtime/test_batches.py make each of these calls on tiny pipelines"),
]
COMMANDS = ("diffusion-engine", "make", ".", "python3", "pip", ".venv/bin/", "accelerate")


def blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


def commands(body: str) -> list[str]:
    """The block's command lines (continuations joined, comments dropped); [] for a non-command block."""
    lines = [line.strip() for line in body.replace("\\\n", " ").splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    if not any(line.split()[0] in COMMANDS or line.startswith(COMMANDS) for line in lines):
        return []  # a diagram or a listing, not commands
    return lines


def reason(command: str) -> str | None:
    return next((why for pattern, why in SKIPPED if re.search(pattern, command)), None)


def expected_status(command: str) -> int:
    found = re.search(r"#\s*exits (\d+)", command)
    return int(found.group(1)) if found else 0


@pytest.mark.slow
def test_every_readme_and_guide_command_runs_or_says_why_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    ran: list[str] = []
    skipped: list[tuple[str, str]] = []
    used_python: set[str] = set()
    for page in (README, *GUIDES):
        for language, body in blocks(page.read_text(encoding="utf-8")):
            if language == "python":
                why = next((w for marker, w in SKIPPED_PYTHON if marker in body), None)
                if why is not None:
                    used_python.add(why)
                    skipped.append((body.splitlines()[0], why))
                    continue
                exec(compile(body, str(page), "exec"), {"__name__": "readme"})  # noqa: S102 - the docs' own code
                ran.append(body.splitlines()[0])
                continue
            if language not in ("sh", "bash", ""):
                continue
            for command in commands(body):
                why = reason(command)
                if why is not None:
                    skipped.append((command, why))
                    continue
                argv = shlex.split(command, comments=True)
                assert argv[0] == "diffusion-engine", f"{page.name}: command not runnable here and not skipped: {command}"
                status = main(argv[1:])
                err = capsys.readouterr().err
                assert status == expected_status(command) and "Traceback" not in err, f"{page.name}: {command}\n{err}"
                ran.append(command)
    stale = [why for _, why in SKIPPED if why not in {w for _, w in skipped}]
    stale += [why for _, why in SKIPPED_PYTHON if why not in used_python]
    assert not stale, f"skip reasons that match no command: {stale}"
    assert any("tiny save" in c for c in ran) and any(c.startswith("diffusion-engine generate") for c in ran)
    assert any(c.startswith("diffusion-engine train") and "--dry-run" not in c for c in ran)  # the tour trains for real
    for written in ("fox.png", "fox-flux.png", "foxes-0.png", "lighthouse.png"):
        assert (tmp_path / written).is_file(), written
    with Image.open(tmp_path / "fox-flux.png") as tiny:
        assert tiny.size == (64, 64), "--tiny defaults to 64 px for every family"
    print(f"\nran {len(ran)} commands and snippets; skipped {len(skipped)}:")
    print("\n".join(f"skipped: {c}  ({why})" for c, why in skipped))


def test_the_generated_pages_are_current() -> None:
    """docs/cli.md (every --help), docs/controls.md and docs/errors.md equal a fresh render."""
    from engine import error_catalogue
    from engine.cli import reference
    from engine.requests import docs

    for name, render in (("cli.md", reference.render), ("controls.md", docs.render), ("errors.md", error_catalogue.render)):
        assert (ROOT / "docs" / name).read_text(encoding="utf-8") == render(), f"docs/{name} is stale: regenerate it"


def test_the_readme_fits_one_sitting() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 250


DOCS = sorted((ROOT / "docs").glob("*.md"))
#: docs/*.md commands not run here: (pattern over the command, why).
DOCS_SKIPPED: list[tuple[str, str]] = [
    (r"^python -m engine\.testing\.memory_figures\b", "derives for minutes at real widths; "
     "tests/policy/test_memory_figures.py runs the tool's step on the worked example's family"),
]


def docs_commands(body: str) -> list[str]:
    """A console block's commands: its ``$ `` lines (the rest is output)."""
    return [line[2:].strip() for line in body.splitlines() if line.startswith("$ ")]


@pytest.mark.slow
def test_every_docs_command_runs_or_says_why_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    install_example: Callable[[], Path],
) -> None:
    """Every ``$ command`` in docs/*.md, as written, in one fresh folder, with the worked
    example installed (the docs' tour uses it); ``VAR=value`` before a command is its environment."""
    install_example()
    monkeypatch.chdir(tmp_path)
    ran: list[str] = []
    used: set[str] = set()
    for doc in DOCS:
        for _, body in blocks(doc.read_text(encoding="utf-8")):
            for command in docs_commands(body):
                why = next((w for pattern, w in DOCS_SKIPPED if re.search(pattern, command)), None)
                if why is not None:
                    used.add(why)
                    continue
                argv = shlex.split(command, comments=True)
                with monkeypatch.context() as env:
                    while argv and re.match(r"^[A-Z_]+=", argv[0]):
                        name, _, value = argv.pop(0).partition("=")
                        env.setenv(name, value)
                    if argv[:3] == ["python", "-m", "engine.testing.quant_factors"]:
                        from engine.testing import quant_factors

                        status = quant_factors.main(argv[3:])
                    else:
                        assert argv[0] == "diffusion-engine", f"{doc.name}: not runnable here and not skipped: {command}"
                        status = main(argv[1:])
                err = capsys.readouterr().err
                assert status == 0 and "Traceback" not in err, f"{doc.name}: {command}\n{err}"
                ran.append(command)
    assert not [why for _, why in DOCS_SKIPPED if why not in used], "a docs skip reason matches no command"
    assert any(c.startswith("diffusion-engine train") for c in ran) and (tmp_path / "sd3.png").is_file()
