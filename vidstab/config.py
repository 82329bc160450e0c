"""Configuration of the guard: one dataclass, a docstring on every field, strict loading.

``GuardConfig.from_dict`` / ``from_yaml`` reject unknown keys and bad values with an error that names
the field (``grad_spike.ratio must be > 1, got 0.5``), because a typo in a stability config silently
turning a detector off is exactly the kind of failure this tool exists to prevent.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .detectors import (
    ClipRateConfig,
    ConfigError,
    ConsecutiveSkipsConfig,
    ExceptionConfig,
    GradGrowthConfig,
    GradSpikeConfig,
    InputRangeConfig,
    InputScaleConfig,
    LossScaleConfig,
    LossSpikeConfig,
    LRBoundConfig,
    LRJumpConfig,
    NonFiniteConfig,
    NonFiniteParamsConfig,
    OOMConfig,
    ParamGrowthConfig,
    RepeatedSpikesConfig,
    SkipRateConfig,
    StragglerConfig,
    TrendConfig,
    UpdateRatioConfig,
    registered_detectors,
)
from .detectors.base import check


@dataclass
class GuardConfig:
    """Everything the guard does, with defaults meant for a real run."""

    enabled: bool = True
    """Master switch. When False, ``guard.backward``/``guard.step`` do exactly what a plain loop does."""
    input_keys: tuple[str, ...] | None = None
    """Keys of the ``batch`` dict given to ``guard.backward`` whose statistics (absmax, mean, std,
    whether non-finite) are recorded; ``None`` (default): every floating tensor of the batch (latents,
    images, noise ...; in the unmodified loop, the model's floating inputs of two or more dimensions:
    per-sample scalars such as float timesteps or sigmas are left out). In the unmodified loop the keys
    are the names of the model's ``forward`` arguments."""
    num_train_timesteps: int = 1000
    """Range of the ``timesteps`` given to ``guard.backward`` (``t / num_train_timesteps`` picks the
    bucket). Use 1 for continuous flow-matching times in [0, 1]."""
    timestep_buckets: int = 10
    """Number of equal-width timestep buckets for the per-bucket loss (instability at t~0 and t~T differs)."""
    max_buckets: int = 64
    """Shape buckets (resolution, frame count, batch size) each per-bucket detector keeps statistics for at once;
    the least recently seen one is dropped beyond that (``guard.backward(..., bucket=...)``)."""
    rank_log_every: int = 50
    """Ranks other than 0 write their healthy steps' ``metrics`` lines every this many optimizer steps (rank 0
    writes every step; a step with a finding is written by every rank), so thousands of ranks do not append a
    line each per step."""
    log_every: int = 1
    """Send metrics to the accelerator's trackers every this many optimizer steps (the JSONL event log
    gets every step regardless)."""
    param_norm_every: int = 10
    """Measure the parameter norm and update/weight ratio every this many optimizer steps (0: never). The
    update ratio needs a transient copy of the (local) parameters on those steps."""
    capture_incidents: bool = True
    """Write incident bundles (batch + metadata) on the offending ranks when a step is skipped/rolled back.
    To do so the guard keeps references (not copies) to the accumulation window's micro-batches until the
    optimizer step, which keeps them alive that long; False drops them at once."""
    max_incidents: int = 50
    """At most this many incident bundles per rank per run (disk budget)."""
    quarantine_bad_samples: bool = True
    """Samples an incident bundle names bad (non-finite or outlier inputs) go into the run's quarantine list
    (``vidstab/quarantine.jsonl``), which :class:`vidstab.QuarantinedDataset` keeps out of later epochs and resumes."""
    rerun_suspect_steps: bool = True
    """Re-run a step skipped for a non-finite value, a spike or an exception on the same weights, on every rank,
    and say whether it is the data, the numerics, a transient fault or one rank's hardware (vidstab/recovery/rerun.py);
    needs ``guard.set_replay_fn``, or in the attached form a diffusers model (its recorded inputs and output
    gradient). Costs a forward+backward per micro-batch, only on such steps."""
    rerun_peer_check: bool = True
    """With the rerun, under DDP, a peer rank also runs a reproduced rank's micro-batches (suspect hardware)."""
    health_window: int = 50
    """A checkpoint is a rollback target (``guard.healthy``) only if no detector has raised a finding in the
    last this many steps (``health_ignore`` aside). A slowly diverging run warns (LR jump, update ratio,
    growth) well before it skips; a checkpoint taken then would be a rollback target that fails again."""
    health_ignore: tuple[str, ...] = ("clip_rate", "loss_scale", "straggler")
    """Detectors whose warnings do not make a checkpoint unhealthy: they describe a lasting regime (heavy
    clipping, an fp16 scale that keeps adjusting, a slow rank), not a state to roll back from."""
    localize_first_nonfinite: bool = True
    """On the first non-finite incident of the run, replay the bad micro-batch with hooks (needs
    ``guard.set_replay_fn``) to name the first module producing NaN/Inf."""
    localize_every_step: bool = False
    """Opt-in: localize every non-finite incident, not only the first (costs a forward+backward each)."""
    nonfinite: NonFiniteConfig = field(default_factory=NonFiniteConfig)
    """Non-finite loss/inputs/gradient norm (default: skip)."""
    exception: ExceptionConfig = field(default_factory=ExceptionConfig)
    """Caller-reported exception in a micro-step (default: rollback)."""
    oom: OOMConfig = field(default_factory=OOMConfig)
    """Out of memory in a micro-step's forward or backward on some rank (default: skip, no rollback)."""
    nonfinite_params: NonFiniteParamsConfig = field(default_factory=NonFiniteParamsConfig)
    """Non-finite parameter norm (default: rollback)."""
    lr_bound: LRBoundConfig = field(default_factory=LRBoundConfig)
    """LR beyond anything the schedule can produce, judged before the update is applied (default: skip)."""
    grad_spike: GradSpikeConfig = field(default_factory=GradSpikeConfig)
    """Gradient-norm spike vs. its EMA (default: skip)."""
    grad_growth: GradGrowthConfig = field(default_factory=GradGrowthConfig)
    """Sustained exponential gradient-norm growth (default: warn)."""
    loss_spike: LossSpikeConfig = field(default_factory=LossSpikeConfig)
    """Loss spike vs. its EMA (default: warn)."""
    clip_rate: ClipRateConfig = field(default_factory=ClipRateConfig)
    """Clipping on most steps of a window (default: warn)."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Frequent fp16 loss-scale drops (default: warn)."""
    param_growth: ParamGrowthConfig = field(default_factory=ParamGrowthConfig)
    """Parameter-norm growth over a long window (default: warn)."""
    lr_jump: LRJumpConfig = field(default_factory=LRJumpConfig)
    """Learning rate jumped vs. its EMA (default: warn)."""
    update_ratio: UpdateRatioConfig = field(default_factory=UpdateRatioConfig)
    """Update/weight ratio grew vs. its EMA (default: warn)."""
    input_range: InputRangeConfig = field(default_factory=InputRangeConfig)
    """An extreme finite input value (e.g. an unclamped VAE latent) vs. its EMA (default: warn)."""
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    """A rank persistently slower than the others (default: warn)."""
    input_scale: InputScaleConfig = field(default_factory=InputScaleConfig)
    """Input RMS vs. a fixed reference (given, or the first healthy steps) (default: warn at x1.5, skip at x2)."""
    trend: TrendConfig = field(default_factory=TrendConfig)
    """Warnings of several detectors within a window (default: rollback)."""
    consecutive_skips: ConsecutiveSkipsConfig = field(default_factory=ConsecutiveSkipsConfig)
    """A run of skipped steps (default: rollback)."""
    repeated_spikes: RepeatedSpikesConfig = field(default_factory=RepeatedSpikesConfig)
    """Spikes clustered in a window (default: rollback)."""
    skip_rate: SkipRateConfig = field(default_factory=SkipRateConfig)
    """More than a share of recent steps skipped, consecutive or not (default: rollback)."""
    custom: dict[str, Any] = field(default_factory=dict)
    """Configs of detectors added with :func:`vidstab.register_detector`, by name. In YAML/dicts they sit
    at the top level like the built-in ones (``my_rule: {action: skip}``); a registered detector without
    an entry runs with its config class's defaults."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad field."""
        check(self.input_keys is None or all(isinstance(k, str) for k in self.input_keys), "input_keys",
              "must be a list of strings or null", self.input_keys)
        check(self.num_train_timesteps > 0, "num_train_timesteps", "must be > 0", self.num_train_timesteps)
        check(self.timestep_buckets >= 1, "timestep_buckets", "must be >= 1", self.timestep_buckets)
        check(self.max_buckets >= 1, "max_buckets", "must be >= 1", self.max_buckets)
        check(self.rank_log_every >= 1, "rank_log_every", "must be >= 1", self.rank_log_every)
        check(self.log_every >= 1, "log_every", "must be >= 1", self.log_every)
        check(self.param_norm_every >= 0, "param_norm_every", "must be >= 0", self.param_norm_every)
        check(self.max_incidents >= 0, "max_incidents", "must be >= 0", self.max_incidents)
        check(self.health_window >= 0, "health_window", "must be >= 0", self.health_window)
        for f in dataclasses.fields(self):
            sub = getattr(self, f.name)
            if dataclasses.is_dataclass(sub):
                sub.validate(f.name)
        user = registered_detectors()
        for name, sub in self.custom.items():
            check(name in user, f"custom.{name}", "must name a detector added with vidstab.register_detector", name)
            check(isinstance(sub, user[name][0]), name, f"must be a {user[name][0].__name__}", sub)
            sub.validate(name)

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_dict(cls, d: dict | None) -> "GuardConfig":
        """Build from a plain dict (nested dicts for detectors); unknown keys and bad values raise."""
        d = dict(d or {})
        if not isinstance(d.get("custom", {}), dict):
            raise ConfigError(f"custom must be a mapping, got {d['custom']!r}")
        user = registered_detectors()
        custom = {name: _build(user[name][0], d.pop(name), name + ".") for name in list(d) if name in user}
        for name, sub in d.pop("custom", {}).items():  # the to_dict form is flat; this spelling is accepted too
            if name not in user:
                raise ConfigError(f"custom.{name}: no detector {name!r} was added with vidstab.register_detector")
            custom[name] = _build(user[name][0], sub, name + ".")
        obj = _build(cls, d, "")
        obj.custom = custom
        obj.validate()
        return obj

    @classmethod
    def from_yaml(cls, path: str | Path) -> "GuardConfig":
        """Build from a YAML file holding the same structure as :meth:`from_dict`."""
        import yaml

        with open(path, encoding="utf-8") as f:
            d = yaml.safe_load(f)
        if d is not None and not isinstance(d, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level, got {type(d).__name__}")
        return cls.from_dict(d)

    def to_dict(self) -> dict:
        """Plain JSON/YAML-serialisable form (round-trips through :meth:`from_dict`)."""
        d = _to_plain(dataclasses.asdict(self))
        custom = d.pop("custom", {})
        return {**d, **custom}


def _to_plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _to_plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_to_plain(v) for v in x]
    return x


