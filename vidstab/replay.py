"""Replay an incident bundle small, seeded and deterministic, and triage it: data, then LR/precision, then structure.

``vidstab replay BUNDLE`` (or ``python scripts/replay.py BUNDLE``) rebuilds the model the bundle names,
loads the checkpoint it points to, feeds it the captured micro-batch, and re-runs forward + backward in
fp32 with deterministic algorithms, twice. It then works through the causes in the order the
field guides give -- cheapest to fix and most common first:

1. **Data**: are the inputs finite and in range (per-sample statistics; a normalised latent with
   absmax > 50 is suspicious), and which sample breaks the step (leave-one-out over the batch)?
2. **Precision and LR**: does the step fail only under the run's fp16/bf16 autocast, and does one
   optimizer update at the run's LR (but not at a tenth of it) blow the loss up?
3. **Structure**: which module first produced a non-finite output from finite inputs, or first
   produced a non-finite gradient (:mod:`vidstab.localize`).

and writes a one-paragraph verdict, a table, and ``replay_report.json`` beside the bundle.

What a replay can and cannot tell: the weights come from the bundle's checkpoint, which may be some
steps older than the incident. A NaN caused by bad data reproduces on any weights; a gradient spike
that depends on the exact weights of that step may not -- the report says how many steps lie between.
The recorded gradient norm covers the whole optimizer step (all micro-batches and ranks); the replay
sees one micro-batch of one rank, so "within 10%" is exact only without accumulation on one rank.

Exit codes of :func:`main`: 0 when a report was produced (whether or not the failure reproduced),
2 when the bundle cannot be replayed (the message names what is missing).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from .atomic import write_json_atomic
from .capture import Incident, IncidentError, json_float, list_incidents, read_incident, sample_report, to_json_safe
from .checkpoint import CheckpointError, verify_checkpoint_files
from .localize import locate_nonfinite

__all__ = [
    "ReplayError",
    "RunResult",
    "ReplayReport",
    "replay",
    "build_model",
    "import_object",
    "main",
    "ABSMAX_LIMIT",
    "SPIKE_TOLERANCE",
]

ABSMAX_LIMIT = 50.0
"""Per-sample absmax above which a (normalised) input is called out of range."""
SPIKE_TOLERANCE = 0.10
"""A spike reproduces when the replayed gradient norm is within this fraction of the recorded one."""
JUMP_FACTOR = 2.0
"""After one update, a loss more than this many times the loss before counts as a jump."""
LOO_INFLUENCE = 0.5
"""For a finite spike: a sample whose removal brings the gradient norm below this fraction of the full
batch's is named as driving it."""
REPORT_FILE = "replay_report.json"
EXIT_OK = 0
EXIT_CANNOT_REPLAY = 2
_STATE_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")


class ReplayError(RuntimeError):
    """The bundle cannot be replayed; the message says what is missing and how to fix it."""


@dataclass
class RunResult:
    """One forward + backward of the loss on (part of) the captured batch."""

    label: str
    """What was run, e.g. ``"fp32"``, ``"without clip-1"``, ``"bf16 autocast"``, ``"update at lr"``."""
    loss: float
    """Mean of the loss function's output (``nan``/``inf`` when non-finite)."""
    loss_finite: bool
    """Whether every element of the loss function's output was finite."""
    grad_norm: float | None
    """Global L2 norm of the parameter gradients (``None`` when no backward ran)."""
    grads_finite: bool | None
    """Whether every parameter gradient was finite (``None`` when no backward ran)."""
    note: str = ""
    """Free text shown in the table (bitwise comparison, loss after an update ...)."""
    error: str | None = None
    """The exception the run raised, when replaying an ``exception`` incident (counts as a failure)."""

    @property
    def finite(self) -> bool:
        """Loss and gradients finite (and nothing raised)."""
        return self.error is None and self.loss_finite and self.grads_finite is not False


