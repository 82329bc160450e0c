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
3. the detectors on that table: the same verdict on every rank;
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from . import capture, signals
from .atomic import write_json_atomic
from .config import GuardConfig
from .detectors import Finding, StepStats, Verdict, absorb, build_detectors, judge, published
from .events import EventLog, log_to_trackers
from .localize import locate_nonfinite
from .lr import scale_lrs

GUARD_STATE_FILE = "vidstab_guard.json"
# A ROLLBACK finding is only a request: the recovery layer logs "rollback" when it actually rolls back.
_KIND = {Verdict.WARN: "warn", Verdict.SKIP: "skip", Verdict.ROLLBACK: "rollback_request"}
_ATTR = "_vidstab_guard"  # set on the optimizer a guard is attached to (attach is idempotent)


@dataclass
class StepResult:
    """What ``guard.step`` decided. Identical on every rank except ``incident``/``incidents``."""

    step: int
    """Optimizer step counter of this step (``guard.step_count`` before it advanced)."""
    applied: bool
    """The optimizer step changed the weights."""
    skipped: bool
    """vidstab skipped the step (SKIP/ROLLBACK verdict). An fp16 overflow is ``applied=False, skipped=False``."""
    micro: bool
    """A non-sync micro-step: nothing was judged or applied."""
    verdict: Verdict = Verdict.OK
    """Worst finding of the step."""
    findings: list[Finding] = field(default_factory=list)
    """All findings of the step, in detector order."""
    grad_norm: float = math.nan
    """Global pre-clip gradient norm."""
    loss: float = math.nan
    """Mean finite loss over ranks and micro-steps."""
    rollback: str | None = None
    """Why a detector asks for a rollback (``"detector: message"``), else ``None``."""
    stop: bool = False
    """Some rank called ``guard.request_stop()``: every rank sees it at the same step."""
    bad_ranks: list[int] = field(default_factory=list)
    """Ranks named by the findings (bad data, exceptions)."""
    incident: Path | None = None
    """First incident bundle written by THIS rank for this step."""
    overflow: bool = False
    """fp16 GradScaler overflow (the scaler skipped the update and lowered the scale)."""
    incidents: list[Path] = field(default_factory=list)
    """All incident bundles written by this rank for this step."""


