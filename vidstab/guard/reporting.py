"""Reporting a judged step, after the optimizer step is enqueued: metrics lines, events, tracker logging, and on
the offending ranks incident bundles (:mod:`vidstab.evidence.capture`) with the non-finite module localised
(:mod:`vidstab.evidence.localize`). Evidence never decides anything: the verdict was taken before, the same on every rank.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..evidence import capture
from ..detectors import StepStats, Verdict
from ..detectors.running import published
from ..events import EventLog, log_to_trackers
from ..evidence.localize import locate_nonfinite
from ..run.host_memory import HostMemoryWatch, climb_line, resident_mib
from ..recovery.quarantine import quarantine_bundle_dir
from ..evidence.replay_record import OUTPUT_GRAD_KEY
from ..signals import Layout, Window
from .recorder import MicroBatch
from .result import StepResult

# A ROLLBACK finding is only a request: the recovery layer logs "rollback" when it actually rolls back.
EVENT_KIND = {Verdict.WARN: "warn", Verdict.SKIP: "skip", Verdict.ROLLBACK: "rollback_request"}


class Reporter:
    """Owns this rank's event log and its incident bundles (their count and budget)."""

    def __init__(self, accelerator: Any, model: torch.nn.Module, optimizer: Any, config: Any, run_dir: Path, *,
                 rank: int, world_size: int, sharded: bool, model_spec: dict | None, seed: int | None,
                 checkpoint_fn: Callable[[], str | None] | None) -> None:
        self.accelerator, self.model, self.optimizer, self.config = accelerator, model, optimizer, config
        self.run_dir, self.rank, self.world_size, self.sharded = run_dir, rank, world_size, sharded
        self.model_spec, self.seed, self.checkpoint_fn = model_spec, seed, checkpoint_fn
        self.events = EventLog(run_dir, rank)
        self.incidents_written = 0
        self.data_seconds = 0.0
        """This step's wait for data, as the loop reported it (``Guard.data_wait``); 0 when it reports none."""
        self.localized = False
        self.replay_fn: Callable[[dict], torch.Tensor] | None = None
        self.output_gradients = None
        """:class:`vidstab.evidence.replay_record.OutputGradients` when the model spec was recorded at attach (diffusers)."""
        self.host_memory = HostMemoryWatch()
        """This rank's resident-memory readings and the warning of a steady climb (:mod:`vidstab.run.host_memory`)."""

    def tracked(self, step: int) -> bool:
        """Whether this step's metrics go to the accelerator's trackers (``log_with``, every ``log_every``)."""
        return step % self.config.log_every == 0 and bool(getattr(self.accelerator, "trackers", None))

    def report(self, s: StepStats, mine: Sequence[float], layout: Layout, *, clip_rate: float, skipped_total: int,
               overflow_total: int, detectors: Sequence[Any], stop: bool, skipped: bool,
               micro_batches: list[MicroBatch], window: Window) -> StepResult:
        """Log the step and, on a skipped step this rank is named in, write its incident bundles."""
        if self.rank == 0 or s.findings or s.step % self.config.rank_log_every == 0:
            metrics = metrics_line(s, mine, layout, self.rank, clip_rate, skipped_total, overflow_total)
            metrics.update(published(detectors))  # the thresholds of the next judgement, on logged lines only
            if self.data_seconds:
                metrics["data_seconds"] = round(self.data_seconds, 6)
            metrics["rss_mib"] = rss = resident_mib()  # this rank's host memory, read only on logged lines
            climb = self.host_memory.observe(s.step, rss)
            if climb is not None:
                self.events.log("host_memory_climb", s.step, **climb)
                print(climb_line(self.rank, s.step, climb, self.events.numbering), file=sys.stderr, flush=True)
            self.events.log_metrics(s.step, metrics)
            if self.tracked(s.step):
                log_to_trackers(self.accelerator, {k: v for k, v in metrics.items() if k not in ("loss_rank", "verdict")},
                                s.step)
        self.data_seconds = 0.0
        bad_ranks, rollback = [], None
        if s.findings:
            bad_ranks = sorted({r for f in s.findings for r in f.ranks})
            for f in s.findings:
                self.events.log(EVENT_KIND[f.verdict], s.step, detector=f.detector, message=f.message,
                                figures=f.figures, bad_ranks=f.ranks, step_verdict=s.verdict.name)
            rollback = next((f"{f.detector}: {f.message}" for f in s.findings if f.verdict >= Verdict.ROLLBACK), None)
        if s.overflow:
            self.events.log("overflow", s.step, loss_scale=s.loss_scale, overflow_total=overflow_total)
        if stop:
            self.events.log("stop", s.step, reason="request_stop")
        incidents = self.capture(s, micro_batches, window) if s.verdict >= Verdict.SKIP and not s.overflow else []
        return StepResult(
            step=s.step, applied=s.applied, skipped=skipped, micro=False, verdict=s.verdict,
            findings=list(s.findings), grad_norm=s.grad_norm, loss=s.loss, rollback=rollback, stop=stop,
            bad_ranks=bad_ranks, incident=incidents[0] if incidents else None, overflow=s.overflow, incidents=incidents,
        )

    # ------------------------------------------------------------------ incidents (cold path)
    def capture(self, s: StepStats, micro_batches: list[MicroBatch], window: Window) -> list[Path]:
        """Write incident bundles for this rank's bad micro-batches if this rank is named by a finding."""
        if not self.config.capture_incidents:
            return []
        # An OOM's record is its ``oom`` event (shapes, phase, micro-batch): its batches are not written out.
        finding = next((f for f in s.findings if f.verdict >= Verdict.SKIP and self.rank in f.ranks
                        and f.detector != "oom"), None)
        if finding is None or not micro_batches:
            return []
        micro = window.micro_flags()  # cold path: one more host read, on this rank only
        # Micro-steps whose loss/inputs were non-finite or that raised; else all, the largest input first.
        idx = [i for i, m in enumerate(micro) if m.loss_nonfinite or m.input_nonfinite > 0 or m.exception]
        if not idx:
            idx = sorted(range(len(micro)), key=lambda i: -micro[i].input_absmax)
        paths = []
        for i in idx:
            if self.incidents_written >= self.config.max_incidents or i >= len(micro_batches):
                break
            batch, ids, error = micro_batches[i]
            tensors = {k: v for k, v in (batch or {}).items() if isinstance(v, torch.Tensor)}
            if self.output_gradients is not None and self.output_gradients.grad(i) is not None:
                tensors[OUTPUT_GRAD_KEY] = self.output_gradients.grad(i)  # what the backward started from
            id_list = [str(x) for x in (ids.tolist() if isinstance(ids, torch.Tensor) else list(ids or []))]
            localization = self.localize(tensors) if finding.detector == "nonfinite" else None
            m = micro[i]
            extra = {"micro": {"loss_nonfinite": bool(m.loss_nonfinite), "input_nonfinite": int(m.input_nonfinite),
                               "input_absmax": m.input_absmax}, "grad_norm": s.grad_norm, "loss": s.loss,
                     "bad_ranks": finding.ranks, "bucket": s.bucket}
            if error is not None:
                extra["error"] = f"{type(error).__name__}: {error}"
            if self.events.numbering is not None:  # the trajectory's step beside the script's, where they differ
                extra.update(self.events.numbering.fields(s.step))
            try:
                path = Path(capture.write_incident(
                    self.run_dir, step=s.step, micro_step=i, rank=self.rank, world_size=self.world_size,
                    batch=tensors, sample_ids=id_list, finding=finding.to_dict(), lr=s.lr,
                    precision=str(getattr(self.accelerator, "mixed_precision", "no")), seed=self.seed,
                    checkpoint=self.checkpoint_fn() if self.checkpoint_fn else None, model_spec=self.model_spec,
                    localization=localization, extra=extra,
                ))
            except Exception as e:  # evidence must never kill the run
                self.events.log("warn", s.step, detector="capture", message=f"incident capture failed: {e!r}",
                                figures={}, bad_ranks=[self.rank])
                continue
            self.incidents_written += 1
            paths.append(path)
            try:
                rel = str(path.relative_to(self.run_dir))
            except ValueError:
                rel = str(path)
            self.events.log("incident", s.step, path=rel, sample_ids=id_list, detector=finding.detector, micro_step=i)
            added = quarantine_bundle_dir(self.run_dir, path) if self.config.quarantine_bad_samples else []
            if added:  # vidstab/recovery/quarantine.py: later epochs and resumes skip them
                self.events.log("quarantine", s.step, sample_ids=added, bundle=rel, source="capture")
        return paths

    def localize(self, batch: dict[str, torch.Tensor]) -> dict | None:
        """Replay one bad micro-batch on the UNWRAPPED model (no DDP collectives) with NaN hooks."""
        cfg = self.config
        if self.replay_fn is None or not (cfg.localize_every_step or (cfg.localize_first_nonfinite and not self.localized)):
            return None
        if self.sharded:  # a sharded model's forward all-gathers: replaying it on the bad rank alone would hang
            return {"error": "not localized: the model is sharded (FSDP), a one-rank replay would deadlock"}
        self.localized = True
        model = self.accelerator.unwrap_model(self.model)
        fn = self.replay_fn
        try:
            with torch.enable_grad():
                result = locate_nonfinite(model, lambda: fn(batch))
        except Exception as e:
            result = {"error": repr(e)}
        finally:
            self.optimizer.zero_grad(set_to_none=True)  # the replay's grads must not leak into the next step
        return result


