"""The docs' tables of controls, generated from the control table.

``python -m engine.requests.docs`` rewrites ``docs/controls.md``; a test
checks it is current, so the docs never spell a control differently from
the CLI and the HTTP API.
"""

from __future__ import annotations

import sys

from engine.requests.controls import GENERATE_CONTROLS, MODEL_CONTROLS, PLAN_CONTROLS, TRAIN_CONTROLS, markdown_table

SECTIONS = (
    ("The model", "Every command that takes a model (`plan`, `generate`, `info`, `train` as `--base`; "
     "`model`, `family`, `base` in the HTTP bodies) reads it the same way.", MODEL_CONTROLS),
    ("Plan controls", "`plan` and `generate` at the terminal; `POST /v1/images/plan` and `/v1/images/load` "
     "over HTTP; `PlanControls` / `InferenceRequest` in Python. `auto` leaves the control to the engine, "
     "which says why it chose what it did.", PLAN_CONTROLS),
    ("Generate", "`generate` at the terminal; `POST /v1/images/generate` over HTTP; `GenerateBody` with "
     "`Engine.images.generate` in Python.", GENERATE_CONTROLS),
    ("Training", "`train` at the terminal; `POST /v1/training/plan` and `/v1/training/start` over HTTP; "
     "`TrainingConfig` with `Engine.training.plan` / `Engine.training.start` in Python (and a "
     "`--config` TOML file of the same fields).", TRAIN_CONTROLS),
)


def render() -> str:
    parts = [
        "# Controls",
        "",
        "<!-- Generated from engine/requests/controls.py by `python -m engine.requests.docs`; do not edit. -->",
        "",
        "One row per control: the flag a terminal user types, the JSON field (and Python keyword) that "
        "means the same, its default and its choices. A refusal names the flag at the terminal and the "
        "field over HTTP.",
    ]
    for title, text, controls in SECTIONS:
        parts += ["", f"## {title}", "", text, "", markdown_table(controls)]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    from engine.generated_docs import write_page

    return write_page("controls.md", render, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
