#!/usr/bin/env python
"""Does vidstab catch divergence earlier, with fewer false alarms, than the rules users run today?

    python benchmarks/bench_detection.py            # full catalogue (~10 min cold on 2 CPU cores, seconds cached)
    python benchmarks/bench_detection.py --quick    # smoke subset, < 60 s
    python benchmarks/bench_detection.py --no-e2e   # detection tables only

1. Every scenario of ``benchmarks/scenarios`` is recorded once, unguarded (cached under benchmarks/.cache/).
2. Every detector -- the published baselines of ``baselines.py`` and vidstab's default detectors -- is
   replayed over the same recordings. Per detector: detection rate on runs that fail, lead time
   (failure step - first alarm at or after the fault's onset; negative = caught after the failure;
   no alarm = missed), false alarms per 1,000 healthy steps (steps with an alarm / healthy steps).
3. End-to-end (recovery on): ``recipes/train.py`` as a subprocess with the scenario's fault, vidstab on
   vs ``--no_vidstab``, and a clean run of the same seed: finished?, final loss (evaluated on fixed
   latents/noise/timesteps from the final checkpoint) relative to the clean run, steps lost (skipped +
   rolled back).

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks import baselines as B  # noqa: E402
from benchmarks.scenarios import catalogue as C  # noqa: E402
from benchmarks.scenarios.evaluation import fixed_noise_loss  # noqa: E402
from benchmarks.scenarios.recorder import CACHE_DIR, Recording, TinyRunConfig, healthy_exceedances, record  # noqa: E402

#: The target of the claim: at most this many false alarms per 1,000 healthy steps (1 per 10,000).
FA_TARGET_PER_1K = 0.1


# ------------------------------------------------------------------------------------------------------
# Replay
# ------------------------------------------------------------------------------------------------------
@dataclass
class Judged:
    """Alarm steps of every detector on one recording."""

    rec: Recording
    alarms: dict[str, list[int]] = field(default_factory=dict)
    """detector row name -> steps where it fired."""


def judge(rec: Recording, vidstab_config=None) -> Judged:
    """Replay one recording through every baseline and vidstab (all detectors, and per detector)."""
    out = Judged(rec)
    rules = B.new_baselines()
    vid = B.VidstabReplay(vidstab_config, lr_peak=TinyRunConfig().learning_rate)
    for rule in rules:
        out.alarms[rule.name] = []
    out.alarms["vidstab"] = []
    for r in rec.rows():
        for rule in rules:
            if rule.observe(r):
                out.alarms[rule.name].append(r.step)
        findings = vid.observe(r)
        if findings:
            out.alarms["vidstab"].append(r.step)
        for f in findings:
            out.alarms.setdefault(f"vidstab:{f.detector}", []).append(r.step)
        if any(f.verdict >= 2 for f in findings):  # SKIP or ROLLBACK: the guard acts, not only warns
            out.alarms.setdefault("vidstab[act]", []).append(r.step)
    out.alarms.setdefault("vidstab[act]", [])
    return out


def lead(j: Judged, name: str) -> float | None:
    """failure step - first alarm at/after onset; None when missed (or no failure)."""
    if j.rec.failure_step is None:
        return None
    first = next((s for s in j.alarms.get(name, []) if s >= j.rec.onset), None)
    return None if first is None else float(j.rec.failure_step - first)


def row_names(judged: list[Judged]) -> list[str]:
    """Table rows: baselines, vidstab, vidstab acting (skip/rollback), then each vidstab detector that fired."""
    names = [cls().name for cls in B.BASELINES] + ["vidstab", "vidstab[act]"]
    per = sorted({k for j in judged for k in j.alarms if k.startswith("vidstab:")})
    return names + per


# ------------------------------------------------------------------------------------------------------
# Figures
# ------------------------------------------------------------------------------------------------------
def figures(healthy: list[Judged], faults: dict[str, list[Judged]]) -> dict:
    """Every number of the tables, as plain JSON-able dicts."""
    rows = row_names(healthy + [j for js in faults.values() for j in js])
    healthy_steps = sum(len(j.rec) for j in healthy)
    out: dict = {"healthy_steps": healthy_steps, "detectors": {}, "scenarios": {}}
    for name in rows:
        fa = sum(len(j.alarms.get(name, [])) for j in healthy)
        divergent = [j for js in faults.values() for j in js if j.rec.failure_step is not None]
        leads = [lead(j, name) for j in divergent]
        got = [x for x in leads if x is not None]
        out["detectors"][name] = {
            "false_alarms": fa,
            "false_alarms_per_1k": round(1000.0 * fa / healthy_steps, 3) if healthy_steps else None,
            "detected": len(got), "divergent_runs": len(divergent),
            "detection_rate": round(len(got) / len(divergent), 3) if divergent else None,
            "median_lead": statistics.median(got) if got else None,
        }
    for scen, js in faults.items():
        div = [j for j in js if j.rec.failure_step is not None]
        entry = {"runs": len(js), "divergent_runs": len(div),
                 "failure_steps": [j.rec.failure_step for j in js], "per_detector": {}}
        for name in rows:
            leads = [lead(j, name) for j in div]
            got = [x for x in leads if x is not None]
            # Benign runs (no failure point): did the rule fire within 5 steps of the fault?
            flagged = [any(j.rec.onset <= s <= j.rec.onset + 5 for s in j.alarms.get(name, [])) for j in js if j.rec.failure_step is None]
            entry["per_detector"][name] = {
                "leads": leads, "detected": len(got),
                "mean_lead": round(statistics.fmean(got), 2) if got else None,
                "benign_flagged": sum(flagged) if flagged else None,
            }
        out["scenarios"][scen] = entry
    out["targets"] = targets(out)
    return out


def targets(fig: dict, row: str = "vidstab") -> dict:
    """vidstab vs the targets: every divergent run detected; lead >= the best baseline's on every run of
    every scenario (against all baselines, and against the quiet ones: <= 1 false alarm per 10k steps);
    <= 1 false alarm per 10,000 healthy steps."""
    base = [cls().name for cls in B.BASELINES]
    quiet = [b for b in base if (fig["detectors"][b]["false_alarms_per_1k"] or 0) <= FA_TARGET_PER_1K]
    v = fig["detectors"][row]
    res = {"row": row, "all_detected": v["detected"] == v["divergent_runs"],
           "false_alarms_per_1k": v["false_alarms_per_1k"],
           "fa_target_met": (v["false_alarms_per_1k"] or 0) <= FA_TARGET_PER_1K,
           "quiet_baselines": quiet, "lead_vs_best": {}, "lead_vs_best_quiet": {}}
    for scen, e in fig["scenarios"].items():
        if not e["divergent_runs"]:
            continue
        for key, pool in (("lead_vs_best", base), ("lead_vs_best_quiet", quiet)):
            ok, worst = True, None
            for i, vl in enumerate(e["per_detector"][row]["leads"]):
                bl = [e["per_detector"][b]["leads"][i] for b in pool]
                best = max((x for x in bl if x is not None), default=None)
                if best is None:
                    continue
                gap = (vl if vl is not None else -math.inf) - best
                worst = gap if worst is None else min(worst, gap)
                ok &= gap >= 0
            res[key][scen] = {"met": ok, "worst_gap": worst}
    res["lead_target_met"] = all(x["met"] for x in res["lead_vs_best"].values())
    res["lead_target_met_quiet"] = all(x["met"] for x in res["lead_vs_best_quiet"].values())
    return res


# ------------------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------------------
def _fmt(x, nd=1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "inf" if math.isinf(x) else f"{x:.{nd}f}"
    return str(x)


def print_tables(fig: dict, rows: list[str]) -> None:
    print(f"\n== Detection summary (divergent runs: {fig['detectors']['vidstab']['divergent_runs']}; "
          f"healthy steps: {fig['healthy_steps']}) ==")
    print(f"{'detector':30s} {'detected':>9s} {'rate':>6s} {'med lead':>9s} {'FA':>5s} {'FA/1k':>7s}")
    for name in rows:
        d = fig["detectors"][name]
        print(f"{name:30s} {d['detected']:>4d}/{d['divergent_runs']:<4d} {_fmt(d['detection_rate'], 2):>6s} "
              f"{_fmt(d['median_lead']):>9s} {d['false_alarms']:>5d} {_fmt(d['false_alarms_per_1k'], 2):>7s}")
    scen = list(fig["scenarios"])
    print("\n== Lead time per scenario: mean steps before the failure (detected/divergent runs) ==")
    print("failure steps: " + "; ".join(f"{s}={fig['scenarios'][s]['failure_steps']}" for s in scen))
    width = 17
    for start in range(0, len(scen), 5):
        chunk = scen[start:start + 5]
        print(f"{'detector':30s}" + "".join(f"{s[:width]:>{width + 1}s}" for s in chunk))
        for name in rows:
            cells = []
            for s in chunk:
                e = fig["scenarios"][s]
                p = e["per_detector"][name]
                if e["divergent_runs"]:
                    cells.append(f"{_fmt(p['mean_lead'])} ({p['detected']}/{e['divergent_runs']})")
                else:
                    cells.append(f"benign {p['benign_flagged']}/{e['runs']}")
            print(f"{name:30s}" + "".join(f"{c:>{width + 1}s}" for c in cells))
        print()
    for t in (fig["targets"],):
        print(f"== Targets ({t['row']}) ==")
        print(f"detects every divergent run: {t['all_detected']}")
        print(f"false alarms per 1k healthy steps: {t['false_alarms_per_1k']} (target <= {FA_TARGET_PER_1K}): {t['fa_target_met']}")
        for key, label in (("lead_vs_best", "all baselines"), ("lead_vs_best_quiet", f"quiet baselines {t['quiet_baselines']}")):
            bad = {s: v["worst_gap"] for s, v in t[key].items() if not v["met"]}
            print(f"lead >= best of {label} on every run: {not bad}" + (f"; short on (worst gap, steps) {bad}" if bad else ""))


def markdown(fig: dict, rows: list[str], e2e: dict | None) -> str:
    """The same tables as Markdown (pasted into RESULTS.md)."""
    out = ["| detector | detected | median lead | false alarms | per 1k healthy steps |", "|---|---|---|---|---|"]
    for name in rows:
        d = fig["detectors"][name]
        out.append(f"| {name} | {d['detected']}/{d['divergent_runs']} | {_fmt(d['median_lead'])} | "
                   f"{d['false_alarms']} | {_fmt(d['false_alarms_per_1k'], 2)} |")
    scen = list(fig["scenarios"])
    out += ["", "| detector | " + " | ".join(scen) + " |", "|---" * (len(scen) + 1) + "|"]
    for name in rows:
        cells = []
        for s in scen:
            e, p = fig["scenarios"][s], fig["scenarios"][s]["per_detector"][name]
            cells.append(f"{_fmt(p['mean_lead'])} ({p['detected']}/{e['divergent_runs']})" if e["divergent_runs"]
                         else f"benign {p['benign_flagged']}/{e['runs']}")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    if e2e:
        out += ["", "| scenario | arm | finished | final loss | x clean | diverged | steps lost |", "|---|---|---|---|---|---|---|"]
        for name, row in e2e.items():
            for arm in [a for a in ("vidstab", "no_vidstab", "vidstab+cfg") if a in row]:
                r = row[arm]
                rel, loss = r["rel_to_clean"], r["final_loss"]
                rel = f"{rel:.3g}" if isinstance(rel, float) else str(rel)
                loss = f"{loss:.4g}" if isinstance(loss, float) else str(loss)
                out.append(f"| {name} | {arm} | {r['finished']} | {loss} | {rel} | {r['diverged']} | {_fmt(r['steps_lost'])} |")
            c = row["clean"]
            out.append(f"| {name} | clean, vidstab | {c['finished']} | {row['clean_loss']} | 1 | False | {c['steps_lost']} |")
            out.append(f"| {name} | clean, no_vidstab | True | {c['no_vidstab_loss']} | - | False | - |")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------------
# End-to-end: the reference trainer with recovery on
# ------------------------------------------------------------------------------------------------------
E2E_SCENARIOS = ("nan_batch", "inf_latent", "lr_spike_x1000", "lr_ramp_x1.3", "lr_ramp_x1.05", "big_latent_flow")


@dataclass
class E2ESetup:
    """The end-to-end trainer runs."""

    steps: int = 120
    """``--max_train_steps``."""
    fault_step: int = 60
    """Step the scenario's fault is moved to."""
    checkpointing_steps: int = 20
    """``--checkpointing_steps`` (rollbacks go back to the last good one)."""
    scenarios: tuple[str, ...] = E2E_SCENARIOS
    """Catalogue scenarios run end to end."""
    extra_config: str | None = None
    """A ``--vidstab_config`` YAML for a third arm ``vidstab+cfg`` (e.g. a proposed detector policy)."""

    def flags(self) -> list[str]:
        return ["--num_videos", "16", "--train_batch_size", "4", "--hidden_size", "32", "--num_heads", "2",
                "--report_to", "none", "--no_async_save", "--checkpointing_steps", str(self.checkpointing_steps),
                "--max_train_steps", str(self.steps)]


