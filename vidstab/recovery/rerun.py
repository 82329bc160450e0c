"""Rerun on suspicion: is a skipped step's trouble the data, the numerics, a transient fault or one GPU?

When the guard skips a step for a non-finite loss or gradient, a spike or an exception, the weights are those
the step saw (nothing was applied), and every rank still holds its micro-batches (the evidence the incident
bundle is written from). :class:`StepRerun` then, on every rank together (the verdict comes from the same
gathered numbers everywhere, so the ranks stay in lockstep):

1. re-runs each of the rank's micro-batches forward and backward through the replay function
   (``guard.set_replay_fn``; for a diffusers model given to ``vidstab.attach``, none needed: the model's
   recorded inputs forward and its recorded output gradient backward, :mod:`vidstab.evidence.replay_record`) on the
   unchanged weights, and averages the gradients over the ranks as the step
   did (DDP: one all-reduce of the gradients; FSDP2: the sharded module's own reduce-scatter);
2. gathers one small row per rank (non-finite losses, finite loss sum and count, exceptions, local gradient
   sum of squares) and compares it with the first run's, from the step's gathered table: each rank's loss,
   which ranks went non-finite or raised, and the global gradient norm;
3. for every rank whose trouble reproduced, sends its micro-batches to a peer rank (``rank + 1``), which runs
   them on its own replica of the weights (DDP only), and gathers what the peer saw.

The verdict (``RerunVerdict``, in the ``rerun`` event, the step's incident bundles and ``StepResult.rerun``):

* ``data`` / ``numerics``: reproduced, by the peer too. ``data`` when the inputs hold non-finite values or a
  sample stands out (:func:`vidstab.evidence.capture.sample_report`, as ``vidstab replay`` triages): the samples are
  named and quarantined (:mod:`vidstab.recovery.quarantine`); ``numerics`` when the inputs are clean.
* ``transient``: the rerun does not reproduce it (a bit flip, a flaky kernel, a one-off exception): counted
  per rank; :class:`vidstab.recovery.policy.Recovery` never lowers the LR nor spends the retry budget for it.
* ``suspect_hardware``: reproduced on the original rank and not by the peer on the same batch and weights:
  a ``warn`` event (``detector="suspect_hardware"``) from that rank names it and its host, and the host is
  appended to ``vidstab/suspect_hosts.txt`` so the next elastic restart can leave it out (docs/runbook.md, "Rerun
  verdicts").

Under FSDP (one rank cannot run the sharded model alone) every rank re-runs its own micro-batches together,
so the verdict is reproduced (data / numerics) or transient; there is no peer check, so no
``suspect_hardware`` (replay the bundle on another node for that). Under DeepSpeed the engine applied the
step inside ``backward``, so the weights changed and nothing is re-run (``not_rerun``). Without a replay
function nor a recorded output gradient (a model that is not a diffusers one, attached with no
``set_replay_fn``) nothing is re-run either; ``not_rerun`` says what to pass, once per run. The cost, only on such a
step: one forward+backward per micro-batch on every rank, one gradient all-reduce, two small gathers, and per
reproduced rank one broadcast of its micro-batches and one forward+backward on the peer (``seconds`` in the
event; ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from ..evidence.capture import sample_report, update_incident
from ..detectors import StepStats, Verdict
from .quarantine import QuarantineList
from ..evidence.replay_record import OUTPUT_GRAD_KEY, OutputGradients, output_grad_loss

__all__ = ["RERUN_DETECTORS", "RerunVerdict", "StepRerun", "SUSPECT_HOSTS_FILE"]

logger = logging.getLogger("vidstab.recovery.rerun")

RERUN_DETECTORS = frozenset({"nonfinite", "grad_spike", "loss_spike", "exception"})
"""Findings whose skip (or rollback) is re-run: a value the data, the numerics or the hardware can explain."""
SUSPECT_HOSTS_FILE = os.path.join("vidstab", "suspect_hosts.txt")
RTOL = 1e-3  # a deterministic rerun matches to the bit; leave room for non-deterministic kernels

# One rank's rerun row: non-finite micro-step losses, finite loss sum, finite count, exceptions, local grad sum of
# squares, and the first run's loss sum over the same micro-steps where the replay's loss is not the step's own.
BAD, LOSS_SUM, LOSS_COUNT, EXCEPTIONS, GRAD_SQ, FIRST_SUM = range(6)
ROW = 6
NO_REPLAY_FN = "no replay function: guard.set_replay_fn(fn) with loss = fn(batch) enables it (docs/runbook.md)"


@dataclass
class RerunVerdict:
    """What the rerun of one skipped step found (the same on every rank but ``samples``)."""

    step: int
    verdict: str
    """``data`` | ``numerics`` | ``transient`` | ``suspect_hardware`` | ``not_rerun``."""
    message: str
    ranks: list[int] = field(default_factory=list)
    """The ranks the verdict is about: where the trouble was (and did or did not reproduce)."""
    reproduced: dict[str, bool] = field(default_factory=dict)
    """Per rank (as text): whether its trouble came back on the rerun."""
    peer: dict[str, bool] = field(default_factory=dict)
    """Per rank whose trouble reproduced (as text): whether its peer reproduced it on the same micro-batches."""
    samples: list[str] = field(default_factory=list)
    """This rank's samples the data verdict names."""
    transient_by_rank: dict[str, int] = field(default_factory=dict)
    """Transient verdicts so far in this process, per rank."""
    grad_norm: float | None = None
    """The rerun's global gradient norm (the first run's is the step's ``grad_norm``)."""
    seconds: float = 0.0
    """What the rerun cost this rank (wall clock)."""

    def to_dict(self) -> dict:
        return asdict(self)


