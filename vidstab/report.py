"""The stability dashboard: one self-contained HTML page per run, readable in a minute.

``write_report(run_dir)`` merges the per-rank event logs (``RUN_DIR/vidstab/events-rank{R}.jsonl``, schema in
docs/ARCHITECTURE.md) and the incident bundles into ``RUN_DIR/report.html``:

- a summary with the verdict (did it finish, steps, skipped steps, rollbacks, incidents, first/last loss);
- plots (inline base64 PNG, matplotlib Agg): loss, gradient norm with its EMA and spike threshold, learning
  rate, loss scale, clip rate, loss per timestep bucket, input statistics per rank, with skipped steps,
  rollbacks and LR back-offs marked;
- the table of events (warn/skip/rollback/checkpoint/...) and of incidents, linking to each bundle folder.

Every section is always present; one without data says "no data" and why. The page has no external assets
(no scripts, fonts or links off the page), so it can be mailed or attached to a ticket as is.

Reading is tolerant: unparseable lines (a process killed mid-write leaves a torn last line) are skipped
and listed under "Notes". Long runs are plotted with per-bin mean and min/max envelopes, so a single-step
spike in a 100k-step run stays visible. After a rollback or a resume the steps after the checkpoint are
logged again: the plots show the final trajectory and draw the superseded attempt in grey.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .atomic import write_atomic
from .events import iter_event_file

#: Section headings, in page order; every one is on every report.
SECTIONS = (
    "Summary",
    "Loss",
    "Gradient norm",
    "Learning rate",
    "Loss scale",
    "Clip rate",
    "Loss by timestep",
    "Input statistics per rank",
    "Events",
    "Incidents",
    "Notes",
)
#: Default spike ratio and EMA decay of the grad_spike detector (see vidstab/detectors/grad_spike.py),
#: used to redraw the threshold when the metrics do not carry it.
SPIKE_RATIO = 10.0
SPIKE_BETA = 0.98
SPIKE_WARMUP = 5  # the ratio test's warm-up (GradSpikeConfig.ratio_warmup_steps)
#: Points per plotted line; longer series are binned (mean line + min/max envelope).
MAX_POINTS = 2000
#: Rows of the event table before it is cut (the full log stays in the JSONL files).
MAX_EVENT_ROWS = 500
#: Event kinds listed in the event table (metrics are plotted; incidents have their own table).
TABLE_KINDS = ("warn", "skip", "rollback_request", "rollback", "checkpoint", "resume", "stop", "start", "fault", "overflow",
               "restart", "hang", "crash")
# An events-rank{R}.jsonl file is named by its rank.
_RANK_PREFIX = "events-rank"
# (attempt, step) packed into one int64 key for numpy group-by: steps stay below 2**40.
_KEY = 1 << 40


# ----------------------------------------------------------------------------------------------------
# Reading the run


@dataclass
class RankMetrics:
    """The ``metrics`` events of one rank as columns (file order), ``nan`` where a value is missing."""

    steps: np.ndarray
    """Step of each record."""
    attempts: np.ndarray
    """0 for the first pass over a step, +1 after every rollback/resume that rewound the step counter."""
    columns: dict[str, np.ndarray]
    """Field -> float values (``nan`` when absent or logged as null)."""
    nulls: dict[str, np.ndarray]
    """Field -> True where the field was present but null (a non-finite number in the log)."""
    loss_by_t: np.ndarray
    """``[records, buckets]`` bucket losses (``nan`` for an empty bucket or a record without them)."""


@dataclass
class RunLog:
    """Everything the report reads from a run folder."""

    run_dir: Path
    """The run folder."""
    metrics: dict[int, RankMetrics] = field(default_factory=dict)
    """Rank -> its metrics."""
    events: list[dict] = field(default_factory=list)
    """Every non-metrics event of every rank, with ``_attempt`` added, in (step, time) order."""
    incidents: list[dict] = field(default_factory=list)
    """Parsed ``incident.json`` files, each with ``_folder`` (path relative to the run folder)."""
    notes: list[str] = field(default_factory=list)
    """Problems met while reading (torn lines, unreadable incident files)."""


_NUMERIC = frozenset((int, float, bool))


def _num(x: Any) -> float:
    """A logged value as a float; ``nan`` for null, missing or non-numeric (JSON gives exact types only)."""
    return float(x) if type(x) in _NUMERIC else math.nan


def load_run(run_dir: str | Path) -> RunLog:
    """Read the event logs of every rank and the incident bundles of a run folder."""
    run_dir = Path(run_dir)
    log = RunLog(run_dir=run_dir)
    files = sorted((run_dir / "vidstab").glob(f"{_RANK_PREFIX}*.jsonl"))
    if not files:
        log.notes.append(f"no event logs found under {run_dir / 'vidstab'}")
    order = 0
    for path in files:
        suffix = path.stem[len(_RANK_PREFIX):]
        file_rank = int(suffix) if suffix.isdigit() else None
        steps, attempts, records, by_t = [], [], [], []
        attempt, last_step = 0, None
        for rec in iter_event_file(path, log.notes):
            step = int(_num(rec.get("step")) if math.isfinite(_num(rec.get("step"))) else 0)
            rank = file_rank if file_rank is not None else int(_num(rec.get("rank")) or 0)
            if rec["kind"] == "metrics":
                # The step counter going back means a rollback or resume re-runs these steps: a new attempt.
                if last_step is not None and step <= last_step:
                    attempt += 1
                last_step = step
                steps.append(step)
                attempts.append(attempt)
                records.append(rec)
                lbt = rec.get("loss_by_t")
                by_t.append(lbt if isinstance(lbt, list) else [])
            else:
                event = dict(rec)
                event["rank"] = rank
                event["_attempt"] = attempt
                event["_order"] = order
                log.events.append(event)
            order += 1
        if records:
            fields = sorted({k for r in records for k, v in r.items() if k not in ("loss_by_t",)}
                            - {"schema", "time", "step", "rank", "kind"})
            columns = {k: np.array([_num(r.get(k)) for r in records]) for k in fields}
            width = max(map(len, by_t))
            lbt = np.array([[_num(x) for x in row] + [math.nan] * (width - len(row)) for row in by_t]).reshape(len(by_t), width)
            columns["time"] = np.array([_num(r.get("time")) for r in records])
            nulls = {k: np.array([k in r and r[k] is None for r in records]) for k in fields}
            log.metrics[file_rank if file_rank is not None else int(_num(records[0].get("rank")) or 0)] = RankMetrics(
                np.array(steps), np.array(attempts), columns, nulls, lbt
            )
    log.events.sort(key=lambda e: (_num(e.get("step")), _num(e.get("time")), e["_order"]))

    for path in sorted((run_dir / "vidstab" / "incidents").glob("*/incident.json")):
        try:
            info = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(info, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as err:
            log.notes.append(f"{path.relative_to(run_dir)}: unreadable incident ({err})")
            continue
        info["_folder"] = path.parent.relative_to(run_dir).as_posix()
        log.incidents.append(info)
    # Incident events whose bundle folder is missing (deleted, or the write never finished) still count.
    folders = {i["_folder"] for i in log.incidents}
    for e in log.events:
        if e.get("kind") == "incident" and e.get("path"):
            folder = str(e["path"]).rstrip("/")
            if folder.endswith("incident.json"):
                folder = folder.rsplit("/", 1)[0]
            if folder not in folders:
                folders.add(folder)
                log.incidents.append({**{k: v for k, v in e.items() if not k.startswith("_")},
                                      "_folder": folder, "_missing": True})
    log.incidents.sort(key=lambda i: (_num(i.get("step")), _num(i.get("rank"))))
    return log


# ----------------------------------------------------------------------------------------------------
# Series: merging ranks and attempts


@dataclass
class Series:
    """One metric over steps: the final trajectory, plus values superseded by a later attempt."""

    steps: np.ndarray
    """Steps of the final trajectory (sorted, unique)."""
    values: np.ndarray
    """Values at those steps."""
    superseded: list[tuple[np.ndarray, np.ndarray]]
    """(steps, values) of each earlier attempt over steps that were run again later."""

    @property
    def empty(self) -> bool:
        """True when no finite value exists."""
        return not np.isfinite(self.values).any()


def _merge(log: RunLog, name: str, ranks: Iterable[int] | None = None, how: str = "mean") -> Series:
    """A metric as one series over steps: ranks combined (``mean`` for rank-local numbers, ``first`` for
    global ones), attempts resolved (the latest attempt of a step wins; earlier ones go to ``superseded``)."""
    parts_s, parts_a, parts_v, parts_r = [], [], [], []
    for rank, m in log.metrics.items():
        if ranks is not None and rank not in ranks:
            continue
        if name not in m.columns:
            continue
        parts_s.append(m.steps)
        parts_a.append(m.attempts)
        parts_v.append(m.columns[name])
        parts_r.append(np.full(len(m.steps), rank))
    if not parts_s:
        return Series(np.array([]), np.array([]), [])
    steps = np.concatenate(parts_s)
    attempts = np.concatenate(parts_a)
    values = np.concatenate(parts_v)
    rank_of = np.concatenate(parts_r)
    if how == "first":  # global numbers: the lowest rank that logged a finite value
        order = np.lexsort((rank_of, ~np.isfinite(values), steps, attempts))
        steps, attempts, values = steps[order], attempts[order], values[order]
        keys = attempts.astype(np.int64) * _KEY + steps.astype(np.int64)
        _, first = np.unique(keys, return_index=True)
        steps, attempts, values = steps[first], attempts[first], values[first]
    else:
        keys = attempts.astype(np.int64) * _KEY + steps.astype(np.int64)
        uniq, inverse = np.unique(keys, return_inverse=True)
        finite = np.isfinite(values)
        sums = np.zeros(len(uniq))
        counts = np.zeros(len(uniq))
        anybad = np.zeros(len(uniq), dtype=bool)
        np.add.at(sums, inverse[finite], values[finite])
        np.add.at(counts, inverse[finite], 1)
        np.logical_or.at(anybad, inverse, ~finite)
        with np.errstate(invalid="ignore", divide="ignore"):
            values = sums / counts
        steps = (uniq % _KEY).astype(np.int64)
        attempts = (uniq // _KEY).astype(np.int64)
    # Final trajectory: for each step the value of its latest attempt.
    order = np.lexsort((attempts, steps))
    steps, attempts, values = steps[order], attempts[order], values[order]
    last = np.r_[steps[1:] != steps[:-1], True]
    superseded = []
    for a in np.unique(attempts[~last]):
        sel = (~last) & (attempts == a)
        superseded.append((steps[sel], values[sel]))
    return Series(steps[last], values[last], superseded)


def _nonfinite_loss_steps(log: RunLog) -> np.ndarray:
    """Steps whose loss was logged as null (non-finite) on any rank, in the final attempt or not."""
    out = [m.steps[m.nulls["loss"]] for m in log.metrics.values() if "loss" in m.nulls]
    return np.unique(np.concatenate(out)) if out else np.array([], dtype=np.int64)


def _loss_by_t(log: RunLog) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, [n_steps, n_buckets])``: bucket losses, mean over ranks, latest attempt per step."""
    parts = [(m.steps, m.attempts, m.loss_by_t) for m in log.metrics.values() if m.loss_by_t.size]
    if not parts:
        return np.array([]), np.zeros((0, 0))
    width = max(p[2].shape[1] for p in parts)
    steps = np.concatenate([p[0] for p in parts])
    attempts = np.concatenate([p[1] for p in parts])
    table = np.concatenate([np.pad(p[2], ((0, 0), (0, width - p[2].shape[1])), constant_values=np.nan) for p in parts])
    keys = attempts.astype(np.int64) * _KEY + steps.astype(np.int64)
    uniq, inverse = np.unique(keys, return_inverse=True)
    finite = np.isfinite(table)
    sums = np.zeros((len(uniq), width))
    counts = np.zeros((len(uniq), width))
    np.add.at(sums, inverse, np.where(finite, table, 0.0))
    np.add.at(counts, inverse, finite)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = sums / counts  # nan where a bucket had no sample on any rank
    steps, attempts = uniq % _KEY, uniq // _KEY
    order = np.lexsort((attempts, steps))
    steps, means = steps[order], means[order]
    last = np.r_[steps[1:] != steps[:-1], True]
    return steps[last], means[last]


