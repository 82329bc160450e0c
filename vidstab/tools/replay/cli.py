"""``vidstab replay`` / ``python scripts/replay.py``: arguments, picking a bundle in a run folder, exit codes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ...evidence.capture import IncidentError, list_incidents
from ..terminal import printable
from .api import replay
from .base import ABSMAX_LIMIT, EXIT_CANNOT_REPLAY, EXIT_OK, REPORT_FILE, ReplayError


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
    p.add_argument("--trust", action="append", metavar="MODULE[:NAME]",
                   help="allow the bundle to import this module (and its submodules) or this one object: the "
                        "model factory/class and loss function of your own project; repeatable. Without it only "
                        "vidstab's own code is imported (the module must be importable: installed or on PYTHONPATH)")
    p.add_argument("--max-params", type=int, default=None, metavar="N",
                   help="the most parameters the rebuilt model may have; a larger one is refused before its "
                        "weights are allocated (default: VIDSTAB_MAX_PARAMS, else 1e9)")
    return p


def main(argv: list[str] | None = None) -> int:
    """``vidstab replay``: print the report, write the JSON; 0 when a report was produced, 2 when not."""
    args = _parser().parse_args(argv)
    # The bundle's import paths are data: only vidstab's own code and what --trust names are imported, and
    # neither the current folder nor the bundle's folder is put on sys.path (vidstab.tools.trusted_import).
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
                        optimizer=args.optimizer, absmax_limit=args.absmax_limit, fresh_init=args.fresh_init,
                        trust=args.trust or (), max_params=args.max_params)
    except (ReplayError, IncidentError, ValueError) as e:  # ValueError: a bound that is not a number
        print(printable(f"vidstab replay: cannot replay {bundle}: {e}"), file=sys.stderr)  # names from the bundle
        return EXIT_CANNOT_REPLAY
    print(report.to_text())
    return EXIT_OK
