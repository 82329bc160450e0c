"""The stability dashboard: one self-contained HTML page per run, readable in a minute.

``write_report(run_dir)`` merges the per-rank event logs (``RUN_DIR/vidstab/events-rank{R}.jsonl``, schema in
docs/ARCHITECTURE.md) and the incident bundles into ``RUN_DIR/report.html``:

- a summary with the verdict (did it finish, steps, skipped steps, rollbacks, incidents, first/last loss);
- plots (inline base64 PNG, matplotlib Agg): loss, gradient norm with its EMA and spike threshold, learning
  rate, loss scale, clip rate, loss per timestep bucket, input statistics per rank, with skipped steps,
  rollbacks and LR back-offs marked;
- the table of events (warn/skip/rollback/checkpoint/...) and of incidents, linking to each bundle folder.

Every section is present (but "Loss by timestep", drawn only from per-sample losses); one without data says
"no data" and why. The page has no external assets
(no scripts, fonts or links off the page), so it can be mailed or attached to a ticket as is.

Long runs are plotted with per-bin mean and min/max envelopes, so a single-step spike in a 100k-step run
stays visible. After a rollback or a resume the steps after the checkpoint are logged again: the plots show
the final trajectory and draw the superseded attempt in grey.

Files, one concern each: ``load`` (reading the run folder), ``series`` (ranks and attempts merged, binning),
``plots`` (matplotlib helpers), ``summary``, ``figures`` (the plotted sections), ``tables``, ``markup``
(HTML pieces, CSS), ``page`` (the page in order, written atomically).
"""

from .load import RankMetrics, RunLog, load_run
from .page import SECTIONS, render_report, write_report
from .series import MAX_POINTS, Series

__all__ = ["SECTIONS", "MAX_POINTS", "RankMetrics", "RunLog", "Series", "load_run", "render_report", "write_report"]
