"""Claim: the guard's per-step host time and bytes on the wire do not grow with the number of ranks on a healthy step.

For world sizes 1, 8, 64, 1,024 and 8,192 (``--worlds``), every rank's vector is built once (seeded healthy figures;
for the anomalous step one rank in the middle has a NaN loss and NaN inputs and the global gradient norm is NaN, as
under DDP). The collective is simulated by its result, what each rank receives; everything after it runs for real
on this host, as every rank runs it:

* ``new`` (``vidstab`` now): the two fixed-size all_reduces' result (the SUM columns summed, the MAX columns
  maximised over ranks) read to the host with the rank's own vector (``vidstab.signals.reduce_and_read``'s one
  read), ``vidstab.guard.stats.anomalous``, ``build_stats`` + ``vidstab.detectors.running.judge`` + ``absorb`` and the
  metrics line (``vidstab.guard.reporting.metrics_line`` with the detectors' published thresholds). A step whose
  summary shows something also reads ``gather_rows``' result (every rank's vector, ``[world, width]``) and builds
  the statistics again with the rows, exactly as ``Guard.guarded_step`` decides (``decide_new`` below).
* ``old`` (the gather-and-loop of the guard before the fixed-size reduction; ``BASELINE`` below is a copy of its
  ``build_stats`` and row columns from the revision it replaced, kept here as the baseline): the all_gather's
  ``[world, 46]`` float32 table read to the host and cut into rows, the Python loop over every row, then the same
  judge, absorb and metrics line.

Bytes on the wire: what each rank's collectives move per step, as the issue counts them: ``new`` = its own vector's
``8 * width`` bytes in the two all_reduces whatever the world size (plus, on an anomalous step only, every rank's
``8 * width`` bytes gathered), ``old`` = the ``4 * 46 * world`` bytes of the table every rank gathers on every step;
one process moves nothing. Each round times one healthy and one anomalous step of every world size and path, in a
random order, so that drift and the load of a shared machine hit all alike; reported: medians over rounds. Last line:
one JSON object; target: the new healthy step at 8,192 ranks <= 1.2x that at 8, and its bytes the same at every
world size of more than one process.

    python benchmarks/bench_guard_scale.py            # about two minutes
    python benchmarks/bench_guard_scale.py --quick    # smoke run (CI)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from typing import Sequence

import torch

from vidstab import signals
from vidstab.config import GuardConfig
from vidstab.detectors import StepStats
from vidstab.detectors.running import absorb, build_detectors, judge, published
from vidstab.guard.reporting import metrics_line
from vidstab.guard.stats import anomalous, build_stats

WORLDS = (1, 8, 64, 1024, 8192)
LR = (1e-4, 1e-4, 1e-4)  # (lr, peak, scheduled): a constant schedule
MAX_GRAD_NORM = 1.0
BUCKET = "2x16x4x32x32"


# ------------------------------------------------------------------------------------------------------
# BASELINE: the gather-and-loop this benchmark compares with, copied from the revision before the fixed-size
# reduction (``vidstab/signals.py``'s row columns and helpers, ``vidstab/guard/stats.py``'s ``build_stats``).
# Not used by vidstab; kept verbatim in logic so that the old per-step cost can be measured beside the new one.
# ------------------------------------------------------------------------------------------------------
OLD_GRAD_NORM, OLD_PARAM_SQ, OLD_UPDATE_SQ, OLD_LOSS_SCALE, OLD_LOSS_SUM = range(5)
OLD_IN_ABSMAX_HI, OLD_IN_ABSMAX_LO = 5, 6
OLD_IN_SUM = 11
OLD_IN_SUMSQ = 16
OLD_NONFINITE_ALL, OLD_LOSS_NONFINITE = 17, 18
OLD_NORM_OK, OLD_LOSS_TOTAL, OLD_EXCEPTIONS, OLD_IN_NUMEL, OLD_STOP, OLD_PARAM_PENDING, OLD_LOCAL_SECONDS = range(19, 26)
OLD_FIXED = 26


def old_width(buckets: int) -> int:
    return OLD_FIXED + 2 * buckets


def old_loss_count(r: Sequence[float]) -> tuple[float, float]:
    total, nonfinite, loss_sum = r[OLD_LOSS_TOTAL], r[OLD_LOSS_NONFINITE], r[OLD_LOSS_SUM]
    if total == 1 and not math.isfinite(loss_sum):
        return 0.0, 1.0
    return loss_sum, nonfinite


def old_inputs_nonfinite(r: Sequence[float]) -> bool:
    if r[OLD_NONFINITE_ALL] - r[OLD_LOSS_NONFINITE] > 0:
        return True
    return r[OLD_IN_NUMEL] > 0 and not (math.isfinite(r[OLD_IN_ABSMAX_HI]) and math.isfinite(r[OLD_IN_ABSMAX_LO]))


def old_gather_and_read(table: torch.Tensor, k: int) -> list[list[float]]:
    """The host side of the old ``gather_and_read``: the gathered ``[world * k]`` table read and cut into rows."""
    flat = table.tolist()
    return [flat[i:i + k] for i in range(0, len(flat), k)]


def old_build_stats(step: int, table: list[list[float]], buckets: int, *, max_grad_norm: float | None,
                    norm_known: bool, sharded: bool, scale_known: bool, has_scaler: bool, lr: float | None,
                    lr_peak: float | None, lr_scheduled: float | None) -> StepStats:
    """BASELINE: the old ``build_stats``, one pass over every rank's row on every step."""
    isfinite, nan = math.isfinite, math.nan
    grad_norm = first_bad = best_absmax = None
    loss_sum = loss_cnt = sum_sq = numel = 0.0
    rank_loss, rank_absmax, rank_seconds = [], [], []
    nonfinite_loss_ranks, nonfinite_input_ranks, exception_ranks = [], [], []
    for i, r in enumerate(table):
        norm = r[OLD_GRAD_NORM]
        if not isfinite(norm):
            if first_bad is None:
                first_bad = norm
        elif grad_norm is None or norm > grad_norm:
            grad_norm = norm
        rank_sum, bad_losses = old_loss_count(r)
        count = r[OLD_LOSS_TOTAL] - bad_losses
        loss_sum += rank_sum
        loss_cnt += count
        rank_loss.append(rank_sum / count if count > 0 else nan)
        bad_inputs = old_inputs_nonfinite(r)
        absmax = max(r[OLD_IN_ABSMAX_HI], r[OLD_IN_ABSMAX_LO]) if r[OLD_IN_NUMEL] > 0 else 0.0
        if isfinite(absmax):
            if best_absmax is None or absmax > best_absmax:
                best_absmax = absmax
        elif bad_inputs:
            absmax = nan
        rank_absmax.append(absmax)
        rank_seconds.append(r[OLD_LOCAL_SECONDS])
        sum_sq += r[OLD_IN_SUMSQ]
        numel += r[OLD_IN_NUMEL]
        if bad_losses > 0:
            nonfinite_loss_ranks.append(i)
        if bad_inputs:
            nonfinite_input_ranks.append(i)
        if r[OLD_EXCEPTIONS] > 0:
            exception_ranks.append(i)
    if first_bad is not None:
        grad_norm = first_bad
    bucket_means = _old_bucket_means(table, buckets) if buckets else []
    param_norm = update_ratio = None
    if table[0][OLD_PARAM_PENDING] > 0:
        psq = sum(r[OLD_PARAM_SQ] for r in table) if sharded else table[0][OLD_PARAM_SQ]
        usq = sum(r[OLD_UPDATE_SQ] for r in table) if sharded else table[0][OLD_UPDATE_SQ]
        param_norm = math.sqrt(psq) if psq >= 0 else math.nan
        update_ratio = math.sqrt(usq) / param_norm if param_norm and math.isfinite(param_norm) and usq >= 0 else None
    s = StepStats(
        step=step, grad_norm=grad_norm if norm_known else math.nan, grad_norm_known=norm_known,
        loss=loss_sum / loss_cnt if loss_cnt > 0 else math.nan, world_size=len(table), max_grad_norm=max_grad_norm,
        clipped=bool(max_grad_norm is not None and math.isfinite(grad_norm) and grad_norm > max_grad_norm),
        lr=lr, loss_scale=table[0][OLD_LOSS_SCALE] if scale_known else None, lr_peak=lr_peak, lr_scheduled=lr_scheduled,
        param_norm=param_norm, update_ratio=update_ratio, nonfinite_loss_ranks=nonfinite_loss_ranks,
        nonfinite_input_ranks=nonfinite_input_ranks, exception_ranks=exception_ranks, rank_loss=rank_loss,
        rank_input_absmax=rank_absmax, rank_seconds=rank_seconds, timestep_bucket_loss=bucket_means,
        input_absmax=0.0 if best_absmax is None else best_absmax, input_nonfinite=len(nonfinite_input_ranks),
        input_rms=math.sqrt(sum_sq / numel) if numel > 0 else None,
    )
    s.overflow = bool(has_scaler and norm_known and not math.isfinite(grad_norm)
                      and not (s.nonfinite_loss_ranks or s.nonfinite_input_ranks or s.exception_ranks))
    return s


