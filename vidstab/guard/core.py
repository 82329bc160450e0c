"""The guard: the orchestrator of one optimizer step, in lockstep on every rank.

Two ways in, one step. ``vidstab.attach(accelerator, model, optimizer, lr_scheduler, run_dir=...)``
wraps the *instances* it is given, so a user's unmodified loop is guarded: ``accelerator.backward(loss)``
records the loss (and, through a forward pre-hook on the model, the model's floating inputs) on the
device; ``accelerator.clip_grad_norm_`` hands over the global pre-clip norm; ``optimizer.step()`` runs the
guarded step below; ``lr_scheduler.step()`` is held after a skipped step; ``optimizer.zero_grad()`` is the
user's own. ``guard.backward`` / ``guard.step`` do the same explicitly, with the batch, sample ids and
per-sample losses as evidence. ``guard.detach()`` undoes the wrapping.

The guarded step, on the last micro-step of an accumulation window (see :meth:`Guard._guarded_step`):

1. the global pre-clip gradient norm (``accelerator.clip_grad_norm_``; FSDP2 DTensor made full);
2. one packed row per rank -> one ``accelerator.gather`` -> one host read of a ``[world, k]`` table;
3. the detectors on that table: the same verdict on every rank (a step their promises clear is not judged:
   applied at once, on every rank alike, its statistics, updates and metrics line made later with the next
   ones, :mod:`vidstab.guard.healthy`);
4. apply (``optimizer.step`` + ``lr_scheduler.step``) or skip (grads to None, scheduler held,
   ``optimizer_step_was_skipped`` true) -- nothing else runs between the read and the optimizer step;
5. after the step is enqueued: detector statistics, events, tracker metrics, incident bundles on the
   offending ranks, rollback request.

Limits: under DeepSpeed the engine steps inside ``accelerator.backward`` and ``clip_grad_norm_``
returns the norm of a step already applied (or ``None``): vidstab then observes and reports, but a
SKIP cannot undo that step. Under fp16, a non-finite gradient with finite losses everywhere is a normal
GradScaler overflow: ``optimizer.step()`` is still called (the scaler skips and lowers the scale).
"""

from __future__ import annotations

import inspect
import json
import math
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from .. import signals
from ..atomic import write_json_atomic
from ..config import GuardConfig
from ..detectors import (Detector, DetectorPlan, StepStats, Verdict, absorb, build_detectors, catch_up, judge,
                         absorb_batch)
from ..detectors.windows import CountWindow
from ..elastic import check_world_size
from ..events import EventLog
from ..exit_fence import register_exit_fence
from ..lr import LRMultiplier
from ..run_record import run_environment
from .healthy import GRAD_NORM, LOSS, MAX_QUEUED, PARAM_NORM, QueuedStep, host_row_values, queued_stats, table_values
from .param_probe import ParamProbe
from .reporting import GuardReporting
from .result import StepResult
from .stats import bad_input_only, build_stats
from .wrapping import ATTACHED_ATTR, UserLoopWrapping

GUARD_STATE_FILE = "vidstab_guard.json"


