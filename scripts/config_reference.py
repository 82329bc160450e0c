"""Write docs/configuration.md, the reference of every configuration field, from the code.

    python scripts/config_reference.py            # rewrite docs/configuration.md
    python scripts/config_reference.py --check    # exit 1 when the page is not what the code says

Each field's default and meaning come from the dataclass itself (its default and the docstring under the
field); which way to turn it comes from :data:`TURN` below, the one thing written here by hand.
tests/test_doc_references.py fails when a field has no docstring or no entry in :data:`TURN`, or when the
page differs from what this script writes.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "configuration.md"

#: Which way to turn a field: by ``"Class.field"`` first, then by field name (shared by the detectors).
TURN: dict[str, str] = {
    # any detector
    "enabled": "false turns the detector off (a misspelt key is refused, never a silent off)",
    "action": "`warn` only logs, `skip` refuses the step, `rollback` goes back to the last healthy checkpoint",
    "quiet_steps": "higher: fewer repeated warnings about one new level; lower: warned again sooner",
    "ratio": "higher: only larger jumps are flagged (fewer findings); lower: more sensitive",
    "zscore": "higher: fewer findings; lower: more sensitive to moderate outliers",
    "beta": "closer to 1: a longer memory, slower to follow a new level; lower: follows the run faster",
    "warmup_steps": "higher: judges later, on a steadier reference; lower: protects short runs sooner",
    "window": "longer: slower patterns are seen, and a finding weighs longer; shorter: only recent steps count",
    "detectors": "add a detector's name to count its findings too; remove one to ignore it here",
    # particular fields
    "LRBoundConfig.skip_peak_ratio": "higher: tolerates larger deliberate LR raises; lower: refuses smaller ones",
    "LRBoundConfig.skip_scheduled_ratio": "higher: tolerates larger departures from the schedule's LR; lower: stricter",
    "LRBoundConfig.warn_peak_ratio": "higher: fewer warnings about an LR above the schedule's peak",
    "GradSpikeConfig.ratio_warmup_steps": "higher: the ratio test starts later; lower: protects the first steps",
    "GradSpikeConfig.min_log_std": "higher: fewer false spikes in quiet phases; lower: more sensitive",
    "GradGrowthConfig.min_rises": "higher: needs a steadier rise to warn; lower: warns on noisier growth",
    "GradGrowthConfig.min_growth": "higher: only steeper growth warns; lower: earlier warnings",
    "GradGrowthConfig.noise_z": "higher: growth must stand further above the noise; lower: more sensitive",
    "LossSpikeConfig.min_std_fraction": "higher: fewer false spikes when the loss is very steady",
    "LossSpikeConfig.min_bucket_samples": "higher: a timestep bucket is judged later, on more samples",
    "ClipRateConfig.max_rate": "higher: tolerates more clipped steps before warning",
    "ClipRateConfig.min_clip_factor": "higher: only heavy clipping counts; lower: mild clipping counts too",
    "LossScaleConfig.max_drops": "higher: tolerates more fp16 loss-scale drops per window",
    "ParamGrowthConfig.max_growth": "higher: tolerates more weight growth per window",
    "UpdateRatioConfig.warmup_samples": "higher: judges later, on more measurements",
    "StragglerConfig.min_seconds": "higher: ignores slowness below this many seconds a step",
    "StragglerConfig.patience": "higher: a rank must be slow for longer before a warning",
    "InputScaleConfig.reference_rms": "set it (e.g. from your latent cache) to judge from the first step; null: learnt",
    "InputScaleConfig.reference_steps": "higher: a steadier learnt reference, judged later",
    "InputScaleConfig.smooth_steps": "higher: one odd batch weighs less, a real change shows later",
    "InputScaleConfig.warn_ratio": "higher: fewer warnings; lower: a smaller change of input scale warns",
    "InputScaleConfig.act_ratio": "higher: acts (skips) only on larger changes of input scale",
    "InputScaleConfig.instant_ratio": "higher: a single batch must be further off to be acted on at once",
    "InputScaleConfig.false_warn_rate": "lower: longer median windows on noisy small batches (fewer false warnings)",
    "InputScaleConfig.max_smooth_steps": "higher: allows longer windows for very noisy batches",
    "InputScaleConfig.drift_threshold": "higher: a drift must go on longer before the warning",
    "InputScaleConfig.drift_allowance": "higher: slower drifts are tolerated",
    "InputScaleConfig.drift_lag": "higher: the drift baseline leaves out more recent steps",
    "InputScaleConfig.drift_restart": "false: one lasting new level keeps warning until outweighed",
    "InputScaleConfig.drift_min_std": "higher: fewer drift warnings on very steady inputs",
    "TrendConfig.min_detectors": "higher: more different detectors must warn before a rollback",
    "TrendConfig.min_steps": "higher: the warnings must be spread over more steps",
    "TrendConfig.witnesses": "empty: any counted detector is enough; add names to require one of them",
    "ConsecutiveSkipsConfig.max_consecutive": "higher: more skips in a row before a rollback; lower: rolls back sooner",
    "RepeatedSpikesConfig.max_spikes": "higher: more spikes per window before a rollback",
    "SkipRateConfig.max_rate": "higher: more of the recent steps may be skipped before a rollback; lower: sooner",
    # GuardConfig
    "GuardConfig.enabled": "false: the guard does nothing (your loop runs as it would without it)",
    "GuardConfig.input_keys": "list the batch keys to watch to leave others (masks, ids) out; null: every float tensor",
    "GuardConfig.num_train_timesteps": "your scheduler's number of training timesteps; 1 for flow matching in [0, 1]",
    "GuardConfig.timestep_buckets": "higher: finer per-timestep losses, each noisier",
    "GuardConfig.max_buckets": "higher: more shape buckets kept at once (more memory per detector)",
    "GuardConfig.rank_log_every": "lower: more metrics lines from the ranks other than 0; higher: smaller logs",
    "GuardConfig.log_every": "higher: fewer tracker calls (the JSONL log keeps every step)",
    "GuardConfig.param_norm_every": "lower: update-ratio and weight-growth detectors see more steps, at a cost; 0: never",
    "GuardConfig.capture_incidents": "false: no incident bundles (and no batch references kept until the step)",
    "GuardConfig.max_incidents": "higher: more bundles per rank on disk; 0: none",
    "GuardConfig.quarantine_bad_samples": "false: samples named bad stay in the data",
    "GuardConfig.rerun_suspect_steps": "false: no in-job rerun of a suspicious step (no verdict data/numerics/transient)",
    "GuardConfig.rerun_peer_check": "false: no peer rank re-runs a reproduced rank's micro-batches",
    "GuardConfig.health_window": "longer: a checkpoint must be further from any finding to be a rollback target",
    "GuardConfig.health_ignore": "add a detector whose warnings describe a lasting regime; remove one to make it count",
    "GuardConfig.localize_first_nonfinite": "false: no hooked replay to name the first non-finite module",
    "GuardConfig.localize_every_step": "true: name the module for every non-finite incident (a forward+backward each)",
    "GuardConfig.custom": "one entry per detector you registered, at the top level of the YAML",
    # RecoveryConfig
    "OOMConfig.advise_after": "lower: name the micro-batch to use after fewer OOMs in one bucket; higher: fewer such lines",
    "RecoveryConfig.reset": "true once, on the launch after you fixed the cause: the LR multiplier and retry budget carried over start afresh",
    "RecoveryConfig.max_retries": "higher: more rollbacks for one incident before the run stops; 0: stop at once",
    "RecoveryConfig.lr_backoff": "lower: a larger LR cut per rollback; 1: never lower the LR",
    "RecoveryConfig.lr_backoff_causes": "add `exception` or `data` to lower the LR for those causes too",
    "RecoveryConfig.incident_window": "higher: failures further apart still share one retry budget",
    "RecoveryConfig.lr_restore_every": "lower: a backed-off LR returns to the schedule sooner; 0: never",
    "RecoveryConfig.skip_data": "false: rewind the data to the checkpoint and replay the batches (needs a data position)",
    "RecoveryConfig.own_checkpoints": "set to your script's checkpoint folder pattern so a rollback removes newer ones",
    # CheckpointConfig
    "CheckpointConfig.keep": "higher: more checkpoints on disk, more rollback targets",
    "CheckpointConfig.keep_for_incidents": "higher: more incident bundles keep the weights they replay on",
    "CheckpointConfig.async_save": "false: the loop waits for the whole write (simpler, slower)",
    "CheckpointConfig.subdir": "another folder under the output dir, if the default clashes with yours",
    "CheckpointConfig.fsync": "false only for throw-away runs (gives up durability on power loss)",
    "CheckpointConfig.pin_memory": "false: pageable host buffers (less pinned memory, slower copy from GPU)",
    "CheckpointConfig.check_params_finite": "false: skip the NaN/Inf check before a save (not advised)",
    "CheckpointConfig.reuse_buffers": "false: frees the host copy after each save (less memory between saves)",
    "CheckpointConfig.rollback_memory_budget_bytes": "0 to spare the host memory (rollbacks read the files); higher "
                                                      "when the state is larger than the default allows",
    "CheckpointConfig.remove_stale": "false for a tool that opens a folder whose run is still saving",
    "CheckpointConfig.allow_world_size_change": "true to resume on another number of processes, when your loop re-derives "
                                               "data positions and the LR schedule (FSDP2: docs/sharded.md)",
    "CheckpointConfig.rank_timeout_s": "higher on slow file systems; lower to give up sooner on a stuck rank",
    "CheckpointConfig.sharded": "true/false to force sharded DCP or full-state files; null: sharded under FSDP2",
    "CheckpointConfig.on_replica_mismatch": "`refuse` to stop instead of repairing replicated state from rank 0",
    "CheckpointConfig.allow_other_run": "true only to start from another run's checkpoint on purpose (e.g. fine-tuning from its weights)",
    "CheckpointConfig.cast_dtypes": "true to load a checkpoint saved in another floating dtype (each cast is logged)",
    "CheckpointConfig.checksum": "`sha256` for checkpoints that cross trust boundaries (about 4x slower)",
}


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (its bases' first, so a subclass's override wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError):
            continue
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def yaml_value(value: object) -> str:
    """A default as a YAML reader writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    if isinstance(value, str) and "/" in value:
        return f'"{value}"'  # a path: as YAML quotes it
    return str(value)


