"""The guard: the orchestrator of one optimizer step, in lockstep on every rank (see :mod:`.core`).

===============  =========================================================================================
``core``         :class:`Guard` (state, ``backward``, ``step`` and the data flow of one guarded step) and
                 :func:`attach`
``wrapping``     the patches on the user's own ``backward``/``clip_grad_norm_``/``optimizer.step``/
                 ``lr_scheduler.step`` (the unmodified loop)
``stats``        the gathered ``[world, k]`` table read into one ``StepStats``
``reporting``    metrics, events, incident bundles and non-finite localisation, after the step
``result``       :class:`StepResult`
===============  =========================================================================================

The LR multiplier the guard holds for recovery lives in :mod:`vidstab.lr`.
"""

from .core import GUARD_STATE_FILE, Guard, attach
from .result import StepResult

__all__ = ["GUARD_STATE_FILE", "Guard", "StepResult", "attach"]
