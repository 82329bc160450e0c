"""The summary section: how the run ended and its counts (skips, rollbacks, incidents, losses)."""

from __future__ import annotations

import datetime as _dt
import html
import math

import numpy as np

from .load import RunLog, _event_steps, _num, _skipped
from .markup import _short_list
from .series import _merge, _nonfinite_loss_steps


def _restarts_text(log: RunLog) -> str:
    """Torch-elastic restarts of the job (vidstab.run.elastic): how many, and the cause and resume step of each."""
    seen = {}
    for e in log.events:
        if e.get("kind") == "restart":
            seen.setdefault(e.get("restart_count"), e)
    if not seen:
        return "0"
    parts = [f"{e.get('cause')} (ranks {_short_list(e.get('culprit_ranks') or [])}), resumed at step {e.get('step')}"
             for _, e in sorted(seen.items(), key=lambda kv: kv[0] if isinstance(kv[0], int) else 0)]
    return html.escape(f"{len(seen)}: " + "; ".join(parts))


def _summary(log: RunLog) -> str:
    loss = _merge(log, "loss")
    finite = np.isfinite(loss.values)
    skipped = _skipped(log)
    skips = sorted({step for _, step in skipped})
    resumes = [e for e in log.events if e.get("kind") == "resume"]
    # Every rank logs each resume: count one rank's (the one that logged most), so two resumes at one step are two.
    by_rank: dict[int, list[int]] = {}
    for e in resumes:
        by_rank.setdefault(e["rank"], []).append(int(_num(e.get("step"))))
    resume_steps = [(0, s) for s in sorted(max(by_rank.values(), key=len, default=[]))]
    rollbacks = [e for e in log.events if e.get("kind") == "rollback"]
    rollback_steps = sorted({(e["_attempt"], e.get("step")) for e in rollbacks})
    warns = {(e.get("step"), e.get("detector")) for e in log.events if e.get("kind") == "warn"}
    overflows = _event_steps(log, "overflow")
    nonfinite = _nonfinite_loss_steps(log)
    stops = [e for e in log.events if e.get("kind") == "stop"]
    checkpoints = [e for e in log.events if e.get("kind") == "checkpoint"]
    last_step = int(max((m.steps.max() for m in log.metrics.values() if len(m.steps)), default=0))
    ranks = sorted(set(log.metrics) | {e["rank"] for e in log.events})

    ending, how = _finished(stops, last_step)
    trouble = bool(skips or rollbacks or log.incidents or len(nonfinite))
    if ending == "unknown":
        # A user's own loop may never log a stop: neither "finished" nor "failed" can be read from the log.
        css, verdict = "neutral", how + ("; trouble handled on the way" if trouble else "")
    elif ending == "failed":
        css, verdict = "bad", f"Did not finish: {how}"
    elif ending == "stopped":
        css, verdict = "warn", f"Stopped early: {how}"
    elif trouble:
        css, verdict = "warn", f"Finished with trouble handled: {how}"
    else:
        css, verdict = "good", f"Finished cleanly: {how}"

    def fmt(x):
        return f"{x:.5g}" if isinstance(x, float) and math.isfinite(x) else "n/a"

    times = [t for m in log.metrics.values() for t in m.columns["time"][[0, -1]].tolist()] + \
            [_num(e.get("time")) for e in log.events]
    times = [t for t in times if math.isfinite(t)]
    duration, launches = _time_running(log)
    started = _dt.datetime.fromtimestamp(min(times), _dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC") if times else "n/a"
    last_ckpt = checkpoints[-1] if checkpoints else None
    rows = [
        ("steps logged", f"{len(loss.steps)} (last step {last_step})"),
        ("processes", f"{len(ranks)} (rank{'s' if len(ranks) > 1 else ''} {_short_list(ranks)})" if ranks else "n/a"),
        ("skipped steps", f"{len(skipped)}" + (f" (steps {_short_list(skips)})" if skips else "")
         + (f"; {len(skipped) - len(skips)} of them a step skipped again after a rollback or resume"
            if len(skipped) > len(skips) else "")),
        ("rollbacks", f"{len(rollback_steps)}" + (f" (at steps {_short_list([s for _, s in rollback_steps])})" if rollbacks else "")),
        ("resumes", f"{len(resume_steps)}" + (f" (at steps {_short_list([s for _, s in resume_steps])})" if resumes else "")),
        ("incidents", str(len(log.incidents))),
        ("job restarts", _restarts_text(log)),
        ("warnings", str(len(warns))),
        ("fp16 overflow steps", str(len(overflows))),
        ("non-finite losses", f"{len(nonfinite)}" + (f" (steps {_short_list(nonfinite.tolist())})" if len(nonfinite) else "")),
        ("first / last loss", f"{fmt(float(loss.values[finite][0])) if finite.any() else 'n/a'} / "
                              f"{fmt(float(loss.values[finite][-1])) if finite.any() else 'n/a'}"),
        ("last checkpoint", html.escape(str(last_ckpt.get("path"))) + ("" if last_ckpt.get("healthy", True) else " (unhealthy)")
         if last_ckpt else "none"),
        ("started", started),
        ("wall time", (f"{duration / 3600:.2f} h" if duration > 3600 else (f"{duration:.0f} s" if math.isfinite(duration) else "n/a"))
         + (f" over {launches} launches (the time between them not counted)" if launches > 1 else "")),
    ]
    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{v if k == 'last checkpoint' else html.escape(v)}</td></tr>"
                    for k, v in rows)
    return f'<p class="verdict {css}">{html.escape(verdict)}</p><table class="kv">{table}</table>'