@dataclass
class ReplayReport:
    """Everything a replay found; :meth:`to_dict` is the JSON report, :meth:`to_text` the printout."""

    bundle: str
    """The bundle folder."""
    step: int
    """Optimizer step of the incident."""
    rank: int
    """Rank that captured it."""
    sample_ids: list[str]
    """Samples of the micro-batch."""
    recorded: dict
    """What the guard recorded: detector, verdict, message, figures, lr, precision."""
    kind: str
    """``nonfinite`` | ``spike`` (a finite gradient-norm figure) | ``loss_spike`` | ``exception`` | ``unknown``."""
    device: str
    """Device of the replay."""
    model: str
    """How the model was rebuilt (import path)."""
    checkpoint: str | None
    """Weights file loaded, or ``None`` for a fresh initialisation."""
    checkpoint_step: int | None
    """Step of those weights when known."""
    reproduced: bool | None
    """Whether the failure reproduces (``None``: nothing recorded to compare with)."""
    reproduction: str
    """One sentence: what was compared."""
    deterministic: bool
    """Two identical fp32 replays gave bitwise-identical loss and gradients."""
    runs: list[RunResult] = field(default_factory=list)
    """Every run made, in order."""
    localization: dict | None = None
    """:func:`vidstab.localize.locate_nonfinite` on the failing run, else ``None``."""
    data: dict = field(default_factory=dict)
    """Triage step 1: input statistics, leave-one-out, culprits, ``implicated``."""
    precision: dict = field(default_factory=dict)
    """Triage step 2a: fp32 vs the run's mixed precision, ``implicated``."""
    lr: dict = field(default_factory=dict)
    """Triage step 2b: one update at lr and at lr/10, ``implicated``."""
    structure: dict = field(default_factory=dict)
    """Triage step 3: the localised module, largest gradients, ``implicated``."""
    notes: list[str] = field(default_factory=list)
    """Caveats (fresh init, checkpoint older than the incident, non-determinism ...)."""
    verdict: str = ""
    """One paragraph for a human."""
    json_path: str | None = None
    """Where the JSON report was written."""

    def to_dict(self) -> dict:
        """The JSON report (strict JSON after :func:`vidstab.capture.to_json_safe`)."""
        d = asdict(self)
        d["runs"] = [dict(asdict(r), finite=r.finite) for r in self.runs]
        return to_json_safe(d)

    def to_text(self) -> str:
        """Human-readable report: header, table of runs, triage, verdict."""
        rec = self.recorded
        lines = [
            f"vidstab replay: {self.bundle}",
            f"  incident: step {self.step}, rank {self.rank}, {len(self.sample_ids)} samples; "
            f"detector {rec.get('detector')} ({rec.get('verdict')}): {rec.get('message')}",
            f"  model: {self.model}; weights: {self.checkpoint or 'fresh initialisation'}"
            + (f" (step {self.checkpoint_step})" if self.checkpoint_step is not None else "")
            + f"; device {self.device}",
            "",
            f"  {'run':<34} {'loss':>12} {'grad norm':>12}  finite  note",
        ]
        for r in self.runs:
            lines.append(
                f"  {r.label[:34]:<34} {_fmt(r.loss):>12} {_fmt(r.grad_norm):>12}  {'yes' if r.finite else 'NO ':<6}  {r.note}"
            )
        lines.append("")
        for title, section in (("1. data", self.data), ("2a. precision", self.precision), ("2b. lr", self.lr),
                               ("3. structure", self.structure)):
            flag = "IMPLICATED" if section.get("implicated") else "not implicated"
            lines.append(f"  {title}: {flag} - {section.get('summary', '')}")
        for n in self.notes:
            lines.append(f"  note: {n}")
        lines += ["", "Verdict: " + self.verdict]
        if self.json_path:
            lines.append(f"(JSON report: {self.json_path})")
        return "\n".join(lines)


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if not math.isfinite(v):
        return str(v)
    return f"{v:.6g}"


# ----------------------------------------------------------------------------------------------------
# Rebuilding the model and the loss from import paths


