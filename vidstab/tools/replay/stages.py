"""The four triage stages: 1 data, 2a precision, 2b learning rate, 3 structure (each returns its section)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch

from ...evidence.capture import Incident, json_float, sample_report
from .base import JUMP_FACTOR, LOO_INFLUENCE, SPIKE_TOLERANCE, _rel
from .lr_evidence import lr_evidence
from .report import ReplayReport, RunResult
from .runner import _dtype_name, _Replayer
from .verdict import _mod


def _triage_data(inc: Incident, r: _Replayer, ref: RunResult, failing: bool, dtype: torch.dtype | None,
                 report: ReplayReport, absmax_limit: float) -> dict:
    """Step 1: input statistics and leave-one-out (in the failing setting: fp32, or the run's precision)."""
    base = ref
    stats = sample_report(inc.tensors, inc.sample_ids, absmax_limit=absmax_limit)
    bsz, ids = stats["batch_size"], stats["sample_ids"]
    section: dict[str, Any] = {
        "absmax_limit": absmax_limit,
        "bad_inputs": stats["bad_reasons"],
        "input_stats": stats["input_stats"],
        "sample_stats": stats["sample_stats"],
        "leave_one_out": [],
        "alone": [],
        "culprits": [],
    }
    if bsz and bsz > 1:
        for i in range(bsz):
            keep = [j for j in range(bsz) if j != i]
            res = r.run(f"without {ids[i]}", r.subset(keep, bsz), dtype=dtype)
            report.runs.append(res)
            section["leave_one_out"].append({"sample_id": ids[i], **asdict(res), "finite": res.finite})
        loo = report.runs[-bsz:]
        if failing:
            section["culprits"] = [ids[i] for i, res in enumerate(loo) if res.finite]
            if not section["culprits"]:  # two or more bad samples: no single removal fixes it, look at each alone
                for i in range(bsz):
                    res = r.run(f"only {ids[i]}", r.subset([i], bsz), dtype=dtype)
                    report.runs.append(res)
                    section["alone"].append({"sample_id": ids[i], **asdict(res), "finite": res.finite})
                alone = report.runs[-bsz:]
                bad_alone = [ids[i] for i, res in enumerate(alone) if not res.finite]
                if 0 < len(bad_alone) < bsz:
                    section["culprits"] = bad_alone
        elif base.grad_norm:
            for i, res in enumerate(loo):
                if res.finite and res.grad_norm is not None and res.grad_norm < LOO_INFLUENCE * base.grad_norm:
                    section["culprits"].append(ids[i])
        if section["culprits"]:
            keep = [j for j in range(bsz) if ids[j] not in section["culprits"]]
            clean = r.subset(keep, bsz)
            if len(section["culprits"]) == 1:
                res = loo[ids.index(section["culprits"][0])]
            else:
                res = r.run("without " + ", ".join(section["culprits"]), clean, dtype=dtype) if keep else base
                if keep:
                    report.runs.append(res)
            section["without_culprits_finite"] = res.finite
            section["without_culprits_grad_norm"] = res.grad_norm
            if keep and res.finite:
                section["_clean_batch"] = clean
    elif bsz == 1 and stats["bad_reasons"] and failing:
        section["culprits"] = list(stats["bad_reasons"])

    bad = stats["bad_reasons"]
    alone_all_fail = bool(section["alone"]) and all(not a["finite"] for a in section["alone"])
    section["whole_batch_bad"] = bool(failing and not section["culprits"] and alone_all_fail and ids
                                      and set(bad) == set(ids))
    if section["whole_batch_bad"]:
        section["culprits"] = list(ids)
    culprits = section["culprits"]
    section["implicated"] = bool(culprits) or (bool(bad) and failing)
    parts = [_summarise_bad(bad) if bad else f"inputs finite and within absmax {absmax_limit:g}"]
    fixed = section.get("without_culprits_finite")
    if section["whole_batch_bad"]:
        parts.append("every sample has bad inputs and fails on its own: the whole micro-batch is bad "
                     "(look at the loader, VAE or latent cache that produced it)")
    elif culprits and not failing:
        parts.append(f"removing {_names(culprits)} brings the grad norm below {LOO_INFLUENCE:.0%} of the batch's")
    elif culprits:
        how = "run one by one, the failing samples are" if section["alone"] else "leave-one-out names"
        it = "it" if len(culprits) == 1 else "them"
        parts.append(f"{how} {_names(culprits)}" + (f"; without {it} the step is finite" if fixed else ""))
    elif bsz and bsz > 1 and failing:
        parts.append("every sample fails on its own although none has bad inputs: not one bad sample"
                     if alone_all_fail else "no single sample causes it (leave-one-out)")
    elif bsz and bsz > 1:
        parts.append("no sample dominates the gradient (leave-one-out)")
    section["summary"] = "; ".join(parts)
    return section


def _names(ids: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(ids[:limit])
    return shown + (f" and {len(ids) - limit} more" if len(ids) > limit else "")


def _summarise_bad(bad: dict[str, list[str]], limit: int = 3) -> str:
    """``"s1 has latents: 3 non-finite ...; s2 ..."``, at most ``limit`` samples spelled out."""
    items = list(bad.items())
    text = "; ".join(f"{sid} has {', '.join(reasons)}" for sid, reasons in items[:limit])
    if len(items) > limit:
        text += f"; and {len(items) - limit} more sample(s) with bad inputs"
    return text


def _triage_precision(precision: str | None, dtype: torch.dtype | None, base: RunResult, mixed: RunResult | None,
                      mixed_error: str | None, report: ReplayReport) -> dict:
    """Step 2a: the fp32 replay against the run's mixed precision (autocast, fp32 weights, like Accelerate)."""
    section: dict[str, Any] = {"precision": precision, "implicated": False}
    if dtype is None:
        if str(precision).lower() == "fp8":
            section["summary"] = "fp8 is not emulated by the replay"
        else:
            section["summary"] = f"not applicable: the run was fp32 (precision {precision!r})"
        return section
    name = _dtype_name(dtype)
    if mixed is None:
        section["summary"] = f"{name} autocast is not available on {report.device}: {mixed_error}"
        return section
    section["mixed"] = asdict(mixed)
    if base.finite and not mixed.finite:
        section["implicated"] = True
        fwd = (report.localization or {}).get("forward") or {}
        where = f" (first in {_mod(fwd.get('module'))})" if fwd.get("module") is not None else ""
        section["summary"] = f"finite in fp32 but non-finite under {name} autocast{where}: an overflow/underflow"
    elif not base.finite:
        section["summary"] = f"fp32 fails as well, so {name} is not the cause"
    else:
        diff = _rel(mixed.grad_norm or 0.0, base.grad_norm) if base.grad_norm else 0.0
        section["grad_norm_rel_diff"] = diff
        section["summary"] = f"finite in fp32 and {name}; grad norms differ by {diff:.1%}"
        if diff > SPIKE_TOLERANCE:
            section["implicated"] = True
            section["summary"] += f" (> {SPIKE_TOLERANCE:.0%}: {name} rounding changes the step)"
    if name == "fp16":
        section["summary"] += "; replayed without GradScaler loss scaling"
    return section


def _triage_lr(meta: dict, r: _Replayer, base: RunResult, clean_batch: dict | None, report: ReplayReport,
               optimizer: str, inc: Incident) -> dict:
    """Step 2b: is the learning rate the cause? The bundle's LR (and the LRs logged since the checkpoint)
    against the checkpoint's schedule (:mod:`.lr_evidence`), then one update at the suspect LR against one at
    a sane LR: the checkpoint's when the suspect is an outlier, else a tenth of it."""
    lr = json_float(meta.get("lr"))
    ckpt_dir = Path(report.checkpoint).parent if report.checkpoint else None
    evidence = lr_evidence(lr, inc.run_dir, inc.rank, inc.step, ckpt_dir, report.checkpoint_step)
    section: dict[str, Any] = {"lr": lr, "implicated": False, "evidence": evidence}
    suspect = evidence["suspect"]
    if suspect is None or not suspect > 0:
        section["summary"] = "skipped: the bundle records no learning rate"
        return section
    outlier = evidence["outlier"]
    where = ("the bundle's" if evidence["suspect_step"] == inc.step and suspect == lr
             else f"logged at step {evidence['suspect_step']}")
    compared = (f"lr {suspect:.3g} ({where}) is {evidence['factor']:.3g}x the largest LR the checkpoint's schedule "
                f"and optimizer hold ({evidence['reference']:.3g})") if outlier else ""
    extra = meta.get("extra") or {}
    if optimizer == "auto":
        optimizer = "sgd" if "sgd" in str(extra.get("optimizer", "")).lower() else "adamw"
    section["optimizer"] = optimizer
    batch, which = r.batch, "the captured batch"
    if not base.finite:
        if clean_batch is None:
            section["implicated"] = outlier
            section["summary"] = (f"{compared}; the weights are already non-finite, so no update test runs" if outlier
                                  else "skipped: the gradients are non-finite before any update, and the learning "
                                       "rate cannot cause that (it only shaped the checkpoint's weights)")
            return section
        batch, which = clean_batch, "the batch without the culprit samples"
    section["batch"] = which
    max_norm = json_float(extra.get("max_grad_norm"))
    sane = evidence["sane"] if outlier else suspect / 10
    sane_name = f"ckpt lr={sane:.3g}" if outlier else f"lr/10={sane:.3g}"
    at_lr, ratio_lr = r.update_test(f"update at lr={suspect:.3g}", batch, suspect, optimizer, max_norm)
    at_sane, ratio_sane = r.update_test(f"update at {sane_name}", batch, sane, optimizer, max_norm)
    report.runs += [at_lr, at_sane]
    section["tested_lr"], section["sane_lr"] = suspect, sane
    section["at_lr"], section["at_sane_lr"] = asdict(at_lr), asdict(at_sane)
    section["loss_ratio_at_lr"], section["loss_ratio_at_sane_lr"] = ratio_lr, ratio_sane
    section["jump_at_lr"], section["jump_at_sane_lr"] = ratio_lr > JUMP_FACTOR, ratio_sane > JUMP_FACTOR
    if not outlier:  # the names of the lr/10 comparison, kept for readers of replay_report.json
        section["at_lr_over_10"], section["loss_ratio_at_lr_over_10"] = section["at_sane_lr"], ratio_sane
        section["jump_at_lr_over_10"] = section["jump_at_sane_lr"]
    blows_up = section["jump_at_lr"] and not section["jump_at_sane_lr"]
    section["implicated"] = outlier or blows_up
    section["outlier"] = outlier
    if outlier and blows_up:
        section["summary"] = (f"{compared}; one {optimizer} update on {which} at it blows the loss up ({at_lr.note}), "
                              f"at the checkpoint's lr {sane:.3g} it does not ({at_sane.note})")
    elif outlier:
        section["summary"] = f"{compared}; one {optimizer} update at it: {at_lr.note}"
    elif blows_up:
        section["summary"] = (f"one {optimizer} update on {which} at lr {suspect:.3g} blows the loss up ({at_lr.note}), "
                              f"at lr/10 it does not ({at_sane.note}): lower the LR or lengthen warm-up")
    elif section["jump_at_lr"]:
        section["summary"] = f"the loss jumps after one update even at lr/10 ({at_sane.note})"
    else:
        section["summary"] = f"one {optimizer} update at lr {suspect:.3g} on {which} is stable ({at_lr.note})"
    return section


def _triage_structure(r: _Replayer, base: RunResult, report: ReplayReport, norms: list[tuple[str, float]]) -> dict:
    section: dict[str, Any] = {"implicated": False}
    # Largest parameter gradients of the fp32 run: where a (finite) spike concentrates.
    section["largest_grads"] = [{"param": n, "grad_norm": v} for n, v in norms[:5]]
    loc = report.localization
    if loc is None:
        top = norms[0][0] if norms else "-"
        section["summary"] = f"no non-finite values in fp32; largest gradient in {top}"
        return section
    fwd, bwd = loc.get("forward"), loc.get("backward")
    section["forward"], section["backward"] = fwd, bwd
    if loc.get("error"):
        section["summary"] = f"the step raised {loc['error']}"
        return section
    data_implicated = report.data.get("implicated")
    if fwd is not None:
        origin = fwd.get("origin")
        if origin is not None:
            o = report.localization["forward"]
            in_absmax = [s.get("absmax") for s in o.get("inputs", {}).values()] if o["module"] == origin["module"] else []
            absmax = max((a for a in in_absmax if isinstance(a, float)), default=None)
            section["module"] = origin["module"]
            section["summary"] = (f"{_mod(origin['module'])} ({origin['type']}) is the first to turn finite inputs "
                                  f"into a non-finite output" + (f" (input absmax {absmax:.4g})" if absmax is not None else ""))
            if fwd.get("nonfinite_params") and fwd["module"] == origin["module"]:
                section["summary"] += f"; its parameters {fwd['nonfinite_params']} are non-finite"
            section["implicated"] = not data_implicated
        else:
            section["module"] = fwd["module"]
            section["summary"] = (f"the first non-finite output ({_mod(fwd['module'])}) already had non-finite inputs: "
                                  f"the model's inputs were non-finite, not a module")
    elif bwd is not None:
        section["module"] = bwd.get("after") or bwd["module"]
        section["summary"] = (f"forward finite; the gradient first became non-finite in the backward of "
                              f"{_mod(section['module'])} (output gradient of {_mod(bwd['module'])} non-finite)")
        section["implicated"] = not data_implicated
    else:
        section["summary"] = "no module output or gradient was non-finite (only the loss)"
    if section["implicated"] and report.precision.get("implicated"):
        section["implicated"] = False
        section["summary"] += " - explained by precision"
    return section