def _time_running(log: RunLog) -> tuple[float, int]:
    """Seconds the run's launches ran (each from its ``start`` events to its last record, the idle time between
    launches left out) and the number of launches."""
    stamps = sorted([(t, False) for m in log.metrics.values() for t in m.columns["time"].tolist()]
                    + [(_num(e.get("time")), e.get("kind") == "start") for e in log.events])
    stamps = [(t, start) for t, start in stamps if math.isfinite(t)]
    if not stamps:
        return math.nan, 0
    total, launches, first, last, in_start = 0.0, 1, stamps[0][0], stamps[0][0], stamps[0][1]
    for t, start in stamps[1:]:
        if start and not in_start:  # a start after the previous launch's records: a new launch
            total += last - first
            launches, first = launches + 1, t
        in_start, last = start, t
    return total + last - first, launches


def _finished(stops: list[dict], last_step: int) -> tuple[str, str]:
    """How the run ended, from its ``stop`` events: ``("finished" | "stopped" | "failed" | "unknown", text)``.

    The reference trainer logs ``stop`` with ``exit_code`` at the end (0: done); ``guard.close()`` logs
    ``reason="closed"`` (a user's loop that closes its guard finished); the guard logs
    ``reason="request_stop"`` when a signal (preemption) asked the run to stop and checkpoint. Without any
    ``stop`` event the log cannot tell a finished user loop from a killed run: ``"unknown"``, said neutrally.
    """
    if not stops:
        return "unknown", (f"No stop event; last step {last_step} (a loop that never calls guard.close() logs "
                           "none; neither does a killed or crashed run)")
    requested = any(e.get("reason") == "request_stop" for e in stops)
    # The trainer's own verdict (exit code) wins over the guard's close() logged after it.
    with_code = [e for e in stops if "exit_code" in e]
    last = with_code[-1] if with_code else stops[-1]
    step = int(_num(last.get("step")))
    if "exit_code" in last:
        code = last.get("exit_code")
        if code == 0 and not requested:
            return "finished", f"stopped at step {step} (exit code 0)"
        if code == 0:
            return "stopped", f"stopped on request at step {step} (signal/preemption); resume from the latest checkpoint"
        return "failed", f"stopped at step {step} with exit code {code}"
    reason = str(last.get("reason") or last.get("message") or "")
    if requested:
        return "stopped", f"stopped on request at step {step} (signal/preemption); resume from the latest checkpoint"
    if reason == "closed":
        return "finished", f"guard closed at step {step}"
    text = reason.lower()
    if any(w in text for w in ("error", "fail", "abort", "exhaust", "diverge", "kill")):
        return "failed", f"stopped at step {step}: {reason}"
    return "finished", f"stopped at step {step}" + (f" ({reason})" if reason else "")