def import_object(path: str, what: str) -> Any:
    """Import ``"package.module:attr"`` (or ``"package.module.attr"``), naming ``what`` in any error."""
    if not isinstance(path, str) or not path.strip():
        raise ReplayError(f"{what} must be an import path 'module:name', got {path!r}")
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ReplayError(f"{what} {path!r} is not an import path of the form 'module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = getattr(e, "name", None)
        inner = f" (while importing it, module {missing!r} was not found)" if missing and missing != module_name else ""
        raise ReplayError(
            f"cannot import module {module_name!r} named by {what} {path!r}{inner}: {e}. "
            f"Run the replay from the training project's folder or add it to PYTHONPATH."
        ) from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ReplayError(f"module {module_name!r} has no attribute {attr!r} (named by {what} {path!r})")
        obj = getattr(obj, part)
    return obj


def build_model(spec: dict | None) -> nn.Module:
    """Rebuild a model from a bundle's ``model`` spec (``class`` + ``config`` or ``factory`` + ``kwargs``)."""
    if not spec:
        raise ReplayError(
            "the bundle has no model spec ('model' is null in incident.json), so the model cannot be rebuilt. "
            "Record one when attaching the guard: model_spec={'class': 'module:Class', 'config': {...}} "
            "(a diffusers ConfigMixin) or {'factory': 'module:function', 'kwargs': {...}}, plus 'loss_fn'."
        )
    if "class" in spec:
        cls = import_object(spec["class"], "model.class")
        if not callable(getattr(cls, "from_config", None)):
            raise ReplayError(
                f"model.class {spec['class']!r} is not a diffusers ConfigMixin (it has no from_config); "
                f"record a 'factory' + 'kwargs' for it instead"
            )
        config = spec.get("config")
        if not isinstance(config, dict):
            raise ReplayError(f"model spec for {spec['class']!r} has no 'config' dict to rebuild it from")
        try:
            model = cls.from_config(config)
        except Exception as e:  # the user's constructor: report whatever it raises
            raise ReplayError(f"{spec['class']}.from_config(...) failed: {type(e).__name__}: {e}") from e
    elif "factory" in spec:
        factory = import_object(spec["factory"], "model.factory")
        kwargs = spec.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ReplayError(f"model.kwargs must be a dict, got {type(kwargs).__name__}")
        try:
            model = factory(**kwargs)
        except Exception as e:
            raise ReplayError(f"{spec['factory']}(**kwargs) failed: {type(e).__name__}: {e}") from e
    else:
        raise ReplayError(f"model spec has neither 'class' nor 'factory': {sorted(spec)}")
    if not isinstance(model, nn.Module):
        raise ReplayError(f"the model spec built a {type(model).__name__}, not a torch.nn.Module")
    return model


def _resolve_checkpoint(inc: Incident, override: str | os.PathLike | None) -> tuple[Path | None, int | None, list[str]]:
    """The weights file to load, its step, and notes. Raises when a named checkpoint is missing or corrupt."""
    notes: list[str] = []
    if override is not None:
        p = Path(override)
        origin = "--checkpoint"
    elif inc.meta.get("checkpoint"):
        p = Path(inc.meta["checkpoint"])
        if not p.is_absolute():
            p = inc.run_dir / p
        origin = f"the bundle's checkpoint {inc.meta['checkpoint']!r}"
    else:
        return None, None, notes
    if not p.exists():
        raise ReplayError(
            f"checkpoint missing: {origin} resolves to {p}, which does not exist "
            f"(the run folder is taken as {inc.run_dir}); pass --checkpoint PATH to point at the weights"
        )
    ckpt_dir = p if p.is_dir() else p.parent
    weights = p / "model.safetensors" if p.is_dir() else p
    if not weights.is_file():
        raise ReplayError(f"checkpoint missing: {origin} has no model.safetensors ({weights} does not exist)")
    step = None
    manifest_path = ckpt_dir / "manifest.json"
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ReplayError(f"{manifest_path} is corrupt (not valid JSON: {e})") from e
        step = manifest.get("step") if isinstance(manifest.get("step"), int) else None
        files = manifest.get("files")
        if isinstance(files, dict) and weights.name in files:
            # Size and checksum (crc32 or sha256, whichever the manifest records) as the loader checks them.
            try:
                verify_checkpoint_files(ckpt_dir, [weights.name])
            except CheckpointError as e:
                raise ReplayError(f"{weights} is corrupt (checked against {manifest_path}): {e}") from e
            recorded = inc.meta.get("checkpoint_weights")
            if override is None and isinstance(recorded, dict) and recorded != files[weights.name]:
                raise ReplayError(
                    f"{origin} was rewritten after the incident: its {weights.name} is not the one the bundle "
                    f"recorded ({recorded} then, {files[weights.name]} now; a rollback saved that step again?), so a "
                    "replay would run other weights; pass --checkpoint PATH to replay on weights you choose")
    elif p.is_dir():
        notes.append(f"{ckpt_dir} has no manifest.json (written last): the checkpoint may be incomplete")
    if step is None:
        m = re.search(r"step_?(\d+)", ckpt_dir.name)
        step = int(m.group(1)) if m else None
    return weights, step, notes


def _load_weights(model: nn.Module, weights: Path) -> None:
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ReplayError(f"{weights} is corrupt or truncated ({type(e).__name__}: {e})") from e
    own = set(model.state_dict())
    if not set(state) & own:  # keys saved through a wrapper (DDP, torch.compile, FSDP): strip its prefix
        for prefix in _STATE_PREFIXES:
            state = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ReplayError(f"the weights in {weights} do not fit the rebuilt model: {str(e)[:600]}") from e


# ----------------------------------------------------------------------------------------------------
# Running the step


def _bits_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))  # NaN == NaN bitwise


