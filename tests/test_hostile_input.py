"""What a stranger hands vidstab is bounded and inert: every file below is hostile, every command is the real
``python -m vidstab ...`` process a user runs on it, and each answer is one clear message (or a note), with
no traceback, no code run, no terminal or HTML injection and bounded memory."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from vidstab.evidence.capture import write_incident
from vidstab.events import EventLog

REPO = Path(__file__).resolve().parents[1]
FINDING = {"detector": "nonfinite", "verdict": "SKIP", "message": "loss is NaN", "figures": {}}
VIDEODIT = {"class": "vidstab.reference.model:VideoDiT",
            "config": {"in_channels": 4, "hidden_size": 16, "num_layers": 1, "num_heads": 2},
            "loss_fn": "vidstab.reference.objective:replay_loss"}
DEEP = 200_000


def cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``python -m vidstab ARGS`` as a user would; returns the process and its peak resident memory (MiB)."""
    code = textwrap.dedent("""
        import re, runpy, sys
        try:
            runpy.run_module("vidstab", run_name="__main__", alter_sys=True)
        finally:
            sys.stdout.flush()
            # this process's own peak (VmHWM); getrusage's ru_maxrss keeps the forking pytest worker's across exec
            with open("/proc/self/status") as f:
                peak = re.search(r"VmHWM:\s*(\d+)", f.read()).group(1)
            print(f"MAXRSS_KIB={peak}", file=sys.stderr)
    """)
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=240,
                          env=full_env, cwd=cwd or REPO)
    rss = re.search(r"MAXRSS_KIB=(\d+)", done.stderr)
    return done, int(rss.group(1)) // 1024 if rss else -1


def a_bundle(run: Path, spec: dict | None = None, sample_ids: list[str] | None = None) -> Path:
    batch = {"latents": torch.randn(2, 4, 2, 4, 4), "timesteps": torch.tensor([10, 900]),
             "noise": torch.randn(2, 4, 2, 4, 4)}
    return write_incident(run, step=3, micro_step=0, rank=0, world_size=1, batch=batch,
                          sample_ids=sample_ids or ["a", "b"], finding=FINDING, lr=1e-3, precision="no", seed=0,
                          checkpoint=None, model_spec=spec or VIDEODIT)


def a_run(run: Path) -> Path:
    log = EventLog(run, rank=0)
    log.log("start", 0, world_size=1)
    for step in range(1, 4):
        log.log("metrics", step, loss=1.0 / step, lr=1e-3, grad_norm=1.0, clipped=False, clip_rate=0.0,
                skipped_total=0)
    log.close()
    return run


def deep_json(depth: int) -> str:
    return "[" * depth + "]" * depth


