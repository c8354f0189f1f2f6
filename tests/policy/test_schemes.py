"""One home per weight scheme: every list of schemes the engine speaks derives from the table."""

from __future__ import annotations

from engine.policy.encoders import TEXT_ENCODER_QUANT_REQUESTS
from engine.policy.schemes import SCHEME_SIZES
from engine.requests import PLAN_CONTROLS, TRAIN_CONTROLS
from engine.contract.schemes import (
    ENCODER_SCHEMES,
    HOST_QUANTISED,
    QUANT_REQUESTS,
    SCHEMES,
    TORCHAO_SCHEMES,
    TRAINING_PRECISIONS,
)
from engine.contract.types import QUANT_SCHEMES


def test_every_list_of_schemes_comes_from_the_table() -> None:
    rows = {c.field: c for c in (*PLAN_CONTROLS, *TRAIN_CONTROLS)}
    assert rows["quant"].choices == QUANT_REQUESTS == ("auto", "none", *[n for n, s in SCHEMES.items()
                                                                        if n != "bf16" and s.requestable])
    assert {n for n, s in SCHEMES.items() if not s.requestable} == {"sdnq", "svdquant", "svdquant_nvfp4"}
    assert rows["text_encoder_quant"].choices == TEXT_ENCODER_QUANT_REQUESTS == ("auto", *ENCODER_SCHEMES)
    assert rows["base_precision"].choices == TRAINING_PRECISIONS
    assert set(TRAINING_PRECISIONS) - {"auto"} == {n for n, s in SCHEMES.items() if s.trainable}
    assert QUANT_SCHEMES == tuple(SCHEMES) and set(SCHEME_SIZES) == set(SCHEMES)
    assert all(SCHEME_SIZES[n].steady == s.steady for n, s in SCHEMES.items())
    assert HOST_QUANTISED == {n for n, s in SCHEMES.items() if s.backend == "torchao"} == set(TORCHAO_SCHEMES)


def test_a_schemes_capability_refusal_is_its_rows() -> None:
    """The capability a scheme needs and its words come from its row, for inference and training."""
    from engine.hardware.presets import preset
    from engine.policy.quant import scheme_unsupported_reason
    from engine.policy.training_fit import mode_requirement_error

    a100 = preset("a100-80g")
    for name, scheme in SCHEMES.items():
        if scheme.needs is None:
            continue
        reason = scheme_unsupported_reason(name, a100)
        assert reason is not None and scheme.needs_text in reason, name
        if scheme.trainable:
            error = mode_requirement_error(name, a100, on_cpu=False)
            assert error is not None and scheme.needs_text in error.message and error.code == f"{name}_unsupported"
