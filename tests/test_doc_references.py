"""The reference pages say what the code does: every configuration field (docs/configuration.md, written by
scripts/config_reference.py), every event kind and the fields of a real run's events (docs/events.md), every
subcommand (docs/cli.md), every public name (docs/api.md), the versions the README says were tested, and the
runbook's commands run on a real incident run.

A failure names the page to update: a field, an event kind, a subcommand or a public name added to the code
needs its line there."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from doc_snippets import REPO, doc_snippet

DOCS = REPO / "docs"


def _config_reference():
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_configuration_field_is_on_the_configuration_page():
    ref = _config_reference()
    missing = ref.problems()
    assert not missing, "document these fields (docs/configuration.md is written from them):\n" + "\n".join(missing)
    assert (DOCS / "configuration.md").read_text(encoding="utf-8") == ref.render(), (
        "docs/configuration.md is not what the code says: run python scripts/config_reference.py")
    from vidstab.checkpoint import CheckpointConfig
    from vidstab.config import GuardConfig
    from vidstab.recovery.policy import RecoveryConfig

    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    for cls in (GuardConfig, RecoveryConfig, CheckpointConfig):  # the oracle is the dataclass, not the script
        for f in dataclasses.fields(cls):
            sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            names = [f"{f.name}.{g.name}" for g in dataclasses.fields(sub)] if dataclasses.is_dataclass(sub) else [f.name]
            for name in names:
                assert f"| `{name}` |" in page, f"docs/configuration.md lacks {cls.__name__}'s `{name}`"


def test_the_vidstab_config_yaml_example_loads(tmp_path):
    from vidstab.config import GuardConfig

    path = tmp_path / "my_guard.yaml"
    path.write_text(doc_snippet("vidstab-config-yaml"))
    cfg = GuardConfig.from_yaml(path)
    assert cfg.grad_spike.ratio == 8.0 and cfg.loss_spike.action == "skip" and not cfg.straggler.enabled
    assert cfg.skip_rate.window == 100 and cfg.skip_rate.max_rate == 0.2


# The kinds the code writes: ``.log("kind", ...)`` / ``log_event(dir, rank, "kind", ...)`` anywhere in the product.
_LOGGED = re.compile(r"(?:\.log|log_event)\(\s*(?:[\w.]+,\s*[\w.]+,\s*)?\"([a-z_]+)\"")


def _documented_kinds() -> dict[str, str]:
    """kind -> its section of docs/events.md."""
    text = (DOCS / "events.md").read_text(encoding="utf-8")
    parts = re.split(r"^### `([a-z_]+)`\n", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_every_event_kind_the_code_writes_is_on_the_events_page():
    from vidstab.events import KINDS
    from vidstab.guard.reporting import EVENT_KIND

    written = set(KINDS) | set(EVENT_KIND.values())
    for folder in ("vidstab", "recipes"):
        for path in (REPO / folder).rglob("*.py"):
            written |= set(_LOGGED.findall(path.read_text(encoding="utf-8")))
    documented = set(_documented_kinds())
    assert not written - documented, f"add a section ### `KIND` to docs/events.md for: {sorted(written - documented)}"
    assert not documented - written, f"docs/events.md documents kinds nothing writes: {sorted(documented - written)}"


def test_every_field_of_a_real_runs_events_is_on_the_events_page(nan_batch_rank1_run):
    sections = _documented_kinds()
    missing = set()
    for log in sorted((nan_batch_rank1_run / "vidstab").glob("events-rank*.jsonl")):
        for line in log.read_text(encoding="utf-8").splitlines():
            event = json.loads(line)
            kind = event["kind"]
            section = sections.get(kind, "")
            for name in set(event) - {"schema", "time", "step", "rank", "kind"}:
                if f"`{name}`" not in section:
                    missing.add(f"{kind}.{name}")
    assert not missing, f"docs/events.md does not describe these fields of a real run's events: {sorted(missing)}"


def test_the_cli_page_lists_every_subcommand():
    import argparse

    from vidstab.tools.cli import _parser

    (sub,) = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    page = (DOCS / "cli.md").read_text(encoding="utf-8")
    missing = [name for name in sub.choices if f"`vidstab {name}" not in page]
    assert not missing, f"docs/cli.md's table 'Every subcommand' lacks: {missing}"


def test_the_api_page_lists_every_public_name():
    import vidstab

    page = (DOCS / "api.md").read_text(encoding="utf-8")
    shown = set(re.findall(r"^::: [\w.]+\.(\w+)$", page, flags=re.M))
    missing = [n for n in vidstab.__all__ if not n.startswith("__") and n not in shown]
    assert not missing, f"docs/api.md lacks a '::: module.NAME' entry for: {missing}"


def test_the_faults_page_lists_every_drill_fault():
    from vidstab.faults import FAULT_KINDS

    page = (DOCS / "faults.md").read_text(encoding="utf-8")
    table = page[page.index("## Fault drills"):]
    missing = [k for k in FAULT_KINDS if not re.search(rf"^\| `{k}[`=\[]", table, flags=re.M)]
    assert not missing, f"docs/faults.md's table 'Fault drills' lacks: {missing}"


def test_the_readme_names_the_versions_installed_here():
    for line in doc_snippet("tested-versions").splitlines():
        name, version = line.split()
        installed = sys.version.split()[0] if name == "python" else importlib.metadata.version(name)
        assert installed.split("+")[0] == version, f"README's tested versions say {name} {version}; installed: {installed}"


def test_the_runbook_commands_run_on_an_incident_run(nan_batch_rank1_run, tmp_path):
    out = tmp_path / "output" / "run"
    shutil.copytree(nan_batch_rank1_run, out)  # the shared run stays as the other tests read it
    quarantined = [json.loads(x)["sample_id"] for x in (out / "vidstab" / "quarantine.jsonl").read_text().splitlines()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    # report and replay are slow: tests/test_docs.py runs them on this run (docs/cli.md); here they must be the same
    cli = [line.split("  #")[0].strip() for line in doc_snippet("cli-around-an-incident").splitlines()]
    for name in ("runbook-first-look", "runbook-replay", "runbook-quarantine"):
        for line in doc_snippet(name).splitlines():
            command = line.split("  #")[0].strip().replace("shapes-s0-00004", quarantined[0])
            if command.startswith(("vidstab report", "vidstab replay")):
                assert command.replace("output/run", "output/vidstab-tiny") in cli, command
                continue
            done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=300)
            assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    left = [json.loads(x)["sample_id"] for x in (out / "vidstab" / "quarantine.jsonl").read_text().splitlines()]
    assert quarantined[0] not in left


def test_every_launch_line_under_max_restarts_resumes():
    """A torch-elastic restart runs the launch's command again: without ``--resume_from_checkpoint latest`` a user's
    script is refused by ``claim_run_dir`` on every restart (docs/faults.md)."""
    from doc_snippets import all_snippets

    lines = [(s.path, line) for s in all_snippets() if s.lang == "bash" for line in s.code.splitlines()
             if "--max_restarts" in line and not line.lstrip().startswith("#")]
    assert lines, "no launch line with --max_restarts in the docs"
    bad = [(path, line) for path, line in lines if "--resume_from_checkpoint latest" not in line]
    assert not bad, f"launch lines under --max_restarts without --resume_from_checkpoint latest: {bad}"