def _train(out: Path, *extra: str, setup: E2ESetup | None = None, timeout: float = 600) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(REPO / "recipes" / "train.py"), "--output_dir", str(out),
           *(setup or E2ESetup()).flags(), *extra]
    t = time.time()
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out, err = p.returncode, p.stdout, p.stderr[-2000:]
    except subprocess.TimeoutExpired:
        rc, out, err = -9, "", "timeout"
    return {"rc": rc, "seconds": round(time.time() - t, 1), "stdout": out[-4000:], "stderr": err}


def eval_loss(run_dir: Path, n_draws: int = 4) -> float:
    """Loss of the run's final checkpoint on all its clips with fixed noise/timesteps (nan: no weights/non-finite)."""
    import yaml
    from safetensors.torch import load_file

    from vidstab.reference.model import VideoDiT
    from vidstab.reference.objective import DiffusionObjective, ObjectiveConfig
    from vidstab.reference.vae import LatentCache

    ckpts = sorted((run_dir / "vidstab" / "checkpoints").glob("step_*/model.safetensors"))
    if not ckpts:
        return math.nan
    args = yaml.safe_load((run_dir / "train_config.yaml").read_text())
    cache = LatentCache.load(run_dir / "latent_cache", verify=False)
    latents = torch.stack([cache[i]["latents"] for i in range(len(cache))]).float()
    model = VideoDiT(in_channels=latents.shape[1], hidden_size=args["hidden_size"], num_layers=args["num_layers"],
                     num_heads=args["num_heads"], attention_type=args["attention_type"], pos_embed=args["pos_embed"],
                     num_train_timesteps=args["num_train_timesteps"])
    model.load_state_dict(load_file(str(ckpts[-1])))
    obj = DiffusionObjective(ObjectiveConfig(prediction_type=args["prediction_type"], num_train_timesteps=args["num_train_timesteps"]))
    return fixed_noise_loss(model, obj, latents, n_draws)


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "vidstab" / "events-rank0.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def steps_lost(run_dir: Path) -> int:
    """Skipped steps + steps thrown away by rollbacks (failure step - checkpoint step), from the event log."""
    ev = _events(run_dir)
    skipped = sum(1 for e in ev if e["kind"] == "skip")
    rolled = sum(int(e["step"]) - int(e.get("to_step", e["step"])) for e in ev if e["kind"] == "rollback")
    return skipped + rolled


