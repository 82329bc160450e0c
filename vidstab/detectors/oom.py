"""A rank ran out of memory in a micro-step's forward or backward -> SKIP on every rank (no rollback: the weights
were not touched). After ``advise_after`` OOMs in one shape bucket the finding says which micro-batch to use.

Inside ``optimizer.step()`` the judge is whether the update was applied (:class:`vidstab.recovery.oom.StepMarks`): a rank
that failed before touching its weights and optimizer state skipped the step; when every rank did, the step was
skipped everywhere alike and nothing more is needed. When a rank had updated part of its state, or some ranks
applied the update and others did not, the ranks no longer agree: ROLLBACK at the next step, on every rank."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Detector, DetectorConfig, Finding, StepStats, Verdict, check


@dataclass
class OOMConfig(DetectorConfig):
    """Configuration of the ``oom`` detector (:mod:`vidstab.recovery.oom`)."""

    action: str = "skip"
    """``warn | skip | rollback``. Skip: an OOM in the forward or backward leaves the weights as they were, so
    the step is dropped on every rank (its memory released) and training goes on; nothing to roll back."""
    advise_after: int = 3
    """After this many OOMs in one shape bucket the finding names the bucket and the micro-batch to use for it."""

    def validate_fields(self, prefix: str) -> None:
        check(self.advise_after >= 1, f"{prefix}.advise_after", "must be >= 1", self.advise_after)


class OOMDetector(Detector):
    """Counts OOMs per shape bucket and keeps the largest micro-batch a loop that can re-run a batch in pieces found
    to fit there (both in its state: a resume keeps them)."""

    name = "oom"
    needs = None  # forward/backward OOMs (oom_ranks) and the previous step's optimizer OOM (optimizer_oom)

    def __init__(self, config: OOMConfig) -> None:
        super().__init__(config)
        self.per_bucket: dict[str, int] = {}
        self.fits: dict[str, int] = {}
        """Per shape bucket, the largest micro-batch (samples) that fitted after an OOM there (:meth:`fitted`)."""

    def fitted(self, bucket: str, size: int) -> None:
        """A step of ``bucket`` was applied in micro-batches of ``size`` samples after an OOM (every rank alike)."""
        self.fits[str(bucket)] = int(size)

    def observe(self, s: StepStats) -> Finding | None:
        if s.optimizer_oom in ("touched", "partial"):
            return self.diverged(s)
        if not s.oom_ranks:
            return None
        count = self.per_bucket.get(s.bucket, 0) + 1
        size = s.oom_micro_batch or 0
        message = (f"out of memory on rank(s) {s.oom_ranks} in bucket {s.bucket}"
                   + (f" at a micro-batch of {size}" if size > 1 else "")
                   + ": step skipped on every rank, its memory released, the weights untouched")
        if count >= self.config.advise_after:
            smaller = (f"a micro-batch of at most {max(size // 2, 1)} samples for it (the data loader's batch size "
                       f"for that bucket; raise gradient accumulation to keep the batch)" if size > 1
                       else "a smaller resolution or frame count for it")
            message += f"; {count} OOMs in bucket {s.bucket}: use {smaller}"
        return self.finding(message, {"ooms_in_bucket": float(count), "micro_batch": float(size)}, s.oom_ranks)

    def diverged(self, s: StepStats) -> Finding:
        """The previous optimizer step ran out of memory and left the ranks' weights or optimizer state unlike a
        whole step's: roll back (``warn`` keeps its verdict: the user chose to be told only)."""
        how = ("after updating part of the weights or optimizer state" if s.optimizer_oom == "touched" else
               "on some ranks only, while the others applied the update")
        message = (f"out of memory inside optimizer.step() of step {s.step - 1} on rank(s) {s.optimizer_oom_ranks}, "
                   f"{how}: the model and optimizer state are no longer one consistent step")
        verdict = self.verdict if self.verdict <= Verdict.WARN else Verdict.ROLLBACK
        return Finding(self.name, verdict, message, {"optimizer_oom": 1.0}, s.optimizer_oom_ranks)

    def update(self, s: StepStats) -> None:
        if s.oom_ranks:
            self.per_bucket[s.bucket] = self.per_bucket.get(s.bucket, 0) + 1

    def state_dict(self) -> dict:
        return {"per_bucket": dict(self.per_bucket), "fits": dict(self.fits)}

    def load_state_dict(self, d: dict) -> None:
        # What a run learned about its memory outlives a rollback to an older checkpoint (a new process has none).
        per_bucket = {str(k): int(v) for k, v in d.get("per_bucket", {}).items()}
        self.per_bucket = {k: max(v, self.per_bucket.get(k, 0)) for k, v in (per_bucket | self.per_bucket).items()}
        self.fits = {str(k): int(v) for k, v in d.get("fits", {}).items()} | self.fits