def metrics_line(s: StepStats, mine: Sequence[float], L: Layout, rank: int, clip_rate: float, skipped_total: int,
                 overflow_total: int) -> dict:
    """The step's ``metrics`` line (before the detectors' thresholds): the step's statistics, this rank's own
    figures from its vector, and the counters as they stood right after the step."""
    n, bad = mine[L.in_numel], mine[L.ranks_input_bad] > 0
    mean = mine[L.in_sum] / n if n > 0 else None
    std = math.sqrt(max(mine[L.in_sumsq] / n - mean * mean, 0.0)) if mean is not None else None
    count = mine[L.loss_count]
    return {
        "loss": s.loss,
        "loss_rank": mine[L.loss_sum] / count if count > 0 else math.nan,
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
        "input_absmax": math.nan if bad else mine[L.in_absmax] if n > 0 else None,
        "input_mean": math.nan if bad else mean,
        "input_std": math.nan if bad else std,
        "input_nonfinite": int(bad),
        "loss_by_t": s.timestep_bucket_loss,
        "local_seconds": mine[L.seconds] if mine[L.slowest] >= 0 else None,
        "bucket": s.bucket,
        "batch_fp": s.batch_fp,  # the step's sample ids over every rank: a resume is checked against it
        "verdict": s.verdict.name,
        "applied": s.applied,
    }