class _quiet:
    """Silence numpy's 'mean of empty slice' warnings (an empty bucket is normal)."""

    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def _bin(x: np.ndarray, y: np.ndarray, max_points: int = MAX_POINTS):
    """``(x, mean, low, high)``: series longer than ``max_points`` binned to ``max_points // 2`` bins
    (``low``/``high`` are the bin min/max, ``None`` when not binned)."""
    if len(x) <= max_points:
        return x, y, None, None
    n_bins = max_points // 2
    edges = np.linspace(0, len(x), n_bins + 1).astype(int)
    xs, mean, low, high = [], [], [], []
    with _quiet():
        for a, b in zip(edges[:-1], edges[1:]):
            if b <= a:
                continue
            seg = y[a:b]
            xs.append(x[a:b].mean())
            mean.append(np.nanmean(seg))
            low.append(np.nanmin(seg))
            high.append(np.nanmax(seg))
    return np.array(xs), np.array(mean), np.array(low), np.array(high)


# ----------------------------------------------------------------------------------------------------
# Plot helpers


def _pyplot():
    """matplotlib with the file-only Agg backend (no display needed, safe in any process)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> str:
    """A figure as an inline ``<img>`` (base64 PNG); the figure is closed."""
    plt = _pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img alt="plot" src="data:image/png;base64,{data}">'


def _line(ax, x, y, label=None, color=None, lw=1.2, alpha=1.0):
    """Plot a (possibly binned) series: mean line plus a min/max band when binned."""
    bx, by, lo, hi = _bin(np.asarray(x, dtype=float), np.asarray(y, dtype=float))
    (line,) = ax.plot(bx, by, label=label, color=color, lw=lw, alpha=alpha)
    if lo is not None:
        ax.fill_between(bx, lo, hi, color=line.get_color(), alpha=0.2 * alpha, lw=0)
    return line


def _marks(ax, steps, color, label):
    """Vertical lines at ``steps`` (one collection: fast even for thousands of marks)."""
    steps = np.asarray(sorted(set(steps)), dtype=float)
    if len(steps):
        ax.vlines(steps, 0, 1, transform=ax.get_xaxis_transform(), colors=color, lw=0.8, alpha=0.6,
                  linestyles="--", label=f"{label} ({len(steps)})")


def _superseded(ax, series: Series, label: bool = True):
    for i, (s, v) in enumerate(series.superseded):
        _line(ax, s, v, label="before rollback/resume" if (label and i == 0) else None, color="0.6", lw=0.9)


def _legend(ax, **kw):
    """Legend outside the plot area on the right, so it never hides a spike."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False, **kw)


