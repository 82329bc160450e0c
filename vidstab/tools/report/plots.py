"""matplotlib helpers of the dashboard: Agg backend, inline PNG, binned lines, event marks, legends."""

from __future__ import annotations

import base64
import io

import numpy as np

from .series import Series, _bin


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
