"""The guard: the orchestrator of one optimizer step, in lockstep on every rank.

Two ways in, one step. ``vidstab.attach(accelerator, model, optimizer, lr_scheduler, run_dir=...)`` wraps the
*instances* it is given (:mod:`vidstab.guard.wrapping`), so a user's unmodified loop is guarded;
``guard.backward`` / ``guard.step`` do the same explicitly, with the batch, sample ids, per-sample losses and
the shape bucket as evidence. The guard is a small facade over parts that each own their state:

===========================  ===================================================================================
:class:`StepRecorder`        the micro-steps of the window: on-device statistics, batch references, own time
:func:`build_stats`          the one producer of a step's statistics, from the reduced summary
detectors                    the judges (:mod:`vidstab.detectors`), one instance per shape bucket where it matters
:class:`OptimizerControl`    the only place the optimizer, the scheduler and the scaler are touched
:class:`Reporter`            the event log, tracker metrics and incident bundles
:class:`LRMultiplier`        the LR multiplier recovery backs off and restores (:mod:`vidstab.recovery.lr`)
:class:`UserLoopPatches`     the patches on the user's own calls (``attach``)
===========================  ===================================================================================

What differs between DDP, FSDP2 and DeepSpeed (ZeRO 1/2/3) is the guard's :class:`~vidstab.engines.Engine`, chosen
once here: the backward, the pre-step norm, apply and skip. Under DeepSpeed the norm is the ZeRO optimizer's
pre-step norm, apply is ``engine.step()`` and skip is DeepSpeed's own overflow path; the attached loop's step is
judged at the last micro-step's ``accelerator.backward`` (where Accelerate steps the engine), the explicit one at
``guard.step``. Under fp16, a non-finite gradient with finite losses everywhere is a normal GradScaler overflow:
``optimizer.step()`` is still called (the scaler skips and lowers the scale).
"""

from __future__ import annotations

import inspect
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from .. import signals
from ..checkpoint.config import CheckpointError
from ..files.atomic import write_json_atomic
from ..config import GuardConfig
from ..detectors import Detector, Finding, StepStats, Verdict
from ..detectors.running import absorb, build_detectors, judge
from ..detectors.windows import CountWindow
from ..run.elastic import check_world_size
from ..engines import engine_for
from ..run.exit_fence import register_exit_fence
from ..run.goodput import process_start_time
from ..files.limits import read_json_file
from ..recovery.lr import LRMultiplier
from ..recovery.oom import is_oom, micro_batch_size, release
from ..recovery.rerun import StepRerun
from ..run.run_record import run_environment
from ..step_numbering import StepNumbering
from .optimizer_control import OptimizerControl
from .recorder import StepRecorder
from .reporting import Reporter
from .result import StepResult
from .saved_state import RESUME_REFUSED_EXIT_CODE, ResumeRefused, checked_guard_state
from .stats import anomalous, bad_input_only, build_stats
from .wrapping import ATTACHED_ATTR, UserLoopPatches

GUARD_STATE_FILE = "vidstab_guard.json"