def _auto_log(ax, values: np.ndarray) -> None:
    """Log y axis when positive values span more than two orders of magnitude (a blow-up next to a
    normal curve would otherwise flatten the normal part into a line at zero)."""
    finite = values[np.isfinite(values)]
    if len(finite) and finite.min() > 0 and finite.max() / finite.min() > 100:
        ax.set_yscale("log")


def _figure(height: float = 2.8):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, height))
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("step")
    return fig, ax


# ----------------------------------------------------------------------------------------------------
# Sections


def _event_steps(log: RunLog, kind: str) -> list[int]:
    return sorted({int(_num(e.get("step"))) for e in log.events if e.get("kind") == kind})


def _skip_steps(log: RunLog) -> list[int]:
    """Steps whose update was not applied by a vidstab verdict: ``skip`` events, plus metrics with
    ``applied: false`` that are not fp16 overflows (those the scaler skips; they are marked apart)."""
    steps = set(_event_steps(log, "skip"))
    overflow = set(_event_steps(log, "overflow"))
    for m in log.metrics.values():
        if "applied" in m.columns:
            not_applied = m.steps[m.columns["applied"] == 0].tolist()
            steps.update(s for s in not_applied if s not in overflow)
    return sorted(steps)


def _nodata(why: str) -> str:
    return f'<p class="nodata">no data: {html.escape(why)}</p>'