def _old_bucket_means(table: list[list[float]], buckets: int) -> list[float | None]:
    sum_slice, cnt_slice = slice(OLD_FIXED, OLD_FIXED + buckets), slice(OLD_FIXED + buckets, OLD_FIXED + 2 * buckets)
    if len(table) == 1:
        cnts = table[0][cnt_slice]
        if not any(cnts):
            return [None] * buckets
        sums = table[0][sum_slice]
    else:
        cnts = [sum(col) for col in zip(*(r[cnt_slice] for r in table))]
        if not any(cnts):
            return [None] * buckets
        sums = [sum(col) for col in zip(*(r[sum_slice] for r in table))]
    return [x / c if c > 0 else None for x, c in zip(sums, cnts)]
# ------------------------------------------------------------------------------------------------------
# end of BASELINE
# ------------------------------------------------------------------------------------------------------


class World:
    """Every rank's vector (new layout) and row (old layout) of one healthy and one anomalous step, built once."""

    def __init__(self, world: int, buckets: int, seed: int = 0) -> None:
        self.world, self.layout = world, signals.Layout(buckets)
        self.bad_rank = world // 2
        rng = random.Random(seed)
        per_rank = [self._figures(rng, buckets) for _ in range(world)]
        L = self.layout
        self.vectors = {}
        self.rows = {}
        for kind in ("healthy", "anomalous"):
            vecs = [self._vector(f, r, kind) for r, f in enumerate(per_rank)]
            rows = [self._old_row(f, r, kind) for r, f in enumerate(per_rank)]
            self.vectors[kind] = torch.tensor(vecs, dtype=torch.float64)
            self.rows[kind] = torch.tensor(rows, dtype=torch.float32).reshape(-1)  # what the all_gather leaves
        # The reduced result every rank receives, per kind (the collective simulated by its result).
        self.reduced = {kind: (v[:, :L.sum_width].sum(0), v[:, L.sum_width:].amax(0)) for kind, v in self.vectors.items()}
        # What the all_gather of gather_rows leaves on a rank: one tensor per rank.
        self.parts = {kind: [v[r].clone() for r in range(world)] for kind, v in self.vectors.items()}
        self.mine = {kind: v[0].clone() for kind, v in self.vectors.items()}  # this host is rank 0

    @staticmethod
    def _figures(rng: random.Random, buckets: int) -> dict:
        numel = 2 * 16 * 4 * 32 * 32
        t = [rng.randrange(buckets) for _ in range(2)]
        psl = [0.3 + 0.2 * rng.random() for _ in range(2)]
        return {"loss": sum(psl) / 2, "absmax": 3.0 + rng.random(), "in_sum": rng.gauss(0, 30), "in_sumsq": numel * (0.9 + 0.2 * rng.random()),
                "numel": float(numel), "seconds": 0.1 + 0.01 * rng.random(), "t": t, "psl": psl}

    def _vector(self, f: dict, rank: int, kind: str) -> list[float]:
        L = self.layout
        v = [0.0] * L.width
        bad = kind == "anomalous" and rank == self.bad_rank
        v[L.norm_known], v[L.ranks], v[L.micro_steps] = 1.0, 1.0, 1.0
        if kind == "anomalous":
            v[L.norm_nan] = 1.0  # DDP all-reduced the NaN gradient: every rank's norm is NaN
        else:
            v[L.grad_norm] = 0.8
        if bad:
            v[L.loss_nonfinite] = v[L.ranks_loss_bad] = v[L.ranks_input_bad] = 1.0
        else:
            v[L.loss_sum], v[L.loss_count] = f["loss"], 1.0
            v[L.in_sum], v[L.in_sumsq], v[L.in_numel], v[L.in_absmax] = f["in_sum"], f["in_sumsq"], f["numel"], f["absmax"]
            for t, x in zip(f["t"], f["psl"]):
                v[L.bucket_sum.start + t] += x
                v[L.bucket_count.start + t] += 1.0
        v[L.seconds] = f["seconds"]
        v[L.slowest] = signals.slowest_key(f["seconds"], rank)
        v[L.bucket] = signals.bucket_hash(BUCKET)
        v[L.neg_bucket] = -v[L.bucket]
        return v

    def _old_row(self, f: dict, rank: int, kind: str) -> list[float]:
        buckets = self.layout.buckets
        r = [0.0] * old_width(buckets)
        bad = kind == "anomalous" and rank == self.bad_rank
        r[OLD_GRAD_NORM] = math.nan if kind == "anomalous" else 0.8
        r[OLD_NORM_OK], r[OLD_LOSS_TOTAL], r[OLD_IN_NUMEL], r[OLD_LOCAL_SECONDS] = 1.0, 1.0, f["numel"], f["seconds"]
        if bad:
            r[OLD_LOSS_SUM] = r[OLD_IN_ABSMAX_HI] = r[OLD_IN_ABSMAX_LO] = r[OLD_IN_SUM] = r[OLD_IN_SUMSQ] = math.nan
            r[OLD_NONFINITE_ALL] = r[OLD_LOSS_NONFINITE] = 1.0
        else:
            r[OLD_LOSS_SUM], r[OLD_IN_ABSMAX_HI], r[OLD_IN_ABSMAX_LO] = f["loss"], f["absmax"], 0.9 * f["absmax"]
            r[OLD_IN_SUM], r[OLD_IN_SUMSQ] = f["in_sum"], f["in_sumsq"]
            for t, x in zip(f["t"], f["psl"]):
                r[OLD_FIXED + t] += x
                r[OLD_FIXED + buckets + t] += 1.0
        return r