def run_e2e(setup: E2ESetup, seed: int, workdir: Path, parallel: int = 2) -> dict:
    """Clean runs + (vidstab on, off[, +cfg]) per scenario, all with ``seed``; returns the outcome table."""
    names = setup.scenarios
    arms = ("vidstab", "no_vidstab") + (("vidstab+cfg",) if setup.extra_config else ())
    jobs = {"clean": []}
    for name in names:
        s = C.get(name)
        if s.cuda_only and not torch.cuda.is_available():
            continue
        specs = []
        for f in s.faults:  # same fault, moved to the e2e step
            kind, rest = f.split("@", 1)
            arg = rest.split("=", 1)[1] if "=" in rest else None
            specs += ["--inject_fault", f"{kind}@{setup.fault_step}" + (f"={arg}" if arg else "")]
        extra = [*s.train_args, *specs]
        jobs[f"{name}|vidstab"] = extra
        jobs[f"{name}|no_vidstab"] = [*extra, "--no_vidstab"]
        if setup.extra_config:
            jobs[f"{name}|vidstab+cfg"] = [*extra, "--vidstab_config", str(setup.extra_config)]
    clean_needed = {tuple(C.get(n).train_args) for n in names}
    for i, targs in enumerate(sorted(clean_needed)):
        jobs[f"clean{i}"] = list(targs)  # vidstab on: any step it skips or rolls back on a clean run is a false action
        jobs[f"clean{i}|no_vidstab"] = [*targs, "--no_vidstab"]
    jobs.pop("clean")
    results = {}

    def go(key):
        out = workdir / key.replace("|", "-")
        res = _train(out, "--seed", str(seed), *jobs[key], setup=setup)
        res["eval_loss"] = eval_loss(out)
        res["steps_lost"] = steps_lost(out)
        res["finished"] = res["rc"] == 0 and f"done: {setup.steps}/{setup.steps} steps" in res["stdout"]
        return key, res

    with ThreadPoolExecutor(max_workers=parallel) as ex:
        for key, res in ex.map(go, list(jobs)):
            results[key] = res
    clean_of = {tuple(t): results[f"clean{i}"]["eval_loss"] for i, t in enumerate(sorted(clean_needed))}
    table = {}
    for name in names:
        if f"{name}|vidstab" not in results:
            continue
        clean = clean_of[tuple(C.get(name).train_args)]
        row = {}
        for arm in arms:
            r = results[f"{name}|{arm}"]
            rel = r["eval_loss"] / clean if math.isfinite(r["eval_loss"]) and clean > 0 else math.inf
            row[arm] = {"finished": r["finished"], "rc": r["rc"], "final_loss": _num(r["eval_loss"]),
                        "diverged": not (math.isfinite(rel) and rel <= 3.0),
                        "rel_to_clean": _num(rel), "steps_lost": r["steps_lost"] if arm != "no_vidstab" else None,
                        "seconds": r["seconds"]}
        row["clean_loss"] = _num(clean)
        i = sorted(clean_needed).index(tuple(C.get(name).train_args))
        row["clean"] = {"steps_lost": results[f"clean{i}"]["steps_lost"], "finished": results[f"clean{i}"]["finished"],
                        "no_vidstab_loss": _num(results[f"clean{i}|no_vidstab"]["eval_loss"])}
        table[name] = row
    return table