def _restarts_text(log: RunLog) -> str:
    """Torch-elastic restarts of the job (vidstab.elastic): how many, and the cause and resume step of each."""
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
    skips = _skip_steps(log)
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
    if ending == "failed":
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
    duration = (max(times) - min(times)) if times else math.nan
    started = _dt.datetime.fromtimestamp(min(times), _dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC") if times else "n/a"
    last_ckpt = checkpoints[-1] if checkpoints else None
    rows = [
        ("steps logged", f"{len(loss.steps)} (last step {last_step})"),
        ("ranks", ", ".join(map(str, ranks)) or "n/a"),
        ("skipped steps", f"{len(skips)}" + (f" (steps {_short_list(skips)})" if skips else "")),
        ("rollbacks", f"{len(rollback_steps)}" + (f" (at steps {_short_list([s for _, s in rollback_steps])})" if rollbacks else "")),
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
        ("wall time", f"{duration / 3600:.2f} h" if duration > 3600 else (f"{duration:.0f} s" if math.isfinite(duration) else "n/a")),
    ]
    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{v if k == 'last checkpoint' else html.escape(v)}</td></tr>"
                    for k, v in rows)
    return f'<p class="verdict {css}">{html.escape(verdict)}</p><table class="kv">{table}</table>'


def _finished(stops: list[dict], last_step: int) -> tuple[str, str]:
    """How the run ended, from its ``stop`` events: ``("finished" | "stopped" | "failed", explanation)``.

    The reference trainer logs ``stop`` with ``exit_code`` at the end (0: done); the guard logs
    ``reason="request_stop"`` when a signal (preemption) asked the run to stop and checkpoint.
    """
    if not stops:
        return "failed", f"no stop event (killed, crashed or still running; last logged step {last_step})"
    last = stops[-1]
    step = int(_num(last.get("step")))
    requested = any(e.get("reason") == "request_stop" for e in stops)
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
    text = reason.lower()
    if any(w in text for w in ("error", "fail", "abort", "exhaust", "diverge", "kill")):
        return "failed", f"stopped at step {step}: {reason}"
    return "finished", f"stopped at step {step}" + (f" ({reason})" if reason else "")


def _short_list(items: list, n: int = 10) -> str:
    shown = ", ".join(str(i) for i in items[:n])
    return shown + (f", ... (+{len(items) - n})" if len(items) > n else "")