def markdown(text: str) -> str:
    """A docstring as table text: RST literals as Markdown code, a run-folder path (``vidstab/checkpoints``, not a
    file of this repository) under ``OUTPUT_DIR/``, and no ``|`` that would end the cell."""
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    text = re.sub(r":\w+:`~?([\w.]+)`", r"`\1`", text)

    def run_folder(m: re.Match) -> str:
        path = m.group(1)
        known = (REPO / path).exists() or (REPO / (path + ".py")).exists()
        return f"`{path}" if known else f"`OUTPUT_DIR/{path}"

    text = re.sub(r"`(vidstab/[\w/.\-]*)", run_folder, text)
    return text.replace("|", "\\|")


def turn(cls: type, name: str) -> str | None:
    return TURN.get(f"{cls.__name__}.{name}") or TURN.get(name)


def sections() -> list[tuple[str, str, type]]:
    """``(heading, YAML prefix, class)`` of every configuration the page documents, in page order."""
    from vidstab.checkpoint import CheckpointConfig
    from vidstab.config import GuardConfig
    from vidstab.detectors import DETECTORS
    from vidstab.recovery.policy import RecoveryConfig

    out = [("GuardConfig", "", GuardConfig)]
    out += [(f"`{name}` ({cfg.__name__})", f"{name}.", cfg) for name, (cfg, _) in DETECTORS.items()]
    out += [("RecoveryConfig", "", RecoveryConfig), ("CheckpointConfig", "", CheckpointConfig)]
    return out


