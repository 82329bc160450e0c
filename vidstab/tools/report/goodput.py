"""The report's Goodput section: the ledger (:mod:`vidstab.run.goodput`) as a stacked bar over time, one segment
per attempt, and a table of seconds per bucket. Plain HTML and CSS: no figure to draw."""

from __future__ import annotations

import html
from pathlib import Path

from ...run.goodput import BUCKETS, ledger
from .markup import _nodata

COLOURS = {"productive": "#2e8b57", "skipped": "#e6a23c", "rework": "#d9534f", "triage": "#b07cc6",
           "checkpoint": "#5b8def", "rollback": "#c0392b", "restart": "#555555", "hang": "#8b0000",
           "startup": "#9aa5b1", "data": "#17a2b8", "validation": "#f0c419", "other": "#cfd6de"}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _goodput_section(run_dir: Path) -> str:
    try:
        led = ledger(run_dir)
    except FileNotFoundError:
        return _nodata("no event log of rank 0")
    wall = led["wall_seconds"]
    if not led["attempts"] or wall <= 0:
        return _nodata("no timed events")
    bar = []
    for a in led["attempts"]:
        segments = "".join(
            f'<div title="attempt {a["attempt"]}: {b} {s:.2f} s" style="flex:{s:.6f};background:{COLOURS[b]}"></div>'
            for b, s in a["buckets"].items() if s > 0)
        bar.append(f'<div title="attempt {a["attempt"]}" style="display:flex;flex:{a["wall_seconds"]:.6f};'
                   f'border-right:2px solid #fff">{segments}</div>')
    legend = " ".join(f'<span style="display:inline-block;width:0.8em;height:0.8em;background:{COLOURS[b]}"></span> {b}'
                      for b in BUCKETS)
    head = "<tr><th>bucket</th><th>seconds</th><th>share</th>" + "".join(
        f"<th>attempt {a['attempt']}</th>" for a in led["attempts"]) + "</tr>"
    rows = [f"<tr><td>{b}</td><td>{led['buckets'][b]:.2f}</td><td>{_pct(led['buckets'][b] / wall)}</td>"
            + "".join(f"<td>{a['buckets'][b]:.2f}</td>" for a in led["attempts"]) + "</tr>" for b in BUCKETS]
    rows.append(f"<tr><th>wall</th><th>{wall:.2f}</th><th>100%</th>"
                + "".join(f"<th>{a['wall_seconds']:.2f}</th>" for a in led["attempts"]) + "</tr>")
    rows.append(f"<tr><th>ETTR</th><th>{_pct(led['ettr'])}</th><th></th>"
                + "".join(f"<th>{_pct(a['ettr'])}</th>" for a in led["attempts"]) + "</tr>")
    caption = (f"ETTR (productive / wall time) {_pct(led['ettr'])} over {len(led['attempts'])} attempt(s), "
               f"{led['restarts']} restart(s); the bar runs left to right through the run's wall time "
               f"({wall:.1f} s), one segment per attempt. Also: vidstab goodput {html.escape(str(run_dir))}")
    return (f'<div style="display:flex;height:1.6em;margin:0.4em 0">{"".join(bar)}</div>'
            f'<p class="caption">{legend}</p><p class="caption">{caption}</p>'
            f'<table class="grid">{head}{"".join(rows)}</table>')