def _loss_section(log: RunLog) -> str:
    loss = _merge(log, "loss")
    if loss.empty and not len(_nonfinite_loss_steps(log)):
        return _nodata("no metrics events with a loss")
    fig, ax = _figure(3.2)
    _superseded(ax, loss)
    _line(ax, loss.steps, loss.values, label="loss", color="C0")
    _marks(ax, _skip_steps(log), "red", "skipped step")
    _marks(ax, _event_steps(log, "rollback"), "purple", "rollback")
    _marks(ax, _event_steps(log, "resume"), "green", "resume")
    bad = _nonfinite_loss_steps(log)
    if len(bad):
        top = np.nanmax(loss.values) if not loss.empty else 1.0
        ax.plot(bad, np.full(len(bad), top), "x", color="red", label=f"non-finite loss ({len(bad)})")
    _auto_log(ax, loss.values)
    ax.set_ylabel("loss")
    _legend(ax)
    return _png(fig) + ('<p class="caption">Per-step loss (the mean over ranks; each rank\'s own loss is under "Input statistics per rank"). Dashed lines: skipped steps (red), '
                        'rollbacks (purple) and resumes (green); grey: steps superseded by a rollback or resume.</p>')


def _spike_band(log: RunLog, grad: Series) -> tuple[np.ndarray, np.ndarray, str]:
    """The grad-norm EMA and spike threshold: from the metrics when logged, else recomputed with the
    detector's defaults (ratio 10, beta 0.98, 5 warm-up steps for the ratio test) over applied steps only."""
    ema = _merge(log, "grad_norm_ema", how="first")
    if not ema.empty:
        thr = _merge(log, "grad_spike_threshold", how="first")
        if not thr.empty:
            values = np.interp(grad.steps, thr.steps, thr.values)
        else:
            values = np.interp(grad.steps, ema.steps, ema.values) * SPIKE_RATIO
        return np.interp(grad.steps, ema.steps, ema.values), values, "logged"
    skipped = set(_skip_steps(log))
    out_ema = np.full(len(grad.steps), np.nan)
    mean, weight, applied = 0.0, 0.0, 0
    for i, (s, v) in enumerate(zip(grad.steps.tolist(), grad.values.tolist())):
        if applied >= SPIKE_WARMUP:
            out_ema[i] = mean / weight
        if s in skipped or not math.isfinite(v):
            continue  # the detector's statistics only see applied steps
        mean = SPIKE_BETA * mean + (1 - SPIKE_BETA) * v
        weight = SPIKE_BETA * weight + (1 - SPIKE_BETA)  # bias correction, as in Adam
        applied += 1
    return out_ema, out_ema * SPIKE_RATIO, f"recomputed (EMA beta {SPIKE_BETA}, ratio {SPIKE_RATIO:g})"


def _grad_section(log: RunLog) -> str:
    grad = _merge(log, "grad_norm", how="first")
    if grad.empty:
        return _nodata("no grad_norm in the metrics")
    fig, ax = _figure(3.2)
    _superseded(ax, grad)
    positive = np.where(grad.values > 0, grad.values, np.nan)
    _line(ax, grad.steps, positive, label="grad norm (pre-clip)", color="C1")
    ema, threshold, source = _spike_band(log, grad)
    if np.isfinite(ema).any():
        _line(ax, grad.steps, ema, label="EMA", color="C2", lw=1.0)
        bx, lo, _, _ = _bin(grad.steps.astype(float), ema)
        _, hi, _, _ = _bin(grad.steps.astype(float), threshold)
        ax.fill_between(bx, lo, hi, color="C2", alpha=0.08, lw=0)
        _line(ax, grad.steps, threshold, label=f"spike threshold ({source})", color="red", lw=0.9)
    skips = _skip_steps(log)
    _marks(ax, skips, "red", "skipped step")
    _marks(ax, _event_steps(log, "rollback"), "purple", "rollback")
    ax.set_yscale("log")
    ax.set_ylabel("global grad norm")
    _legend(ax)
    return _png(fig) + ('<p class="caption">Global gradient norm before clipping (log scale) with its EMA; the shaded '
                        'band reaches the spike threshold (EMA x ratio). A step above the red line is a spike.</p>')


def _lr_section(log: RunLog) -> str:
    lr = _merge(log, "lr", how="first")
    if lr.empty:
        return _nodata("no lr in the metrics")
    fig, ax = _figure()
    _superseded(ax, lr)
    _line(ax, lr.steps, lr.values, label="learning rate", color="C4")
    # A rollback backs the LR off; a resume after one carries the reduced multiplier on.
    backoffs = [int(_num(e.get("step"))) for e in log.events
                if e.get("kind") == "rollback" or any(k in e for k in ("lr_factor", "lr_backoff", "new_lr"))
                or (e.get("kind") == "resume" and _num(e.get("lr_multiplier")) < 1)]
    _marks(ax, backoffs, "purple", "rollback / LR back-off")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.set_ylabel("lr")
    _legend(ax)
    return _png(fig) + '<p class="caption">Learning rate per step; purple lines: rollbacks and LR back-offs.</p>'