class _Replayer:
    """Holds the rebuilt model, its starting weights, the batch and the loss; runs variants of the step."""

    def __init__(self, model: nn.Module, loss_fn: Callable, loss_kwargs: dict, batch: dict[str, torch.Tensor],
                 device: torch.device, seed: int, catch_errors: bool = False) -> None:
        # Replaying an ``exception`` incident: a raising run is the reproduced failure, not an unreplayable bundle.
        self.catch_errors = catch_errors
        self.model = model.to(device).float().train()
        self.loss_fn = loss_fn
        self.loss_kwargs = loss_kwargs
        self.device = device
        self.seed = seed
        self.batch = {k: (v.float() if v.is_floating_point() else v).to(device) for k, v in batch.items()}
        # Every run starts from the same weights (an update test changes them).
        self.state0 = {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def reset(self) -> None:
        self.model.load_state_dict(self.state0)
        for p in self.model.parameters():
            p.grad = None
        torch.manual_seed(self.seed)  # same dropout masks / random ops in every run
        if self.device.type == "cuda":
            torch.cuda.manual_seed_all(self.seed)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.loss_fn(self.model, batch, **self.loss_kwargs)
        if isinstance(out, dict) and "loss" in out:
            out = out["loss"]
        elif isinstance(out, (tuple, list)) and out:
            out = out[0]
        if not isinstance(out, torch.Tensor):
            raise ReplayError(f"the loss_fn returned a {type(out).__name__}, not a Tensor")
        return out

    def autocast(self, dtype: torch.dtype | None):
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def run(self, label: str, batch: dict[str, torch.Tensor] | None = None, *, dtype: torch.dtype | None = None,
            backward: bool = True) -> RunResult:
        """Reset, run loss (mean of the loss_fn's output) and its backward; gradients stay in ``param.grad``."""
        try:
            return self._run(label, batch, dtype, backward)
        except ReplayError:
            raise
        except Exception as e:
            if not self.catch_errors:
                raise
            return RunResult(label, float("nan"), False, None, False, note="raised", error=f"{type(e).__name__}: {e}"[:300])

    def _run(self, label: str, batch: dict[str, torch.Tensor] | None, dtype: torch.dtype | None,
             backward: bool) -> RunResult:
        batch = self.batch if batch is None else batch
        self.reset()
        with self.autocast(dtype):
            out = self.loss(batch)
        out = out.float()
        loss_finite = bool(torch.isfinite(out.detach()).all())
        loss = out.mean()
        grad_norm = grads_finite = None
        if backward and loss.requires_grad:
            loss.backward()
            grad_norm, grads_finite = self.grad_summary()
        return RunResult(label, float(loss.detach()), loss_finite, grad_norm, grads_finite)

    def grad_summary(self) -> tuple[float, bool]:
        sq = 0.0
        finite = True
        for p in self.model.parameters():
            if p.grad is not None:
                g = p.grad.detach()
                finite = finite and bool(torch.isfinite(g).all())
                sq += float(g.double().pow(2).sum())
        return (math.sqrt(sq) if math.isfinite(sq) else float("nan")), finite

    def grads(self) -> list[torch.Tensor | None]:
        return [None if p.grad is None else p.grad.detach().clone() for p in self.model.parameters()]

    def subset(self, keep: Sequence[int], bsz: int) -> dict[str, torch.Tensor]:
        idx = torch.tensor(list(keep), dtype=torch.long, device=self.device)
        return {k: (v.index_select(0, idx) if v.ndim >= 1 and v.shape[0] == bsz else v) for k, v in self.batch.items()}

    def localize(self, batch: dict[str, torch.Tensor] | None = None, dtype: torch.dtype | None = None) -> dict:
        batch = self.batch if batch is None else batch
        self.reset()

        def fn() -> torch.Tensor:
            with self.autocast(dtype):
                return self.loss(batch).float().mean()

        try:
            return locate_nonfinite(self.model, fn, keep_grads=True)
        except Exception as e:  # only reachable when replaying an exception incident (the run raised too)
            if not self.catch_errors:
                raise
            return {"forward": None, "backward": None, "loss_finite": False, "error": f"{type(e).__name__}: {e}"[:300]}

    def update_test(self, label: str, batch: dict[str, torch.Tensor], lr: float, optimizer: str,
                    max_grad_norm: float | None) -> tuple[RunResult, float]:
        """One fresh-optimizer step from the starting weights at ``lr`` on ``batch``.

        Returns the run (its loss is the loss *after* the update, its grad norm the one before) and the
        ratio loss-after / loss-before (``inf`` when the loss after is non-finite).
        """
        before = self.run(label, batch)
        if not before.finite:
            return RunResult(label, float("nan"), False, before.grad_norm, before.grads_finite,
                             note="gradients non-finite before the update"), math.inf
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm)
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=lr) if optimizer == "sgd" else torch.optim.AdamW(params, lr=lr)
        opt.step()
        torch.manual_seed(self.seed)
        with torch.no_grad():
            after = self.loss(batch).float()
        after_loss = float(after.mean())
        finite = bool(torch.isfinite(after).all())
        ratio = after_loss / before.loss if before.loss > 0 and finite else (1.0 if finite else math.inf)
        return RunResult(label, after_loss, finite, before.grad_norm, before.grads_finite,
                         note=f"loss before {before.loss:.6g} -> after {_fmt(after_loss)} (x{ratio:.3g})"), ratio


