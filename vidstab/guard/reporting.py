"""Step 5, after the optimizer step is enqueued: metrics, events, tracker logging, and on the offending
ranks incident bundles (:mod:`vidstab.capture`) with the non-finite module localised (:mod:`vidstab.localize`).

Evidence never decides anything: the verdict was taken before (step 3), the same on every rank.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .. import capture, signals as S
from ..detectors import Finding, StepStats, Verdict, published
from ..events import log_to_trackers
from ..localize import locate_nonfinite
from ..replay_record import OUTPUT_GRAD_KEY
from .result import StepResult

# A ROLLBACK finding is only a request: the recovery layer logs "rollback" when it actually rolls back.
EVENT_KIND = {Verdict.WARN: "warn", Verdict.SKIP: "skip", Verdict.ROLLBACK: "rollback_request"}
VERDICT_NAME = tuple(v.name for v in Verdict)  # Verdict(i).name by index: the enum's property costs more, every step


class GuardReporting:
    """The :class:`~vidstab.guard.Guard` methods that turn a judged step into evidence and a result."""

    output_gradients = None
    """:class:`vidstab.replay_record.OutputGradients` when the model spec was recorded at attach (a diffusers model)."""

    def _report(self, s: StepStats, table: list[list[float]], stop: bool) -> StepResult:
        metrics = self._metrics(s, table[self.rank], self._clip_flags.rate(), self.skipped_total, self.overflow_total)
        # Each detector's own thresholds for the next step (the dashboard's lines); one whose update of this
        # step waits writes them into the line when it is made, before the event log encodes it (on a step a
        # tracker takes, absorb made every update: _tracked).
        metrics.update(published(self._plan, metrics))
        self.events.log_metrics(s.step, metrics)
        if self._tracked(s.step):
            log_to_trackers(self.accelerator, {k: v for k, v in metrics.items() if k not in ("loss_rank", "verdict")}, s.step)
        bad_ranks, rollback = [], None
        if s.findings:  # a healthy step has none: nothing below to build
            bad_ranks = sorted({r for f in s.findings for r in f.ranks})
            for f in s.findings:
                self.events.log(EVENT_KIND[f.verdict], s.step, detector=f.detector, message=f.message,
                                figures=f.figures, bad_ranks=f.ranks, step_verdict=s.verdict.name)
            rollback = next((f"{f.detector}: {f.message}" for f in s.findings if f.verdict >= Verdict.ROLLBACK), None)
        if s.overflow:
            self.events.log("overflow", s.step, loss_scale=s.loss_scale, overflow_total=self.overflow_total)
        if stop:
            self.events.log("stop", s.step, reason="request_stop")
        incidents = self._capture(s) if s.verdict >= Verdict.SKIP and not s.overflow else []
        skipped = s.verdict >= Verdict.SKIP and not self._observe_only
        return StepResult(
            step=s.step, applied=s.applied, skipped=skipped, micro=False, verdict=s.verdict,
            findings=list(s.findings), grad_norm=s.grad_norm, loss=s.loss, rollback=rollback, stop=stop,
            bad_ranks=bad_ranks, incident=incidents[0] if incidents else None, overflow=s.overflow, incidents=incidents,
        )

    def _metrics(self, s: StepStats, mine: list[float], clip_rate: float, skipped_total: int,
                 overflow_total: int) -> dict:
        """The step's ``metrics`` line (before the detectors' thresholds), from its stats, this rank's row and
        the counters as they stood right after the step."""
        n = mine[S.IN_NUMEL]
        mean = mine[S.IN_SUM] / n if n > 0 else None
        std = math.sqrt(max(mine[S.IN_SUMSQ] / n - mean * mean, 0.0)) if mean is not None and math.isfinite(mean) else None
        return {
            "loss": s.loss,
            "loss_rank": s.rank_loss[self.rank],
            "lr": s.lr,
            "grad_norm": s.grad_norm,
            "clipped": s.clipped,
            "clip_ratio": s.grad_norm / s.max_grad_norm if s.max_grad_norm else None,
            "clip_rate": clip_rate,
            "loss_scale": s.loss_scale,
            "param_norm": s.param_norm,
            "update_ratio": s.update_ratio,
            "skipped_total": skipped_total,
            "overflow_total": overflow_total,
            "input_absmax": s.rank_input_absmax[self.rank] if n > 0 else None,
            "input_mean": mean,
            "input_std": std,
            "input_nonfinite": int(self.rank in s.nonfinite_input_ranks),  # build_stats read it off the row
            "loss_by_t": s.timestep_bucket_loss,
            "local_seconds": mine[S.LOCAL_SECONDS] if mine[S.LOCAL_SECONDS] >= 0 else None,
            "verdict": VERDICT_NAME[s.verdict],
            "applied": s.applied,
        }

    def _tracked(self, step: int) -> bool:
        """Whether this step's metrics go to the accelerator's trackers (``log_with``, every ``log_every``)."""
        return step % self.config.log_every == 0 and bool(getattr(self.accelerator, "trackers", None))

    # ------------------------------------------------------------------ incidents (cold path)
    def _capture(self, s: StepStats) -> list[Path]:
        """Write incident bundles for this rank's bad micro-batches if this rank is named by a finding."""
        if not self.config.capture_incidents:
            return []
        finding = next((f for f in s.findings if f.verdict >= Verdict.SKIP and self.rank in f.ranks), None)
        if finding is None or not self._refs:
            return []
        micro = self.window.micro_flags()  # cold path: one more host read, on this rank only
        # Micro-steps whose loss/inputs were non-finite or that raised; else all, the largest input first.
        idx = [i for i, m in enumerate(micro) if m.loss_nonfinite or m.input_nonfinite > 0 or m.exception]
        if not idx:
            idx = sorted(range(len(micro)), key=lambda i: -micro[i].input_absmax)
        paths = []
        for i in idx:
            if self.incidents_written >= self.config.max_incidents or i >= len(self._refs):
                break
            batch, ids, error = self._refs[i]
            if type(batch) is tuple:  # the attached loop's (args, kwargs) of the model
                batch = self._model_batch(batch)
            tensors = {k: v for k, v in (batch or {}).items() if isinstance(v, torch.Tensor)}
            if self.output_gradients is not None and self.output_gradients.grad(i) is not None:
                tensors[OUTPUT_GRAD_KEY] = self.output_gradients.grad(i)  # what the backward started from
            id_list = [str(x) for x in (ids.tolist() if isinstance(ids, torch.Tensor) else list(ids or []))]
            localization = self._localize(s, finding, tensors) if finding.detector == "nonfinite" else None
            m = micro[i]
            extra = {"micro": {"loss_nonfinite": bool(m.loss_nonfinite), "input_nonfinite": int(m.input_nonfinite),
                               "input_absmax": m.input_absmax}, "grad_norm": s.grad_norm, "loss": s.loss,
                     "bad_ranks": finding.ranks}
            if error is not None:
                extra["error"] = f"{type(error).__name__}: {error}"
            try:
                path = capture.write_incident(
                    self.run_dir, step=s.step, micro_step=i, rank=self.rank, world_size=self.world_size,
                    batch=tensors, sample_ids=id_list, finding=finding.to_dict(), lr=s.lr,
                    precision=str(getattr(self.accelerator, "mixed_precision", "no")), seed=self.seed,
                    checkpoint=self.checkpoint_fn() if self.checkpoint_fn else None, model_spec=self.model_spec,
                    localization=localization, extra=extra,
                )
            except Exception as e:  # evidence must never kill the run
                self.events.log("warn", s.step, detector="capture", message=f"incident capture failed: {e!r}",
                                figures={}, bad_ranks=[self.rank])
                continue
            path = Path(path)
            self.incidents_written += 1
            paths.append(path)
            try:
                rel = str(path.relative_to(self.run_dir))
            except ValueError:
                rel = str(path)
            self.events.log("incident", s.step, path=rel, sample_ids=id_list, detector=finding.detector, micro_step=i)
        return paths

    def _localize(self, s: StepStats, finding: Finding, batch: dict[str, torch.Tensor]) -> dict | None:
        """Replay one bad micro-batch on the UNWRAPPED model (no DDP collectives) with NaN hooks."""
        cfg = self.config
        if self._replay_fn is None or not (cfg.localize_every_step or (cfg.localize_first_nonfinite and not self.localized)):
            return None
        if self._sharded:  # a sharded model's forward all-gathers: replaying it on the bad rank alone would hang
            return {"error": "not localized: the model is sharded (FSDP), a one-rank replay would deadlock"}
        self.localized = True
        model = self.accelerator.unwrap_model(self.model)
        fn = self._replay_fn
        try:
            with torch.enable_grad():
                result = locate_nonfinite(model, lambda: fn(batch))
        except Exception as e:
            result = {"error": repr(e)}
        finally:
            self.optimizer.zero_grad(set_to_none=True)  # the replay's grads must not leak into the next step
        return result