class Guard:
    """Detects trouble on every rank in lockstep; see the module docstring. Build it with :func:`attach`."""

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
        self.events = EventLog(self.run_dir, self.rank)
        self.detectors = build_detectors(self.config)
        self.window = signals.Window(
            accelerator.device, self.config.timestep_buckets, self.config.num_train_timesteps, self.config.input_keys
        )
        self.clock = signals.StepClock(accelerator.device)
        self._params = list(model.parameters())  # same objects as model.parameters(): Accelerate's FSDP path compares
        self._trainable = [p for p in self._params if p.requires_grad]
        self._sharded = str(getattr(accelerator, "distributed_type", "")).endswith("FSDP") or any(
            signals.is_dtensor(p) for p in self._params
        )
        # DeepSpeed steps inside accelerator.backward: the guard can only observe and report (module docstring).
        self._observe_only = str(getattr(accelerator, "distributed_type", "")).endswith("DEEPSPEED")
        self._refs: list[tuple[Mapping[str, Any] | None, Any, Any]] = []  # (batch, sample_ids, error) per micro-step
        self._pending: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)  # (param_sq, update_sq)
        self._stop_requested = False
        self._replay_fn: Callable[[dict], torch.Tensor] | None = None
        self._clip_flags: list[bool] = []
        # The methods the guard itself calls: the originals, also once the instances are wrapped (attach).
        self._backward = accelerator.backward
        self._clip = accelerator.clip_grad_norm_
        self._optimizer_step = optimizer.step
        self._scheduler_step = lr_scheduler.step if lr_scheduler is not None else None
        self._patches: list[tuple[Any, str, bool, Any]] = []
        self._handles: list[Any] = []
        self._user_norm: tuple[torch.Tensor | None, float | None] | None = None  # from the user's clip_grad_norm_
        self._model_inputs: tuple[tuple, dict] | None = None  # (args, kwargs) of the latest forward
        self._forward_names: list[str] = []
        self._hold_scheduler = False
        self._scale_known = False
        self.last_result: StepResult | None = None
        """The result of the last optimizer step (the unmodified loop's way to read it)."""
        # Persistent counters (state_dict).
        self.step_count = 0
        self.skipped_total = 0
        self.overflow_total = 0
        self.incidents_written = 0
        self.localized = False
        self.lr_multiplier = 1.0
        self._last_verdict = Verdict.OK
        self._params_finite = True
        self._last_anomaly_step = -(10**9)  # last step with a finding that makes checkpoints unhealthy
        self._orig_lrs = self._current_base_lrs()
        if register_hooks and hasattr(accelerator, "register_save_state_pre_hook"):
            self._handles.append(accelerator.register_save_state_pre_hook(self._save_state_hook))
            self._handles.append(accelerator.register_load_state_pre_hook(self._load_state_hook))
        self.events.log("start", self.step_count, world_size=self.world_size, config=self.config.to_dict())

    # ------------------------------------------------------------------ the unmodified loop (attach)
    def wrap(self) -> "Guard":
        """Guard the user's own calls on these instances (what :func:`attach` does); undone by :meth:`detach`."""
        if self._patches:
            return self
        self._patch(self.accelerator, "backward", self._user_backward)
        self._patch(self.accelerator, "clip_grad_norm_", self._user_clip_grad_norm)
        self._patch(self.optimizer, "step", self._user_optimizer_step)
        if self.lr_scheduler is not None:
            self._patch(self.lr_scheduler, "step", self._user_scheduler_step)
        forward = getattr(self.accelerator.unwrap_model(self.model), "forward", None)
        try:
            self._forward_names = [n for n, p in inspect.signature(forward).parameters.items()
                                   if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            self._forward_names = []
        self._handles.append(self.model.register_forward_pre_hook(self._see_model_inputs, with_kwargs=True))
        setattr(self.optimizer, _ATTR, self)
        return self

    def detach(self) -> None:
        """Undo :meth:`wrap` and the save/load hooks: the instances behave as before :func:`attach`.
        Idempotent; the event log is flushed (``close`` closes it)."""
        for obj, name, had, old in reversed(self._patches):
            if had:
                setattr(obj, name, old)
            else:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
        self._patches.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if getattr(self.optimizer, _ATTR, None) is self:
            delattr(self.optimizer, _ATTR)
        self.events.flush()

    def _patch(self, obj: Any, name: str, fn: Callable) -> None:
        had = name in vars(obj)
        self._patches.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, fn)

    def _see_model_inputs(self, module: Any, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook: keep references to the inputs of the latest forward with grad enabled (the one
        the next backward is most likely about; a forward without a backward is simply replaced)."""
        if torch.is_grad_enabled():
            self._model_inputs = (args, kwargs)

    def _model_batch(self) -> dict[str, torch.Tensor] | None:
        """The tensors of the micro-step's model inputs, named after ``forward``'s parameters."""
        if self._model_inputs is None:
            return None
        args, kwargs = self._model_inputs
        batch = {}
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                batch[self._forward_names[i] if i < len(self._forward_names) else f"arg{i}"] = a
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                batch[k] = v
        return batch

    def _user_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The user's ``accelerator.backward(loss)``: the original, then the micro-step's on-device flags."""
        if not self.config.enabled or self._model_inputs is None:
            # This guard's model did not run since the last backward: another model's loss (a second
            # guard on the same accelerator, an unguarded model) passes straight through.
            return self._backward(loss, **kwargs)
        if self.accelerator.sync_gradients:
            self.clock.mark()  # DDP all-reduces inside this backward: the rank's own time ends here
        self._backward(loss, **kwargs)
        batch = self._model_batch()
        self._model_inputs = None
        self.window.record(loss, batch)
        self._refs.append((batch if self.config.capture_incidents else None, None, None))

    def _user_clip_grad_norm(self, parameters: Any, max_norm: float, norm_type: float = 2, **kwargs: Any) -> Any:
        """The user's ``accelerator.clip_grad_norm_``: the original; its pre-clip norm feeds the guard."""
        norm = self._clip(parameters, max_norm, norm_type, **kwargs)
        if self.window.micro_steps and self.accelerator.sync_gradients and float(norm_type) == 2.0:
            self._user_norm = (signals.norm_tensor(norm), float(max_norm))
        return norm

    def _user_optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's ``optimizer.step()``: the guarded step on the last micro-step, else the original."""
        if not self.config.enabled or not self.accelerator.sync_gradients:
            return self._optimizer_step(*args, **kwargs)
        if self._user_norm is not None:
            norm, max_norm = self._user_norm
        else:  # the loop does not clip: measure the global norm once, without clipping
            norm, max_norm = signals.global_grad_norm(self.accelerator, self._params, None, clip=self._clip), None
        self._guarded_step(norm, max_norm, step_scheduler=False)
        return None

    def _user_scheduler_step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's ``lr_scheduler.step()``: held right after a skipped optimizer step."""
        if self._hold_scheduler and self.accelerator.sync_gradients:
            return None
        return self._scheduler_step(*args, **kwargs)

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
        if self.accelerator.sync_gradients:
            self.clock.mark()
        self._backward(loss, **backward_kwargs)
        self._model_inputs = None
        if not self.config.enabled:
            return
        if timesteps is None and batch is not None:
            timesteps = batch.get("timesteps")
        self.window.record(loss, batch, per_sample_loss, timesteps, error is not None)
        # References only (no copies), dropped after the step; they keep the window's batches alive until then.
        self._refs.append((batch if self.config.capture_incidents else None, sample_ids, error))

    def step(self, max_grad_norm: float | None = 1.0) -> StepResult:
        """Judge and apply (or skip) the optimizer step; a cheap no-op on non-sync micro-steps."""
        if not self.accelerator.sync_gradients:
            return StepResult(self.step_count, applied=False, skipped=False, micro=True)
        if not self.config.enabled:
            return self._plain_step(max_grad_norm)
        norm = signals.global_grad_norm(self.accelerator, self._params, max_grad_norm, clip=self._clip)
        return self._guarded_step(norm, max_grad_norm, step_scheduler=True)

    def _guarded_step(self, norm: torch.Tensor | None, max_grad_norm: float | None, step_scheduler: bool) -> StepResult:
        """Steps 2-5 of the module docstring, given the global pre-clip norm (clipped in place already)."""
        step = self.step_count
        # 2. One row per rank -> one gather -> one host read.
        stop, self._stop_requested = self._stop_requested, False
        scale = self._loss_scale_tensor()
        self._scale_known = scale is not None
        row = self.window.pack(norm, stop, *self._pending, scale, self.clock.seconds())
        self._pending = (None, None)
        table = signals.gather_and_read(self.accelerator, row)
        self.clock.restart()
        # 3. Same table on every rank -> same verdict on every rank.
        stats = self._build_stats(step, table, max_grad_norm, norm is not None)
        judge(self.detectors, stats)
        # 4. Apply or skip (nothing else before the optimizer step).
        stats.applied = self._apply(stats, self._measure_params(step) and stats.verdict < Verdict.ROLLBACK,
                                    step_scheduler)
        # 5. After the step is enqueued: statistics absorb only applied steps; evidence.
        # A skip of bad input data (finite weights) says nothing about the model's health.
        bad_data_only = _bad_input_only(stats, self.config.health_ignore)
        self._last_verdict = Verdict.OK if bad_data_only else stats.verdict
        if not bad_data_only and any(f.verdict >= Verdict.WARN and f.detector not in self.config.health_ignore
                                     for f in stats.findings):
            self._last_anomaly_step = step
        if stats.param_norm is not None:
            self._params_finite = math.isfinite(stats.param_norm)
        absorb(self.detectors, stats)
        result = self._report(stats, table, stop=any(r[signals.STOP] > 0 for r in table))
        self._refs.clear()
        self.window.reset()
        self._user_norm = self._model_inputs = None
        self.step_count += 1
        self.last_result = result
        return result

    # ------------------------------------------------------------------ step parts
    def _build_stats(self, step: int, table: list[list[float]], max_grad_norm: float | None, norm_known: bool) -> StepStats:
        S = signals
        lay = self.window.layout
        norms = [r[S.GRAD_NORM] for r in table]
        bad = [n for n in norms if not math.isfinite(n)]
        grad_norm = bad[0] if bad else max(norms)
        counts = [r[S.LOSS_TOTAL] - r[S.LOSS_NONFINITE] for r in table]
        loss_sum, loss_cnt = sum(r[S.LOSS_SUM] for r in table), sum(counts)
        rank_loss = [r[S.LOSS_SUM] / c if c > 0 else math.nan for r, c in zip(table, counts)]
        buckets = []
        if lay.buckets:
            sums = [sum(col) for col in zip(*(r[lay.bucket_sum] for r in table))]
            cnts = [sum(col) for col in zip(*(r[lay.bucket_count] for r in table))]
            buckets = [x / c if c > 0 else None for x, c in zip(sums, cnts)]
        param_norm = update_ratio = None
        if table[0][S.PARAM_PENDING] > 0:
            # DDP: every rank holds all params (same value) -> take rank 0; FSDP: shards -> sum over ranks.
            psq = sum(r[S.PARAM_SQ] for r in table) if self._sharded else table[0][S.PARAM_SQ]
            usq = sum(r[S.UPDATE_SQ] for r in table) if self._sharded else table[0][S.UPDATE_SQ]
            param_norm = math.sqrt(psq) if psq >= 0 else math.nan
            update_ratio = math.sqrt(usq) / param_norm if param_norm and math.isfinite(param_norm) and usq >= 0 else None
        in_nonfinite = [r[S.NONFINITE_ALL] - r[S.LOSS_NONFINITE] for r in table]
        absmax = [max(r[S.IN_ABSMAX_HI], r[S.IN_ABSMAX_LO]) if r[S.IN_NUMEL] > 0 else 0.0 for r in table]
        absmax = [a if math.isfinite(a) or n == 0 else math.nan for a, n in zip(absmax, in_nonfinite)]
        s = StepStats(
            step=step,
            grad_norm=grad_norm if norm_known else math.nan,
            grad_norm_known=norm_known,
            loss=loss_sum / loss_cnt if loss_cnt > 0 else math.nan,
            world_size=len(table),
            max_grad_norm=max_grad_norm,
            clipped=bool(max_grad_norm is not None and math.isfinite(grad_norm) and grad_norm > max_grad_norm),
            lr=self._lr(),
            loss_scale=table[0][S.LOSS_SCALE] if self._scale_known else None,
            lr_peak=self._lr_peak(),
            lr_scheduled=self._lr_scheduled(),
            param_norm=param_norm,
            update_ratio=update_ratio,
            nonfinite_loss_ranks=[i for i, r in enumerate(table) if r[S.LOSS_NONFINITE] > 0],
            nonfinite_input_ranks=[i for i, n in enumerate(in_nonfinite) if n > 0],
            exception_ranks=[i for i, r in enumerate(table) if r[S.EXCEPTIONS] > 0],
            rank_loss=rank_loss,
            rank_input_absmax=absmax,
            rank_seconds=[r[S.LOCAL_SECONDS] for r in table],
            timestep_bucket_loss=buckets,
            # the largest FINITE absmax: a rank with non-finite inputs is the nonfinite detector's case
            input_absmax=max((a for a in absmax if math.isfinite(a)), default=0.0),
            input_nonfinite=int(sum(in_nonfinite)),
            input_rms=_rms(sum(r[S.IN_SUMSQ] for r in table), sum(r[S.IN_NUMEL] for r in table)),
        )
        s.overflow = bool(
            getattr(self.accelerator, "scaler", None) is not None
            and norm_known
            and not math.isfinite(grad_norm)
            and not (s.nonfinite_loss_ranks or s.nonfinite_input_ranks or s.exception_ranks)
        )
        return s

    def _measure_params(self, step: int) -> bool:
        every = self.config.param_norm_every
        return every > 0 and step % every == 0 and bool(self._trainable)

    def _apply(self, s: StepStats, measure: bool, step_scheduler: bool) -> bool:
        """Step or skip; on measured steps leave (param_sq, update_sq) on device for the next read.

        ``step_scheduler``: the explicit ``guard.step`` steps the scheduler and zeroes the gradients; in the
        user's own loop (``step_scheduler=False``) the user's ``lr_scheduler.step()``/``zero_grad()`` follow.
        """
        opt = self.optimizer
        if s.verdict <= Verdict.WARN or self._observe_only:
            self._hold_scheduler = False
            before = [signals.local_tensor(p.detach()).clone() for p in self._trainable] if measure else None
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
            cur = [signals.local_tensor(p.detach()) for p in self._trainable]
            update_sq = None
            if before is not None:
                torch._foreach_sub_(before, cur)
                update_sq = signals.sum_of_squares(before)
            self._pending = (signals.sum_of_squares(cur), update_sq)
        if applied:
            self._clip_flags = (self._clip_flags + [s.clipped])[-100:]
        if s.verdict >= Verdict.SKIP and not self._observe_only:
            self.skipped_total += 1
        if s.overflow:
            self.overflow_total += 1
        return applied

    def _report(self, s: StepStats, table: list[list[float]], stop: bool) -> StepResult:
        mine = table[self.rank]
        S = signals
        n = mine[S.IN_NUMEL]
        mean = mine[S.IN_SUM] / n if n > 0 else None
        std = math.sqrt(max(mine[S.IN_SUMSQ] / n - mean * mean, 0.0)) if mean is not None and math.isfinite(mean) else None
        metrics = {
            "loss": s.loss,
            "loss_rank": s.rank_loss[self.rank],
            "lr": s.lr,
            "grad_norm": s.grad_norm,
            "clipped": s.clipped,
            "clip_ratio": s.grad_norm / s.max_grad_norm if s.max_grad_norm else None,
            "clip_rate": sum(self._clip_flags) / len(self._clip_flags) if self._clip_flags else 0.0,
            "loss_scale": s.loss_scale,
            "param_norm": s.param_norm,
            "update_ratio": s.update_ratio,
            "skipped_total": self.skipped_total,
            "overflow_total": self.overflow_total,
            "input_absmax": s.rank_input_absmax[self.rank] if n > 0 else None,
            "input_mean": mean,
            "input_std": std,
            "input_nonfinite": int(mine[S.NONFINITE_ALL] - mine[S.LOSS_NONFINITE]),
            "loss_by_t": s.timestep_bucket_loss,
            "local_seconds": mine[S.LOCAL_SECONDS] if mine[S.LOCAL_SECONDS] >= 0 else None,
            "verdict": s.verdict.name,
            "applied": s.applied,
            **published(self.detectors),  # each detector's own thresholds for the next step (the dashboard's lines)
        }
        self.events.log("metrics", s.step, **metrics)
        if s.step % self.config.log_every == 0 and getattr(self.accelerator, "trackers", None):
            log_to_trackers(self.accelerator, {k: v for k, v in metrics.items() if k not in ("loss_rank", "verdict")}, s.step)
        bad_ranks = sorted({r for f in s.findings for r in f.ranks})
        for f in s.findings:
            self.events.log(_KIND[f.verdict], s.step, detector=f.detector, message=f.message, figures=f.figures,
                            bad_ranks=f.ranks, step_verdict=s.verdict.name)
        if s.overflow:
            self.events.log("overflow", s.step, loss_scale=s.loss_scale, overflow_total=self.overflow_total)
        if stop:
            self.events.log("stop", s.step, reason="request_stop")
        rollback = next((f"{f.detector}: {f.message}" for f in s.findings if f.verdict >= Verdict.ROLLBACK), None)
        incidents = self._capture(s) if s.verdict >= Verdict.SKIP and not s.overflow else []
        skipped = s.verdict >= Verdict.SKIP and not self._observe_only
        return StepResult(
            step=s.step, applied=s.applied, skipped=skipped, micro=False, verdict=s.verdict,
            findings=list(s.findings), grad_norm=s.grad_norm, loss=s.loss, rollback=rollback, stop=stop,
            bad_ranks=bad_ranks, incident=incidents[0] if incidents else None, overflow=s.overflow, incidents=incidents,
        )

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
        idx = [i for i, m in enumerate(micro) if m[0] or m[1] > 0 or m[3]]
        if not idx:
            idx = sorted(range(len(micro)), key=lambda i: -micro[i][2])
        paths = []
        for i in idx:
            if self.incidents_written >= self.config.max_incidents or i >= len(self._refs):
                break
            batch, ids, error = self._refs[i]
            tensors = {k: v for k, v in (batch or {}).items() if isinstance(v, torch.Tensor)}
            id_list = [str(x) for x in (ids.tolist() if isinstance(ids, torch.Tensor) else list(ids or []))]
            localization = self._localize(s, finding, tensors) if finding.detector == "nonfinite" else None
            extra = {"micro": {"loss_nonfinite": bool(micro[i][0]), "input_nonfinite": int(micro[i][1]),
                               "input_absmax": micro[i][2]}, "grad_norm": s.grad_norm, "loss": s.loss,
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

    # ------------------------------------------------------------------ controls
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

    # ------------------------------------------------------------------ learning rate
    def _scheduler(self) -> Any:
        s = self.lr_scheduler
        return getattr(s, "scheduler", s)  # AcceleratedScheduler -> the torch scheduler

    def _current_base_lrs(self) -> list[float]:
        sch = self._scheduler()
        if sch is not None and hasattr(sch, "base_lrs"):
            return [float(b) for b in sch.base_lrs]
        return [float(g.get("initial_lr", g["lr"])) for g in self.optimizer.param_groups]

    def _lr(self) -> float | None:
        lr = self.optimizer.param_groups[0].get("lr") if self.optimizer.param_groups else None
        return float(lr) if isinstance(lr, (int, float)) else None  # a tensor LR would need a sync: not read

    def _lr_peak(self) -> float | None:
        """The largest LR the schedule can produce for group 0: base LR at attach x ``lr_multiplier``, or
        the group's ``max_lr`` (OneCycleLR/CyclicLR) when larger."""
        if not self.optimizer.param_groups or not self._orig_lrs:
            return None
        peak = self._orig_lrs[0] * self.lr_multiplier
        max_lr = self.optimizer.param_groups[0].get("max_lr")
        return max(peak, float(max_lr) * self.lr_multiplier) if isinstance(max_lr, (int, float)) else peak

    def _lr_scheduled(self) -> float | None:
        """The LR the scheduler set for this step (``get_last_lr()[0]``), before anyone else touched it."""
        sch = self._scheduler()
        last = getattr(sch, "_last_lr", None) if sch is not None else None
        return float(last[0]) if last and isinstance(last[0], (int, float)) else None

    def scale_lr(self, factor: float) -> None:
        """Multiply the LR persistently: param-group lrs now, and the scheduler's ``base_lrs`` so the
        factor survives ``lr_scheduler.step()`` (LambdaLR & co. recompute ``base_lr * f(step)``)."""
        scale_lrs(self.optimizer, factor, self.lr_scheduler)
        self.lr_multiplier *= float(factor)

    def reapply_lr_multiplier(self) -> None:
        """Make the optimizer/scheduler reflect ``lr_multiplier`` after they were (re)loaded.

        The guard remembers the un-multiplied base LRs (``state_dict()["base_lrs"]``). Targets are
        ``base * lr_multiplier``; each param group's lr is rescaled by ``target / current base``.
        Idempotent: a scheduler restored from a checkpoint saved with the multiplier in effect already
        matches (no change); a freshly built one gets the multiplier applied.
        """
        sch = self._scheduler()
        target = [b * self.lr_multiplier for b in self._orig_lrs]
        current = self._current_base_lrs()
        groups = self.optimizer.param_groups
        for i, g in enumerate(groups):
            if i >= len(target) or current[i] == 0:
                continue
            r = target[i] / current[i]
            if r != 1.0:
                g["lr"] = g["lr"] * r
                if "initial_lr" in g:
                    g["initial_lr"] = g["initial_lr"] * r
        if sch is not None and hasattr(sch, "base_lrs"):
            sch.base_lrs = list(target[: len(sch.base_lrs)])
            if hasattr(sch, "_last_lr"):
                sch._last_lr = [g["lr"] for g in groups]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """JSON-serialisable state: counters, LR multiplier, detector statistics."""
        return {
            "schema": 1,
            "step_count": self.step_count,
            "skipped_total": self.skipped_total,
            "overflow_total": self.overflow_total,
            "incidents_written": self.incidents_written,
            "localized": self.localized,
            "lr_multiplier": self.lr_multiplier,
            "base_lrs": list(self._orig_lrs),
            "clip_flags": [int(c) for c in self._clip_flags],
            "last_anomaly_step": self._last_anomaly_step,
            "detectors": {d.name: d.state_dict() for d in self.detectors},
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (detectors missing from ``d`` keep their fresh state)."""
        self.step_count = int(d["step_count"])
        # Event counters never go backward: an in-process rollback to an older checkpoint keeps what this
        # run already skipped and wrote (the incident disk budget included); a fresh process takes the file's.
        self.skipped_total = max(self.skipped_total, int(d.get("skipped_total", 0)))
        self.overflow_total = max(self.overflow_total, int(d.get("overflow_total", 0)))
        self.incidents_written = max(self.incidents_written, int(d.get("incidents_written", 0)))
        self.localized = self.localized or bool(d.get("localized", False))
        self.lr_multiplier = float(d.get("lr_multiplier", 1.0))
        if d.get("base_lrs"):
            self._orig_lrs = [float(x) for x in d["base_lrs"]]
        self._clip_flags = [bool(c) for c in d.get("clip_flags", [])]
        self._last_anomaly_step = int(d.get("last_anomaly_step", -(10**9)))
        states = d.get("detectors", {})
        for det in self.detectors:
            if det.name in states:
                det.load_state_dict(states[det.name])
        # Anything measured on the weights before the load (a rollback) must not be judged after it.
        self._pending = (None, None)
        self._refs.clear()
        self.window.reset()
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


def _bad_input_only(s: StepStats, ignore: Sequence[str]) -> bool:
    """True when the step's only finding is ``nonfinite`` and every rank with a non-finite loss also had
    non-finite inputs: bad data, skipped before it reached the weights, not a sick model (a ``nonfinite``
    SKIP on bad inputs still never applies the step; this only keeps checkpoints healthy)."""
    loud = [f for f in s.findings if f.verdict >= Verdict.WARN and f.detector not in ignore]
    return (bool(s.nonfinite_input_ranks) and bool(loud) and all(f.detector == "nonfinite" for f in loud)
            and set(s.nonfinite_loss_ranks) <= set(s.nonfinite_input_ranks) and not s.exception_ranks)


def _rms(sum_sq: float, count: float) -> float | None:
    return math.sqrt(sum_sq / count) if count > 0 else None


def _set_skipped(optimizer: Any, skipped: bool) -> None:
    """Set AcceleratedOptimizer's overflow flag, read by ``accelerator.optimizer_step_was_skipped`` and by
    AcceleratedScheduler (which then holds the schedule)."""
    if hasattr(optimizer, "_is_overflow"):
        optimizer._is_overflow = skipped


def attach(
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
) -> Guard:
    """Attach a :class:`Guard` to prepared Accelerate objects and guard the loop as it is.

    After this one line the user's own ``accelerator.backward(loss)``, ``accelerator.clip_grad_norm_``,
    ``optimizer.step()``, ``lr_scheduler.step()`` and ``optimizer.zero_grad()`` are guarded (the instances
    are wrapped, not the classes; ``guard.detach()`` undoes it); ``guard.backward``/``guard.step`` remain
    for loops that want the batch, sample ids and per-sample losses in the evidence. The guard's state
    travels with ``accelerator.save_state``/``load_state`` as ``vidstab_guard.json``.

    Attaching again to the same optimizer returns the guard already attached (until it is detached).
    ``model_spec`` (how to rebuild the model), ``seed`` and ``checkpoint_fn`` (-> newest checkpoint
    path or None) are written into incident bundles so an incident can be replayed elsewhere.
    """
    existing = getattr(optimizer, _ATTR, None)
    if isinstance(existing, Guard) and existing.accelerator is accelerator and existing.model is model:
        return existing
    if isinstance(existing, Guard):
        existing.detach()
    return Guard(accelerator, model, optimizer, lr_scheduler, config, run_dir,
                 model_spec=model_spec, seed=seed, checkpoint_fn=checkpoint_fn).wrap()
