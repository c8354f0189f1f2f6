"""Pure decisions with provenance. Nothing under this package imports torch.

Each decision returns a :class:`~engine.policy.resolved.Resolved` (value,
source, reason); the inputs are a family's table (through the registry), a
:class:`~engine.hardware.profile.HardwareProfile` and the request.
"""

from engine.policy.resolved import Resolved

__all__ = ["Resolved"]