def _num(x: float):
    return round(x, 4) if isinstance(x, float) and math.isfinite(x) else (None if x is None else str(x))


def print_e2e(table: dict, setup: E2ESetup) -> None:
    print(f"\n== End-to-end, recovery on (recipes/train.py, {setup.steps} steps, fault at step {setup.fault_step}, "
          f"checkpoint every {setup.checkpointing_steps}"
          + (f"; vidstab+cfg = --vidstab_config {setup.extra_config}" if setup.extra_config else "") + ") ==")
    print(f"{'scenario':18s} {'arm':11s} {'finished':>8s} {'final loss':>11s} {'x clean':>9s} {'diverged':>8s} {'steps lost':>10s}")
    for name, row in table.items():
        for arm in [a for a in ("vidstab", "no_vidstab", "vidstab+cfg") if a in row]:
            r = row[arm]
            rel = r["rel_to_clean"]
            rel = f"{rel:.3g}" if isinstance(rel, float) else str(rel)
            loss = r["final_loss"]
            loss = f"{loss:.4g}" if isinstance(loss, float) else str(loss)
            print(f"{name:18s} {arm:11s} {str(r['finished']):>8s} {loss:>11s} "
                  f"{rel:>9s} {str(r['diverged']):>8s} {_fmt(r['steps_lost']):>10s}")
        c = row["clean"]
        print(f"{'':18s} {'clean':11s} {str(c['finished']):>8s} {str(row['clean_loss']):>11s} {'1':>9s} {'False':>8s} "
              f"{_fmt(c['steps_lost']):>10s}   (clean with --no_vidstab: {c['no_vidstab_loss']})")


# ------------------------------------------------------------------------------------------------------
# The held-out split (benchmarks/scenarios/heldout.py): never used to choose a default
# ------------------------------------------------------------------------------------------------------
#: A baseline is "quiet" when it raises at most this many alarms per 1,000 healthy held-out steps.
QUIET_PER_1K = 1.0


def _step_record(rec, i: int, s):
    """The baselines' view (``StepRecord``) of one recorded held-out step, read off the statistics ``s`` the guard's
    own producer made of its vector (``VidstabReplay.stats_of_vector``)."""
    from benchmarks.scenarios.recorder import StepRecord

    g = s.grad_norm
    loss = rec.loss[i]
    return StepRecord(i, loss, g, rec.lr[i], bool(math.isfinite(g) and g > 1.0), math.nan, math.nan,
                      not math.isfinite(loss), False, s.input_absmax, s.input_nonfinite, None)