class Guard:
    """Detects trouble on every rank in lockstep; see the module docstring. Build it with :func:`attach`.

    Args:
        accelerator: the prepared ``Accelerator``.
        model, optimizer, lr_scheduler: the objects ``accelerator.prepare`` returned (scheduler optional).
        config: :class:`~vidstab.GuardConfig` (default: all defaults).
        run_dir: the output folder (event logs and incident bundles under ``run_dir/vidstab``).
        model_spec: how to rebuild the model, written into incident bundles for ``vidstab replay``.
        seed: the run's seed, written into incident bundles.
        checkpoint_fn: ``() -> newest checkpoint path or None``, written into incident bundles.
        register_hooks: save/load the guard's state with ``accelerator.save_state``/``load_state``
            (``vidstab_guard.json``); False when the caller saves :meth:`state_dict` itself.
    """

    def __init__(
        self,
        accelerator: Any,
        model: torch.nn.Module,
        optimizer: Any,
        lr_scheduler: Any = None,
        config: GuardConfig | None = None,
        run_dir: str | Path = "output",
        *,
        model_spec: dict | None = None,
        seed: int | None = None,
        checkpoint_fn: Callable[[], str | None] | None = None,
        register_hooks: bool = True,
    ) -> None:
        self.accelerator, self.model, self.optimizer, self.lr_scheduler = accelerator, model, optimizer, lr_scheduler
        self.config = config or GuardConfig()
        self.run_dir = Path(run_dir)
        self.rank, self.world_size = accelerator.process_index, accelerator.num_processes
        check_world_size(self.world_size)  # unjoined processes would write each other's rank-0 event log
        register_exit_fence()  # a run with collectives must not abort at exit (vidstab/run/exit_fence.py); else a no-op
        self.params = list(model.parameters())  # same objects as model.parameters(): Accelerate's FSDP path compares
        self.engine = engine_for(accelerator, model, self.params)
        """What differs between DDP, FSDP2 and DeepSpeed (:mod:`vidstab.engines`): backward, norm, apply, skip."""
        self.sharded = self.engine.sharded  # FSDP2 shards, ZeRO partitions: their sums add over ranks
        self.recorder = StepRecorder(accelerator.device, self.config)
        self.layout = self.recorder.window.layout
        self.detectors: list[Detector] = build_detectors(self.config, self.world_size)
        self.control = OptimizerControl(accelerator, optimizer, lr_scheduler, self.params, self.config.param_norm_every,
                                        self.engine)
        self.reporter = Reporter(accelerator, model, optimizer, self.config, self.run_dir, rank=self.rank,
                                 world_size=self.world_size, sharded=self.sharded, model_spec=model_spec, seed=seed,
                                 checkpoint_fn=checkpoint_fn)
        self.lr = LRMultiplier(optimizer, lr_scheduler)
        self.rerun = StepRerun(accelerator, model, self.run_dir, self.events, sharded=self.sharded,
                               not_rerun=self.engine.not_rerun, peer_check=self.config.rerun_peer_check,
                               quarantine=self.config.quarantine_bad_samples)
        self.patches = UserLoopPatches(self)
        self._stop_requested = False
        self._oom_in_step = 0  # this step's optimizer ran out of memory: 1 untouched, 2 touched (vidstab.recovery.oom)
        self._clip_flags = CountWindow(self.config.clip_rate.window)  # clipped or not, last applied steps
        self.last_result: StepResult | None = None
        """The result of the last optimizer step (the unmodified loop's way to read it)."""
        # Persistent counters (state_dict).
        self.step_count = 0
        self.skipped_total = 0
        self.overflow_total = 0
        self._last_verdict = Verdict.OK
        self._params_finite = True
        self._last_anomaly_step = -(10**9)  # last step with a finding that makes checkpoints unhealthy
        self._hook_handles = []
        if register_hooks and hasattr(accelerator, "register_save_state_pre_hook"):
            self._hook_handles.append(accelerator.register_save_state_pre_hook(self._save_state_hook))
            self._hook_handles.append(accelerator.register_load_state_pre_hook(self._load_state_hook))
        self.auto_rollback = None
        """:class:`vidstab.recovery.auto_rollback.AutoRollback` when attached with ``rollback_every``: after each step."""
        self.rollback_not_kept = None
        """:class:`vidstab.recovery.auto_rollback.RollbackNotKept` when attached without ``rollback_every``: after each step."""
        self.console = None
        """:class:`vidstab.console.StepConsole` in the attached form: its lines on skips, bundles, rollbacks, the end."""
        self.numbering = StepNumbering()
        """The script's step and the trajectory's (they differ after in-place rollbacks): every stated step's producer."""
        self.events.numbering = self.numbering  # every event about the step being taken carries both where they differ
        self.events.log("start", self.step_count, world_size=self.world_size, config=self.config.to_dict(),
                        run=run_environment(accelerator), process_started=process_start_time())

    @property
    def checkpoint_fn(self) -> Callable[[], str | None] | None:
        """``() -> newest checkpoint path or None``, written into incident bundles (settable after attach)."""
        return self.reporter.checkpoint_fn

    @checkpoint_fn.setter
    def checkpoint_fn(self, fn: Callable[[], str | None] | None) -> None:
        self.reporter.checkpoint_fn = fn

    @property
    def original_backward(self) -> Callable:
        """The accelerator's ``backward`` before ``attach`` wrapped it (the engine's): the guard always calls it."""
        return self.engine.original_backward

    @original_backward.setter
    def original_backward(self, fn: Callable) -> None:
        self.engine.original_backward = fn

    @property
    def original_clip(self) -> Callable:
        """The accelerator's ``clip_grad_norm_`` before ``attach`` wrapped it (the engine's)."""
        return self.engine.original_clip

    @original_clip.setter
    def original_clip(self, fn: Callable) -> None:
        self.engine.original_clip = fn

    @property
    def own_state_hooks(self) -> list[Callable]:
        """The guard's own save/load-state hooks on the accelerator (the script's are the others)."""
        return [self._save_state_hook, self._load_state_hook]

    @property
    def events(self):
        """This rank's event log (:class:`vidstab.events.EventLog`)."""
        return self.reporter.events

    # ------------------------------------------------------------------ one step
    def backward(
        self,
        loss: torch.Tensor,
        batch: Mapping[str, Any] | None = None,
        sample_ids: Sequence[Any] | torch.Tensor | None = None,
        per_sample_loss: torch.Tensor | None = None,
        timesteps: torch.Tensor | None = None,
        error: BaseException | None = None,
        bucket: Any = None,
        **backward_kwargs: Any,
    ) -> None:
        """``accelerator.backward(loss)`` + the micro-step's on-device record (no host sync).

        ``batch``: the micro-batch tensors (kept by reference until the step, for incident capture; the input
        statistics cover its floating tensors, or ``GuardConfig.input_keys``); ``per_sample_loss``/``timesteps``
        ([B] each; timesteps default to ``batch["timesteps"]``) feed the per-timestep-bucket loss; ``error``: an
        exception the caller caught for this micro-step (the caller still passes a zero loss through the wrapped
        model so DDP collectives match) -> ROLLBACK; ``bucket``: the micro-batch's shape bucket (any hashable,
        e.g. ``(frames, height, width)``), compared only with steps of the same bucket; default: the shape of
        the batch's first floating tensor with the most dimensions.
        """
        if timesteps is None and batch is not None:
            timesteps = batch.get("timesteps")
        self.record_backward(loss, batch, batch, sample_ids, per_sample_loss, timesteps, error, bucket,
                             backward_kwargs)

    def record_backward(self, loss: torch.Tensor, inputs: Any, batch: Mapping[str, Any] | None, sample_ids: Any = None,
                        per_sample_loss: torch.Tensor | None = None, timesteps: torch.Tensor | None = None,
                        error: BaseException | None = None, bucket: Any = None,
                        backward_kwargs: Mapping[str, Any] | None = None) -> None:
        """The original ``accelerator.backward`` and the micro-step's record (``inputs``: what the input statistics
        cover; ``batch``: what an incident bundle holds)."""
        if self.accelerator.sync_gradients:
            self.recorder.clock.mark()  # DDP all-reduces inside this backward: the rank's own time ends here
        if error is None and self.patches.forward_oom is not None:  # attach: the model's forward ran out of memory
            error = self.patches.forward_oom.take()
        oom = self._out_of_memory(error, "forward", inputs, bucket) if is_oom(error) else 0
        error = None if oom else error
        try:
            self.engine.backward(loss, **(backward_kwargs or {}))  # under DeepSpeed without the engine step
        except Exception as exc:  # with one process an OOM here is a skipped step; with more, peers wait in DDP's
            if not is_oom(exc):   # all-reduce: the run stops (an elastic restart resumes it)
                raise
            oom = self._out_of_memory(exc, "backward", inputs, bucket)
            if self.world_size > 1:
                raise
        if self.config.enabled:
            self.recorder.record(loss, inputs, batch, sample_ids, per_sample_loss, timesteps, error,
                                 None if bucket is None else str(bucket), oom)

    def _out_of_memory(self, exc: BaseException, phase: str, inputs: Any, bucket: Any) -> int:
        """A micro-step ran out of memory in ``phase``: its memory released (the exception's frames, the gradients
        after a backward, the allocator's cache), an ``oom`` event; returns its micro-batch size (1: unknown)."""
        if phase == "backward":
            self.optimizer.zero_grad(set_to_none=True)
        release(exc, self.accelerator.device)
        data = signals.floating_inputs(inputs, self.config.input_keys)
        size = micro_batch_size(data) or 1
        self.events.log("oom", self.step_count, phase=phase, micro_batch=size, error=str(exc)[:500],
                        bucket=str(bucket) if bucket is not None else signals.shape_bucket(data))
        return size

    def _optimizer_oom(self, stats: StepStats) -> bool:
        """``optimizer.step()`` ran out of memory on this rank: the step is skipped here (its memory released), an
        ``oom`` event; every rank judges it at the next step (the ``oom`` detector: a rollback unless every rank
        failed before touching anything). Returns True (skipped)."""
        exc, touched = self.control.step_oom
        self.control.step_oom = None
        self._oom_in_step = 2 if touched else 1
        self.lr.restore_schedule()
        self.events.log("oom", stats.step, phase="optimizer", touched=touched, error=str(exc)[:500], bucket=stats.bucket)
        stop = self.engine.optimizer_oom_stop(stats.step, self.rank, exc)
        if stop is not None:  # the engine gathers the update from every rank: no lockstep skip, a stop
            self.events.flush()
            raise stop from None
        how = "after touching part of the weights or optimizer state" if touched else "before touching any weight"
        stats.findings.append(Finding("oom", Verdict.SKIP, f"out of memory inside optimizer.step() on rank {self.rank}, "
                                      f"{how}: the step is skipped here; every rank judges it at the next step",
                                      {"touched": float(touched)}, [self.rank]))
        # stats.verdict stays the one every rank took: the collectives of a judged skip (bundles, rerun) must not run
        return True

    def data_wait(self, seconds: float) -> None:
        """Seconds this rank waited for data in the current step (summed over its micro-steps): the step's
        ``metrics`` line carries them as ``data_seconds``, the goodput ledger's ``data`` bucket."""
        self.reporter.data_seconds += float(seconds)

    def step(self, max_grad_norm: float | None = 1.0) -> StepResult:
        """Judge and apply (or skip) the optimizer step; a cheap no-op on non-sync micro-steps."""
        if not self.accelerator.sync_gradients:
            return StepResult(self.step_count, applied=False, skipped=False, micro=True)
        if not self.config.enabled:
            self.control.plain_step(self.original_clip, self.params, max_grad_norm)
            self.step_count += 1
            return StepResult(self.step_count - 1, applied=True, skipped=False, micro=False)
        norm, max_grad_norm = self.engine.pre_step_norm(max_grad_norm)  # DeepSpeed's: its own gradient_clipping
        return self.guarded_step(norm, max_grad_norm, step_scheduler=True)

    def guarded_step(self, norm: torch.Tensor | None, max_grad_norm: float | None, step_scheduler: bool) -> StepResult:
        """One guarded optimizer step, given the global pre-clip norm (clipped in place already)."""
        step = self.step_count
        # 1. This rank's vector -> two fixed-size all_reduces -> ONE host read: the summary, the same on every rank.
        stop, self._stop_requested = self._stop_requested, False
        scale = self.control.loss_scale()
        local = self.recorder.pack(norm, stop=stop, param_sums=self.control.take_param_sums(), loss_scale=scale,
                                   rank=self.rank, lr=self.lr.figures())
        summary, mine = signals.reduce_and_read(local, self.layout, self.world_size)
        self.recorder.clock.restart()
        # 2. Statistics -> verdict. Every rank's vector is gathered only where the summary shows a bad rank or a
        # detector finds something (to name the ranks): never on a healthy step.
        rows = [mine] if self.world_size == 1 else None
        if rows is None and anomalous(summary, self.layout):
            rows = signals.gather_rows(local, self.world_size)
        stats = judge(self.detectors, self._stats(step, summary, rows, max_grad_norm, scale is not None))
        if rows is None and stats.findings:
            rows = signals.gather_rows(local, self.world_size)
            stats = judge(self.detectors, self._stats(step, summary, rows, max_grad_norm, scale is not None))
        # 3. Apply or skip: nothing else runs between the read and the optimizer step.
        skipped = judged_skip = stats.verdict >= Verdict.SKIP
        measure = self.control.measures(step) and stats.verdict < Verdict.ROLLBACK
        if skipped:
            self.control.skip(measure)
            self.lr.restore_schedule()  # the held scheduler would leave a bad LR in param_groups (vidstab.recovery.lr)
        else:
            stats.applied = self.control.apply(measure, step_scheduler)
            skipped = self.control.step_oom is not None and self._optimizer_oom(stats)
        # 4. After the step: counters and detector statistics (they absorb applied steps only), then evidence.
        self._count(stats, skipped)
        absorb(self.detectors, stats)
        result = self.reporter.report(
            stats, mine, self.layout, clip_rate=self._clip_flags.rate(), skipped_total=self.skipped_total,
            overflow_total=self.overflow_total, detectors=self.detectors, stop=stats_stop(summary, self.layout),
            skipped=skipped, micro_batches=self.recorder.micro_batches, window=self.recorder.window)
        if judged_skip and self.config.rerun_suspect_steps:  # every rank together: data, numerics or a flaky device?
            result.rerun = self.rerun.check(stats, result.incidents, self.recorder.micro_batches,
                                            self.reporter.replay_fn, dict)
        self.recorder.reset()
        self.recorder.window.oom_in_step, self._oom_in_step = self._oom_in_step, 0  # judged by every rank next step
        self.step_count += 1
        self.last_result = result
        return result

    def _stats(self, step: int, summary: list[float], rows: list[list[float]] | None, max_grad_norm: float | None,
               scale_known: bool) -> StepStats:
        return build_stats(step, summary, self.layout, rows=rows, bucket=self.recorder.bucket_name,
                           max_grad_norm=max_grad_norm, sharded=self.sharded, scale_known=scale_known,
                           has_scaler=getattr(self.accelerator, "scaler", None) is not None)

    def _count(self, s: StepStats, skipped: bool) -> None:
        """The counters and the health of a judged step, once it is applied or skipped."""
        if s.applied:
            self._clip_flags.push(s.clipped)
        self.skipped_total += skipped
        self.overflow_total += s.overflow
        # A skip of bad input data (finite weights) says nothing about the model's health.
        bad_data_only = bad_input_only(s, self.config.health_ignore)
        self._last_verdict = Verdict.OK if bad_data_only else s.verdict
        if not bad_data_only and any(f.verdict >= Verdict.WARN and f.detector not in self.config.health_ignore
                                     for f in s.findings):
            self._last_anomaly_step = s.step
        if s.param_norm is not None:
            self._params_finite = math.isfinite(s.param_norm)

    # ------------------------------------------------------------------ controls
    def request_stop(self) -> None:
        """Ask every rank to stop at the next optimizer step (safe from a signal handler: sets a flag)."""
        self._stop_requested = True

    def track_samples(self, loader: Any) -> Any:
        """``loader = guard.track_samples(loader)`` (the attached form's one line for data): the loop's batches name
        their samples in incident bundles and the rerun, and quarantined samples are skipped in later epochs and
        after a resume (:mod:`vidstab.guard.loader`)."""
        from .loader import TrackedLoader

        return TrackedLoader(loader, self)

    def set_replay_fn(self, fn: Callable[[dict], torch.Tensor] | None) -> None:
        """``fn(batch) -> loss`` used to replay a bad micro-batch for non-finite localisation."""
        self.reporter.replay_fn = fn

    @property
    def healthy(self) -> bool:
        """Whether a checkpoint taken now may serve as a rollback target: the last step was neither skipped
        nor rolled back, the last measured parameter norm was finite, and no detector (``health_ignore``
        aside) raised a finding in the last ``health_window`` steps."""
        quiet = self.step_count - 1 - self._last_anomaly_step >= self.config.health_window
        return self._last_verdict <= Verdict.WARN and self._params_finite and quiet

    @property
    def global_step(self) -> int:
        """The optimizer step counter used in logs (alias of ``step_count``; settable after resume)."""
        return self.step_count

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.step_count = int(value)

    # ------------------------------------------------------------------ learning rate (vidstab.recovery.lr)
    @property
    def lr_multiplier(self) -> float:
        """The persistent LR multiplier (recovery's back-off) over the base LRs seen at attach."""
        return self.lr.multiplier

    @lr_multiplier.setter
    def lr_multiplier(self, value: float) -> None:
        self.lr.multiplier = float(value)

    def set_lr_multiplier(self, multiplier: float) -> None:
        """Make the LR multiplier ``multiplier`` (recovery's back-off and return): the param groups' LRs and the
        scheduler's ``base_lrs`` follow it."""
        self.lr.set(multiplier)

    def scale_lr(self, factor: float) -> None:
        """Multiply the LR persistently: param-group lrs now, and the scheduler's ``base_lrs`` so the
        factor survives ``lr_scheduler.step()`` (LambdaLR & co. recompute ``base_lr * f(step)``)."""
        self.lr.scale(factor)

    def reapply_lr_multiplier(self) -> None:
        """Make the optimizer/scheduler reflect ``lr_multiplier`` after they were (re)loaded.

        The guard remembers the un-multiplied base LRs (``state_dict()["base_lrs"]``). Targets are
        ``base * lr_multiplier``; each param group's lr is rescaled by ``target / current base``.
        Idempotent: a scheduler restored from a checkpoint saved with the multiplier in effect already
        matches (no change); a freshly built one gets the multiplier applied.
        """
        self.lr.reapply()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """JSON-serialisable state: counters, LR multiplier, detector statistics."""
        return {
            "schema": 1,
            "step_count": self.step_count,
            "skipped_total": self.skipped_total,
            "overflow_total": self.overflow_total,
            "incidents_written": self.reporter.incidents_written,
            "localized": self.reporter.localized,
            "lr_multiplier": self.lr_multiplier,
            "base_lrs": list(self.lr.base_lrs),
            "clip_flags": [int(c) for c in self._clip_flags.values],
            "last_anomaly_step": self._last_anomaly_step,
            "detectors": {d.name: d.state_dict() for d in self.detectors},
        }

    def load_state_dict(self, d: Mapping[str, Any], source: str = "the guard's state") -> None:
        """Restore :meth:`state_dict` (detectors missing from ``d`` keep their fresh state). Every field is checked
        first (:func:`~vidstab.guard.saved_state.checked_guard_state`): a malformed one is a
        :class:`~vidstab.CheckpointError` naming ``source`` (the file it came from) and the field; nothing changed."""
        d = checked_guard_state(d, source)
        self._load_detectors(d["detectors"], source)  # first: a detector's malformed state leaves everything as it was
        self.step_count = d["step_count"]
        # Event counters never go backward: an in-process rollback to an older checkpoint keeps what this
        # run already skipped and wrote (the incident disk budget included); a fresh process takes the file's.
        self.skipped_total = max(self.skipped_total, d["skipped_total"])
        self.overflow_total = max(self.overflow_total, d["overflow_total"])
        rep = self.reporter
        rep.incidents_written = max(rep.incidents_written, d["incidents_written"])
        rep.localized = rep.localized or d["localized"]
        self.lr_multiplier = d["lr_multiplier"]
        if d["base_lrs"]:
            self.lr.base_lrs = d["base_lrs"]
        self._clip_flags = CountWindow(self.config.clip_rate.window, (bool(c) for c in d["clip_flags"]))
        self._last_anomaly_step = d["last_anomaly_step"]
        # Anything measured on the weights before the load (a rollback) must not be judged after it.
        self.control.take_param_sums()
        self.recorder.reset()
        self._last_verdict, self._params_finite = Verdict.OK, True

    def _load_detectors(self, states: Mapping[str, Any], source: str) -> None:
        """Each detector's saved state, or none: one that does not fit its detector puts every detector back and is
        a :class:`~vidstab.CheckpointError` naming ``source`` and the detector."""
        before = {det.name: det.state_dict() for det in self.detectors}
        for det in self.detectors:
            if det.name not in states:
                continue
            try:
                det.load_state_dict(states[det.name])
            except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as e:
                for d in self.detectors:
                    d.load_state_dict(before[d.name])
                raise CheckpointError(f"{source}: unreadable guard state (detector {det.name!r}: "
                                      f"{type(e).__name__}: {str(e)[:80]})") from None

    def checked_state(self, d: Any, source: str) -> dict:
        """``d`` checked as :meth:`load_state_dict` checks it (the checkpoint manager's decode: a malformed guard state
        makes its checkpoint invalid before anything is applied)."""
        return checked_guard_state(d, source)

    # The steps in-place rollbacks undid travel with the script's own checkpoint (a relaunch numbers on as the run did),
    # never in vidstab's rollback checkpoints: loading one must not wind the numbering back (auto_rollback.py sets it).
    def _save_state_hook(self, models: Any, weights: Any, output_dir: str) -> None:
        if self.accelerator.is_main_process:
            write_json_atomic(Path(output_dir) / GUARD_STATE_FILE, dict(self.state_dict(), steps_lost=self.numbering.lost))

    def _load_state_hook(self, models: Any, input_dir: str) -> None:
        try:
            self._resume_from(Path(input_dir))
        except CheckpointError as e:
            if self.console is None:  # a Guard built by hand, not attach(): the script's own handling decides
                raise
            # The attached form: one message and an exit code, as its aborts (before Accelerate loads anything).
            self.events.log("stop", self.step_count, message=str(e), reason="resume_refused",
                            exit_code=RESUME_REFUSED_EXIT_CODE)
            self.events.flush()
            if self.accelerator.is_main_process:
                print(f"vidstab: not resuming: {e}", file=sys.stderr, flush=True)
            raise ResumeRefused(str(e)) from None

    def _resume_from(self, folder: Path) -> None:
        """The guard's state from the script's ``save_state`` folder, once it is known that the resume can be right."""
        caveat = self.engine.save_state_caveat()
        if caveat is not None and self.world_size > 1:
            raise CheckpointError(f"{folder}: {caveat}")
        path = folder / GUARD_STATE_FILE
        if path.exists():
            try:
                state = checked_guard_state(read_json_file(path, GUARD_STATE_FILE), str(path))
            except (OSError, ValueError) as e:  # too large, not UTF-8 JSON: what a damaged manifest is told
                why = f"not JSON: {e}" if isinstance(e, json.JSONDecodeError) else str(e)
                raise CheckpointError(f"{path}: unreadable guard state ({why})") from None
            self.load_state_dict(state, str(path))
            self.numbering.lost = state["steps_lost"]
            self.events.log("resume", self.step_count, path=str(path), lr_multiplier=self.lr_multiplier,
                            **self.numbering.fields(self.step_count))

    def close(self) -> None:
        """Let the last automatic rollback checkpoint (``rollback_every``) finish writing on this rank, log
        ``stop`` (``reason="closed"``: the report reads the run as finished), detach (:meth:`detach`) and close
        the event log."""
        if self.auto_rollback is not None:
            self.auto_rollback.close()
        if self.rollback_not_kept is not None:
            self.rollback_not_kept.close()
        if self.console is not None:
            self.console.summary()
        if not self.events.closed:
            self.events.log("stop", self.step_count, reason="closed")
        self.detach()
        self.events.close()

    def wrap(self) -> "Guard":
        """Guard the user's own calls on these instances (what :func:`attach` does); undone by :meth:`detach`."""
        if not self.patches.patches:
            self.patches.install()
        return self

    def detach(self) -> None:
        """Undo :meth:`wrap` and the save/load hooks: the instances behave as before :func:`attach`.
        Idempotent; the event log is flushed (``close`` closes it)."""
        self.patches.remove()
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        self.events.flush()