def _loss_scale_section(log: RunLog) -> str:
    scale = _merge(log, "loss_scale", how="first")
    if scale.empty:
        return _nodata("no loss_scale in the metrics (it is logged under fp16 loss scaling only)")
    fig, ax = _figure()
    _line(ax, scale.steps, scale.values, label="loss scale", color="C5")
    _marks(ax, _event_steps(log, "overflow"), "orange", "overflow")
    ax.set_yscale("log", base=2)
    ax.set_ylabel("loss scale")
    _legend(ax)
    return _png(fig) + ('<p class="caption">fp16 loss scale (log2); orange lines: overflow steps the scaler skipped. '
                        'A scale that keeps falling means the model lives at the edge of fp16 range.</p>')


def _clip_section(log: RunLog) -> str:
    rate = _merge(log, "clip_rate", how="first")
    source = "clip_rate as logged"
    if rate.empty:
        clipped = _merge(log, "clipped", how="first")
        if clipped.empty:
            return _nodata("no clip_rate or clipped in the metrics")
        window = 50
        vals = np.nan_to_num(clipped.values)
        rate = Series(clipped.steps, np.convolve(vals, np.ones(window) / window, mode="full")[: len(vals)], [])
        source = f"fraction of clipped steps over the last {window}"
    fig, ax = _figure(2.4)
    _line(ax, rate.steps, rate.values, label=source, color="C3")
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("clip rate")
    _legend(ax)
    return _png(fig) + ('<p class="caption">Share of steps whose gradient was clipped. Clipping every step means '
                        'the LR, the model or the data needs attention: clipping is a seat belt, not an engine.</p>')


def _timestep_section(log: RunLog) -> str:
    steps, table = _loss_by_t(log)
    if not len(steps) or not np.isfinite(table).any():
        return _nodata("no loss_by_t in the metrics")
    plt = _pyplot()
    n_buckets = table.shape[1]
    fig, ax = _figure(3.2)
    # Per-bucket losses are noisy (few samples per bucket per step): bin them to at most 200 points.
    edges = np.linspace(0, len(steps), min(200, len(steps)) + 1).astype(int)
    xs = np.array([steps[a:b].mean() for a, b in zip(edges[:-1], edges[1:]) if b > a])
    with _quiet():
        binned = np.array([np.nanmean(table[a:b], axis=0) for a, b in zip(edges[:-1], edges[1:]) if b > a])
    if n_buckets <= 12:
        cmap = plt.get_cmap("viridis")
        for k in range(n_buckets):
            ax.plot(xs, binned[:, k], color=cmap(k / max(1, n_buckets - 1)), lw=1.0, label=f"t bucket {k}")
        ax.set_ylabel("loss")
        _legend(ax)
    else:
        im = ax.imshow(binned.T, aspect="auto", origin="lower", extent=(xs[0], xs[-1], -0.5, n_buckets - 0.5),
                       cmap="viridis")
        fig.colorbar(im, ax=ax, label="loss")
        ax.set_ylabel("timestep bucket")
    return _png(fig) + (f'<p class="caption">Loss per timestep bucket ({n_buckets} buckets, 0 = least noise), mean '
                        'over ranks. Trouble often starts in one bucket (t near 0 or near T) before the total moves.</p>')


def _inputs_section(log: RunLog) -> str:
    fields = [("loss_rank", "loss (this rank)", False), ("input_absmax", "input |max|", True), ("input_std", "input std", False),
              ("input_mean", "input mean", False), ("input_nonfinite", "non-finite inputs", False)]
    present = [f for f in fields if any(f[0] in m.columns and np.isfinite(m.columns[f[0]]).any()
                                        for m in log.metrics.values())]
    table = _rank_table(log)
    if not present:
        return table + _nodata("no input_* statistics in the metrics")
    plt = _pyplot()
    fig, axes = plt.subplots(len(present), 1, figsize=(10, 1.9 * len(present) + 0.6), sharex=True, squeeze=False)
    for ax, (name, label, log_y) in zip(axes[:, 0], present):
        seen = []
        for rank in sorted(log.metrics):
            s = _merge(log, name, ranks=[rank])
            if s.empty:
                continue
            y = np.where(s.values > 0, s.values, np.nan) if log_y else s.values
            _line(ax, s.steps, y, label=f"rank {rank}", lw=1.0)
            seen.append(s.values)
        if log_y:
            ax.set_yscale("log")
        elif name == "loss_rank" and seen:
            _auto_log(ax, np.concatenate(seen))
        ax.set_ylabel(label, fontsize=8)
        ax.grid(True, alpha=0.3)
        _marks(ax, _skip_steps(log), "red", "skipped step")
    _legend(axes[0, 0])
    axes[-1, 0].set_xlabel("step")
    return table + _png(fig) + ('<p class="caption">Statistics of each rank\'s input batch. One rank standing out points '
                        'at that rank\'s data: do not read rank 0 only.</p>')


