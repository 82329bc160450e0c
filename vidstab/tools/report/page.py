"""The whole page: every section in order (one failing section never costs the dashboard), written atomically."""

from __future__ import annotations

import datetime as _dt
import html
from pathlib import Path

import numpy as np

from ...files.atomic import write_atomic
from .figures import (_clip_section, _grad_section, _inputs_section, _loss_scale_section, _loss_section,
                      _lr_section, _timestep_section)
from .goodput import _goodput_section
from .load import RunLog, load_run
from .markup import _CSS
from .series import _loss_by_t
from .summary import _summary
from .tables import _events_section, _incidents_section, _notes_section, _quarantine_section, _samples_section


#: Section headings, in page order; every one is on every report except "Loss by timestep", which is left
#: out when the run logged no per-sample loss (``guard.backward(..., per_sample_loss=...)``): an empty
#: panel would only say what was not given.
SECTIONS = (
    "Summary",
    "Goodput",
    "Loss",
    "Gradient norm",
    "Learning rate",
    "Loss scale",
    "Clip rate",
    "Loss by timestep",
    "Input statistics per rank",
    "Events",
    "Incidents",
    "Quarantine",
    "Samples",
    "Notes",
)


def _has_per_sample_loss(log: RunLog) -> bool:
    """Whether any step logged a finite timestep-bucket loss (from per-sample losses)."""
    _, table = _loss_by_t(log)
    return bool(table.size and np.isfinite(table).any())


def render_report(run_dir: str | Path, out_dir: str | Path | None = None) -> str:
    """The dashboard HTML of a run (links to incident bundles relative to ``out_dir``, default the run folder)."""
    log = load_run(run_dir)
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir
    builders = {
        "Summary": lambda: _summary(log),
        "Goodput": lambda: _goodput_section(run_dir),
        "Loss": lambda: _loss_section(log),
        "Gradient norm": lambda: _grad_section(log),
        "Learning rate": lambda: _lr_section(log),
        "Loss scale": lambda: _loss_scale_section(log),
        "Clip rate": lambda: _clip_section(log),
        "Loss by timestep": lambda: _timestep_section(log),
        "Input statistics per rank": lambda: _inputs_section(log),
        "Events": lambda: _events_section(log),
        "Incidents": lambda: _incidents_section(log, out_dir),
        "Quarantine": lambda: _quarantine_section(log),
        "Samples": lambda: _samples_section(log, out_dir),
        "Notes": lambda: _notes_section(log),
    }
    shown = [t for t in SECTIONS if t != "Loss by timestep" or _has_per_sample_loss(log)]
    parts = []
    for title in shown:
        anchor = title.lower().replace(" ", "-")
        try:
            body = builders[title]()
        except Exception as err:  # noqa: BLE001 -- one broken section must not cost the whole dashboard
            body = f'<p class="nodata">no data: this section failed to render ({html.escape(type(err).__name__)}: {html.escape(str(err))})</p>'
        parts.append(f'<section id="{anchor}"><h2>{html.escape(title)}</h2>{body}</section>')
    nav = "".join(f'<a href="#{t.lower().replace(" ", "-")}">{html.escape(t)}</a>' for t in shown)
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
