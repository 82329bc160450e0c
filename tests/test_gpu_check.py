"""benchmarks/gpu_check.sh must keep running where no GPU is: its --dry-run runs every piece tiny on the CPU."""

import json
import os
import subprocess

from trainer_utils import REPO


def test_gpu_check_dry_run_runs_every_piece_and_prints_one_json_line():
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run"], cwd=REPO, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and summary["ok"], json.dumps(summary, indent=1)[-4000:]
    assert summary["dry_run"] and summary["device"] == "cpu"
    pieces = summary["pieces"]
    assert set(pieces) == {"sync_debug", "guard_overhead", "model", "fp16_overflow", "async_stall", "cuda_oom",
                           "rollback_memory", "guard_memory"}
    rollback = pieces["rollback_memory"]["result"]["sizes"]["tiny"]
    assert rollback["memory_equals_files"] and rollback["held_tensors"] > 0  # pinned only on CUDA: not asserted here
    assert "no CUDA device" in pieces["cuda_oom"]["result"]["skipped"]  # said, not measured
    guard_memory = pieces["guard_memory"]["result"]  # every part ran: the DiT's extra peak, the host time per size
    assert guard_memory["device"] == "cpu" and guard_memory["smoke"] and guard_memory["memory"]["dit"]["param_tensors"] > 0
    assert [h["tensors"] for h in guard_memory["host_time"]] == [5, 50, 500, 5]  # figures, not asserted (timing)
    assert {"plain_ms", "guarded_ms", "full_copy_ms"} <= set(guard_memory["unet_step"])
    assert pieces["sync_debug"]["result"]["reads_per_step"] == [1] * 5  # the guard's one read, nothing hidden
    assert pieces["model"]["result"]["sizes"]["micro"]["models"]["ours"]["achieved_tflops"] > 0
    assert {"stall_ms", "total_ms"} <= set(pieces["async_stall"]["result"]["async"])  # figures, not asserted (timing)
    assert all(p["result"].get("cuda") is False for k, p in pieces.items() if k in ("sync_debug", "fp16_overflow", "async_stall", "cuda_oom",
                                                                            "rollback_memory"))