def judge_heldout(rec, vidstab_config=None, findings: list | None = None) -> dict:
    """Alarm steps of every baseline and of vidstab (any finding / actions / per detector) on one recording;
    ``findings``: a list to which every vidstab finding is appended as ``(run, step, Finding)``."""
    rules = B.new_baselines()
    vid = B.VidstabReplay(vidstab_config)
    alarms: dict[str, list[int]] = {r.name: [] for r in rules}
    alarms.update({"vidstab": [], "vidstab[act]": []})
    for i in range(len(rec)):
        s = vid.stats_of_vector(i, rec.vectors[i], rec.lr[i], rec.lr_peak[i], rec.lr_scheduled[i], rec.bucket[i])
        r = _step_record(rec, i, s)
        for rule in rules:
            if rule.observe(r):
                alarms[rule.name].append(i)
        found = vid.observe_stats(s)
        if found:
            alarms["vidstab"].append(i)
        if any(f.verdict >= 2 for f in found):
            alarms["vidstab[act]"].append(i)
        for f in found:
            alarms.setdefault(f"vidstab:{f.detector}", []).append(i)
            if findings is not None:
                findings.append((rec.name, i, f))
    vid.close()
    return alarms


def heldout_figures(healthy: list, faults: list, vidstab_config=None) -> dict:
    """Per family: alarms and actions per 1k healthy steps (vidstab and baselines); on fault runs: detection,
    first action before the failure (slow faults), lead vs the best quiet baseline on every run; every vidstab
    finding on a healthy run (``healthy_findings``: what each false alarm was)."""
    from benchmarks.scenarios import heldout as H

    base = [cls().name for cls in B.BASELINES]
    fams = sorted({r.family for r in healthy + faults}, key=(*H.FAMILIES, H.SMALL_BATCH_FAMILY).index)
    out: dict = {"families": {}, "runs": [], "baselines": {}}
    found: list = []
    jh = [(rec, judge_heldout(rec, vidstab_config, found)) for rec in healthy]
    out["healthy_findings"] = [{"run": run, "step": step, "detector": f.detector, "verdict": f.verdict.name,
                                "message": f.message} for run, step, f in found]
    steps_all = sum(len(r) for r, _ in jh)
    for name in base + ["vidstab", "vidstab[act]"]:
        fa = sum(len(a.get(name, [])) for _, a in jh)
        out["baselines"][name] = {"alarms_per_1k": round(1000 * fa / steps_all, 3) if steps_all else None}
    quiet = [b for b in base if (out["baselines"][b]["alarms_per_1k"] or 0) <= QUIET_PER_1K]
    out["quiet_baselines"] = quiet
    for fam in fams:
        fh = [(r, a) for r, a in jh if r.family == fam]
        n = sum(len(r) for r, _ in fh)
        per: dict = {"healthy_steps": n}
        for name in base + ["vidstab", "vidstab[act]"]:
            per[name] = round(1000 * sum(len(a.get(name, [])) for _, a in fh) / n, 3) if n else None
        per["vidstab_alarm_detectors"] = sorted({k.split(":", 1)[1] for _, a in fh for k, v in a.items()
                                                 if k.startswith("vidstab:") and v})
        out["families"][fam] = per
    for rec in faults:
        a = judge_heldout(rec, vidstab_config)
        fail = rec.failure_step
        def first(name):
            return next((s for s in a.get(name, []) if s >= rec.onset), None)
        lead = {name: (None if fail is None or first(name) is None else fail - first(name))
                for name in base + ["vidstab", "vidstab[act]"]}
        best_quiet = max((lead[b] for b in quiet if lead[b] is not None), default=None)
        act = first("vidstab[act]")
        slow = rec.kind in H.SLOW_FAULTS
        out["runs"].append({
            "run": rec.name, "family": rec.family, "kind": rec.kind, "onset": rec.onset, "failure_step": fail,
            "detected": fail is not None and first("vidstab") is not None,
            "first_alarm": first("vidstab"), "first_action": act,
            "action_in_time": None if fail is None or act is None else (act < fail if slow else act <= fail),
            "lead": lead["vidstab"], "best_quiet_lead": best_quiet,
            "lead_ge_best_quiet": None if fail is None or best_quiet is None else (lead["vidstab"] is not None and lead["vidstab"] >= best_quiet),
            "first_detectors": sorted({k.split(":", 1)[1] for k, v in a.items() if k.startswith("vidstab:") and first(k) is not None and first(k) == first("vidstab")}),
        })
    div = [r for r in out["runs"] if r["failure_step"] is not None]
    slow = [r for r in div if r["kind"] in H.SLOW_FAULTS]
    cmp_ = [r for r in div if r["lead_ge_best_quiet"] is not None]
    out["summary"] = {
        "divergent_runs": len(div), "detected": sum(r["detected"] for r in div),
        "detection_rate": round(sum(r["detected"] for r in div) / len(div), 3) if div else None,
        "slow_divergent": len(slow), "slow_action_in_time": sum(bool(r["action_in_time"]) for r in slow),
        "lead_ge_best_quiet": sum(r["lead_ge_best_quiet"] for r in cmp_), "lead_compared": len(cmp_),
        "benign_runs": len(out["runs"]) - len(div),
        "max_skips_per_1k_family": max((f["vidstab[act]"] or 0) for f in out["families"].values()) if fams else None,
        "max_alarms_per_1k_family": max((f["vidstab"] or 0) for f in out["families"].values()) if fams else None,
    }
    out["summary"]["by_kind"] = {
        kind: {"divergent_runs": len(rs), "detected": sum(r["detected"] for r in rs),
               "action_in_time": sum(bool(r["action_in_time"]) for r in rs),
               "lead_ge_best_quiet": sum(bool(r["lead_ge_best_quiet"]) for r in rs),
               "lead_compared": sum(r["lead_ge_best_quiet"] is not None for r in rs)}
        for kind in sorted({r["kind"] for r in div}) for rs in [[r for r in div if r["kind"] == kind]]}
    s_ = out["summary"]
    s_["targets"] = {
        "detection_rate>=0.95": (s_["detection_rate"] or 0) >= 0.95,
        "slow_action_in_time_most": s_["slow_action_in_time"] * 2 > s_["slow_divergent"],
        "skips<=0.1/1k_every_family": (s_["max_skips_per_1k_family"] or 0) <= 0.1,
        "alarms<=0.3/1k_every_family": (s_["max_alarms_per_1k_family"] or 0) <= 0.3,
        "lead>=best_quiet_every_run": s_["lead_ge_best_quiet"] == s_["lead_compared"],
    }
    return out


