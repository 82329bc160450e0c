"""The guard: the orchestrator of one optimizer step, in lockstep on every rank (see :mod:`.core`).

=====================  ===================================================================================
``core``               :class:`Guard` (the facade: ``backward``, ``step``, state) and :func:`attach`
``recorder``           the micro-steps of the accumulation window (on-device statistics, batch references)
``stats``              the one producer of a step's statistics, from the reduced summary
``optimizer_control``  apply or skip: the only place the optimizer, the scheduler and the scaler are touched
``reporting``          metrics lines, events, incident bundles and non-finite localisation, after the step
``wrapping``           the patches on the user's own calls (the unmodified loop)
``result``             :class:`StepResult`
=====================  ===================================================================================

The LR multiplier the guard holds for recovery lives in :mod:`vidstab.recovery.lr`.
"""

from .core import GUARD_STATE_FILE, Guard, attach
from .result import StepResult

__all__ = ["GUARD_STATE_FILE", "Guard", "StepResult", "attach"]
