"""The training request: :class:`TrainingConfig` and how a file of its fields is read.

The record itself lives beside the trainer that holds it
(:mod:`engine.training.config`, torch-free); the faces name it from here, as
part of the one request vocabulary.
"""

from __future__ import annotations

from engine.training.config import InvalidConfig, LossWeighting, Optimizer, TrainingConfig, read_config_file

__all__ = ["InvalidConfig", "LossWeighting", "Optimizer", "TrainingConfig", "read_config_file"]
