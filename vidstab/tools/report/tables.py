"""The table sections: per-rank blame, events, incidents (linking each bundle), reading notes."""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np

from .load import RunLog
from .markup import _nodata, _run_file_href, _short_list


#: Rows of the event table before it is cut (the full log stays in the JSONL files).
MAX_EVENT_ROWS = 500

#: Event kinds listed in the event table (metrics are plotted; incidents have their own table).
TABLE_KINDS = ("warn", "skip", "rollback_request", "rollback", "checkpoint", "resume", "stop", "start", "fault", "overflow",
               "restart", "hang", "crash", "quarantine", "rerun")


#: Steps in the per-rank own step time of the rank table (the straggler detector's default window).
OWN_TIME_STEPS = 20


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
    # Each rank's own compute time per step (``local_seconds``: the straggler detector's input), as the median
    # of its last OWN_TIME_STEPS steps: the straggler detector's window (StragglerConfig.window), so a rank that
    # became slow late in a long run still shows.
    own_ms = {}
    for r in ranks:
        m = log.metrics.get(r)
        t = m.columns.get("local_seconds", np.array([])) if m is not None else np.array([])
        t = t[np.isfinite(t) & (t >= 0)][-OWN_TIME_STEPS:]
        own_ms[r] = float(np.median(t)) * 1e3 if len(t) else None
    rows = []
    for r in ranks:
        m = log.metrics.get(r)
        col = (lambda k: m.columns.get(k, np.array([])) if m is not None else np.array([]))
        absmax = col("input_absmax")
        finite = absmax[np.isfinite(absmax)]
        nonfinite_inputs = int((np.nan_to_num(col("input_nonfinite")) > 0).sum())
        nonfinite_loss = int(m.nonfinite["loss_rank"].sum()) if m is not None and "loss_rank" in m.nonfinite else 0
        incidents = sum(1 for i in log.incidents if i.get("rank") == r)
        flagged = bool(blamed[r] or nonfinite_inputs or nonfinite_loss or incidents)
        cells = [str(r), str(len(m.steps) if m is not None else 0), str(len(blamed[r])), str(incidents),
                 str(nonfinite_loss), str(nonfinite_inputs),
                 f"{np.median(finite):.4g}" if len(finite) else "n/a", f"{finite.max():.4g}" if len(finite) else "n/a",
                 _own_time_cell(r, own_ms)]
        style = ' class="flag"' if flagged else ""
        rows.append(f"<tr{style}>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = ("<tr><th>rank</th><th>steps logged</th><th>named as bad rank</th><th>incidents</th>"
            "<th>non-finite loss steps</th><th>steps with non-finite inputs</th><th>median input |max|</th>"
            "<th>largest input |max|</th><th>own step time, median of the last 20 steps (x the other ranks')</th></tr>")
    return f'<table class="grid">{head}{"".join(rows)}</table>'


def _own_time_cell(rank: int, own_ms: dict) -> str:
    """``12.3 ms (x1.02)``: the rank's median own compute time and its ratio to the median of the others'."""
    mine = own_ms.get(rank)
    if mine is None:
        return "n/a"
    others = [v for r, v in own_ms.items() if r != rank and v is not None]
    ratio = f" (x{mine / float(np.median(others)):.2f})" if others and np.median(others) > 0 else ""
    return f"{mine:.3g} ms{ratio}"


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
        href = _run_file_href(log.run_dir, str(inc["_folder"]), out_dir)
        ids = [str(i) for i in inc.get("sample_ids") or []]
        bad = {str(i) for i in inc.get("bad_sample_ids") or []}
        ids_html = ", ".join(f"<b>{html.escape(i)}</b>" if i in bad else html.escape(i) for i in ids) or "n/a"
        link = (f'<a href="{html.escape(href)}/">{html.escape(inc["_folder"])}</a>' if href is not None
                else html.escape(str(inc["_folder"])))
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


def _quarantine_section(log: RunLog) -> str:
    """The run's quarantine list (:mod:`vidstab.recovery.quarantine`): samples kept out of later epochs and resumes."""
    from ...recovery.quarantine import QuarantineError, QuarantineList

    qlist = QuarantineList(log.run_dir)
    try:
        entries = qlist.entries()
    except QuarantineError as e:
        return _nodata(str(e))
    if not entries:
        return _nodata(f"no quarantined samples ({qlist.path.relative_to(log.run_dir)} is empty or absent)")
    body = "".join(
        f"<tr><td>{html.escape(str(e['sample_id']))}</td><td>{html.escape(str(e.get('step')))}</td>"
        f"<td>{html.escape(str(e.get('rank')))}</td><td>{html.escape(str(e.get('source') or ''))}</td>"
        f"<td>{html.escape(str(e.get('reason') or ''))}</td><td>{html.escape(str(e.get('bundle') or '-'))}</td></tr>"
        for e in entries)
    head = "<tr><th>sample</th><th>step</th><th>rank</th><th>source</th><th>reason</th><th>bundle</th></tr>"
    return (f'<table class="grid">{head}{body}</table><p class="caption">{len(entries)} sample(s) kept out of later '
            f"epochs and resumes by <code>vidstab.QuarantinedDataset</code>; release them with "
            f"<code>vidstab quarantine RUN_DIR --clear [--sample ID]</code>.</p>")


def _samples_section(log: RunLog, out_dir: Path) -> str:
    """Validation samples of the reference trainer (events ``kind="validation"``): preview strips and clips."""
    rows = [e for e in log.events if e.get("kind") == "validation" and e.get("strip")]
    if not rows:
        return _nodata("no validation samples (recipes/train.py writes them at the end of a run)")
    body, refused = [], []
    for e in rows[-5:]:
        strip = _run_file_href(log.run_dir, e["strip"], out_dir)
        clips = []
        for v in e.get("videos") or []:
            href = _run_file_href(log.run_dir, v, out_dir)
            if href is None:
                refused.append(v)
            else:
                clips.append(f'<a href="{html.escape(href)}">{html.escape(Path(str(v)).name)}</a>')
        if strip is None:
            refused.append(e["strip"])
        figures = ", ".join(f"{k.replace('_', ' ')} {e[k]}" for k in ("nn_distance", "noise_nn_distance", "data_nn_distance") if e.get(k) is not None)
        image = f'<br><img src="{html.escape(strip)}" alt="samples">' if strip is not None else ""
        body.append(f'<p>step {html.escape(str(e.get("step")))}{" (EMA)" if e.get("ema") else ""}: {" ".join(clips)}<br>'
                    f'<span class="caption">{html.escape(figures)}</span>{image}</p>')
    if refused:
        body.append(f'<p class="caption">not linked (not a file inside the run folder): '
                    f'{html.escape(", ".join(repr(r)[:80] for r in refused[:10]))}</p>')
    return "".join(body) + ('<p class="caption">One row of frames per clip. nn distance: how far sampled latents are from the '
                            "nearest training clip, next to Gaussian noise and the data's own spacing.</p>")


def _notes_section(log: RunLog) -> str:
    if not log.notes:
        return '<p class="nodata">no data: every log line was read</p>'
    shown = log.notes[:50]
    more = f"<li>... and {len(log.notes) - 50} more</li>" if len(log.notes) > 50 else ""
    return "<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in shown) + more + "</ul>"