# ----------------------------------------------------------------------------------------------------
# Triage


def _recorded(meta: dict) -> dict:
    keys = ("detector", "verdict", "message", "figures", "lr", "precision", "seed", "checkpoint", "extra")
    return {k: meta.get(k) for k in keys}


def _incident_kind(meta: dict) -> tuple[str, float | None, float | None]:
    """What to compare the replay with: ``(kind, recorded grad norm, recorded loss)``.

    Figures come from the finding, else from ``extra`` (the guard records the step's global numbers there).
    """
    figures = meta.get("figures") or {}
    extra = meta.get("extra") if isinstance(meta.get("extra"), dict) else {}
    g = json_float(figures.get("grad_norm", extra.get("grad_norm")))
    loss = json_float(figures.get("loss", extra.get("loss") if "grad_norm" not in figures else None))
    detector = str(meta.get("detector") or "")
    if detector == "exception":
        return "exception", g, loss
    if "nonfinite" in detector or "nan" in detector or any(v is not None and not math.isfinite(v) for v in (g, loss)):
        return "nonfinite", g, loss
    if g is not None:
        return "spike", g, loss
    if loss is not None:
        return "loss_spike", g, loss
    return "unknown", g, loss


def _precision_dtype(precision: str | None) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}.get(
        str(precision).lower() if precision else ""
    )


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else math.inf


def replay(
    bundle_dir: str | os.PathLike,
    device: str = "cpu",
    json_path: str | os.PathLike | None = None,
    *,
    checkpoint: str | os.PathLike | None = None,
    optimizer: str = "auto",
    absmax_limit: float = ABSMAX_LIMIT,
    fresh_init: bool = False,
) -> ReplayReport:
    """Replay one incident bundle and triage it; write the JSON report and return it.

    Args:
        bundle_dir: the bundle folder (``RUN_DIR/vidstab/incidents/step...``).
        device: where to run (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).
        json_path: where to write the JSON report (default ``<bundle>/replay_report.json``).
        checkpoint: a checkpoint folder or ``.safetensors`` file overriding the bundle's checkpoint.
        optimizer: ``"adamw"``, ``"sgd"`` or ``"auto"`` (the bundle's ``extra.optimizer`` if it names SGD,
            else AdamW) for the LR test's single update.
        absmax_limit: per-sample absmax above which an input is called out of range.
        fresh_init: ignore the bundle's checkpoint and replay on a seeded fresh initialisation (for a bundle
            copied away from its run folder: data problems still show, weight-dependent ones do not).

    Raises:
        ReplayError / IncidentError: the bundle cannot be replayed; the message says why.
    """
    inc = read_incident(bundle_dir)
    meta = inc.meta
    dev = torch.device(device)
    if dev.type == "cuda":
        # cuBLAS needs this for deterministic algorithms; it must be set before cuBLAS initialises.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    spec = meta.get("model")
    loss_spec = meta.get("loss")
    model_name = (spec or {}).get("class") or (spec or {}).get("factory") or "?"
    seed = meta.get("seed") if isinstance(meta.get("seed"), int) else 0
    det_before = torch.are_deterministic_algorithms_enabled()
    warn_only_before = torch.is_deterministic_algorithms_warn_only_enabled()
    tf32_before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    bench_before = torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32
    torch.backends.cudnn.benchmark = False
    # The replay seeds the global RNGs; the caller's streams are put back afterwards.
    cuda_devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    rng = torch.random.fork_rng(devices=cuda_devices)
    rng.__enter__()
    try:
        # Checked in this order so the first thing a user must fix is named first: model, loss, weights.
        torch.manual_seed(seed)  # a fresh initialisation (no checkpoint) is then reproducible too
        model = build_model(spec)
        if not loss_spec or not loss_spec.get("fn"):
            raise ReplayError(
                "the bundle records no loss function ('loss' is null in incident.json); record "
                "'loss_fn': 'module:function' (loss = fn(model, batch, **loss_fn_kwargs)) in the model spec"
            )
        loss_fn = import_object(loss_spec["fn"], "loss.fn")
        if not callable(loss_fn):
            raise ReplayError(f"loss.fn {loss_spec['fn']!r} is not callable")
        weights, ckpt_step, notes = (None, None, []) if fresh_init else _resolve_checkpoint(inc, checkpoint)
        if weights is not None:
            _load_weights(model, weights)
        else:
            why = "--fresh-init was asked for" if fresh_init else "the bundle names no checkpoint"
            notes.append(f"{why}: replayed on a fresh initialisation, so the result says "
                         "little about the trained weights (pass --checkpoint PATH)")
        if ckpt_step is not None and ckpt_step != inc.step:
            notes.append(f"the weights are from step {ckpt_step}, {inc.step - ckpt_step} step(s) before the incident: "
                         f"bad data reproduces on them, a weight-dependent spike may not")
        r = _Replayer(model, loss_fn, dict(loss_spec.get("kwargs") or {}), inc.tensors, dev, seed,
                      catch_errors=str(meta.get("detector")) == "exception")
        report = _triage(inc, r, model_name, str(dev), weights, ckpt_step, notes, optimizer, absmax_limit)
    finally:
        rng.__exit__(None, None, None)
        torch.use_deterministic_algorithms(det_before, warn_only=warn_only_before)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32_before
        torch.backends.cudnn.benchmark = bench_before

    out = Path(json_path) if json_path is not None else inc.path / REPORT_FILE
    try:
        report.json_path = str(out)
        write_json_atomic(out, report.to_dict(), allow_nan=False)  # a reader never sees half a report
    except OSError as e:
        report.json_path = None
        report.notes.append(f"could not write the JSON report to {out}: {e}")
    return report


