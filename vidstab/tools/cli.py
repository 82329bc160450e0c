"""The ``vidstab`` command: preflight audit, dashboard, replay, incidents and events of a run.

    vidstab audit --latents CACHE_DIR --config trainer.yaml --json audit.json   # exit 1 if anything blocks, 2 if unreadable
    vidstab report RUN_DIR [--out report.html]
    vidstab replay BUNDLE [...]                 # see `vidstab replay --help`
    vidstab incidents RUN_DIR
    vidstab quarantine RUN_DIR [--clear [--sample ID ...]]
    vidstab events RUN_DIR [--kind skip] [--rank 1]
    vidstab goodput RUN_DIR [--json]

``python -m vidstab ...`` is the same command. Heavy modules (torch, matplotlib) are imported by the
sub-command that needs them, so ``vidstab --help`` answers at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# Exit codes: 0 ok, 1 the audit found blocking problems, 2 bad usage or unreadable input.
EXIT_OK, EXIT_BLOCKED, EXIT_USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vidstab",
        description="Training-stability tooling for latent video diffusion: audit before, dashboard and replay after.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    audit = sub.add_parser(
        "audit", help="preflight checks: data/latents, model attention and activations, config, loss source",
        description="Run the preflight checklist on what you give it. Exits 1 when a finding blocks training.",
    )
    audit.add_argument("--latents", metavar="CACHE_DIR", help="latent cache folder (safetensors shards + manifest.json)")
    audit.add_argument("--data-dir", metavar="VIDEO_DIR", help="folder of video files, decoded and scanned")
    audit.add_argument("--num-frames", type=int, default=16, help="frames per clip for --data-dir (default 16)")
    audit.add_argument("--resolution", type=int, default=64, help="clip side for --data-dir (default 64)")
    audit.add_argument("--model", metavar="MODULE:FACTORY",
                       help="callable returning a model, or (model, example_inputs); a dry-run forward is made")
    audit.add_argument("--config", metavar="FILE", help="training config (YAML or JSON)")
    audit.add_argument("--loss", metavar="MODULE:FUNCTION", help="loss function (or module class) whose source is scanned")
    audit.add_argument("--precision", choices=("no", "bf16", "fp16"), help="mixed precision (default: from --config)")
    audit.add_argument("--absmax-threshold", type=float, default=None,
                       help="|value| above which a data sample blocks (default 20, for normalised latents)")
    audit.add_argument("--memory", action="store_true",
                       help="with --model: one forward, backward and AdamW step per shape bucket at its largest "
                            "micro-batch (the factory's 'buckets': {name: example inputs}; else its example inputs), "
                            "and its peak memory and headroom (GPU: the allocator's peak; CPU: the profiler's count)")
    audit.add_argument("--inject_fault", action="append", metavar="KIND@STEP=N",
                       help="a drill for --memory: oom_batch_above@0=N, a device that fits at most N samples")
    audit.add_argument("--json", metavar="OUT", help="also write the findings as JSON")

    report = sub.add_parser("report", help="write the HTML dashboard of a run", description="Write RUN_DIR/report.html.")
    report.add_argument("run_dir", metavar="RUN_DIR")
    report.add_argument("--out", metavar="PATH", help="where to write the page (default RUN_DIR/report.html)")

    sub.add_parser("replay", help="re-run an incident bundle and say where it goes non-finite (see: vidstab replay --help)",
                   add_help=False)

    incidents = sub.add_parser("incidents", help="list the incident bundles of a run")
    incidents.add_argument("run_dir", metavar="RUN_DIR")
    incidents.add_argument("--json", action="store_true", help="one JSON object per incident")

    quarantine = sub.add_parser("quarantine", help="list (or --clear) the samples a run keeps out of its data",
                                description="The run's quarantine list (vidstab/quarantine.jsonl): samples named bad, "
                                            "skipped by vidstab.QuarantinedDataset in later epochs and resumes.")
    quarantine.add_argument("run_dir", metavar="RUN_DIR")
    quarantine.add_argument("--clear", action="store_true", help="release samples (all, or those named by --sample); "
                            "do it while the run is stopped")
    quarantine.add_argument("--sample", action="append", metavar="ID", help="with --clear: only this sample (repeatable)")
    quarantine.add_argument("--json", action="store_true", help="one JSON object per quarantined sample")

    events = sub.add_parser("events", help="print the merged event log of a run")
    events.add_argument("run_dir", metavar="RUN_DIR")
    events.add_argument("--kind", action="append", help="only these kinds (repeatable), e.g. --kind skip --kind rollback")
    events.add_argument("--rank", type=int, action="append", help="only these ranks (repeatable)")
    events.add_argument("--json", action="store_true", help="print the raw JSON lines")

    goodput = sub.add_parser("goodput", help="where a run's wall time went: productive steps and each kind of loss",
                             description="The goodput ledger of a run from its event logs: every second of wall time, "
                                         "across restarts and relaunches, in one bucket; ETTR = productive / wall.")
    goodput.add_argument("run_dir", metavar="RUN_DIR")
    goodput.add_argument("--json", action="store_true", help="print the ledger as one JSON object")
    goodput.add_argument("--expected-mtbf-hours", type=float, default=24.0,
                         help="prior mean time between failures for the checkpoint interval advice (default 24)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``vidstab`` command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "replay":
        return _replay(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return {"audit": _audit, "report": _report, "incidents": _incidents, "quarantine": _quarantine, "events": _events,
                "goodput": _goodput}[args.command](args)
    except (FileNotFoundError, ValueError, ImportError, AttributeError) as err:  # ImportPathError is a ValueError
        from .terminal import printable

        print(f"vidstab {args.command}: error: {printable(err)}", file=sys.stderr)
        return EXIT_USAGE


# ----------------------------------------------------------------------------------------------------
# Sub-commands


def _audit(args: argparse.Namespace) -> int:
    if not any((args.latents, args.data_dir, args.model, args.config, args.loss)):
        print("vidstab audit: give at least one of --latents, --data-dir, --model, --config, --loss", file=sys.stderr)
        return EXIT_USAGE
    from vidstab.tools.audit import DEFAULT_ABSMAX_THRESHOLD, run_audit
    from vidstab.tools.trusted_import import resolve

    # --model and --loss are named by the user on this command line: that is what trusts them. The
    # current folder is not added to sys.path; the modules must be importable (installed or on PYTHONPATH).
    model, example_inputs, buckets = None, None, None
    if args.model:
        factory = resolve(args.model, "--model", trust=[args.model])
        made = factory()
        model, example_inputs = _model_from_factory(made)
        buckets = made.get("buckets") if isinstance(made, dict) else None
    loss_fn = resolve(args.loss, "--loss", trust=[args.loss]) if args.loss else None
    report = run_audit(
        latents=args.latents, data_dir=args.data_dir, video_reader=_video_reader() if args.data_dir else None,
        model=model, example_inputs=example_inputs,
        config=args.config, loss_fn=loss_fn, precision=args.precision, num_frames=args.num_frames,
        resolution=args.resolution,
        absmax_threshold=args.absmax_threshold if args.absmax_threshold is not None else DEFAULT_ABSMAX_THRESHOLD,
    )
    if args.memory:
        report.extend(_bucket_memory(args, model, buckets or ({"example": example_inputs} if example_inputs else None)))
    print(report.format_table())
    if args.json:
        report.to_json(args.json)
        print(f"findings written to {args.json}")
    if report.unreadable:
        for f in report.unreadable:
            print(f"vidstab audit: error: {f['message']}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_BLOCKED if report.blocking else EXIT_OK


def _bucket_memory(args: argparse.Namespace, model: Any, buckets: Any) -> list[dict]:
    """``--memory``: the per-bucket preflight (:mod:`vidstab.tools.audit.memory`)."""
    if model is None or not buckets:
        raise ValueError("--memory needs --model MODULE:FACTORY returning the model with its example inputs, or a "
                         "dict {'model': ..., 'buckets': {name: example inputs at the bucket's largest micro-batch}}")
    from vidstab.faults import FaultInjector
    from vidstab.tools.audit.memory import audit_model_memory

    faults = FaultInjector(args.inject_fault, rank=0)
    return audit_model_memory(model, buckets, before_forward=lambda samples: faults.maybe_oom(0, samples))


def _video_reader():
    """The reference data loader's decoder for ``--data-dir`` (PyAV; the ``[reference]`` extra)."""
    import functools

    try:
        from vidstab.reference.data import video_folder_dataset
    except ImportError as err:
        raise ImportError(f"--data-dir decodes videos with vidstab.reference.data, which needs the reference "
                          f"extra: pip install -e '.[reference]' in the vidstab-train clone ({err})") from err
    return functools.partial(video_folder_dataset, skip_bad_samples=True)