def _rank_table(log: RunLog) -> str:
    """One row per rank: how often it was the bad one. A rank that stands out is a data or hardware lead."""
    ranks = sorted(set(log.metrics) | {e["rank"] for e in log.events})
    if not ranks:
        return ""
    blamed: dict[int, set] = {r: set() for r in ranks}
    for e in log.events:
        for r in e.get("bad_ranks") or []:
            if isinstance(r, int) and r in blamed:
                # Every rank logs the same verdict: count each (kind, step, attempt, detector) once.
                blamed[r].add((e.get("kind"), e.get("step"), e["_attempt"], e.get("detector")))
    rows = []
    for r in ranks:
        m = log.metrics.get(r)
        col = (lambda k: m.columns.get(k, np.array([])) if m is not None else np.array([]))
        absmax = col("input_absmax")
        finite = absmax[np.isfinite(absmax)]
        nonfinite_inputs = int((np.nan_to_num(col("input_nonfinite")) > 0).sum())
        nonfinite_loss = int(m.nulls["loss_rank"].sum()) if m is not None and "loss_rank" in m.nulls else 0
        incidents = sum(1 for i in log.incidents if i.get("rank") == r)
        flagged = bool(blamed[r] or nonfinite_inputs or nonfinite_loss or incidents)
        cells = [str(r), str(len(m.steps) if m is not None else 0), str(len(blamed[r])), str(incidents),
                 str(nonfinite_loss), str(nonfinite_inputs),
                 f"{np.median(finite):.4g}" if len(finite) else "n/a", f"{finite.max():.4g}" if len(finite) else "n/a"]
        style = ' class="flag"' if flagged else ""
        rows.append(f"<tr{style}>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = ("<tr><th>rank</th><th>steps logged</th><th>named as bad rank</th><th>incidents</th>"
            "<th>non-finite loss steps</th><th>steps with non-finite inputs</th><th>median input |max|</th>"
            "<th>largest input |max|</th></tr>")
    return f'<table class="grid">{head}{"".join(rows)}</table>'


def _events_section(log: RunLog) -> str:
    merged: dict[tuple, dict] = {}
    for e in log.events:
        if e.get("kind") not in TABLE_KINDS:
            continue
        # The same verdict is logged by every rank: one row, listing the ranks.
        key = (e.get("kind"), e.get("step"), e["_attempt"], e.get("detector"), str(e.get("message")), str(e.get("path")))
        if key in merged:
            merged[key]["_ranks"].append(e["rank"])
        else:
            merged[key] = {**e, "_ranks": [e["rank"]]}
    rows = list(merged.values())
    if not rows:
        return _nodata("no warn/skip/rollback/checkpoint/resume/stop events")
    note = ""
    if len(rows) > MAX_EVENT_ROWS:
        note = f'<p class="caption">{len(rows)} events; the first {MAX_EVENT_ROWS} are shown (all are in the JSONL logs).</p>'
        rows = rows[:MAX_EVENT_ROWS]
    skip_keys = {"schema", "time", "step", "rank", "kind", "detector", "message", "reason"}
    body = []
    for e in rows:
        details = {k: v for k, v in e.items() if k not in skip_keys and not k.startswith("_")}
        text = json.dumps(details, separators=(", ", ": "), default=str)
        if len(text) > 240:
            text = text[:240] + " ..."
        body.append(
            f'<tr class="k-{html.escape(str(e.get("kind")))}"><td>{html.escape(str(e.get("step")))}</td>'
            f"<td>{html.escape(str(e.get('kind')))}</td><td>{html.escape(_short_list(sorted(set(e['_ranks']))))}</td>"
            f"<td>{html.escape(str(e.get('detector') or ''))}</td><td>{html.escape(str(e.get('message') or e.get('reason') or ''))}</td>"
            f"<td class=\"mono\">{html.escape(text)}</td></tr>"
        )
    head = "<tr><th>step</th><th>kind</th><th>ranks</th><th>detector</th><th>message</th><th>details</th></tr>"
    return f'<table class="grid">{head}{"".join(body)}</table>{note}'