def _triage(inc: Incident, r: _Replayer, model_name: str, device: str, weights: Path | None, ckpt_step: int | None,
            notes: list[str], optimizer: str, absmax_limit: float) -> ReplayReport:
    meta = inc.meta
    kind, rec_g, rec_loss = _incident_kind(meta)
    report = ReplayReport(
        bundle=str(inc.path), step=inc.step, rank=inc.rank, sample_ids=inc.sample_ids, recorded=_recorded(meta),
        kind=kind, device=device, model=model_name, checkpoint=str(weights) if weights else None,
        checkpoint_step=ckpt_step, reproduced=None, reproduction="", deterministic=True, notes=notes,
    )

    # -- reproduce, twice, bitwise ------------------------------------------------------------------
    try:
        base = r.run("fp32")
    except ReplayError:
        raise
    except Exception as e:  # the user's loss/model raising on the captured batch
        raise ReplayError(f"the loss_fn raised on the captured batch: {type(e).__name__}: {e}") from e
    grads_a = r.grads()
    param_norms = sorted(
        ((n, float(p.grad.detach().double().norm())) for n, p in r.model.named_parameters() if p.grad is not None),
        key=lambda x: -x[1] if math.isfinite(x[1]) else -math.inf,  # non-finite first: that is where it broke
    )
    again = r.run("fp32 (again)")
    grads_b = r.grads()
    same = _bits_equal(torch.tensor(base.loss), torch.tensor(again.loss)) and all(
        _bits_equal(a, b) for a, b in zip(grads_a, grads_b)
    )
    report.deterministic = same
    again.note = "bitwise identical" if same else "DIFFERS from the first run"
    report.runs += [base, again]
    if not same:
        notes.append("two identical replays differed bitwise: a hint of non-determinism or faulty hardware "
                     "rather than a data or model problem - replay on another device to confirm")

    # The run's own precision, when it was mixed: a failure may exist only there.
    dtype = _precision_dtype(meta.get("precision"))
    mixed: RunResult | None = None
    mixed_error = None
    if dtype is not None:
        try:
            mixed = r.run(f"{_dtype_name(dtype)} autocast", dtype=dtype)
            report.runs.append(mixed)
        except RuntimeError as e:  # e.g. fp16 autocast unsupported on this device
            mixed_error = f"{type(e).__name__}: {e}"
    # The setting in which the step fails: fp32, else the run's mixed precision, else none (a finite spike).
    failing, fail_dtype, ref = False, None, base
    if not base.finite:
        failing = True
    elif mixed is not None and not mixed.finite:
        failing, fail_dtype, ref = True, dtype, mixed

    _judge_reproduction(report, kind, base, mixed, rec_g, rec_loss)
    if failing:
        report.localization = r.localize(dtype=fail_dtype)

    # -- 1. data ------------------------------------------------------------------------------------
    report.data = _triage_data(inc, r, ref, failing, fail_dtype, report, absmax_limit)
    clean_batch = report.data.pop("_clean_batch", None)

    # -- 2a. precision --------------------------------------------------------------------------------
    report.precision = _triage_precision(meta.get("precision"), dtype, base, mixed, mixed_error, report)

    # -- 2b. lr ----------------------------------------------------------------------------------------
    report.lr = _triage_lr(meta, r, base, clean_batch, report, optimizer)

    # -- 3. structure ----------------------------------------------------------------------------------
    report.structure = _triage_structure(r, base, report, param_norms)

    report.verdict = _verdict(report)
    return report


