"""Resume fidelity: does a resumed (or rewound) run replay what the original run did?

Every ``metrics`` line carries ``batch_fp``, a cheap fingerprint of the step's batch on every rank: each rank's
CRC-32 of the sample ids given to ``guard.backward`` over the step's micro-batches, in order (:func:`batch_crc`),
summed over the ranks in the guard's one reduction (``null`` when the loop gives no ids), so rank 0's line,
written every step, covers every rank's data. After a resume or a rollback that rewinds the data,
:class:`ResumeCheck` compares the first replayed steps with what the original attempt logged for the same steps,
in the same rank's event log, and names what changed in a ``warn`` event
(``detector="resume_fidelity"``), in the order that explains the rest:

* **world size**: the attempt that logged the original steps ran on another number of processes;
* **data order**: another batch at the same step (fingerprint; without ids, the logged input statistics);
* **optimizer/scheduler state**, the LR: another LR in ``param_groups`` at the same step (after a rollback's
  back-off, the LR scaled by it): the scheduler, or the optimizer whose param groups hold the LR, was not
  restored;
* **RNG**: the same data and LR, but another loss or gradient norm at the *first* replayed step, where the
  weights are the checkpoint's own (verified on load): the random draws (noise, timesteps, dropout) differ;
* **optimizer/scheduler state**, the update: the first step matched but a later one did not: the first
  update differed (the optimizer's moments or step count were not restored).

An exact resume is quiet. :class:`vidstab.recovery.policy.Recovery` runs the check: ``resume()`` and a rollback that
rewinds the data start it, ``check_resume(step)`` starts it after a load the loop made itself, and
``on_step`` compares once the replay has logged ``steps`` steps. A rollback that skips the data (the
default) compares the world size and the LR only: its batches differ on purpose.
"""

from __future__ import annotations

import logging
import math
import os
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from ..events import events_dir, flush_open_logs, iter_event_file, log_event
from ..files.strict_json import json_float

__all__ = ["batch_crc", "batch_fingerprint", "host_ids", "ResumeCheck", "compare_replay"]

logger = logging.getLogger("vidstab.run.resume_check")


def host_ids(sample_ids: Any) -> Any:
    """``sample_ids`` ready to read on the host at the step's end: a device tensor is copied without blocking
    (the step's one host read waits for the copy with everything else); anything else as it is."""
    if isinstance(sample_ids, torch.Tensor) and sample_ids.device.type != "cpu":
        return sample_ids.to("cpu", non_blocking=True)
    return sample_ids


def batch_fingerprint(ids_per_micro_step: Iterable[Any]) -> str | None:
    """8 hex digits of :func:`batch_crc` (None when no micro-step had ids)."""
    crc = batch_crc(ids_per_micro_step)
    return None if crc is None else f"{crc:08x}"


def batch_crc(ids_per_micro_step: Iterable[Any]) -> int | None:
    """CRC-32 over the sample ids of a step's micro-batches, in order (ids as text; it tells batches apart, it is
    not a security hash); None when no micro-step had ids."""
    crc, seen = 0, False
    for ids in ids_per_micro_step:
        if ids is None:
            continue
        values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        crc = zlib.crc32(("\x1f".join(map(str, values)) + "\x1e").encode(), crc)  # \x1e: micro-step boundary
        seen = True
    return crc if seen else None


def _close(a: Any, b: Any, rtol: float) -> bool:
    x, y = json_float(a), json_float(b)
    if x is None or y is None:
        return x is None and y is None
    if not (math.isfinite(x) and math.isfinite(y)):
        return (math.isnan(x) and math.isnan(y)) or x == y
    return math.isclose(x, y, rel_tol=rtol, abs_tol=0.0)


def compare_replay(original: dict[int, dict], replayed: dict[int, dict], *, world_then: int | None, world_now: int,
                   same_data: bool = True, lr_ratio: float = 1.0, rtol: float = 1e-4) -> list[tuple[str, str]]:
    """What changed between the ``original`` and ``replayed`` metrics lines of the same steps (step -> line):
    ``[(what, evidence)]``, empty when the replay matches (see the module docstring for the order)."""
    changes: list[tuple[str, str]] = []
    if world_then is not None and world_then != world_now:
        changes.append(("world size", f"{world_then} process(es) then, {world_now} now"))
    for i, step in enumerate(sorted(set(original) & set(replayed))):
        o, r = original[step], replayed[step]
        if same_data:
            fo, fr = o.get("batch_fp"), r.get("batch_fp")
            if fo is not None and fr is not None:
                if fo != fr:
                    changes.append(("data order", f"step {step}: batch fingerprint {fo} then, {fr} now"))
                    break
            elif not all(_close(o.get(k), r.get(k), rtol) for k in ("input_mean", "input_absmax")):
                changes.append(("data order", f"step {step}: input mean {o.get('input_mean')} then, "
                                f"{r.get('input_mean')} now (pass sample_ids to guard.backward for an exact check)"))
                break
        lo, lr_ = json_float(o.get("lr")), json_float(r.get("lr"))
        if lo is not None and lr_ is not None and not _close(lo * lr_ratio, lr_, rtol):
            scaled = f" (x{lr_ratio:.4g} expected after the rollback's back-off)" if lr_ratio != 1.0 else ""
            changes.append(("optimizer/scheduler state", f"step {step}: learning rate {lo:.6g} then, {lr_:.6g} now{scaled}"))
            break
        if not same_data or (i > 0 and lr_ratio != 1.0):
            break  # other batches, or another LR since the first update: the losses differ by design
        if not (_close(o.get("loss"), r.get("loss"), rtol) and _close(o.get("grad_norm"), r.get("grad_norm"), rtol)):
            what = "RNG" if i == 0 else "optimizer/scheduler state"
            why = ("same batch, same LR and the checkpoint's weights" if i == 0 else
                   "the steps before matched, so the update before this step differed: optimizer moments or step count")
            changes.append((what, f"step {step}: loss {o.get('loss')} then, {r.get('loss')} now, grad norm "
                                  f"{o.get('grad_norm')} then, {r.get('grad_norm')} now ({why})"))
            break
    return changes