def _incidents_section(log: RunLog, out_dir: Path) -> str:
    if not log.incidents:
        return _nodata("no incident bundles under vidstab/incidents/")
    body = []
    for inc in log.incidents:
        folder = log.run_dir / inc["_folder"]
        href = Path(os.path.relpath(folder, out_dir)).as_posix() + "/"
        ids = [str(i) for i in inc.get("sample_ids") or []]
        bad = {str(i) for i in inc.get("bad_sample_ids") or []}
        ids_html = ", ".join(f"<b>{html.escape(i)}</b>" if i in bad else html.escape(i) for i in ids) or "n/a"
        link = f'<a href="{html.escape(href)}">{html.escape(inc["_folder"])}</a>'
        if inc.get("_missing"):
            link += " (bundle missing)"
        body.append(
            f"<tr><td>{html.escape(str(inc.get('step')))}</td><td>{html.escape(str(inc.get('rank')))}</td>"
            f"<td>{ids_html}</td><td>{html.escape(str(inc.get('detector') or ''))}</td>"
            f"<td>{html.escape(str(inc.get('verdict') or ''))}</td><td>{html.escape(str(inc.get('message') or ''))}</td>"
            f"<td>{link}</td></tr>"
        )
    head = ("<tr><th>step</th><th>rank</th><th>sample ids (bad in bold)</th><th>detector</th><th>verdict</th>"
            "<th>message</th><th>bundle</th></tr>")
    return (f'<table class="grid">{head}{"".join(body)}</table><p class="caption">Replay one with '
            f'<code>vidstab replay RUN_DIR/&lt;bundle&gt;</code>.</p>')


def _notes_section(log: RunLog) -> str:
    if not log.notes:
        return '<p class="nodata">no data: every log line was read</p>'
    shown = log.notes[:50]
    more = f"<li>... and {len(log.notes) - 50} more</li>" if len(log.notes) > 50 else ""
    return "<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in shown) + more + "</ul>"


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:1.5em auto;max-width:1100px;color:#222}
h1{font-size:1.5em;margin-bottom:0.2em} h2{font-size:1.15em;border-bottom:1px solid #ddd;padding-bottom:2px;margin-top:1.6em}
.verdict{font-size:1.15em;font-weight:600;padding:0.5em 0.8em;border-radius:4px}
.good{background:#e6f4ea;color:#1e6b34}.warn{background:#fff4e0;color:#8a5300}.bad{background:#fde7e7;color:#a11}
table{border-collapse:collapse;font-size:0.85em} td,th{padding:3px 8px;text-align:left;vertical-align:top}
table.grid td,table.grid th{border:1px solid #ddd} table.kv th{font-weight:500;color:#555}
tr.k-skip td,tr.k-rollback td{background:#fff6f6} tr.k-warn td{background:#fffbea} tr.flag td{background:#fff0f0;font-weight:600}
.mono{font-family:ui-monospace,Menlo,monospace;font-size:0.9em;word-break:break-all}
.nodata{color:#888;font-style:italic} .caption{color:#555;font-size:0.85em;margin-top:0}
img{max-width:100%} nav a{margin-right:0.8em;font-size:0.85em}
"""


def render_report(run_dir: str | Path, out_dir: str | Path | None = None) -> str:
    """The dashboard HTML of a run (links to incident bundles relative to ``out_dir``, default the run folder)."""
    log = load_run(run_dir)
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir
    builders = {
        "Summary": lambda: _summary(log),
        "Loss": lambda: _loss_section(log),
        "Gradient norm": lambda: _grad_section(log),
        "Learning rate": lambda: _lr_section(log),
        "Loss scale": lambda: _loss_scale_section(log),
        "Clip rate": lambda: _clip_section(log),
        "Loss by timestep": lambda: _timestep_section(log),
        "Input statistics per rank": lambda: _inputs_section(log),
        "Events": lambda: _events_section(log),
        "Incidents": lambda: _incidents_section(log, out_dir),
        "Notes": lambda: _notes_section(log),
    }
    parts = []
    for title in SECTIONS:
        anchor = title.lower().replace(" ", "-")
        try:
            body = builders[title]()
        except Exception as err:  # noqa: BLE001 -- one broken section must not cost the whole dashboard
            body = f'<p class="nodata">no data: this section failed to render ({html.escape(type(err).__name__)}: {html.escape(str(err))})</p>'
        parts.append(f'<section id="{anchor}"><h2>{html.escape(title)}</h2>{body}</section>')
    nav = "".join(f'<a href="#{t.lower().replace(" ", "-")}">{html.escape(t)}</a>' for t in SECTIONS)
    name = html.escape(run_dir.resolve().name)
    generated = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>vidstab report: {name}</title><style>{_CSS}</style></head><body>"
        f"<h1>vidstab report: {name}</h1><p class=\"caption\">{html.escape(str(run_dir))}, generated {generated}</p>"
        f"<nav>{nav}</nav>{''.join(parts)}</body></html>\n"
    )


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the dashboard of ``run_dir`` to ``out`` (default ``RUN_DIR/report.html``) and return its path.

    Written to a temporary file and renamed, so a reader never sees half a page.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run folder {str(run_dir)!r} does not exist")
    out = Path(out) if out is not None else run_dir / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(out, render_report(run_dir, out.parent))