def _model_from_factory(made: Any) -> tuple[Any, Any]:
    """A factory's result as ``(model, example_inputs)``: a model, a ``(model, inputs)`` pair or a dict
    ``{"model", "example_inputs"}``."""
    if isinstance(made, dict):
        return made["model"], made.get("example_inputs")
    if isinstance(made, tuple) and len(made) == 2:
        return made
    return made, None


def _report(args: argparse.Namespace) -> int:
    from vidstab.tools.report import write_report

    path = write_report(args.run_dir, args.out)
    print(f"report written to {path}")
    return EXIT_OK


def _replay(argv: list[str]) -> int:
    from vidstab.tools.replay import main as replay_main  # lazily: replay imports torch-heavy tooling

    return int(replay_main(argv) or 0)


def _read_incidents(run_dir: Path) -> list[dict]:
    """Incident metadata of a run (the batch tensors are not needed to list incidents)."""
    from ..evidence.capture import list_incidents
    from ..files.limits import read_json_file

    out = []
    for folder in list_incidents(run_dir):
        try:
            meta = read_json_file(Path(folder) / "incident.json")
            if not isinstance(meta, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as err:
            meta = {"error": f"unreadable incident.json: {err}"}
        meta["path"] = str(folder)
        out.append(meta)
    return out


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _incidents(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run folder {str(run_dir)!r} does not exist")
    incidents = _read_incidents(run_dir)
    if args.json:
        for meta in incidents:
            print(json.dumps(meta, default=str))
        return EXIT_OK
    if not incidents:
        print(f"no incidents in {run_dir}")
        return EXIT_OK
    from .terminal import printable  # sample ids and names come from files: never print their control characters

    print(f"{'step':>7}  {'rank':>4}  {'detector':<16} {'verdict':<8} sample ids (bad ones marked *) -> bundle")
    for meta in incidents:
        bad = {str(i) for i in _as_list(meta.get("bad_sample_ids"))}
        ids = ", ".join(f"{i}*" if str(i) in bad else str(i) for i in _as_list(meta.get("sample_ids")))
        print(printable(f"{str(meta.get('step', '?')):>7}  {str(meta.get('rank', '?')):>4}  "
                        f"{str(meta.get('detector', '')):<16} {str(meta.get('verdict', '')):<8} "
                        f"{ids or meta.get('error', '')} -> {meta['path']}"))
    print(f"{len(incidents)} incident(s); replay one with: vidstab replay <bundle>")
    return EXIT_OK


def _quarantine(args: argparse.Namespace) -> int:
    from ..recovery.quarantine import QuarantineList

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run folder {str(run_dir)!r} does not exist")
    if args.sample and not args.clear:
        raise ValueError("--sample names samples to release: use it with --clear")
    qlist = QuarantineList(run_dir)
    if args.clear:
        from .terminal import printable

        released = qlist.clear(args.sample)
        missing = sorted(set(args.sample or []) - set(released))
        print(printable(f"released {len(released)} sample(s) from {qlist.path}: {', '.join(released) or '-'}"))
        if missing:
            print(printable(f"not in the quarantine list: {', '.join(missing)}"))
        return EXIT_OK
    from .terminal import printable  # ids and reasons come from a file: never print their control characters

    notes: list[str] = []
    count = 0
    for e in qlist.iter_entries(notes):  # streamed: a long list is never held whole
        if args.json:
            print(json.dumps(e))
        else:
            if not count:
                print(f"{'sample':<16} {'step':>7}  {'rank':>4}  {'source':<8} reason -> bundle")
            print(printable(f"{str(e['sample_id']):<16} {str(e.get('step', '?')):>7}  {str(e.get('rank', '?')):>4}  "
                            f"{str(e.get('source', '')):<8} {e.get('reason', '')} -> {e.get('bundle') or '-'}"))
        count += 1
    for note in notes:
        print(f"note: {printable(note)}", file=sys.stderr)
    if args.json:
        return EXIT_OK
    if not count:
        print(f"no quarantined samples in {run_dir}")
        return EXIT_OK
    print(f"{count} sample(s) quarantined; release with: vidstab quarantine {run_dir} --clear [--sample ID]")
    return EXIT_OK


def _events(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run folder {str(run_dir)!r} does not exist")
    kinds = set(args.kind or [])
    ranks = set(args.rank or [])
    from ..events import read_events
    from .terminal import printable

    notes: list[str] = []
    records = read_events(run_dir, tuple(kinds) if kinds else None, notes)
    shown = 0
    for rec in records:
        if (kinds and rec.get("kind") not in kinds) or (ranks and rec.get("rank") not in ranks):
            continue
        shown += 1
        if args.json:
            print(json.dumps(rec, separators=(",", ":")))
            continue
        details = {k: v for k, v in rec.items() if k not in ("schema", "time", "step", "rank", "kind")}
        text = json.dumps(details, separators=(", ", "="), default=str)[1:-1].replace('"', "")
        print(printable(f"step {str(rec.get('step', '?')):>7}  rank {rec.get('rank', '?')}  "
                        f"{str(rec.get('kind', '?')):<10} {text[:300]}"))
    for note in notes:
        print(f"note: {printable(note)}", file=sys.stderr)
    if not args.json:
        print(f"{shown} event(s)", file=sys.stderr)
    return EXIT_OK


def _goodput(args: argparse.Namespace) -> int:
    from ..run.checkpoint_interval import recommend
    from ..run.goodput import format_table, ledger
    from .terminal import printable

    if not args.expected_mtbf_hours > 0:
        raise ValueError(f"--expected-mtbf-hours {args.expected_mtbf_hours}: must be > 0")
    notes: list[str] = []
    led = ledger(args.run_dir, notes)
    if args.json:
        print(json.dumps({**led, "interval": recommend(led, args.expected_mtbf_hours)}))
    else:
        print(format_table(led, args.expected_mtbf_hours))
    for note in notes:
        print(f"note: {printable(note)}", file=sys.stderr)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