def _dtype_name(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "fp16"


def _judge_reproduction(report: ReplayReport, kind: str, base: RunResult, mixed: RunResult | None,
                        rec_g: float | None, rec_loss: float | None) -> None:
    """Set ``reproduced`` and ``reproduction`` from the fp32 run (and the run's mixed precision)."""
    replayed = f"replayed fp32 loss {_fmt(base.loss)}, grad norm {_fmt(base.grad_norm)}"
    mixed_failed = mixed is not None and not mixed.finite
    if mixed_failed:
        replayed += f"; non-finite under {mixed.label} (the run's precision)"
    if kind == "exception":
        recorded = (report.recorded.get("extra") or {}).get("error") or "an exception"
        report.reproduced = base.error is not None
        report.reproduction = (f"recorded {recorded}; the replay " + (f"raised {base.error}" if base.error else
                               f"ran without raising (loss {_fmt(base.loss)}, grad norm {_fmt(base.grad_norm)})"))
    elif kind == "nonfinite":
        report.reproduced = (not base.finite) or mixed_failed
        report.reproduction = f"recorded a non-finite step; {replayed}"
    elif kind == "spike":
        g = base.grad_norm
        close = g is not None and math.isfinite(g) and _rel(g, rec_g) <= SPIKE_TOLERANCE
        report.reproduced = (not base.finite) or mixed_failed or close
        report.reproduction = (f"recorded grad norm {_fmt(rec_g)}; {replayed}"
                               + (f" ({(g - rec_g) / rec_g:+.0%})" if g is not None and math.isfinite(g) and rec_g else ""))
    elif kind == "loss_spike":
        report.reproduced = (not base.finite) or mixed_failed or _rel(base.loss, rec_loss) <= SPIKE_TOLERANCE
        report.reproduction = f"recorded loss {_fmt(rec_loss)}; {replayed}"
    else:
        report.reproduced = True if (not base.finite or mixed_failed) else None
        report.reproduction = f"nothing recorded to compare with; {replayed}"


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
               optimizer: str) -> dict:
    lr = json_float(meta.get("lr"))
    section: dict[str, Any] = {"lr": lr, "implicated": False}
    if lr is None or not lr > 0:
        section["summary"] = "skipped: the bundle records no learning rate"
        return section
    extra = meta.get("extra") or {}
    if optimizer == "auto":
        optimizer = "sgd" if "sgd" in str(extra.get("optimizer", "")).lower() else "adamw"
    section["optimizer"] = optimizer
    batch, which = r.batch, "the captured batch"
    if not base.finite:
        if clean_batch is None:
            section["summary"] = ("skipped: the gradients are non-finite before any update, and the learning rate "
                                  "cannot cause that (it only shaped the checkpoint's weights)")
            return section
        batch, which = clean_batch, "the batch without the culprit samples"
    section["batch"] = which
    max_norm = json_float(extra.get("max_grad_norm"))
    at_lr, ratio_lr = r.update_test(f"update at lr={lr:.3g}", batch, lr, optimizer, max_norm)
    at_tenth, ratio_tenth = r.update_test(f"update at lr/10={lr / 10:.3g}", batch, lr / 10, optimizer, max_norm)
    report.runs += [at_lr, at_tenth]
    section["at_lr"], section["at_lr_over_10"] = asdict(at_lr), asdict(at_tenth)
    section["loss_ratio_at_lr"], section["loss_ratio_at_lr_over_10"] = ratio_lr, ratio_tenth
    section["jump_at_lr"], section["jump_at_lr_over_10"] = ratio_lr > JUMP_FACTOR, ratio_tenth > JUMP_FACTOR
    section["implicated"] = section["jump_at_lr"] and not section["jump_at_lr_over_10"]
    if section["implicated"]:
        section["summary"] = (f"one {optimizer} update on {which} at lr {lr:.3g} blows the loss up ({at_lr.note}), "
                              f"at lr/10 it does not ({at_tenth.note}): lower the LR or lengthen warm-up")
    elif section["jump_at_lr"]:
        section["summary"] = f"the loss jumps after one update even at lr/10 ({at_tenth.note})"
    else:
        section["summary"] = f"one {optimizer} update at lr {lr:.3g} on {which} is stable ({at_lr.note})"
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