def problems() -> list[str]:
    """Fields without a docstring or without a line in :data:`TURN`."""
    found = []
    for _, _, cls in sections():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(default(f)):
                continue  # a detector's section, documented field by field below
            if not docs.get(f.name):
                found.append(f"{cls.__name__}.{f.name} has no docstring under the field (its meaning on the page)")
            if not turn(cls, f.name):
                found.append(f"{cls.__name__}.{f.name} has no 'which way to turn it' line in scripts/config_reference.py TURN")
    return found


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Every field of `vidstab.GuardConfig` (and of each detector's section in it), `vidstab.RecoveryConfig` and",
        "`vidstab.CheckpointConfig`: its default, what it means and which way to turn it. Written from the code by",
        "`python scripts/config_reference.py` (tests/test_doc_references.py fails when the page and the code differ).",
        "",
        "`GuardConfig` is what `vidstab.attach(..., config=...)` takes, and what a YAML file given to the reference",
        "trainer's `--vidstab_config` holds: the top-level fields, and one mapping per detector. A key that is not",
        "a field, or a value out of range, is refused with a message naming it. An example (loaded by",
        "tests/test_doc_references.py):",
        "",
        "<!-- snippet: vidstab-config-yaml -->",
        "```yaml",
        "health_window: 50",
        "grad_spike:",
        "  ratio: 8.0          # flag a gradient norm 8x its moving average (default 10)",
        "  warmup_steps: 30",
        "loss_spike:",
        "  action: skip        # refuse a loss spike instead of only warning",
        "skip_rate:",
        "  window: 100",
        "  max_rate: 0.2",
        "straggler:",
        "  enabled: false",
        "```",
        "",
        "The reference trainer reads it with `--vidstab_config my_guard.yaml`; in your own loop pass",
        "`config=vidstab.GuardConfig.from_yaml(\"my_guard.yaml\")` to `vidstab.attach`. `RecoveryConfig` and",
        "`CheckpointConfig` are Python arguments of the explicit form (`vidstab.Recovery(..., config=...)`,",
        "`vidstab.CheckpointManager(..., config=...)`); the reference trainer sets them from its flags",
        "(`--max_retries`, `--replay_data_after_rollback`, `--checkpointing_steps` ...).",
        "What the detectors watch and when each acts: [detectors.md](detectors.md).",
        "",
    ]
    for heading, prefix, cls in sections():
        docs = field_docs(cls)
        lines += [f"## {heading}", ""]
        lines += ["| field | default | meaning | which way to turn it |", "| --- | --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            value = default(f)
            if dataclasses.is_dataclass(value):
                continue
            meaning = markdown(docs.get(f.name) or "")
            shown = f"`{yaml_value(value)}`".replace("|", "\\|")
            lines.append(f"| `{prefix}{f.name}` | {shown} | {meaning} | {markdown(turn(cls, f.name) or '')} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(REPO))
    missing = problems()
    if missing:
        print("\n".join(missing), file=sys.stderr)
        return 1
    text = render()
    if "--check" in argv:
        if PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE.relative_to(REPO)} is not what the code says: run python scripts/config_reference.py",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