def _loss_of(output: Any) -> torch.Tensor:
    loss = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"the replay function returned {type(loss).__name__}, not a tensor")
    return loss.float().mean()


class StepRerun:
    """Re-runs a skipped step on every rank and classifies it (module docstring). Held by the guard.

    Args:
        accelerator: the run's ``Accelerator``.
        model: the prepared model (unwrapped here for the rerun; an FSDP2 module is its own unwrapped self).
        run_dir: the run folder (event log, quarantine list, suspect hosts).
        events: the guard's :class:`~vidstab.events.EventLog`.
        sharded: the model is sharded (FSDP): every rank re-runs together, no peer check.
        not_rerun: why the engine cannot re-run a step (DeepSpeed's: a rank cannot re-run alone); None: it can.
        peer_check: send a reproduced rank's micro-batches to a peer (DDP, two or more processes).
        quarantine: quarantine the samples a ``data`` verdict names.
    """

    def __init__(self, accelerator: Any, model: torch.nn.Module, run_dir: str | os.PathLike, events: Any, *,
                 sharded: bool, not_rerun: str | None = None, peer_check: bool = True, quarantine: bool = True) -> None:
        self.accelerator, self.model, self.run_dir, self.events = accelerator, model, Path(run_dir), events
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.sharded, self.not_rerun = sharded, not_rerun
        self.peer_check, self.quarantine = peer_check, quarantine
        self.transient_by_rank: dict[int, int] = {}
        self.recorded: OutputGradients | None = None
        """The attached form's record of each micro-step's output gradient: re-runs without a replay function."""
        self.no_replay = NO_REPLAY_FN
        """Why a step without a replay function is not re-run, and what to pass (in the user's form)."""
        self.reruns = 0
        """Steps re-run in this process."""
        self._said: set[str] = set()  # reasons already printed

    def attached(self, recorded: OutputGradients | None, input_names: Sequence[str]) -> None:
        """A guard built by ``vidstab.attach``: re-run from ``recorded`` (the model's inputs and output gradient)
        when there is no replay function; without a record, say what to pass in either form."""
        self.recorded = recorded
        if recorded is None:
            self.no_replay = ("no replay function, and no output gradient recorded to re-run without one (recorded "
                              "for a diffusers model attached without model_spec=): guard.set_replay_fn(fn) with loss = "
                              "fn(batch) enables it, batch being the model's forward arguments by name "
                              f"({', '.join(input_names) or 'as forward takes them'}) in the attached form, what "
                              "guard.backward(batch=...) got in the explicit one (docs/runbook.md)")

    # ------------------------------------------------------------------ the guard's one call
    def check(self, s: StepStats, incidents: Sequence[Path], refs: Sequence[tuple],
              replay_fn: Callable[[dict], Any] | None, to_batch: Callable[[tuple], dict]) -> RerunVerdict | None:
        """Re-run the step ``s`` (skipped or rolled back) when a finding in :data:`RERUN_DETECTORS` caused it.
        Every rank calls it with the same ``s``; ``refs``: the guard's ``(batch, sample_ids, error)`` per
        micro-step; ``incidents``: this rank's bundles of the step (the verdict is added to them)."""
        if s.verdict < Verdict.SKIP or s.overflow:
            return None
        triggers = sorted({f.detector for f in s.findings if f.verdict >= Verdict.SKIP} & RERUN_DETECTORS)
        if not triggers:
            return None
        why, batches, first = None, [], None
        if self.not_rerun is not None:
            why = self.not_rerun
        elif not refs or any(b is None for b, _, _ in refs):
            why = ("the micro-batches were not kept (GuardConfig.capture_incidents is False): "
                   "config=GuardConfig(capture_incidents=True) enables it")
        else:
            batches = [to_batch(b) if type(b) is tuple else dict(b) for b, _, _ in refs]
            if replay_fn is None:  # the attached form: the recorded inputs and output gradient, if recorded
                replay_fn, batches, first = self._recorded_replay(batches)
                why = self.no_replay if replay_fn is None else None
        if why is not None:
            verdict = RerunVerdict(s.step, "not_rerun", f"step {s.step} not re-run: {why}")
            self._publish(verdict, incidents)
            return verdict
        started = time.perf_counter()
        ids = [self._id_list(i, _batch_size(b)) for b, (_, i, _) in zip(batches, refs)]
        own = self._rerun_own(batches, replay_fn, first)
        table = self._gather(own)
        verdict = self._classify(s, table, triggers)
        if verdict.verdict != "transient" and self.peer_check and self.world > 1 and not self.sharded:
            self._peer(verdict, batches, replay_fn, divide=first is None)
        if verdict.verdict in ("data", "numerics"):
            self._name_data(verdict, s, batches, ids)
        verdict.seconds = round(time.perf_counter() - started, 6)
        self.reruns += 1
        self._publish(verdict, incidents)
        return verdict

    # ------------------------------------------------------------------ running
    @staticmethod
    def _id_list(ids: Any, n: int) -> list[str]:
        if ids is None:
            return [f"#{i}" for i in range(n)]
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return [str(v) for v in values]

    def _unwrapped(self) -> torch.nn.Module:
        # DDP: the plain module runs without collectives (its reducer only acts on a DDP forward). FSDP2: the
        # sharded module itself, run by every rank together.
        return self.model if self.sharded else self.accelerator.unwrap_model(self.model)

    def _recorded_replay(self, batches: list[dict]) -> tuple[Callable | None, list[dict], list[float] | None]:
        """The replay without a replay function: ``(loss function, each micro-step's model inputs with its output
        gradient, the first run's loss per micro-step)`` from :attr:`recorded`; no function when a micro-step's
        record is missing."""
        if self.recorded is None:
            return None, batches, None
        runs = [self.recorded.rerun_batch(i) for i in range(len(batches))]
        if any(r is None for r in runs) or len(self.recorded.steps) != len(batches):
            return None, batches, None
        model = self._unwrapped()
        return (lambda batch: output_grad_loss(model, batch)), [b for b, _ in runs], [float(f) for _, f in runs]

    def _run(self, batches: Sequence[Mapping[str, Any]], replay_fn: Callable, divide: int,
             first: Sequence[float] | None = None) -> list[float]:
        """Forward + backward of ``batches`` (losses divided by ``divide``, as the step's accumulation did);
        the row of what it saw (``first``: the first run's losses, when the replay's loss is not the step's).
        Gradients stay in ``.grad`` (the caller reads and clears them)."""
        row = [0.0] * ROW
        row[FIRST_SUM] = math.nan if first is None else 0.0
        for k, batch in enumerate(batches):
            try:
                with torch.enable_grad(), self.accelerator.autocast():  # the step's own precision
                    loss = _loss_of(replay_fn(batch))
                    (loss / divide).backward()
            except Exception as e:  # noqa: BLE001 - a step that raised is re-run to see whether it raises again
                logger.info("rerun: the micro-batch raised %s: %s", type(e).__name__, e)
                row[EXCEPTIONS] += 1
                continue
            value = float(loss.detach())
            if math.isfinite(value):
                row[LOSS_SUM] += value
                row[LOSS_COUNT] += 1
                if first is not None:
                    row[FIRST_SUM] += first[k]
            else:
                row[BAD] += 1
        return row

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self._unwrapped().parameters() if p.requires_grad]

    def _grad_sq(self) -> float:
        total = 0.0
        for p in self._params():
            g = p.grad
            if g is None:
                continue
            g = g.to_local() if hasattr(g, "to_local") else g
            total += float(g.detach().float().pow(2).sum())
        return total

    def _rerun_own(self, batches: list[dict], replay_fn: Callable, first: list[float] | None) -> list[float]:
        """This rank's micro-batches on the unchanged weights; the gradients averaged over the ranks as the step
        did; the row, with the *global* gradient's sum of squares (the sharded part of it under FSDP). A recorded
        output gradient (``first`` given) already holds the accumulation's division."""
        params = self._params()
        for p in params:
            p.grad = None
        row = self._run(batches, replay_fn, divide=len(batches) if first is None else 1, first=first)
        if self.world > 1 and not self.sharded:  # DDP averaged the gradients: do the same, once
            import torch.distributed as dist

            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
            for p in params:
                by_dtype.setdefault(p.grad.dtype, []).append(p)
            for group in by_dtype.values():  # one all-reduce per dtype, not one per parameter
                flat = torch.cat([p.grad.reshape(-1) for p in group])
                dist.all_reduce(flat)
                flat.div_(self.world)
                offset = 0
                for p in group:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                    offset += p.numel()
        row[GRAD_SQ] = self._grad_sq()
        for p in params:
            p.grad = None  # the rerun's gradients must never reach an optimizer step
        return row

    def _gather(self, row: list[float]) -> list[list[float]]:
        t = torch.tensor(row, dtype=torch.float64, device=self.accelerator.device)
        if self.world == 1:
            return [row]
        gathered = self.accelerator.gather(t.reshape(1, -1))
        return gathered.cpu().tolist()

    # ------------------------------------------------------------------ judging (the same on every rank)
    def _classify(self, s: StepStats, table: list[list[float]], triggers: list[str]) -> RerunVerdict:
        first_bad = set(s.nonfinite_loss_ranks) | set(s.exception_ranks)
        reproduced: dict[str, bool] = {}
        changed_loss = []
        for r, row in enumerate(table):
            again = row[BAD] > 0 or row[EXCEPTIONS] > 0
            if r in first_bad:
                reproduced[str(r)] = again
            else:
                mean = row[LOSS_SUM] / row[LOSS_COUNT] if row[LOSS_COUNT] else math.nan
                was = s.rank_loss[r] if math.isnan(row[FIRST_SUM]) else row[FIRST_SUM] / max(row[LOSS_COUNT], 1)
                same = _close(mean, was) and not again
                if not same:
                    changed_loss.append(r)
                reproduced[str(r)] = same
        grad_sq = table[0][GRAD_SQ] if not self.sharded else sum(row[GRAD_SQ] for row in table)
        grad_norm = math.sqrt(grad_sq) if math.isfinite(grad_sq) and grad_sq >= 0 else math.nan
        grad_again = _close(grad_norm, s.grad_norm) or (not math.isfinite(s.grad_norm) and not math.isfinite(grad_norm))
        grad_matters = bool({"nonfinite", "grad_spike"} & set(triggers)) and not first_bad
        if first_bad:
            ranks = sorted(first_bad)
            not_again = [r for r in ranks if not reproduced[str(r)]]
        else:  # a spike or a non-finite gradient with finite losses: the ranks whose loss changed, if any
            not_again = changed_loss if changed_loss or grad_again or not grad_matters else list(range(len(table)))
            ranks = not_again or list(range(len(table)))
        if not_again or (grad_matters and not grad_again):
            for r in not_again or ranks:
                self.transient_by_rank[r] = self.transient_by_rank.get(r, 0) + 1
            where = ", ".join(str(r) for r in (not_again or ranks))
            return RerunVerdict(s.step, "transient", f"step {s.step} re-run on the same weights and micro-batches did "
                                f"not reproduce the trouble on rank(s) {where} ({', '.join(triggers)}): a transient "
                                "fault, not the data nor the model", ranks=not_again or ranks, reproduced=reproduced,
                                transient_by_rank={str(k): v for k, v in sorted(self.transient_by_rank.items())},
                                grad_norm=_finite_or_none(grad_norm))
        kind = "data" if s.nonfinite_input_ranks else "numerics"  # refined by the samples (_name_data)
        return RerunVerdict(s.step, kind, f"step {s.step} reproduced on the same weights and micro-batches "
                            f"({', '.join(triggers)}) on rank(s) {', '.join(map(str, ranks))}", ranks=ranks,
                            reproduced=reproduced, grad_norm=_finite_or_none(grad_norm),
                            transient_by_rank={str(k): v for k, v in sorted(self.transient_by_rank.items())})

    # ------------------------------------------------------------------ the peer check (DDP)
    def _peer(self, verdict: RerunVerdict, batches: list[dict], replay_fn: Callable, divide: bool = True) -> None:
        """For each rank whose trouble reproduced, its peer runs the same micro-batches on its own replica."""
        for r in verdict.ranks:
            peer = (r + 1) % self.world
            sent = _broadcast_batches(batches if self.rank == r else None, r, self.accelerator.device)
            row = [math.nan] * ROW
            if self.rank == peer:
                params = self._params()
                for p in params:
                    p.grad = None
                row = self._run(sent, replay_fn, divide=len(sent) if divide else 1)
                row[GRAD_SQ] = self._grad_sq()
                for p in params:
                    p.grad = None
            table = self._gather(row)
            seen = table[peer]
            again = seen[BAD] > 0 or seen[EXCEPTIONS] > 0 or not math.isfinite(seen[GRAD_SQ])
            verdict.peer[str(r)] = again
        suspects = [r for r in verdict.ranks if verdict.peer.get(str(r)) is False]
        if suspects:
            verdict.verdict = "suspect_hardware"
            verdict.ranks = suspects
            verdict.message = (f"step {verdict.step} reproduced on rank(s) {', '.join(map(str, suspects))} but not on "
                               f"a peer running the same micro-batches on the same weights: suspect hardware on "
                               f"rank(s) {', '.join(map(str, suspects))}")

    # ------------------------------------------------------------------ naming the data
    def _name_data(self, verdict: RerunVerdict, s: StepStats, batches: list[dict], ids: list[list[str]]) -> None:
        """``data`` when a sample of this rank's reproduced micro-batches holds non-finite values or stands out;
        the samples named (this rank's) and quarantined."""
        if self.rank not in verdict.ranks:
            return
        named: dict[str, list[str]] = {}
        for batch, batch_ids in zip(batches, ids):
            tensors = {k: v.detach().cpu() for k, v in batch.items() if isinstance(v, torch.Tensor) and k != OUTPUT_GRAD_KEY}
            report = sample_report(tensors, batch_ids)
            for sid in report["bad_sample_ids"]:
                named.setdefault(sid, report["bad_reasons"].get(sid, []))
        if not named:
            return
        verdict.verdict = "data"
        verdict.samples = sorted(named)
        verdict.message += f"; the data: sample(s) {', '.join(verdict.samples)} on rank {self.rank}"
        if self.quarantine:
            added = QuarantineList(self.run_dir).add(
                [k for k in verdict.samples if not k.startswith("#")], "reproduced on rerun: " + "; ".join(
                    r for v in named.values() for r in v)[:500], step=s.step, rank=self.rank, source="rerun")
            if added:
                self.events.log("quarantine", s.step, sample_ids=added, bundle=None, source="rerun")

    # ------------------------------------------------------------------ evidence
    def _publish(self, verdict: RerunVerdict, incidents: Sequence[Path]) -> None:
        d = verdict.to_dict()
        self.events.log("rerun", verdict.step, **{k: v for k, v in d.items() if k != "step"})
        for path in incidents:
            try:
                update_incident(path, rerun=d)
            except Exception as e:  # noqa: BLE001 - evidence must never kill the run
                logger.warning("could not add the rerun verdict to %s: %s", path, e)
        if verdict.verdict == "suspect_hardware" and self.rank in verdict.ranks:
            host = socket.gethostname()
            message = (f"suspect hardware: rank {self.rank} on host {host} reproduced step {verdict.step}'s trouble on "
                       "the same micro-batches and weights where its peer did not. Leave the host out at the next "
                       f"restart (its name is in {SUSPECT_HOSTS_FILE}): docs/runbook.md, 'Rerun verdicts'")
            self.events.log("warn", verdict.step, detector="suspect_hardware", message=message,
                            figures={"rank": self.rank}, bad_ranks=[self.rank], host=host)
            path = self.run_dir / SUSPECT_HOSTS_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"{host}\n")
        said = verdict.verdict == "not_rerun" and verdict.message.split(": ", 1)[-1] in self._said
        self._said.add(verdict.message.split(": ", 1)[-1])
        if not said and (self.rank == 0 or self.rank in verdict.ranks):  # the same reason once; the log has each step
            logger.warning("vidstab rerun: %s (%s, %.3f s)", verdict.message, verdict.verdict, verdict.seconds)


