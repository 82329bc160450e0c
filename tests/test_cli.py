"""The `vidstab` command: exit codes in real subprocesses, and the run-folder sub-commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from safetensors.torch import save_file

from vidstab.tools.cli import main

from test_report import INCIDENT_IDS, make_run


def vidstab(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    # cwd first (the user's own modules), then whatever PYTHONPATH already holds (this checkout, in CI).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(cwd), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "vidstab", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def write_cache(folder: Path, poison: bool) -> Path:
    """A latent cache in the reference layout (one shard + manifest), optionally with one NaN sample."""
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(8, 4, 3, 8, 8, generator=g)
    if poison:
        latents[3, 0, 0, 0, 0] = float("nan")
    save_file({"latents": latents}, str(folder / "latents-00000.safetensors"))
    ids = [f"clip-{i}" for i in range(8)]
    (folder / "manifest.json").write_text(json.dumps(
        {"sample_ids": ids, "shards": [{"file": "latents-00000.safetensors", "num_samples": 8}]}))
    return folder


def test_audit_exits_1_on_blocking_findings_and_0_when_clean(tmp_path):
    (tmp_path / "mymodels.py").write_text(textwrap.dedent("""
        import torch
        import torch.nn.functional as F
        from torch import nn

        class Attention(nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv = nn.Linear(16, 48)

            def forward(self, x):
                q, k, v = self.qkv(x).chunk(3, dim=-1)
                return F.scaled_dot_product_attention(q, k, v)

        def build():
            return Attention(), (torch.randn(1, 6, 16),)
    """))
    (tmp_path / "trainer.yaml").write_text(
        "learning_rate: 1.0e-4\nlr_warmup_steps: 500\nmax_grad_norm: 1.0\nmixed_precision: bf16\n"
        "prediction_type: epsilon\n")

    bad = vidstab("audit", "--latents", str(write_cache(tmp_path / "bad", poison=True)), "--json", "out.json",
                  cwd=tmp_path)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "latents.nonfinite" in bad.stdout and "clip-3" in bad.stdout
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["ok"] is False
    assert [f["details"]["sample_ids"] for f in report["findings"] if f["severity"] == "block"] == [["clip-3"]]

    good = vidstab("audit", "--latents", str(write_cache(tmp_path / "good", poison=False)),
                   "--config", "trainer.yaml", "--model", "mymodels:build", cwd=tmp_path)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "OK to train" in good.stdout
    assert "scaled_dot_product_attention calls in 1 modules" in good.stdout


def test_audit_config_without_warmup_and_fp16_scaling_blocks(tmp_path, capsys):
    (tmp_path / "fp16.yaml").write_text(
        "learning_rate: 1.0e-4\nlr_warmup_steps: 0\nmax_grad_norm: 1.0\nmixed_precision: fp16\ngrad_scaler: false\n")
    assert main(["audit", "--config", str(tmp_path / "fp16.yaml")]) == 1
    out = capsys.readouterr().out
    assert "config.fp16_scaling" in out and "config.warmup" in out


def test_help_and_usage_errors(tmp_path):
    helped = vidstab("--help", cwd=tmp_path)
    assert helped.returncode == 0
    for command in ("audit", "report", "replay", "incidents", "events"):
        assert command in helped.stdout
    assert main(["audit"]) == 2  # nothing to audit
    assert main(["report", str(tmp_path / "missing")]) == 2


def test_report_incidents_and_events_of_a_run(tmp_path, capsys):
    run = make_run(tmp_path / "run", steps=80)
    assert main(["report", str(run)]) == 0
    assert (run / "report.html").is_file()

    assert main(["incidents", str(run)]) == 0
    out = capsys.readouterr().out
    assert "nonfinite" in out and INCIDENT_IDS[0] in out and "step000060-rank1" in out

    assert main(["events", str(run), "--kind", "skip"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert len(lines) == 2 and all(" skip " in line for line in lines)  # one per rank
    assert "bad_ranks=[1]" in lines[0]
    assert "truncated last line" in captured.err

    assert main(["events", str(run), "--kind", "metrics", "--rank", "1", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(records) == 80 and {r["rank"] for r in records} == {1}


def test_replay_is_delegated(tmp_path, capsys):
    # A folder that is not a bundle: the replay tool itself answers (exit 2, with its message).
    assert main(["replay", str(tmp_path / "no-such-bundle")]) == 2
    assert "no-such-bundle" in capsys.readouterr().err


def test_audit_of_garbage_shards_names_the_file_and_exits_2(tmp_path):
    cache = write_cache(tmp_path / "cache", poison=False)
    (cache / "latents-00001.safetensors").write_bytes(b"\xff" * 64)  # header length says ~18 EB: "header too large"
    proc = vidstab("audit", "--latents", str(cache), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "latents-00001.safetensors" in proc.stderr and "Traceback" not in proc.stderr
    (tmp_path / "broken.yaml").write_text("learning_rate: [1e-4\n")
    assert main(["audit", "--config", str(tmp_path / "broken.yaml")]) == 2


def test_audit_imports_only_what_the_command_line_names(tmp_path):
    # The factory named on the command line is trusted by being named; nothing else is imported, and the
    # current folder is not searched for it (it must be importable: here through PYTHONPATH).
    (tmp_path / "mymodels.py").write_text("import torch\ndef build():\n    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)\n")
    # Like the installed `vidstab` console script: a launcher outside the current folder.
    launcher = tmp_path / "bin" / "vidstab_cli.py"
    launcher.parent.mkdir()
    launcher.write_text("import sys\nfrom vidstab.tools.cli import main\nsys.exit(main())\n")
    env_less = subprocess.run([sys.executable, str(launcher), "audit", "--model", "mymodels:build"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
    assert env_less.returncode == 2 and "mymodels" in env_less.stderr and "PYTHONPATH" in env_less.stderr
    ok = vidstab("audit", "--model", "mymodels:build", cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
