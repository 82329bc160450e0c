"""The replay loss of a bundle that holds the gradient at the model's output (:mod:`vidstab.evidence.replay_record`).

The loss itself lives in the core (the in-job rerun runs it too); this path is the one bundles name
(:data:`vidstab.evidence.replay_record.OUTPUT_GRAD_LOSS`).
"""

from __future__ import annotations

from ...evidence.replay_record import output_grad_loss

__all__ = ["output_grad_loss"]