def run_heldout(quick: bool = False, vidstab_config=None, cache: Path = CACHE_DIR, draw: str = "B") -> dict:
    """Record (cached) and judge the held-out split (``draw``: seeds of ``heldout.DRAW_SEEDS``); ``quick``:
    a handful of runs for CI."""
    from benchmarks.scenarios import heldout as H

    if quick:
        healthy_runs = [H.HeldoutRun("unet_eps", "cosine_restarts", 100, steps=150),
                        H.HeldoutRun("plain_tf_flow", "long_warmup", 100, steps=150)]
        fault_runs = [H.HeldoutRun("unet_eps", "cosine_restarts", 100, "lr_bug@12=1e4", steps=30, tail=10),
                      H.HeldoutRun("plain_tf_flow", "long_warmup", 100, "input_scale@60=5.5", steps=150)]
    elif draw in H.HEALTHY_ONLY_DRAWS:
        seeds = H.DRAW_SEEDS[draw]
        small = seeds[:H.HEALTHY_ONLY_DRAWS[draw]]
        healthy_runs = H.healthy_runs(seeds=seeds) + H.healthy_runs(
            (H.SMALL_BATCH_FAMILY,), H.SMALL_BATCH_SCHEDULES, small, H.SMALL_BATCH_STEPS)
        fault_runs = []
    else:
        seeds = H.DRAW_SEEDS[draw]
        fine = H.finetune_runs(seeds=seeds)
        healthy_runs = H.healthy_runs(seeds=seeds) + [r for r in fine if r.fault is None]
        c_like = draw in H.C_SCENARIO_DRAWS
        fault_runs = H.fault_runs(seeds=seeds, qk_growth=H.QK_GROWTH_C if c_like else None)
        fault_runs += [r for r in fine if r.fault is not None]
        if c_like:
            fault_runs += H.logit_growth_runs(seeds)
        if c_like:  # the heavy-tailed healthy UNet: batches of 2, some of only small timesteps
            healthy_runs += H.healthy_runs((H.SMALL_BATCH_FAMILY,), H.SMALL_BATCH_SCHEDULES, seeds, H.SMALL_BATCH_STEPS)
    healthy = {r: H.record(r, cache) for r in healthy_runs}
    faults = []
    for r in fault_runs:
        twin = next((h for hr, h in healthy.items() if (hr.family, hr.schedule, hr.seed, hr.steps) == (r.family, r.schedule, r.seed, r.steps)), None)
        faults.append(H.record(r, cache, healthy=twin))
    return heldout_figures(list(healthy.values()), faults, vidstab_config)


def run_small_batch_tuning(vidstab_config=None, cache: Path = CACHE_DIR) -> dict:
    """The tuning split's small-batch UNet (``catalogue.small_batch_runs``: healthy, seeds 0-19), recorded with
    the held-out recorder (cached) and judged like a held-out family: where the small-batch defaults are chosen."""
    from benchmarks.scenarios import heldout as H

    return heldout_figures([H.record(r, cache) for r in C.small_batch_runs()], [], vidstab_config)


def print_small_batch_tuning(fig: dict) -> None:
    print("\n== Tuning split, small-batch UNet (healthy; seeds "
          f"{', '.join(map(str, C.SMALL_BATCH_SEEDS))}): alarms per 1k healthy steps ==")
    names = [cls().name for cls in B.BASELINES] + ["vidstab", "vidstab[act]"]
    print(f"{'family':22s} {'steps':>6s}" + "".join(f" {n[:12]:>12s}" for n in names))
    for fam, f in fig["families"].items():
        print(f"{fam:22s} {f['healthy_steps']:>6d}" + "".join(f" {_fmt(f[n], 2):>12s}" for n in names))
    print("vidstab findings on these healthy runs (every one a false alarm):")
    for f in fig["healthy_findings"]:
        print(f"  {f['run']} step {f['step']}: {f['detector']} {f['verdict']}: {f['message']}")
    if not fig["healthy_findings"]:
        print("  none")