def _mod(name: str | None) -> str:
    """A module's qualified name for humans; ``""`` is the model's own forward (code between submodules)."""
    if name is None:
        return "no module"
    return f"module {name!r}" if name else "the model's own forward (root module, code between its submodules)"


def _verdict(rep: ReplayReport) -> str:
    parts = []
    if rep.reproduced is True:
        parts.append(f"Reproduces ({rep.reproduction}).")
    elif rep.reproduced is False:
        parts.append(f"Does not reproduce ({rep.reproduction}).")
    else:
        parts.append(f"Reproduction cannot be judged ({rep.reproduction}).")
    if not rep.deterministic:
        parts.append("Two identical replays differed bitwise: suspect non-determinism or faulty hardware before "
                     "data or model.")
    sections = (("Data", rep.data), ("Precision", rep.precision), ("LR", rep.lr), ("Structure", rep.structure))
    implicated = [name for name, s in sections if s.get("implicated")]
    for name, s in sections:
        if s.get("implicated"):
            parts.append(f"{name}: {s.get('summary')}.")
    if rep.reproduced is False and not implicated:
        parts.append("Nothing in this bundle explains the incident on these weights; see the notes "
                     "(checkpoint age, other micro-batches/ranks).")
    elif implicated:
        first = implicated[0]
        fix = {"Data": "Fix the data (drop or re-encode the named samples)",
               "Precision": "Keep the failing op in fp32 or use bf16 instead of fp16",
               "LR": "Lower the learning rate or lengthen warm-up",
               "Structure": f"Look at {_mod(rep.structure.get('module'))}"}[first]
        rest = [n if n == "LR" else n.lower() for n, _ in sections if n not in implicated]
        listed = rest[0] if len(rest) == 1 else ", ".join(rest[:-1]) + " and " + rest[-1] if rest else ""
        parts.append(f"{fix}" + (f"; {listed} {'is' if len(rest) == 1 else 'are'} not implicated." if rest else "."))
    else:
        parts.append("Data, precision, LR and structure are not implicated by this replay.")
    if any("fresh initialisation" in n for n in rep.notes):
        parts.append("(Replayed on a fresh initialisation: less meaningful.)")
    return " ".join(parts)


# ----------------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vidstab replay",
        description="Replay an incident bundle deterministically and triage it (data, precision/LR, structure).",
    )
    p.add_argument("bundle", help="incident bundle folder (RUN_DIR/vidstab/incidents/step...), or a run folder "
                                  "(its first incident is replayed)")
    p.add_argument("--device", default="cpu", help="device to replay on (default: cpu)")
    p.add_argument("--json", dest="json_path", default=None,
                   help=f"where to write the JSON report (default: BUNDLE/{REPORT_FILE})")
    p.add_argument("--checkpoint", default=None, help="checkpoint folder or model.safetensors overriding the bundle's")
    p.add_argument("--fresh-init", action="store_true",
                   help="ignore the bundle's checkpoint and replay on a seeded fresh initialisation (less meaningful)")
    p.add_argument("--optimizer", choices=("auto", "adamw", "sgd"), default="auto",
                   help="optimizer of the one-update LR test (default: the bundle's, else AdamW)")
    p.add_argument("--absmax-limit", type=float, default=ABSMAX_LIMIT,
                   help=f"per-sample input absmax called out of range (default: {ABSMAX_LIMIT:g})")
    return p


def main(argv: list[str] | None = None) -> int:
    """``vidstab replay``: print the report, write the JSON; 0 when a report was produced, 2 when not."""
    args = _parser().parse_args(argv)
    # Bundles name the user's modules by import path; the user runs replay from their project folder.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    bundle = Path(args.bundle)
    try:
        if not (bundle / "incident.json").is_file() and bundle.is_dir():
            found = list_incidents(bundle)
            if found:
                print(f"{bundle} is a run folder with {len(found)} incident(s); replaying the first: {found[0]}")
                bundle = found[0]
            elif (bundle / "vidstab").is_dir():
                raise ReplayError("it is a run folder without incidents (nothing under vidstab/incidents/)")
        report = replay(bundle, device=args.device, json_path=args.json_path, checkpoint=args.checkpoint,
                        optimizer=args.optimizer, absmax_limit=args.absmax_limit, fresh_init=args.fresh_init)
    except (ReplayError, IncidentError) as e:
        print(f"vidstab replay: cannot replay {bundle}: {e}", file=sys.stderr)
        return EXIT_CANNOT_REPLAY
    print(report.to_text())
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