class Guard(UserLoopWrapping, GuardReporting):
    """Detects trouble on every rank in lockstep; see the module docstring. Build it with :func:`attach`.

    The user-call patches live in :mod:`vidstab.guard.wrapping`, the statistics of a step in
    :mod:`vidstab.guard.stats`, the evidence in :mod:`vidstab.guard.reporting`, the LR multiplier in
    :mod:`vidstab.lr`; this class holds the state and the data flow of one step.

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
        self.accelerator = accelerator
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.config = config or GuardConfig()
        self.run_dir = Path(run_dir)
        self.model_spec, self.seed, self.checkpoint_fn = model_spec, seed, checkpoint_fn
        self.rank, self.world_size = accelerator.process_index, accelerator.num_processes
        check_world_size(self.world_size)  # unjoined processes would write each other's rank-0 event log
        self.events = EventLog(self.run_dir, self.rank)
        register_exit_fence()  # a run with collectives must not abort at exit (vidstab/exit_fence.py); else a no-op
        self._detectors = build_detectors(self.config, self.world_size)
        # Who observes, absorbs and publishes, read once (vidstab.detectors.DetectorPlan): the list is fixed
        # from here on; a user's own detector is added with vidstab.register_detector before the guard is built.
        # Healthy steps' updates of steady promises wait and are made several at once (detectors/screen.py);
        # the event log completes their metrics lines first (their thresholds) when it flushes.
        self._plan = DetectorPlan.of(self._detectors, defer=True)
        # Healthy steps the promises clear are applied at once and absorbed later (vidstab/guard/healthy.py),
        # on every rank alike: the gathered table they are cleared on is the same everywhere.
        self._queued: list[QueuedStep] = []
        self._batchable = self._plan.screen.batchable
        self.steps_batched = 0
        """Optimizer steps of this process applied at once and absorbed later, with others (not saved)."""
        self.events.before_flush = _weak_catch_up(self)
        self.window = signals.Window(
            accelerator.device, self.config.timestep_buckets, self.config.num_train_timesteps, self.config.input_keys
        )
        self.clock = signals.StepClock(accelerator.device)
        self._params = list(model.parameters())  # same objects as model.parameters(): Accelerate's FSDP path compares
        self._param_probe = ParamProbe([p for p in self._params if p.requires_grad])
        self._sharded = str(getattr(accelerator, "distributed_type", "")).endswith("FSDP") or any(
            signals.is_dtensor(p) for p in self._params
        )
        # DeepSpeed steps inside accelerator.backward: the guard can only observe and report (module docstring).
        self._observe_only = str(getattr(accelerator, "distributed_type", "")).endswith("DEEPSPEED")
        # (batch, sample_ids, error) per micro-step; the attached loop's batch is the model's (args, kwargs)
        self._refs: list[tuple[Mapping[str, Any] | tuple | None, Any, Any]] = []
        self._pending: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)  # (param_sq, update_sq)
        self._stop_requested = False
        self._replay_fn: Callable[[dict], torch.Tensor] | None = None
        self._clip_flags = CountWindow(self.config.clip_rate.window)  # clipped or not, last applied steps
        # The methods the guard itself calls: the originals, also once the instances are wrapped (attach).
        self._backward = accelerator.backward
        self._clip = accelerator.clip_grad_norm_
        self._optimizer_step = optimizer.step
        self._scheduler_step = lr_scheduler.step if lr_scheduler is not None else None
        self._patches: list[tuple[Any, str, bool, Any]] = []
        self._handles: list[Any] = []
        self._user_norm: tuple[torch.Tensor | None, float | None] | None = None  # from the user's clip_grad_norm_
        self._model_inputs: tuple[tuple, dict] | None = None  # (args, kwargs) of the latest forward
        self._held: tuple | None = None  # the window's last micro-step, recorded by its optimizer step (_hold)
        self._forward_names: list[str] = []
        self._hold_scheduler = False
        self._scale_known = False
        self._last_result: StepResult | tuple | None = None  # a tuple: a healthy step's, made on first read
        # Persistent counters (state_dict).
        self.step_count = 0
        self.skipped_total = 0
        self.overflow_total = 0
        self.incidents_written = 0
        self.localized = False
        self._lr = LRMultiplier(optimizer, lr_scheduler)  # lr_multiplier and the base LRs at attach
        self._last_verdict = Verdict.OK
        self._params_finite = True
        self._last_anomaly_step = -(10**9)  # last step with a finding that makes checkpoints unhealthy
        if register_hooks and hasattr(accelerator, "register_save_state_pre_hook"):
            self._handles.append(accelerator.register_save_state_pre_hook(self._save_state_hook))
            self._handles.append(accelerator.register_load_state_pre_hook(self._load_state_hook))
        self.events.log("start", self.step_count, world_size=self.world_size, config=self.config.to_dict(),
                        run=run_environment(accelerator))

    # ------------------------------------------------------------------ hot path
    def backward(
        self,
        loss: torch.Tensor,
        batch: Mapping[str, Any] | None = None,
        sample_ids: Sequence[Any] | torch.Tensor | None = None,
        per_sample_loss: torch.Tensor | None = None,
        timesteps: torch.Tensor | None = None,
        error: BaseException | None = None,
        **backward_kwargs: Any,
    ) -> None:
        """``accelerator.backward(loss)`` + on-device flags of this micro-step (no host sync).

        ``batch``: the micro-batch tensors (kept by reference until the step, for incident capture; the
        input statistics cover its floating tensors, or ``GuardConfig.input_keys``);
        ``per_sample_loss``/``timesteps`` ([B] each; timesteps default to ``batch["timesteps"]``) feed the
        per-timestep-bucket loss; ``error``: an exception the caller caught for this micro-step (the caller
        still passes a zero loss through the wrapped model so DDP collectives match) -> ROLLBACK.
        """
        last = self.accelerator.sync_gradients  # the window's last micro-step: the optimizer step follows
        if last:
            self.clock.mark()
        self._backward(loss, **backward_kwargs)
        self._model_inputs = None
        if not self.config.enabled:
            return
        if timesteps is None and batch is not None:
            timesteps = batch.get("timesteps")
        # References only (no copies), dropped after the step; they keep the window's batches alive until then.
        self._refs.append((batch if self.config.capture_incidents else None, sample_ids, error))
        self._hold((loss, batch, per_sample_loss, timesteps, error is not None, None), last)

    def _hold(self, micro_step: tuple, last: bool) -> None:
        """Record one micro-step in the window (``micro_step``: :meth:`Window.record`'s arguments, then the model's
        ``(args, kwargs)`` of the attached loop, whose tensors are picked when it is recorded), or hold the
        window's ``last`` one until its optimizer step: recorded there (:meth:`_record_held`), right before the
        packing, its input reductions next to the packing's stack and after the clip, whose kernels they share.
        Right after a backward the CPU's caches are cold and the three reductions cost about 6x what they cost
        warm (``benchmarks/RESULTS.md``, "Reductions where the caches favour them", "The last micro-step
        recorded by its optimizer step"). Only the last one waits: an earlier micro-step's input buffer may be
        refilled in place by the next one; the last one's holds its values until the optimizer step (as the
        incident capture already requires). A held micro-step whose optimizer step never came (the loop went on
        to another backward) is recorded first, as any other."""
        if self._held is not None:
            self._record_held()
        self._held = micro_step
        if not last:
            self._record_held()

    def _record_held(self) -> None:
        """The held micro-step (:meth:`_hold`) into the window."""
        (loss, batch, per_sample_loss, timesteps, error, model_inputs), self._held = self._held, None
        if model_inputs is not None:
            batch = self._model_data(model_inputs)
        self.window.record(loss, batch, per_sample_loss, timesteps, error)

    def step(self, max_grad_norm: float | None = 1.0) -> StepResult:
        """Judge and apply (or skip) the optimizer step; a cheap no-op on non-sync micro-steps."""
        if not self.accelerator.sync_gradients:
            return StepResult(self.step_count, applied=False, skipped=False, micro=True)
        if not self.config.enabled:
            return self._plain_step(max_grad_norm)
        norm = signals.global_grad_norm(self.accelerator, self._params, max_grad_norm, clip=self._clip)
        return self._guarded_step(norm, max_grad_norm, step_scheduler=True)

    def _guarded_step(self, norm: torch.Tensor | None, max_grad_norm: float | None, step_scheduler: bool) -> StepResult | None:
        """Steps 2-5 of the module docstring, given the global pre-clip norm (clipped in place already); the
        result (None for a healthy step of the unmodified loop: ``last_result`` makes it when read)."""
        step = self.step_count
        if self._held is not None:  # the window's last micro-step (_hold)
            self._record_held()
        # 2. One row per rank -> one gather -> one host read.
        stop, self._stop_requested = self._stop_requested, False
        scale = self._loss_scale_tensor() if getattr(self.accelerator, "scaler", None) is not None else None
        self._scale_known = scale is not None
        # One process gathers nothing: its row is finished on the host after the read (Window.pack_for_host).
        pack = self.window.pack if self.world_size > 1 else self.window.pack_for_host
        row = pack(norm, stop, *self._pending, scale, self.clock.seconds())
        self._pending = (None, None)
        table = signals.gather_and_read(self.accelerator, row)
        self.clock.restart()
        lr = self._lr.figures()
        # 3. Same table on every rank -> same verdict on every rank. A step the detectors' promises clear has
        # nothing to judge: applied now, absorbed and reported with the next ones (vidstab/guard/healthy.py).
        if (self._batchable and not self._scale_known and self._plan.screen.may_admit(step, len(self._queued))
                and not self._tracked(step)):
            values = (host_row_values(table, self.window.layout, max_grad_norm, *lr) if self.world_size == 1 else
                      table_values(table, self.window.layout, max_grad_norm, *lr, self._sharded))
            if values is not None:
                room = self._plan.screen.clears(values, len(self._queued))  # (may_admit said yes)
                if room >= 0:
                    return self._healthy_step(step, table, values, max_grad_norm, lr, step_scheduler, room)
        waiting = self._absorb_queued() if self._queued else ()  # the detectors judge from their current state
        stats = self._build_stats(step, table, max_grad_norm, norm is not None, lr)
        judge(self._plan, stats)
        # 4. Apply or skip (nothing else before the optimizer step).
        stats.applied = self._apply(stats.verdict, self._measure_params(step) and stats.verdict < Verdict.ROLLBACK,
                                    step_scheduler)
        self._count(stats)
        # 5. After the step is enqueued: statistics absorb only applied steps; evidence.
        # A skip of bad input data (finite weights) says nothing about the model's health.
        bad_data_only = bad_input_only(stats, self.config.health_ignore)
        self._last_verdict = Verdict.OK if bad_data_only else stats.verdict
        if not bad_data_only and stats.findings and any(f.verdict >= Verdict.WARN and f.detector not in self.config.health_ignore
                                                        for f in stats.findings):
            self._last_anomaly_step = step
        if stats.param_norm is not None:
            self._params_finite = math.isfinite(stats.param_norm)
        absorb(self._plan, stats, defer=not self._tracked(step))  # a tracker takes the thresholds now
        if waiting:
            self._log_queued(waiting)
        result = self._report(stats, table, stop=signals.stop_requested(table))
        self._refs.clear()
        self.window.reset()
        self._user_norm = self._model_inputs = None
        self.step_count += 1
        self._last_result = result
        return result

    # ------------------------------------------------------------------ step parts
    def _build_stats(self, step: int, table: list[list[float]], max_grad_norm: float | None, norm_known: bool,
                     lr: tuple[float | None, float | None, float | None] | None = None) -> StepStats:
        """Step 3's input from the gathered table (:func:`vidstab.guard.stats.build_stats`); ``lr``: the step's
        ``(lr, lr_peak, lr_scheduled)`` (default: as they are now)."""
        if lr is None:
            lr = self._lr.figures()
        return build_stats(
            step, table, self.window.layout, max_grad_norm=max_grad_norm, norm_known=norm_known,
            sharded=self._sharded, scale_known=self._scale_known,
            has_scaler=getattr(self.accelerator, "scaler", None) is not None,
            lr=lr[0], lr_peak=lr[1], lr_scheduled=lr[2],
        )

    def _healthy_step(self, step: int, table: list[list[float]], values: tuple, max_grad_norm: float | None,
                      lr: tuple, step_scheduler: bool, room: int) -> StepResult | None:
        """A step the promises cleared (``room``: how many more they cover): applied now, queued for later.
        Its result when ``guard.step`` asked (``step_scheduler``), else None (made when ``last_result`` is read)."""
        applied = self._apply(Verdict.OK, self._measure_params(step), step_scheduler)
        self._last_verdict = Verdict.OK
        if values[PARAM_NORM] is not None:
            self._params_finite = True  # admitted: finite
        # tuple.__new__: a NamedTuple's own __new__ is a Python function, one more cold call per step
        self._queued.append(_new_tuple(QueuedStep, (step, table, max_grad_norm, *lr, applied, time.time(), values)))
        self.steps_batched += 1
        self._refs.clear()
        self.window.reset()
        self._user_norm = self._model_inputs = None
        self.step_count += 1
        # The unmodified loop discards optimizer.step()'s value: its result is made when last_result is read.
        self._last_result = (step, applied, values[GRAD_NORM], values[LOSS])
        if room == 0 or len(self._queued) >= MAX_QUEUED:  # the next step needs these updates made
            self._catch_up()
        return self.last_result if step_scheduler else None  # guard.step returns it

    def _absorb_queued(self) -> list[tuple]:
        """The queued healthy steps' statistics and detector updates, in step order, as their own steps would
        have made them (:func:`vidstab.detectors.absorb_batch`); returns what their metrics lines need
        (:meth:`_log_queued`)."""
        queue, self._queued = self._queued, []
        steps, rates = [], []
        one, layout = self.world_size == 1, self.window.layout
        for q in queue:
            s = queued_stats(q, layout) if one else None
            if s is None:
                s = self._build_stats(q.step, q.table, q.max_grad_norm, True, (q.lr, q.lr_peak, q.lr_scheduled))
            s.applied = q.applied
            if q.applied:
                self._clip_flags.push(s.clipped)
            rates.append(self._clip_flags.rate())
            steps.append(s)
        thresholds = absorb_batch(self._plan, steps)
        counts = self.skipped_total, self.overflow_total  # no queued step skips or overflows
        return [(q, s, rate, *counts, t) for q, s, rate, t in zip(queue, steps, rates, thresholds)]

    def _log_queued(self, done: list[tuple]) -> None:
        """The metrics lines of the steps :meth:`_absorb_queued` absorbed, as their own steps would have written them."""
        for q, s, clip_rate, skipped, overflow, thresholds in done:
            metrics = self._metrics(s, q.table[self.rank], clip_rate, skipped, overflow)
            metrics.update(thresholds)
            self.events.log_metrics(q.step, metrics, when=q.time)

    def _catch_up(self) -> None:
        """Everything held back made now, in step order: the queued healthy steps (absorbed, then their lines),
        then the deferring plan's waiting updates. Before anything reads the detectors, the counters or the log."""
        if self._queued:
            self._log_queued(self._absorb_queued())
        catch_up(self._plan)

    def _measure_params(self, step: int) -> bool:
        every = self.config.param_norm_every
        return every > 0 and step % every == 0 and bool(self._param_probe)

    def _apply(self, verdict: Verdict, measure: bool, step_scheduler: bool) -> bool:
        """Step or skip as ``verdict`` says; on measured steps leave (param_sq, update_sq) on device for the next read.

        ``step_scheduler``: the explicit ``guard.step`` steps the scheduler and zeroes the gradients; in the
        user's own loop (``step_scheduler=False``) the user's ``lr_scheduler.step()``/``zero_grad()`` follow.
        """
        opt = self.optimizer
        if verdict <= Verdict.WARN or self._observe_only:
            self._hold_scheduler = False
            before = self._param_probe.snapshot() if measure else None
            _set_skipped(opt, False)  # Accelerate only resets this flag under a GradScaler
            self._optimizer_step()  # under fp16 the scaler may still skip (overflow): read back below
            applied = not bool(getattr(opt, "step_was_skipped", False))
            if step_scheduler:
                if applied and self._scheduler_step is not None:
                    self._scheduler_step()
                opt.zero_grad(set_to_none=True)
        else:
            before = None
            self._hold_scheduler = True
            opt.zero_grad(set_to_none=True)  # poisoned grads must never be used
            _set_skipped(opt, True)  # -> accelerator.optimizer_step_was_skipped
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:  # clip_grad_norm_ unscaled: close the scaler's step without stepping
                try:
                    scaler.update()
                except (AssertionError, RuntimeError):
                    pass
            applied = False
        if measure:
            self._pending = self._param_probe.sums(before)
        return applied

    def _count(self, s: StepStats) -> None:
        """The counters of a judged step, once it is applied or skipped (a queued healthy step's clip flag is
        pushed when it is absorbed: :meth:`_absorb_queued`)."""
        if s.applied:
            self._clip_flags.push(s.clipped)
        if s.verdict >= Verdict.SKIP and not self._observe_only:
            self.skipped_total += 1
        if s.overflow:
            self.overflow_total += 1

    # ------------------------------------------------------------------ controls
    @property
    def last_result(self) -> StepResult | None:
        """The result of the last optimizer step (the unmodified loop's way to read it)."""
        last = self._last_result
        if type(last) is tuple:
            step, applied, grad_norm, loss = last
            last = self._last_result = StepResult(step, applied=applied, skipped=False, micro=False,
                                                  grad_norm=grad_norm, loss=loss)
        return last

    @property
    def detectors(self) -> list[Detector]:
        """The guard's detectors in evaluation order, with every update they owe made (the guard makes a
        healthy step's updates of some detectors later, several at once: :mod:`vidstab.detectors.screen`,
        :mod:`vidstab.guard.healthy`)."""
        self._catch_up()
        return self._detectors

    def request_stop(self) -> None:
        """Ask every rank to stop at the next optimizer step (safe from a signal handler: sets a flag)."""
        self._stop_requested = True

    def set_replay_fn(self, fn: Callable[[dict], torch.Tensor] | None) -> None:
        """``fn(batch) -> loss`` used to replay a bad micro-batch for non-finite localisation."""
        self._replay_fn = fn

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

    # ------------------------------------------------------------------ learning rate (vidstab.lr)
    @property
    def lr_multiplier(self) -> float:
        """The persistent LR multiplier (recovery's back-off) over the base LRs seen at attach."""
        return self._lr.multiplier

    @lr_multiplier.setter
    def lr_multiplier(self, value: float) -> None:
        self._lr.multiplier = float(value)

    def scale_lr(self, factor: float) -> None:
        """Multiply the LR persistently: param-group lrs now, and the scheduler's ``base_lrs`` so the
        factor survives ``lr_scheduler.step()`` (LambdaLR & co. recompute ``base_lr * f(step)``)."""
        self._lr.scale(factor)

    def reapply_lr_multiplier(self) -> None:
        """Make the optimizer/scheduler reflect ``lr_multiplier`` after they were (re)loaded.

        The guard remembers the un-multiplied base LRs (``state_dict()["base_lrs"]``). Targets are
        ``base * lr_multiplier``; each param group's lr is rescaled by ``target / current base``.
        Idempotent: a scheduler restored from a checkpoint saved with the multiplier in effect already
        matches (no change); a freshly built one gets the multiplier applied.
        """
        self._lr.reapply()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """JSON-serialisable state: counters, LR multiplier, detector statistics."""
        self._catch_up()
        return {
            "schema": 1,
            "step_count": self.step_count,
            "skipped_total": self.skipped_total,
            "overflow_total": self.overflow_total,
            "incidents_written": self.incidents_written,
            "localized": self.localized,
            "lr_multiplier": self.lr_multiplier,
            "base_lrs": list(self._lr.base_lrs),
            "clip_flags": [int(c) for c in self._clip_flags.values],
            "last_anomaly_step": self._last_anomaly_step,
            "detectors": {d.name: d.state_dict() for d in self.detectors},
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (detectors missing from ``d`` keep their fresh state)."""
        self._catch_up()  # the steps held back are this run's, absorbed and logged before the state is replaced
        self.step_count = int(d["step_count"])
        # Event counters never go backward: an in-process rollback to an older checkpoint keeps what this
        # run already skipped and wrote (the incident disk budget included); a fresh process takes the file's.
        self.skipped_total = max(self.skipped_total, int(d.get("skipped_total", 0)))
        self.overflow_total = max(self.overflow_total, int(d.get("overflow_total", 0)))
        self.incidents_written = max(self.incidents_written, int(d.get("incidents_written", 0)))
        self.localized = self.localized or bool(d.get("localized", False))
        self.lr_multiplier = float(d.get("lr_multiplier", 1.0))
        if d.get("base_lrs"):
            self._lr.base_lrs = [float(x) for x in d["base_lrs"]]
        self._clip_flags = CountWindow(self.config.clip_rate.window, (bool(c) for c in d.get("clip_flags", [])))
        self._last_anomaly_step = int(d.get("last_anomaly_step", -(10**9)))
        states = d.get("detectors", {})
        for det in self.detectors:
            if det.name in states:
                det.load_state_dict(states[det.name])
        self._plan.screen.clear()  # the promises were about the state just replaced
        # Anything measured on the weights before the load (a rollback) must not be judged after it.
        self._pending = (None, None)
        self._refs.clear()
        self.window.reset()
        self._held = None
        self._last_verdict, self._params_finite = Verdict.OK, True

    def _save_state_hook(self, models: Any, weights: Any, output_dir: str) -> None:
        if self.accelerator.is_main_process:
            write_json_atomic(Path(output_dir) / GUARD_STATE_FILE, self.state_dict())

    def _load_state_hook(self, models: Any, input_dir: str) -> None:
        path = Path(input_dir) / GUARD_STATE_FILE
        if path.exists():
            with open(path, encoding="utf-8") as f:
                self.load_state_dict(json.load(f))
            self.events.log("resume", self.step_count, path=str(path), lr_multiplier=self.lr_multiplier)

    # ------------------------------------------------------------------ helpers
    def _loss_scale_tensor(self) -> torch.Tensor | None:
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
            return None
        scale = scaler._get_scale_async()  # device tensor: get_scale() would sync
        return scale if scale is not None else torch.tensor(float(scaler._init_scale))

    def _plain_step(self, max_grad_norm: float | None) -> StepResult:
        """``enabled=False``: exactly a plain Accelerate step."""
        if max_grad_norm is not None:
            self._clip(self._params, max_grad_norm)
        self._optimizer_step()
        if self._scheduler_step is not None:
            self._scheduler_step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return StepResult(self.step_count - 1, applied=True, skipped=False, micro=False)

    def close(self) -> None:
        """Log ``stop`` (``reason="closed"``: the report reads the run as finished), detach (:meth:`detach`)
        and close the event log."""
        if not self.events.closed:
            self.events.log("stop", self.step_count, reason="closed")
        self.detach()
        self.events.close()


def _weak_catch_up(guard: Guard) -> Callable[[], None]:
    """``guard._catch_up`` for its event log's ``before_flush``, without the log keeping the guard alive."""
    ref = weakref.ref(guard)

    def before_flush() -> None:
        g = ref()
        if g is not None:
            g._catch_up()
    return before_flush


_new_tuple = tuple.__new__


def _set_skipped(optimizer: Any, skipped: bool) -> None:
    """Set AcceleratedOptimizer's overflow flag, read by ``accelerator.optimizer_step_was_skipped`` and by
    AcceleratedScheduler (which then holds the schedule)."""
    if hasattr(optimizer, "_is_overflow"):
        optimizer._is_overflow = skipped


def attach(accelerator: Any, model: torch.nn.Module, optimizer: Any, lr_scheduler: Any = None,
           *guard_args: Any, rollback_every: int | None = None, **guard_kwargs: Any) -> Guard:
    """Attach a :class:`Guard` to prepared Accelerate objects and guard the loop as it is.

    Takes exactly :class:`Guard`'s arguments (``config``, ``run_dir``, ``model_spec``, ``seed``,
    ``checkpoint_fn``, ``register_hooks``: see there) and forwards them unchanged.

    After this one line the user's own ``accelerator.backward(loss)``, ``accelerator.clip_grad_norm_``,
    ``optimizer.step()``, ``lr_scheduler.step()`` and ``optimizer.zero_grad()`` are guarded (the instances
    are wrapped, not the classes; ``guard.detach()`` undoes it); ``guard.backward``/``guard.step`` remain
    for loops that want the batch, sample ids and per-sample losses in the evidence. The guard's state
    travels with ``accelerator.save_state``/``load_state`` as ``vidstab_guard.json``.

    ``rollback_every=N``: also roll back automatically, in place, inside the loop's own ``optimizer.step()``,
    to vidstab's own rollback checkpoints saved every ``N`` optimizer steps (:mod:`vidstab.auto_rollback`).

    Attaching again to the same optimizer returns the guard already attached (until it is detached).
    """
    existing = getattr(optimizer, ATTACHED_ATTR, None)
    if isinstance(existing, Guard) and existing.accelerator is accelerator and existing.model is model:
        return existing
    if isinstance(existing, Guard):
        existing.detach()
    guard = Guard(accelerator, model, optimizer, lr_scheduler, *guard_args, **guard_kwargs).wrap()
    if guard.model_spec is None and guard.config.capture_incidents:  # a diffusers model: replay needs no user code
        from ..replay_record import OutputGradients, model_spec_of

        guard.model_spec = model_spec_of(accelerator.unwrap_model(model))
        if guard.model_spec is not None:
            guard.output_gradients = OutputGradients(model, accelerator)
    if rollback_every:
        from ..auto_rollback import AutoRollback

        guard.auto_rollback = AutoRollback(guard, rollback_every)
    return guard


# help(attach) and IDEs show Guard's own parameters: one signature, declared once (on Guard.__init__).
_guard_signature = inspect.signature(Guard)
attach.__signature__ = _guard_signature.replace(return_annotation="Guard", parameters=[
    *_guard_signature.parameters.values(),
    inspect.Parameter("rollback_every", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="int | None")])