class Paths:
    """The host work after the collective on one rank, new and old, with detectors of their own."""

    def __init__(self, w: World, config: GuardConfig) -> None:
        self.w, self.config = w, config
        self.detectors = {"new": build_detectors(config, w.world), "old": build_detectors(config, w.world)}
        self.step = {"new": 0, "old": 0}

    def _finish(self, path: str, s: StepStats, mine: list[float]) -> dict:
        """``applied`` as the guard sets it, ``absorb``, and the metrics line with the published thresholds."""
        dets = self.detectors[path]
        s.applied = s.verdict < 2
        absorb(dets, s)
        line = metrics_line(s, mine, self.w.layout, 0, 0.0, 0, 0)
        line.update(published(dets))
        self.step[path] += 1
        return line

    def _stats(self, step: int, summary: list[float], rows: list[list[float]] | None) -> StepStats:
        L, summary = self.w.layout, list(summary)
        summary[L.lr], summary[L.lr_peak], summary[L.lr_scheduled] = LR  # what every rank packs (the same LR)
        return build_stats(step, summary, L, rows=rows, bucket=BUCKET, max_grad_norm=MAX_GRAD_NORM,
                           sharded=False, scale_known=False, has_scaler=False)

    def decide_new(self, kind: str) -> tuple[StepStats, bool]:
        """``Guard.guarded_step``'s steps 1-2 after the all_reduces; returns the statistics and whether rows were read."""
        w, L, dets, step = self.w, self.w.layout, self.detectors["new"], self.step["new"]
        sums, maxes = w.reduced[kind]
        local = w.mine[kind]
        flat = torch.cat([sums, maxes, local]).tolist()  # reduce_and_read's one host read
        n = local.numel()
        summary, mine = flat[:n], flat[n:]
        rows = [mine] if w.world == 1 else None
        if rows is None and anomalous(summary, L):
            rows = torch.stack(w.parts[kind]).tolist()  # gather_rows' host side
        s = judge(dets, self._stats(step, summary, rows))
        if rows is None and s.findings:
            rows = torch.stack(w.parts[kind]).tolist()
            s = judge(dets, self._stats(step, summary, rows))
        self._finish("new", s, mine)
        return s, rows is not None and w.world > 1

    def decide_old(self, kind: str) -> StepStats:
        """The old step after the all_gather: read the table, loop over every row, judge."""
        w, dets, step = self.w, self.detectors["old"], self.step["old"]
        table = old_gather_and_read(w.rows[kind], old_width(w.layout.buckets))
        lr, peak, sched = LR
        s = judge(dets, old_build_stats(step, table, w.layout.buckets, max_grad_norm=MAX_GRAD_NORM, norm_known=True,
                                        sharded=False, scale_known=False, has_scaler=False, lr=lr, lr_peak=peak,
                                        lr_scheduled=sched))
        self._finish("old", s, w.mine[kind].tolist())
        return s