def _build(cls: type, d: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "guard config"
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a mapping, got {d!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key(s) in {where}: {', '.join(prefix + u for u in unknown)} (known: {', '.join(fields)})")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in d.items():
        kwargs[name] = _coerce(hints[name], value, prefix + name)
    try:
        obj = cls(**kwargs)
    except ConfigError:
        raise
    if prefix:  # nested configs are validated with their full dotted name
        obj.validate(prefix.rstrip("."))
    return obj


def _coerce(tp: Any, value: Any, name: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, name + ".")
    origin = typing.get_origin(tp)
    if tp is bool:
        check(isinstance(value, bool), name, "must be true or false", value)
        return value
    if tp is int:
        check(isinstance(value, int) and not isinstance(value, bool), name, "must be an integer", value)
        return value
    if tp is float:
        check(isinstance(value, (int, float)) and not isinstance(value, bool), name, "must be a number", value)
        return float(value)
    if tp is str:
        check(isinstance(value, str), name, "must be a string", value)
        return value
    if origin is tuple:
        check(isinstance(value, (list, tuple)), name, "must be a list", value)
        return tuple(_coerce(typing.get_args(tp)[0], v, f"{name}[{i}]") for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, name)
    return value


def config_hash(cfg: Any) -> str:
    """Stable short hash (sha256, 16 hex) of a run configuration (dict, dataclass or argparse Namespace).

    Keys are sorted and values that JSON cannot hold are written with ``str``, so the same settings give
    the same hash across processes and runs (checkpoint manifests use it to spot a changed config on resume).
    """
    import hashlib
    import json

    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        cfg = dataclasses.asdict(cfg)
    elif hasattr(cfg, "__dict__") and not isinstance(cfg, dict):
        cfg = vars(cfg)
    blob = json.dumps(_to_plain(cfg), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]
