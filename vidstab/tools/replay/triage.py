"""The triage of one bundle: reproduce twice, bitwise; then data, precision, LR and structure, in that order."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ...evidence.capture import Incident, json_float
from .base import SPIKE_TOLERANCE, ReplayError, _rel
from .report import ReplayReport, RunResult, _fmt
from .runner import _bits_equal, _dtype_name, _precision_dtype, _Replayer
from .stages import _triage_data, _triage_lr, _triage_precision, _triage_structure
from .verdict import _verdict


def _recorded(meta: dict) -> dict:
    keys = ("detector", "verdict", "message", "figures", "lr", "precision", "seed", "checkpoint", "extra")
    return {k: meta.get(k) for k in keys}


def _incident_kind(meta: dict) -> tuple[str, float | None, float | None]:
    """What to compare the replay with: ``(kind, recorded grad norm, recorded loss)``.

    Figures come from the finding, else from ``extra`` (the guard records the step's global numbers there).
    """
    figures = meta.get("figures") or {}
    extra = meta.get("extra") if isinstance(meta.get("extra"), dict) else {}
    g = json_float(figures.get("grad_norm", extra.get("grad_norm")))
    loss = json_float(figures.get("loss", extra.get("loss") if "grad_norm" not in figures else None))
    detector = str(meta.get("detector") or "")
    if detector == "exception":
        return "exception", g, loss
    if "nonfinite" in detector or "nan" in detector or any(v is not None and not math.isfinite(v) for v in (g, loss)):
        return "nonfinite", g, loss
    if g is not None:
        return "spike", g, loss
    if loss is not None:
        return "loss_spike", g, loss
    return "unknown", g, loss




def _triage(inc: Incident, r: _Replayer, model_name: str, device: str, weights: Path | None, ckpt_step: int | None,
            notes: list[str], optimizer: str, absmax_limit: float) -> ReplayReport:
    meta = inc.meta
    kind, rec_g, rec_loss = _incident_kind(meta)
    report = ReplayReport(
        bundle=str(inc.path), step=inc.step, rank=inc.rank, sample_ids=inc.sample_ids, recorded=_recorded(meta),
        kind=kind, device=device, model=model_name, checkpoint=str(weights) if weights else None,
        checkpoint_step=ckpt_step, reproduced=None, reproduction="", deterministic=True, notes=notes,
    )

    # -- reproduce, twice, bitwise ------------------------------------------------------------------
    try:
        base = r.run("fp32")
    except ReplayError:
        raise
    except Exception as e:  # the user's loss/model raising on the captured batch
        raise ReplayError(f"the loss_fn raised on the captured batch: {type(e).__name__}: {e}") from e
    grads_a = r.grads()
    param_norms = sorted(
        ((n, float(p.grad.detach().double().norm())) for n, p in r.model.named_parameters() if p.grad is not None),
        key=lambda x: -x[1] if math.isfinite(x[1]) else -math.inf,  # non-finite first: that is where it broke
    )
    again = r.run("fp32 (again)")
    grads_b = r.grads()
    same = _bits_equal(torch.tensor(base.loss), torch.tensor(again.loss)) and all(
        _bits_equal(a, b) for a, b in zip(grads_a, grads_b)
    )
    report.deterministic = same
    again.note = "bitwise identical" if same else "DIFFERS from the first run"
    report.runs += [base, again]
    if not same:
        notes.append("two identical replays differed bitwise: a hint of non-determinism or faulty hardware "
                     "rather than a data or model problem - replay on another device to confirm")

    # The run's own precision, when it was mixed: a failure may exist only there.
    dtype = _precision_dtype(meta.get("precision"))
    mixed: RunResult | None = None
    mixed_error = None
    if dtype is not None:
        try:
            mixed = r.run(f"{_dtype_name(dtype)} autocast", dtype=dtype)
            report.runs.append(mixed)
        except RuntimeError as e:  # e.g. fp16 autocast unsupported on this device
            mixed_error = f"{type(e).__name__}: {e}"
    # The setting in which the step fails: fp32, else the run's mixed precision, else none (a finite spike).
    failing, fail_dtype, ref = False, None, base
    if not base.finite:
        failing = True
    elif mixed is not None and not mixed.finite:
        failing, fail_dtype, ref = True, dtype, mixed

    _judge_reproduction(report, kind, base, mixed, rec_g, rec_loss)
    if failing:
        report.localization = r.localize(dtype=fail_dtype)

    # -- 1. data ------------------------------------------------------------------------------------
    report.data = _triage_data(inc, r, ref, failing, fail_dtype, report, absmax_limit)
    clean_batch = report.data.pop("_clean_batch", None)

    # -- 2a. precision --------------------------------------------------------------------------------
    report.precision = _triage_precision(meta.get("precision"), dtype, base, mixed, mixed_error, report)

    # -- 2b. lr ----------------------------------------------------------------------------------------
    report.lr = _triage_lr(meta, r, base, clean_batch, report, optimizer, inc)
    if report.reproduced is False and report.lr.get("implicated") and report.lr.get("jump_at_lr"):
        # The checkpoint's weights are healthy; the failure is the update an outlier LR makes from them.
        lr = report.lr
        report.reproduced = True
        report.reproduction += (f"; the step is healthy on the checkpoint's weights, but one update at lr "
                                f"{lr['tested_lr']:.3g} reproduces the blow-up ({lr['at_lr']['note']})")

    # -- 3. structure ----------------------------------------------------------------------------------
    report.structure = _triage_structure(r, base, report, param_norms)

    report.verdict = _verdict(report)
    return report



def _judge_reproduction(report: ReplayReport, kind: str, base: RunResult, mixed: RunResult | None,
                        rec_g: float | None, rec_loss: float | None) -> None:
    """Set ``reproduced`` and ``reproduction`` from the fp32 run (and the run's mixed precision)."""
    replayed = f"replayed fp32 loss {_fmt(base.loss)}, grad norm {_fmt(base.grad_norm)}"
    mixed_failed = mixed is not None and not mixed.finite
    if mixed_failed:
        replayed += f"; non-finite under {mixed.label} (the run's precision)"
    if kind == "exception":
        recorded = (report.recorded.get("extra") or {}).get("error") or "an exception"
        report.reproduced = base.error is not None
        report.reproduction = (f"recorded {recorded}; the replay " + (f"raised {base.error}" if base.error else
                               f"ran without raising (loss {_fmt(base.loss)}, grad norm {_fmt(base.grad_norm)})"))
    elif kind == "nonfinite":
        report.reproduced = (not base.finite) or mixed_failed
        report.reproduction = f"recorded a non-finite step; {replayed}"
    elif kind == "spike":
        g = base.grad_norm
        close = g is not None and math.isfinite(g) and _rel(g, rec_g) <= SPIKE_TOLERANCE
        report.reproduced = (not base.finite) or mixed_failed or close
        report.reproduction = (f"recorded grad norm {_fmt(rec_g)}; {replayed}"
                               + (f" ({(g - rec_g) / rec_g:+.0%})" if g is not None and math.isfinite(g) and rec_g else ""))
    elif kind == "loss_spike":
        report.reproduced = (not base.finite) or mixed_failed or _rel(base.loss, rec_loss) <= SPIKE_TOLERANCE
        report.reproduction = f"recorded loss {_fmt(rec_loss)}; {replayed}"
    else:
        report.reproduced = True if (not base.finite or mixed_failed) else None
        report.reproduction = f"nothing recorded to compare with; {replayed}"