class ResumeCheck:
    """Compares the first ``steps`` replayed steps of this rank with the original attempt's (module docstring).

    Args:
        run_dir: the run folder (this rank's event log).
        rank: this process's rank.
        world_size: the number of processes now.
        steps: how many replayed steps to compare.
        rtol: relative tolerance on losses, gradient norms, LRs and input statistics (a resume on the same
            hardware with deterministic kernels is bitwise; non-deterministic kernels differ slightly).
        complete: called before the event log is read, to have every line of the replayed steps written (the
            guard holds healthy steps' lines back for a few steps: ``guard.detectors`` completes them).
    """

    def __init__(self, run_dir: str | os.PathLike, rank: int, world_size: int, *, steps: int = 3, rtol: float = 1e-4,
                 complete: Callable[[], Any] | None = None) -> None:
        self.run_dir, self.rank, self.world_size = Path(run_dir), int(rank), int(world_size)
        self.steps, self.rtol, self.complete = int(steps), float(rtol), complete
        self.path = events_dir(run_dir) / f"events-rank{self.rank}.jsonl"
        self._pending: dict | None = None
        self.last: list[tuple[str, str]] | None = None
        """What the latest comparison found (``[]``: the replay matched), None before any."""

    def begin(self, step: int, *, what: str = "resume", same_data: bool = True, lr_ratio: float = 1.0,
              until: int | None = None) -> None:
        """The run continues from ``step`` (the loaded checkpoint's); lines written from now on are the replay.
        ``until``: compare only steps before it (a rollback: the original steps from the failure on went wrong)."""
        if self.complete is not None:
            self.complete()
        flush_open_logs(self.path)
        try:
            offset = os.path.getsize(self.path)
        except OSError:
            offset = 0
        end = int(step) + self.steps if until is None else min(int(step) + self.steps, int(until))
        self._pending = {"step": int(step), "end": end, "what": what, "same_data": same_data,
                         "lr_ratio": float(lr_ratio), "offset": offset}

    def after_step(self, step: int) -> list[tuple[str, str]] | None:
        """``step``: the loop's count after a step. Once ``steps`` steps were replayed: compare, log a ``warn``
        event when something changed, and return the changes (``[]``: quiet); before that (or with no check
        pending) None."""
        p = self._pending
        if p is None or step < p["end"]:
            return None
        self._pending = None
        if p["end"] <= p["step"]:
            return None  # nothing before the failure to compare
        original, replayed, world_then = self._read(p["offset"], range(p["step"], p["end"]))
        if not original:
            return None  # the original attempt never logged these steps (it saved and stopped there)
        changes = compare_replay(original, replayed, world_then=world_then, world_now=self.world_size,
                                 same_data=p["same_data"], lr_ratio=p["lr_ratio"], rtol=self.rtol)
        self.last = changes
        if changes:
            steps = sorted(set(original) & set(replayed))
            message = (f"the {p['what']} from step {p['step']} does not replay what the original run did: "
                       + "; ".join(f"{w} changed ({e})" for w, e in changes))
            logger.warning("vidstab: rank %d: %s (what to do: docs/runbook.md, 'Resume-fidelity warning')",
                           self.rank, message)
            log_event(self.run_dir, self.rank, "warn", p["step"], detector="resume_fidelity", message=message,
                      figures={"steps_compared": len(steps)}, bad_ranks=[self.rank], changed=[w for w, _ in changes],
                      resumed_at=p["step"], what=p["what"])
        return changes

    def _read(self, offset: int, steps: range) -> tuple[dict[int, dict], dict[int, dict], int | None]:
        """(original lines, replayed lines, world size of the attempt that wrote the original lines)."""
        if self.complete is not None:
            self.complete()
        original: dict[int, tuple[dict, int | None]] = {}
        replayed: dict[int, dict] = {}
        world = None
        # Bounded reads (vidstab.files.limits), one line at a time: the log may be long, and a line in it hostile.
        for rec in iter_event_file(self.path, end=offset):
            if rec.get("kind") == "start":
                world = rec.get("world_size", world)
            elif rec.get("kind") == "metrics" and rec.get("step") in steps:
                original[rec["step"]] = (rec, world)  # the latest attempt before the replay
        for rec in iter_event_file(self.path, start=offset):
            if rec.get("kind") == "metrics" and rec.get("step") in steps and rec["step"] not in replayed:
                replayed[rec["step"]] = rec
        worlds = {w for _, w in original.values() if w is not None}
        return {s: r for s, (r, _) in original.items()}, replayed, (worlds.pop() if len(worlds) == 1 else None)
