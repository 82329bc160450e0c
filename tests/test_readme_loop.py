"""The integration diffs of the README (the attached form) and docs/own-loop.md (the explicit form), run:
each "before" side is a working plain loop that a NaN sample ruins, each "after" side trains through it with
the guard; the explicit one with vidstab's checkpoints and recovery, resumed with --resume_from_checkpoint
latest. The line counts the docs state are the diffs'. Real Accelerate, real processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from doc_snippets import doc_snippet

REPO = Path(__file__).resolve().parents[1]

# What the README's diff leaves to the reader: the run's objects, and a NaN in one sample of batch 5.
PRELUDE = textwrap.dedent('''
    import argparse, os, sys
    import torch
    from accelerate import Accelerator

    args = argparse.Namespace(output_dir=sys.argv[1], resume_from_checkpoint=sys.argv[2] or None, max_train_steps=12,
                              checkpointing_steps=4, max_grad_norm=1.0)
    torch.manual_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    latents = torch.randn(40, 4)
    latents[10, 0] = float("nan")  # sample 10: batch 5, the second micro-batch of optimizer step 2
    data = [{"latents": latents[i], "ids": torch.tensor(i)} for i in range(len(latents))]
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    num_train_epochs = 3

    def compute_loss(model, batch):
        return model(batch["latents"]).pow(2).mean()
''')
EPILOGUE = textwrap.dedent('''
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print(f"finished at step {global_step}, weights finite: {finite}", flush=True)
''')


def _diff(name: str = "own-loop-diff") -> list[str]:
    return doc_snippet(name).splitlines()


def _side(lines: list[str], keep: str) -> str:
    return "\n".join(x[1:] for x in lines if x[:1] in (" ", keep))


def _run(code: str, out: Path, resume: str = "") -> subprocess.CompletedProcess:
    script = out.parent / f"loop_{abs(hash(code))}.py"
    script.write_text(PRELUDE + code + "\n" + EPILOGUE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(script), str(out), resume], env=env, capture_output=True, text=True, timeout=180)


def test_the_docs_state_the_diffs_line_counts():
    lines = _diff()
    added, removed = sum(x.startswith("+") for x in lines), sum(x.startswith("-") for x in lines)
    assert f"**+{added} / −{removed} lines**" in (REPO / "docs" / "own-loop.md").read_text()
    attach = _diff("attach-diff")
    assert sum(x.startswith("-") for x in attach) == 0
    words = {3: "Three", 4: "Four", 5: "Five", 6: "Six"}
    assert f"{words[sum(x.startswith('+') for x in attach)]} added lines, none removed" in (REPO / "README.md").read_text()


def _before_and_after(lines: list[str], tmp_path: Path) -> tuple[Path, str]:
    """Run the diff's plain side (the NaN sample must ruin it) and its guarded side; the guarded run's folder
    and output."""
    plain = _run(_side(lines, "-"), tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "finished at step 12, weights finite: False" in plain.stdout  # the NaN sample ruined the plain run
    out = tmp_path / "guarded"
    guarded = _run(_side(lines, "+"), out)
    assert guarded.returncode == 0, guarded.stderr[-3000:]
    assert "finished at step 12, weights finite: True" in guarded.stdout
    return out, guarded.stdout


def test_readme_attach_diff_runs_before_and_after(tmp_path):
    out, _ = _before_and_after(_diff("attach-diff"), tmp_path)
    # the step with the NaN sample was skipped on every rank and its micro-batch captured
    assert list((out / "vidstab" / "incidents").glob("step000002-rank0*")), os.listdir(out / "vidstab" / "incidents")
    assert any(p.name.startswith("checkpoint-") for p in out.iterdir())  # the script's own checkpoints, as before
    from vidstab.recovery.quarantine import QuarantineList

    assert QuarantineList(out).ids() == {"10"}  # guard.track_samples: the NaN sample named by its index, quarantined


def test_own_loop_diff_runs_before_and_after(tmp_path):
    lines = _diff()
    out, _ = _before_and_after(lines, tmp_path)
    assert (out / "vidstab" / "incidents" / "step000002-rank0-m1").is_dir()  # the NaN micro-batch, skipped, captured
    resumed = _run(_side(lines, "+"), out, resume="latest")
    assert resumed.returncode == 0 and "finished at step 12" in resumed.stdout  # resumed at the end: nothing to do
    # (the same command again without resuming is refused: tests/test_run_dir.py, tests/test_examples.py)