def _batch_size(batch: Mapping[str, Any]) -> int:
    return next((int(v.shape[0]) for v in batch.values() if isinstance(v, torch.Tensor) and v.ndim), 0)


def _close(a: float, b: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):
        return False
    return math.isclose(a, b, rel_tol=RTOL, abs_tol=1e-12)


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _broadcast_batches(batches: list[dict] | None, src: int, device: torch.device) -> list[dict]:
    """``src``'s micro-batches (their tensors) on every rank: a JSON header of names, dtypes and shapes, then
    the tensors, over the default process group (nothing pickled)."""
    import torch.distributed as dist

    header = b""
    if batches is not None:
        spec = [[(k, str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in b.items()
                 if isinstance(v, torch.Tensor)] for b in batches]
        header = json.dumps(spec).encode()
    size = torch.tensor([len(header)], dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if batches is not None:
        buf.copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    dist.broadcast(buf, src)
    spec = json.loads(bytes(buf.cpu().tolist()).decode())
    out = []
    for k_batch, entries in enumerate(spec):
        got = {}
        for name, dtype, shape in entries:
            if batches is not None:
                t = batches[k_batch][name].detach().to(device).contiguous()
            else:
                t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            dist.broadcast(t, src)
            got[name] = t
        out.append(got)
    return out