def run_families_tuning(vidstab_config=None, cache: Path = CACHE_DIR) -> dict:
    """The held-out families on tuning seeds (``catalogue.family_healthy_runs``, ``catalogue.logit_growth_runs`` and
    ``catalogue.input_drift_runs`` with their healthy twins), recorded with the held-out recorder (cached) and
    judged like a draw: where the logit-growth and input-drift behaviour of the defaults is chosen, and where a
    change is checked for false alarms on the three batch-4 families before any draw is replayed."""
    from benchmarks.scenarios import heldout as H

    healthy = {r: H.record(r, cache) for r in C.family_healthy_runs()}
    faults = []
    for r in C.logit_growth_runs() + C.input_drift_runs():
        # The twin is the healthy run of the same family, schedule, seed and length (one recording, counted once).
        twin = next((h for h in healthy if (h.family, h.schedule, h.seed, h.steps) == (r.family, r.schedule, r.seed, r.steps)),
                    None) or H.healthy_runs((r.family,), (r.schedule,), (r.seed,), r.steps)[0]
        if twin not in healthy:
            healthy[twin] = H.record(twin, cache)
        faults.append(H.record(r, cache, healthy=healthy[twin]))
    return heldout_figures(list(healthy.values()), faults, vidstab_config)


def print_heldout(fig: dict, split: str = "Held-out") -> None:
    base = [cls().name for cls in B.BASELINES]
    print(f"\n== {split} split: alarms per 1k healthy steps, per model family (vidstab[act] = SKIP/ROLLBACK) ==")
    names = base + ["vidstab", "vidstab[act]"]
    print(f"{'family':16s} {'steps':>6s}" + "".join(f" {n[:12]:>12s}" for n in names))
    for fam, f in fig["families"].items():
        print(f"{fam:16s} {f['healthy_steps']:>6d}" + "".join(f" {_fmt(f[n], 2):>12s}" for n in names)
              + (f"   vidstab alarms from: {', '.join(f['vidstab_alarm_detectors'])}" if f["vidstab_alarm_detectors"] else ""))
    print(f"quiet baselines (<= {QUIET_PER_1K:g} alarm per 1k healthy steps): {fig['quiet_baselines']}")
    found = fig.get("healthy_findings", [])
    print(f"vidstab findings on the healthy runs (every one a false alarm): {len(found)}")
    for f in found[:40]:
        print(f"  {f['run']} step {f['step']}: {f['detector']} {f['verdict']}: {f['message']}")
    print(f"\n== {split} fault runs: lead = failure step - first alarm (vidstab vs best quiet baseline) ==")
    print(f"{'run':52s} {'fail':>5s} {'alarm':>6s} {'act':>5s} {'lead':>5s} {'bestQ':>6s}  first detectors")
    for r in fig["runs"]:
        print(f"{r['run'][:52]:52s} {_fmt(r['failure_step']):>5s} {_fmt(r['first_alarm']):>6s} {_fmt(r['first_action']):>5s} "
              f"{_fmt(r['lead']):>5s} {_fmt(r['best_quiet_lead']):>6s}  {','.join(r['first_detectors'])}")
    s = fig["summary"]
    print(f"\n{split.lower()}: detected {s['detected']}/{s['divergent_runs']} divergent runs; slow faults acted on before the "
          f"failure {s['slow_action_in_time']}/{s['slow_divergent']}; lead >= best quiet baseline on "
          f"{s['lead_ge_best_quiet']}/{s['lead_compared']} runs; benign fault runs (no failure point) {s['benign_runs']}")
    print(f"{split.lower()} per fault kind (divergent runs): " + "; ".join(
        f"{k} detected {v['detected']}/{v['divergent_runs']}, acted before the failure {v['action_in_time']}, "
        f"lead >= best quiet {v['lead_ge_best_quiet']}/{v['lead_compared']}" for k, v in s["by_kind"].items()))
    print(f"{split.lower()} targets: {s['targets']}")


