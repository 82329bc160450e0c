"""The attached form's console: what vidstab did to the user's unmodified loop, said as it happens.

In the attached form (``vidstab.attach``) the loop's own code prints nothing about vidstab, so the guard says it:
on the main process only, one line per skipped step (an update refused), one line per incident bundle of any rank
(with the command that replays it; the ranks' paths are gathered on the skipped steps, which every rank judges in
lockstep), one line per in-place rollback (:mod:`vidstab.recovery.auto_rollback`) and a summary at ``guard.close()``. Steps
are the script's (:mod:`vidstab.step_numbering`), with the trajectory step beside them where in-place rollbacks made
the two differ. The explicit form and the reference trainer print their own.
"""

from __future__ import annotations

import sys
from typing import Any

from .detectors import Verdict
from .step_numbering import step_label


class StepConsole:
    """Prints the attached form's lines (module docstring). Built by :func:`vidstab.attach`."""

    def __init__(self, guard: Any) -> None:
        self.guard = guard
        self.main = bool(guard.accelerator.is_main_process)
        self.skipped = 0
        self.rollbacks = 0
        self.rollbacks_not_kept = 0  # rollback requests a guard without rollback checkpoints could only skip

    def say(self, line: str) -> None:
        """``line`` on stderr, on the main process."""
        if self.main:
            print(line, file=sys.stderr, flush=True)

    def label(self, step: int) -> str:
        """``step N`` (the script's), ``(trajectory step T)`` beside it after in-place rollbacks."""
        return self.guard.numbering.label(step)

    def after_step(self, result: Any) -> None:
        """The lines of one judged step of the loop."""
        if result is None or result.micro:
            return
        if result.rollback is not None and self.guard.auto_rollback is None:
            self.skipped += 1
            self.rollbacks_not_kept += 1
            self.say(f"vidstab: {self.label(result.step)}: a rollback is asked for ({result.rollback}); this guard "
                     f"keeps no rollback checkpoints, so the step was only skipped: attach(..., rollback_every=N) rolls "
                     f"back in place")
        elif result.skipped and result.rollback is None:
            self.skipped += 1
            worst = max(result.findings, key=lambda f: f.verdict, default=None)
            why = f"{worst.detector}: {worst.message}" if worst is not None else "skipped"
            self.say(f"vidstab: {self.label(result.step)}: update refused, step skipped ({why})")
        for rank, bundle in self.bundles(result):
            self.say(f"vidstab: {self.label(result.step)}: rank {rank} wrote incident bundle {bundle}; "
                     f"replay it with: vidstab replay {bundle}")

    def bundles(self, result: Any) -> list[tuple[int, str]]:
        """``(rank, path)`` of every rank's incident bundles of this step, on every rank. A collective on the steps
        that may write one (a skip, judged in lockstep, as the reporter captures), so the main process says them all."""
        g = self.guard
        mine = [(g.rank, str(p)) for p in result.incidents]
        if (g.world_size <= 1 or not g.config.capture_incidents or result.verdict < Verdict.SKIP
                or getattr(result, "overflow", False)):
            return mine
        from accelerate.utils import gather_object

        return [tuple(x) for x in gather_object(mine)]

    def rolled_back(self, step: int, info: dict) -> None:
        """One in-place rollback at the script's ``step``, to the checkpoint ``info``."""
        self.rollbacks += 1
        rec = info.get("_recovery", {})
        ckpt = info.get("_checkpoint", {})
        budget = self.guard.auto_rollback.recovery.config.max_retries
        saved = step_label(ckpt.get("step"), ckpt.get("trajectory_step"))  # the checkpoint's steps, as it recorded them
        self.say(f"vidstab: {self.label(step)}: rolled back in place to {saved} from {ckpt.get('path')}, rollback "
                 f"{rec.get('retries')}/{budget} of this incident, cause {rec.get('cause')}, LR multiplier "
                 f"x{rec.get('lr_multiplier', 1.0):.4g}")

    def summary(self) -> None:
        """The last line of the run (main process)."""
        g = self.guard
        not_kept = (f" ({self.rollbacks_not_kept} of them asked for a rollback this guard could not make: "
                    f"attach(..., rollback_every=N))" if self.rollbacks_not_kept else "")
        self.say(f"vidstab: {g.step_count} optimizer steps guarded, {self.skipped} skipped{not_kept}, {self.rollbacks} "
                 f"rolled back in place; events: vidstab events {g.run_dir}; incident bundles: vidstab incidents {g.run_dir}")
