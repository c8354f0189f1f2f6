"""The sound a family trains is declared where it can be trained: on a flow-matching objective."""

from __future__ import annotations

import pytest

from engine.contract.types import SoundTraining, TrainingObjective, TrainingSpec


def test_sound_training_needs_a_flow_matching_objective() -> None:
    """The trainer noises a clip's sound on a flow schedule beside its picture: a table that
    declares sound on an epsilon objective (or none) is refused when it is built, naming why."""
    flow = TrainingObjective(prediction="flow_matching", timestep_sampling="uniform")
    assert TrainingSpec(objective=flow, sound=SoundTraining(flow_shift=3.0)).sound is not None
    with pytest.raises(ValueError, match="flow_matching, not epsilon"):
        TrainingSpec(objective=TrainingObjective(prediction="epsilon", timestep_sampling="uniform"),
                     sound=SoundTraining())
    with pytest.raises(ValueError, match="flow_matching, not None"):
        TrainingSpec(sound=SoundTraining())