# ------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="Smoke subset (< 60 s): 3 scenarios x 1 seed, 1 healthy seed, no e2e.")
    ap.add_argument("--no-e2e", action="store_true", help="Skip the end-to-end trainer runs.")
    ap.add_argument("--split", choices=("tuning", "heldout", "both"), default="both",
                    help="tuning: the DiT catalogue the defaults were chosen on; heldout: scenarios/heldout.py.")
    ap.add_argument("--heldout-draw", choices=("A", "B", "C", "D", "E"), default="B",
                    help="Held-out seeds: B (recorded after the defaults were frozen; default), A, C (draw B's "
                         "defaults, a logit growth that fails, the small-batch UNet), D (C's scenarios, recorded "
                         "after the small-batch changes were frozen) or E (healthy runs only, 11 seeds: >= 30,000 "
                         "healthy steps per family); see RESULTS.md.")
    ap.add_argument("--e2e-seed", type=int, default=0)
    ap.add_argument("--e2e-steps", type=int, default=E2ESetup.steps)
    ap.add_argument("--e2e-fault-step", type=int, default=E2ESetup.fault_step)
    ap.add_argument("--e2e-scenarios", type=str, default=",".join(E2E_SCENARIOS), help="Comma-separated scenario names.")
    ap.add_argument("--e2e-vidstab-config", type=str, default=None,
                    help="YAML for a third end-to-end arm (vidstab+cfg), e.g. a proposed detector policy.")
    ap.add_argument("--cache-dir", type=str, default=str(CACHE_DIR))
    ap.add_argument("--markdown", type=str, default=None, help="Also write the tables as Markdown to this file.")
    ap.add_argument("--vidstab-config", type=str, default=None,
                    help="YAML of GuardConfig fields for the replayed vidstab detectors (default: GuardConfig()).")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    started = time.time()
    cache = Path(args.cache_dir)
    vcfg = None
    if args.vidstab_config:
        from vidstab.config import GuardConfig

        vcfg = GuardConfig.from_yaml(args.vidstab_config)
        print(f"vidstab detectors configured from {args.vidstab_config}")

    if not torch.cuda.is_available():
        print("note: fp16_overflow needs CUDA; skipped on this CPU-only machine")
    else:
        print("note: fp16_overflow runs end to end only (the signal recorder is fp32 on CPU)")
    scen = [s for s in C.SCENARIOS if not (s.cuda_only and not torch.cuda.is_available())]
    # The fp16 scenario is not recordable by the CPU recorder (fp32); it only runs end-to-end on CUDA.
    scen = [s for s in scen if not s.cuda_only]
    if args.quick:
        scen = [s for s in scen if s.name in C.QUICK_SCENARIOS]
    seeds_of = (lambda s: C.QUICK_SEEDS) if args.quick else (lambda s: s.seeds)
    healthy_seeds = C.QUICK_HEALTHY_SEEDS if args.quick else C.HEALTHY_SEEDS

    summary = {"bench": "detection", "quick": args.quick, "split": args.split}
    if args.split in ("tuning", "both"):
        healthy = {}
        for seed in healthy_seeds:
            healthy[seed] = record(C.HEALTHY, seed, cache_dir=cache)
        judged_h = [judge(h, vcfg) for h in healthy.values()]
        faults: dict[str, list[Judged]] = {}
        for s in scen:
            faults[s.name] = []
            for seed in seeds_of(s):
                ref = healthy.get(seed) if s.prediction_type == "epsilon" else None
                faults[s.name].append(judge(record(s, seed, healthy=ref, cache_dir=cache), vcfg))
        fig = figures(judged_h, faults)
        fig["median_only_exceedances_per_1k"] = round(
            1000.0 * sum(healthy_exceedances(h) for h in healthy.values()) / max(1, fig["healthy_steps"]), 2)
        rows = row_names(judged_h + [j for js in faults.values() for j in js])
        print_tables(fig, rows)

        e2e = None
        if not args.quick and not args.no_e2e:
            work = cache / "e2e"
            import shutil

            shutil.rmtree(work, ignore_errors=True)
            names = tuple(x for x in args.e2e_scenarios.split(",") if x)
            if torch.cuda.is_available() and "fp16_overflow" not in names:
                names += ("fp16_overflow",)  # GradScaler overflow: only meaningful (and possible) on CUDA
            setup = E2ESetup(steps=args.e2e_steps, fault_step=args.e2e_fault_step, scenarios=names,
                             extra_config=str(Path(args.e2e_vidstab_config).resolve()) if args.e2e_vidstab_config else None)
            e2e = run_e2e(setup, args.e2e_seed, work)
            print_e2e(e2e, setup)
        elif args.quick:
            print("\nnote: --quick skips the end-to-end trainer runs (run without --quick for them)")

        small = fam = None
        if not args.quick:
            small = run_small_batch_tuning(vcfg, cache)
            print_small_batch_tuning(small)
            fam = run_families_tuning(vcfg, cache)
            print_heldout(fam, split="Tuning (held-out families on tuning seeds, logit growth, input drift)")

        if args.markdown:
            Path(args.markdown).write_text(markdown(fig, rows, e2e))
        t = fig["targets"]
        summary.update({
            "healthy_steps": fig["healthy_steps"],
            "detectors": {k: {kk: v[kk] for kk in ("detection_rate", "median_lead", "false_alarms_per_1k")} for k, v in fig["detectors"].items()},
            "scenarios": {k: {"failure_steps": v["failure_steps"],
                              "vidstab_leads": v["per_detector"]["vidstab"]["leads"],
                              "best_baseline_leads": [max((v["per_detector"][b]["leads"][i] for b in [c().name for c in B.BASELINES]
                                                           if v["per_detector"][b]["leads"][i] is not None), default=None)
                                                      for i in range(v["divergent_runs"])]}
                          for k, v in fig["scenarios"].items()},
            "targets": {k: t[k] for k in ("all_detected", "fa_target_met", "false_alarms_per_1k", "lead_target_met", "lead_target_met_quiet")},
            "e2e": e2e,
            "small_batch_tuning": None if small is None else {
                "families": small["families"],
                "healthy_findings": [{k: f[k] for k in ("run", "step", "detector", "verdict")} for f in small["healthy_findings"]]},
            "families_tuning": None if fam is None else {
                "summary": fam["summary"], "families": fam["families"], "quiet_baselines": fam["quiet_baselines"],
                "healthy_findings": [{k: f[k] for k in ("run", "step", "detector", "verdict")} for f in fam["healthy_findings"]]},
        })
    if args.split in ("heldout", "both"):
        held = run_heldout(quick=args.quick, vidstab_config=vcfg, cache=cache, draw=args.heldout_draw)
        print(f"\nheld-out draw {args.heldout_draw if not args.quick else 'quick'}")
        print_heldout(held)
        summary["heldout"] = {"draw": "quick" if args.quick else args.heldout_draw, "summary": held["summary"], "families": held["families"],
                              "quiet_baselines": held["quiet_baselines"], "baselines": held["baselines"]}
    summary["seconds"] = round(time.time() - started, 1)
    print(json.dumps(summary, default=str))
    return summary


if __name__ == "__main__":
    main()
