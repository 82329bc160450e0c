"""The plotted sections: loss, gradient norm with its spike band, LR, loss scale, clip rate, loss by
timestep, input statistics per rank."""

from __future__ import annotations


import numpy as np

from .load import RunLog, _event_steps, _num, _skip_steps
from .markup import _nodata
from .plots import _auto_log, _figure, _legend, _line, _marks, _png, _pyplot, _superseded
from .series import Series, _bin, _loss_by_t, _merge, _nonfinite_loss_steps, _quiet
from .tables import _rank_table


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


def _spike_band(log: RunLog, grad: Series) -> tuple[np.ndarray, np.ndarray, str] | None:
    """The grad_spike detector's reference and threshold as it published them with each step's metrics
    (``grad_norm_ema``, ``grad_spike_threshold``: ``GradSpikeDetector.published``); ``None`` when the run
    did not log them (grad_spike disabled, or a log older than the publishing detectors). Never recomputed
    here: a line redrawn with other maths would not be the detector's line."""
    ema = _merge(log, "grad_norm_ema", how="first")
    thr = _merge(log, "grad_spike_threshold", how="first")
    if ema.empty or thr.empty:
        return None
    # Published after step s was absorbed: the line that judges step s + 1.
    return (np.interp(grad.steps, ema.steps + 1, ema.values), np.interp(grad.steps, thr.steps + 1, thr.values),
            "published by grad_spike")


def _grad_section(log: RunLog) -> str:
    grad = _merge(log, "grad_norm", how="first")
    if grad.empty:
        return _nodata("no grad_norm in the metrics")
    fig, ax = _figure(3.2)
    _superseded(ax, grad)
    positive = np.where(grad.values > 0, grad.values, np.nan)
    _line(ax, grad.steps, positive, label="grad norm (pre-clip)", color="C1")
    band = _spike_band(log, grad)
    if band is not None:
        ema, threshold, source = band
        _line(ax, grad.steps, ema, label="grad_spike reference", color="C2", lw=1.0)
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
    caption = ("Global gradient norm before clipping (log scale) with the grad_spike detector's reference; the shaded "
               "band reaches the threshold the detector published for each step (the lower of its ratio and z-score "
               "tests). A step above the red line is a spike." if band is not None else
               "Global gradient norm before clipping (log scale). No spike threshold is drawn: the run's metrics do "
               "not carry the grad_spike detector's published threshold (detector disabled, or an older log).")
    return _png(fig) + f'<p class="caption">{caption}</p>'


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