def no_traceback(done: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in done.stdout + done.stderr, (done.stdout[-2000:], done.stderr[-3000:])


# ------------------------------------------------------------------------------------------- item 2: HTML


def test_report_never_links_a_javascript_or_external_url_from_a_validation_event(tmp_path):
    run = a_run(tmp_path / "run")
    (run / "validation").mkdir()
    (run / "validation" / "strip.png").write_bytes(b"\x89PNG")
    log = EventLog(run, rank=0)
    log.log("validation", 3, strip="https://attacker.example/beacon.png",
            videos=["javascript:alert(document.cookie)", "validation/clip0.mp4", "/etc/passwd", "../../outside.mp4",
                    "data:text/html,<script>alert(1)</script>"])
    log.log("validation", 3, strip="validation/strip.png", videos=['validation/a"onmouseover="alert(1).mp4'])
    log.close()
    done, _ = cli("report", str(run))
    assert done.returncode == 0, done.stderr[-3000:]
    page = (run / "report.html").read_text(encoding="utf-8")
    # The report's own plots are inline images; every other link comes from the event log.
    hrefs = [h for h in re.findall(r'(?:href|src)="([^"]*)"', page) if not h.startswith("data:image/png;base64,")]
    assert hrefs, "no link at all"
    for h in hrefs:
        assert ":" not in h and not h.startswith("/") and ".." not in h, h
    assert "attacker.example" not in "".join(hrefs) and "javascript" not in "".join(hrefs)
    assert 'src="validation/strip.png"' in page and 'href="validation/clip0.mp4"' in page
    assert "onmouseover=\"alert" not in page
    assert "not linked (not a file inside the run folder)" in page


# ------------------------------------------------------------------------------- item 3: deep JSON


def test_a_deeply_nested_event_line_is_a_note_in_report_and_events_not_a_recursion_error(tmp_path):
    run = a_run(tmp_path / "run")
    log_file = run / "vidstab" / "events-rank0.jsonl"
    with open(log_file, "a") as fh:
        fh.write('{"kind": "warn", "step": 2, "rank": 0, "x": ' + deep_json(DEEP) + "}\n")
        fh.write(json.dumps({"kind": "warn", "step": 3, "rank": 0, "message": "after the deep line"}) + "\n")
    for args in (("report", str(run)), ("events", str(run))):
        done, _ = cli(*args)
        no_traceback(done)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "RecursionError" not in done.stderr
    done, _ = cli("events", str(run))
    assert "events-rank0.jsonl line 5: JSON nested 200001 levels deep" in done.stderr, done.stderr[-2000:]
    assert "after the deep line" in done.stdout  # the lines after it are still read
    assert "nested 200001 levels deep" in (run / "report.html").read_text(encoding="utf-8")


def test_the_restart_path_reads_an_event_log_with_a_deep_line(tmp_path):
    from vidstab.run.elastic import previous_attempt

    run = a_run(tmp_path / "run")
    with open(run / "vidstab" / "events-rank0.jsonl", "a") as fh:
        fh.write('{"kind": "hang", "step": 3, "x": ' + deep_json(DEEP) + "}\n")
    got = previous_attempt(run, before=float("inf"))
    assert got["ranks"][0]["last_step"] == 3


def test_a_deeply_nested_incident_json_is_refused_by_replay_and_listed_as_unreadable(tmp_path):
    bundle = a_bundle(tmp_path / "run")
    (bundle / "incident.json").write_text(deep_json(DEEP))
    done, _ = cli("replay", str(bundle))
    no_traceback(done)
    assert done.returncode == 2 and "nested 200000 levels deep" in done.stderr, done.stderr[-2000:]
    done, _ = cli("incidents", str(tmp_path / "run"))
    no_traceback(done)
    assert done.returncode == 0 and "unreadable incident.json" in done.stdout, done.stdout


# ------------------------------------------------------------------------ item 4: terminal escapes


def test_incidents_and_replay_print_no_terminal_escape_from_a_sample_id(tmp_path):
    evil = "s1\x1b]0;pwned\x07\x1b[2J\x1b[31m\u202e\nFAKE LINE"
    bundle = a_bundle(tmp_path / "run", sample_ids=[evil, "ok"])
    log = EventLog(tmp_path / "run", rank=0)
    log.log("incident", 3, path=str(bundle.relative_to(tmp_path / "run")), sample_ids=[evil], detector="x\x1b[2J")
    log.close()
    for args in (("incidents", str(tmp_path / "run")), ("events", str(tmp_path / "run")), ("replay", str(bundle))):
        done, _ = cli(*args)
        assert done.returncode == 0, (args, done.stderr[-2000:])
        for stream in (done.stdout, done.stderr.split("MAXRSS")[0]):
            assert "\x1b" not in stream and "\x07" not in stream and "\u202e" not in stream, (args, stream[-500:])
            assert "\nFAKE LINE" not in stream, args
    done, _ = cli("incidents", str(tmp_path / "run"))
    assert "s1\\x1b]0;pwned\\x07" in done.stdout  # shown escaped, so the user still sees what is there


# ------------------------------------------------------------------- item 5: no module run by a bundle


def test_a_bundle_naming_vidstab_main_or_a_cli_module_as_its_model_class_imports_nothing(tmp_path):
    for name in ("vidstab.__main__:VideoDiT", "vidstab.tools.cli:main",
                 "diffusers.commands.diffusers_cli:main"):
        bundle = a_bundle(tmp_path / name.replace(":", "_"), spec={**VIDEODIT, "class": name})
        probe = textwrap.dedent(f"""
            import sys
            sys.argv = ["host-program", "--host-flag"]
            from vidstab.tools.replay import replay, UntrustedCodeError
            try:
                replay({str(bundle)!r})
            except UntrustedCodeError as e:
                print("REFUSED", e)
            module = {name.split(":")[0]!r}
            print("IMPORTED" if module in sys.modules else "NOT IMPORTED")
        """)
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        no_traceback(done)
        assert done.returncode == 0 and "REFUSED" in done.stdout and "NOT IMPORTED" in done.stdout, (name, done.stdout, done.stderr[-2000:])
        assert "Nothing was imported" in done.stdout and "--trust" in done.stdout


# ------------------------------------------------------------------------------- item 6: size bounds


def test_a_replayed_model_too_large_is_refused_before_its_weights_are_allocated(tmp_path):
    huge = {**VIDEODIT, "config": {"in_channels": 4, "hidden_size": 32768, "num_layers": 24, "num_heads": 8}}
    bundle = a_bundle(tmp_path / "run", spec=huge)
    done, rss = cli("replay", str(bundle))
    no_traceback(done)
    assert done.returncode == 2 and "parameters, more than the 1,000,000,000" in done.stderr, done.stderr[-2000:]
    assert "--max-params" in done.stderr
    assert 0 < rss < 1500, f"replay grew to {rss} MiB before refusing"
    # The cap is the user's to set: a small model passes a small cap only when it fits.
    small = a_bundle(tmp_path / "small")
    done, _ = cli("replay", str(small), "--max-params", "1000")
    assert done.returncode == 2 and "more than the 1,000 a replay builds" in done.stderr, done.stderr[-2000:]
    done, _ = cli("replay", str(small), env={"VIDSTAB_MAX_PARAMS": "10000000"})
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_oversized_incident_json_is_refused_unread_in_bounded_memory(tmp_path):
    bundle = a_bundle(tmp_path / "run")
    meta = json.loads((bundle / "incident.json").read_text())
    meta["extra"] = {"padding": ["x" * 1000] * 70_000}  # ~70 MB of JSON, beyond the 64 MiB default
    (bundle / "incident.json").write_text(json.dumps(meta))
    for args in (("replay", str(bundle)), ("incidents", str(tmp_path / "run"))):
        done, rss = cli(*args)
        no_traceback(done)
        assert "more than the 67108864 allowed (VIDSTAB_MAX_JSON_BYTES)" in done.stdout + done.stderr, (args, done.stderr[-1500:])
        assert 0 < rss < 1000, f"{args[0]} grew to {rss} MiB"
    # A lower cap is the user's to set.
    (bundle / "incident.json").write_text(json.dumps({**meta, "extra": {"padding": ["x" * 1000] * 200}}))
    done, _ = cli("replay", str(bundle), env={"VIDSTAB_MAX_JSON_BYTES": "100000"})
    assert done.returncode == 2 and "more than the 100000 allowed" in done.stderr, done.stderr[-1500:]


def test_an_event_line_beyond_the_cap_is_skipped_with_a_note(tmp_path):
    run = a_run(tmp_path / "run")
    with open(run / "vidstab" / "events-rank0.jsonl", "a") as fh:
        fh.write(json.dumps({"kind": "warn", "step": 3, "rank": 0, "message": "y" * 3_000_000}) + "\n")
        fh.write(json.dumps({"kind": "warn", "step": 3, "rank": 0, "message": "short"}) + "\n")
    done, _ = cli("events", str(run))
    no_traceback(done)
    assert "longer than 1048576 bytes (VIDSTAB_MAX_EVENT_LINE_BYTES)" in done.stderr, done.stderr[-1500:]
    assert "short" in done.stdout