def stats_stop(summary: Sequence[float], layout: signals.Layout) -> bool:
    """Whether some rank asked every rank to stop at this step (``guard.request_stop``)."""
    return summary[layout.stop] > 0

def attach(accelerator: Any, model: torch.nn.Module, optimizer: Any, lr_scheduler: Any = None,
           *guard_args: Any, rollback_every: int | str | None = None, recovery: Any = None,
           rollback_memory_budget_bytes: int | None = None, **guard_kwargs: Any) -> Guard:
    """Attach a :class:`Guard` to prepared Accelerate objects and guard the loop as it is.

    Takes exactly :class:`Guard`'s arguments (``config``, ``run_dir``, ``model_spec``, ``seed``,
    ``checkpoint_fn``, ``register_hooks``: see there) and forwards them unchanged.

    After this one line the user's own ``accelerator.backward(loss)``, ``accelerator.clip_grad_norm_``,
    ``optimizer.step()``, ``lr_scheduler.step()`` and ``optimizer.zero_grad()`` are guarded (the instances
    are wrapped, not the classes; ``guard.detach()`` undoes it); ``guard.backward``/``guard.step`` remain
    for loops that want the batch, sample ids and per-sample losses in the evidence. The guard's state
    travels with ``accelerator.save_state``/``load_state`` as ``vidstab_guard.json``.

    ``rollback_every=N``: also roll back automatically, in place, inside the loop's own ``optimizer.step()``,
    to vidstab's own rollback checkpoints saved every ``N`` optimizer steps (:mod:`vidstab.recovery.auto_rollback`);
    ``rollback_every="auto"``: at the interval the run's goodput ledger calls for (:mod:`vidstab.run.checkpoint_interval`).
    ``recovery``: its retry budget, LR back-off and ``reset`` of the state carried over from an earlier launch
    (:class:`~vidstab.RecoveryConfig`; with ``rollback_every`` only). ``rollback_memory_budget_bytes``: the host
    memory per process for the copy of the newest healthy rollback checkpoint that in-place rollbacks restore from
    (``CheckpointConfig.rollback_memory_budget_bytes``: None the default share, 0 off: rollbacks read the files).

    Attaching again to the same optimizer returns the guard already attached (until it is detached).
    """
    if (recovery is not None or rollback_memory_budget_bytes is not None) and not rollback_every:
        given = "recovery=RecoveryConfig(...)" if recovery is not None else "rollback_memory_budget_bytes=..."
        raise ValueError(f"attach(..., {given}) configures the automatic rollback: pass rollback_every=N with it (the "
                         "explicit form passes it to vidstab.Recovery or CheckpointConfig)")
    existing = getattr(optimizer, ATTACHED_ATTR, None)
    if isinstance(existing, Guard) and existing.accelerator is accelerator and existing.model is model:
        return existing
    if isinstance(existing, Guard):
        existing.detach()
    guard = Guard(accelerator, model, optimizer, lr_scheduler, *guard_args, **guard_kwargs).wrap()
    from ..console import StepConsole

    guard.console = StepConsole(guard)
    rep = guard.reporter
    if rep.model_spec is None and guard.config.capture_incidents:  # a diffusers model: replay needs no user code
        from ..evidence.replay_record import OutputGradients, model_spec_of

        rep.model_spec = model_spec_of(accelerator.unwrap_model(model))
        if rep.model_spec is not None:
            rep.output_gradients = OutputGradients(model, accelerator, guard.patches.named_inputs)
    guard.rerun.attached(rep.output_gradients, guard.patches.forward_names)  # re-runs with no replay function
    if rollback_every:
        from ..recovery.auto_rollback import AutoRollback

        guard.auto_rollback = AutoRollback(guard, rollback_every, recovery=recovery,
                                           memory_budget_bytes=rollback_memory_budget_bytes)
    from ..recovery.script_state import hold_emas

    emas = hold_emas(guard)  # the script's EMAs vidstab can see take no skipped step
    if not rollback_every:
        from ..recovery.auto_rollback import RollbackNotKept

        guard.rollback_not_kept = RollbackNotKept(guard, emas)
    return guard


# help(attach) and IDEs show Guard's own parameters: one signature, declared once (on Guard.__init__).
_guard_signature = inspect.signature(Guard)
attach.__signature__ = _guard_signature.replace(return_annotation="Guard", parameters=[
    *_guard_signature.parameters.values(),
    inspect.Parameter("rollback_every", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="int | str | None"),
    inspect.Parameter("recovery", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="RecoveryConfig | None")])
