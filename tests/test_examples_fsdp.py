"""examples/vidstab_loop.py --fsdp with 2 real processes (FSDP2 ``fully_shard`` per block on a gloo CPU mesh,
as the example does where Accelerate refuses FSDP): the DDP drill's faults -- a NaN sample on rank 1 and an
LR x10^4 bug in the user's loop -- give the same lockstep skips (the one-step LR bug costs one skip, no
rollback; FSDP rollbacks: tests/test_checkpoint_fsdp_train.py); the checkpoint
is sharded (each rank wrote its own shard, nothing gathered, nothing pickled), `vidstab replay` reproduces
the NaN bundle on it, and its weights are the run's.
examples/plain_loop.py --fsdp with the same faults ends with ruined weights.

"Identical weights" when sharded: both ranks print the digest of the gathered full weights (the same on every
rank by construction), so the check that means something is that a plain 1-process model restored from the
run's last checkpoint (DCP reshards 2 -> 1) has exactly those weights and the optimizer moments by name."""

from __future__ import annotations

import json
import subprocess
import sys

from safetensors import safe_open
from test_checkpoint_sharded import assert_no_pickle_or_zip
from test_examples import DRILL, REPO, _done_lines, _env, _events, launch

# The DDP drill with one more step (argparse keeps the last value), so the final step is checkpointed.
FSDP_DRILL = [*DRILL, "--max_train_steps", "25", "--fsdp"]

# A user taking the sharded checkpoint of a 2-process run into one process: a plain model, vidstab's manager
# (another world size is the user's explicit choice), then one more optimizer step from the restored moments.
RESTORE_IN_ONE_PROCESS = """
import json, sys, torch
from accelerate import Accelerator
import vidstab
from vidstab_loop import TinyVideoDenoiser, weights_digest
accelerator = Accelerator()
model = TinyVideoDenoiser()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ckpt = vidstab.CheckpointManager(accelerator, sys.argv[1], vidstab.CheckpointConfig(allow_world_size_change=True))
ckpt.register("model", model)
ckpt.register("optimizer", optimizer)
state = ckpt.load("latest")
finite, digest = weights_digest(model)
moments = sorted(n for n, p in model.named_parameters() if optimizer.state[p]["exp_avg"].abs().sum() > 0)
model(torch.randn(2, 4, 2, 8, 8), torch.tensor([1, 2])).square().mean().backward()
optimizer.step()
print(json.dumps({"step": state["step"], "finite": finite, "digest": digest, "moments": moments,
                  "stepped_finite": weights_digest(model)[0]}))
"""


def test_guarded_example_fsdp_two_processes_skip_rollback_sharded_checkpoint_restores_in_one(tmp_path):
    run = tmp_path / "run"
    proc = launch("vidstab_loop.py", "--output_dir", str(run), *FSDP_DRILL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    done = _done_lines(proc.stdout)
    assert set(done) == {0, 1} and done[0] == done[1] and done[0][:2] == ("25", "True")

    ev = {r: _events(run, r) for r in (0, 1)}
    skips = {r: [(e["step"], e["detector"], e["bad_ranks"]) for e in ev[r] if e["kind"] == "skip"] for r in (0, 1)}
    assert skips[0] == skips[1]  # lockstep under FSDP2 too: the same steps skipped on both ranks
    assert [s for s in skips[0] if s[1] == "nonfinite"] == [(5, "nonfinite", [1])]
    assert [s for s in skips[0] if s[1] == "lr_bound"] == [(13, "lr_bound", [])]
    assert not [e for r in (0, 1) for e in ev[r] if e["kind"] in ("rollback", "rollback_request")]

    # Sharded: the manifest says so, and each rank wrote its own shard of every parameter (a half of dim 0:
    # hidden 32 -> 16 rows, channels 4 -> 2), so no rank ever held the full model to write it.
    last = run / "vidstab" / "checkpoints" / "step_000025"
    manifest = json.loads((last / "manifest.json").read_text())
    assert manifest["backend"] == "sharded" and manifest["world_size"] == 2
    shards = sorted((last / "dcp").glob("*.safetensors"))
    assert len(shards) == 2
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            assert f.get_slice("model.inp.weight").get_shape()[0] == 16
            assert f.get_slice("model.out.weight").get_shape()[0] == 2
            assert f.get_slice("optimizer.state.inp.weight.exp_avg").get_shape()[0] == 16
    assert_no_pickle_or_zip(run / "vidstab")  # checkpoints, incident bundles, event logs

    # `vidstab replay` of rank 1's NaN bundle on trained weights read from a sharded checkpoint into one plain
    # model: it reproduces the step and names the sample. The bundle names step 5's checkpoint when that async
    # save had finished before the NaN came (then it is kept for the bundle, and must pass the bundle's record
    # of its shards); otherwise none, and the user points replay at one.
    bundle = run / "vidstab" / "incidents" / "step000005-rank1"
    named = json.loads((bundle / "incident.json").read_text())["checkpoint"]
    weights = run / named if named else last
    cmd = [sys.executable, "-m", "vidstab", "replay", str(bundle), "--trust", "vidstab_loop"]
    replay = subprocess.run(cmd + ([] if named else ["--checkpoint", str(last)]), cwd=tmp_path, env=_env(),
                            capture_output=True, text=True, timeout=240)
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]
    report = json.loads((bundle / "replay_report.json").read_text())
    bad_id = json.loads((bundle / "incident.json").read_text())["bad_sample_ids"]
    assert report["reproduced"] is True and bad_id and bad_id[0] in report["verdict"]
    assert report["checkpoint"] == str(weights / "dcp")

    # Restored in 1 process: exactly the 2-process run's final weights, the optimizer moments matched by name.
    restore = subprocess.run([sys.executable, "-c", RESTORE_IN_ONE_PROCESS, str(run)], cwd=REPO, env=_env(),
                             capture_output=True, text=True, timeout=180)
    assert restore.returncode == 0, restore.stderr[-4000:]
    restored = json.loads(restore.stdout.strip().splitlines()[-1])
    assert restored["step"] == 25 and restored["finite"] and restored["stepped_finite"]
    assert restored["digest"] == done[0][2]
    assert restored["moments"] == ["inp.bias", "inp.weight", "out.bias", "out.weight", "time.bias", "time.weight"]


def test_plain_example_fsdp_with_the_same_faults_ends_with_ruined_weights(tmp_path):
    proc = launch("plain_loop.py", "--output_dir", str(tmp_path / "plain"), *FSDP_DRILL)
    # The plain loop has no vidstab, so no exit fence: after its last line it may end in gloo's exit-time
    # std::terminate (vidstab/run/exit_fence.py: the guarded example did in 2 of 32 runs before the fence). Its
    # weights are what this test is about.
    exit_abort = proc.returncode != 0 and "terminate called without an active exception" in proc.stderr
    assert proc.returncode == 0 or exit_abort, proc.stderr[-4000:]
    done = _done_lines(proc.stdout)
    assert set(done) == {0, 1} and done[0] == done[1] and done[0][:2] == ("25", "False")