def same_figures(a: StepStats, b: StepStats) -> bool:
    """Whether two paths read the same step figures off the same world (the baseline measures the same work)."""
    def close(x, y) -> bool:
        return (x is None and y is None) or (x is not None and y is not None and math.isclose(x, y, rel_tol=1e-6))
    pairs = [(a.loss, b.loss), (a.grad_norm, b.grad_norm), (a.input_rms, b.input_rms), (a.input_absmax, b.input_absmax),
             *zip(a.timestep_bucket_loss, b.timestep_bucket_loss)]
    return len(a.timestep_bucket_loss) == len(b.timestep_bucket_loss) and all(close(x, y) for x, y in pairs)


def payload_bytes(world: int, layout: signals.Layout, buckets: int) -> dict:
    """Bytes each rank's collectives move per step (module docstring); one process moves none."""
    if world == 1:
        return {"new_healthy": 0, "new_anomalous": 0, "old": 0}
    new_healthy = 8 * layout.width
    return {"new_healthy": new_healthy, "new_anomalous": new_healthy + 8 * layout.width * world,
            "old": 4 * old_width(buckets) * world}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="comma-separated world sizes")
    ap.add_argument("--rounds", type=int, default=100, help="timed rounds (one step of each kind, path and world)")
    ap.add_argument("--warmup", type=int, default=30, help="healthy steps per path and world before timing")
    ap.add_argument("--quick", action="store_true", help="smoke run: a few rounds")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.warmup = 5, 5
    torch.set_num_threads(1)
    worlds = [int(x) for x in args.worlds.split(",")]
    config = GuardConfig()
    buckets = config.timestep_buckets
    built = time.perf_counter()
    paths = {}
    for n in worlds:
        w = World(n, buckets)
        paths[n] = Paths(w, config)
    built = time.perf_counter() - built
    # Checks before timing: both paths read the same statistics off the same world (the baseline is faithful).
    checks = {}
    for n, p in paths.items():
        for _ in range(args.warmup):
            p.decide_new("healthy")
            p.decide_old("healthy")
        s_new, read_rows = p.decide_new("anomalous")
        s_old = p.decide_old("anomalous")
        healthy, read_rows_healthy = p.decide_new("healthy")
        healthy_old = p.decide_old("healthy")
        checks[n] = {"verdict_new": s_new.verdict.name, "verdict_old": s_old.verdict.name,
                     "bad_ranks_new": s_new.nonfinite_loss_ranks, "bad_ranks_old": s_old.nonfinite_loss_ranks,
                     "rows_read_on_anomaly": read_rows, "rows_read_on_healthy": read_rows_healthy,
                     "healthy_verdict_new": healthy.verdict.name,
                     "healthy_stats_agree": same_figures(healthy, healthy_old)}
    clock = time.perf_counter_ns
    times = {(n, path, kind): [] for n in worlds for path in ("new", "old") for kind in ("healthy", "anomalous")}
    shuffler = random.Random(0)
    keys = list(times)
    started = time.perf_counter()
    for _ in range(args.rounds):
        for n, path, kind in shuffler.sample(keys, len(keys)):
            p = paths[n]
            fn = p.decide_new if path == "new" else p.decide_old
            t0 = clock()
            fn(kind)
            times[(n, path, kind)].append((clock() - t0) / 1e3)
            if kind == "anomalous":  # a healthy step after each anomaly, untimed: the detectors' state stays steady
                fn("healthy")
    elapsed = time.perf_counter() - started
    med = {k: statistics.median(v) for k, v in times.items()}
    layout = signals.Layout(buckets)
    wire = {n: payload_bytes(n, layout, buckets) for n in worlds}

    print(f"host time per step after the collective (us, median of {args.rounds} rounds; worlds built in {built:.1f} s, "
          f"timed in {elapsed:.1f} s); bytes = what each rank's collectives move per step")
    print(f"{'world':>6} | {'new healthy':>12}{'new anomalous':>15}{'old (every step)':>18}{'old anomalous':>15} | "
          f"{'bytes new healthy':>18}{'new anomalous':>15}{'old':>12}")
    for n in worlds:
        b = wire[n]
        print(f"{n:>6} | {med[(n, 'new', 'healthy')]:>12.1f}{med[(n, 'new', 'anomalous')]:>15.1f}"
              f"{med[(n, 'old', 'healthy')]:>18.1f}{med[(n, 'old', 'anomalous')]:>15.1f} | "
              f"{b['new_healthy']:>18}{b['new_anomalous']:>15}{b['old']:>12}")
    base, top = (8 if 8 in worlds else min(worlds)), max(worlds)
    ratio = med[(top, "new", "healthy")] / med[(base, "new", "healthy")]
    ratio_old = med[(top, "old", "healthy")] / med[(base, "old", "healthy")]
    bytes_flat = len({wire[n]["new_healthy"] for n in worlds if n > 1}) <= 1
    print(f"new healthy step at {top} ranks / at {base}: {ratio:.2f}x (target <= 1.2x); old: {ratio_old:.1f}x; "
          f"new healthy bytes the same at every world size > 1: {bytes_flat}")
    print("anomalous step: one rank's loss and inputs NaN, the global gradient norm NaN; verdicts and named ranks "
          "(new, old): " + "; ".join(f"{n}: {c['verdict_new']}/{c['verdict_old']} {c['bad_ranks_new']}/"
                                       f"{c['bad_ranks_old']}" for n, c in checks.items()))
    print(json.dumps({
        "benchmark": "guard_scale", "rounds": args.rounds, "worlds": worlds, "width_new": layout.width,
        "width_old": old_width(buckets),
        "host_us_median": {str(n): {f"{path}_{kind}": round(med[(n, path, kind)], 1) for path in ("new", "old")
                                    for kind in ("healthy", "anomalous")} for n in worlds},
        "bytes_per_rank": {str(n): wire[n] for n in worlds},
        "healthy_ratio_top_vs_base": {"worlds": [top, base], "new": round(ratio, 3), "old": round(ratio_old, 2)},
        "target_ratio": 1.2, "bytes_flat_new_healthy": bytes_flat,
        "meets_target": bool(ratio <= 1.2 and bytes_flat),
        "checks": {str(n): c for n, c in checks.items()},
    }))


if __name__ == "__main__":
    main()
