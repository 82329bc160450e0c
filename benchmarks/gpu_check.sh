#!/usr/bin/env bash
# The GPU check kit: everything vidstab claims about a GPU that a CPU machine cannot show, in one run.
#
#   benchmarks/gpu_check.sh             # on one CUDA GPU: at most 10 minutes (the sum of the pieces' time limits)
#   benchmarks/gpu_check.sh --dry-run   # on a CPU: every piece tiny, to prove the kit still runs (a test does this)
#
# Pieces (each prints a JSON line; the last line of this script is ONE JSON object holding them all):
#   sync_debug     the reference trainer's guarded step under torch.cuda.set_sync_debug_mode: reads of device
#                  values per step (must be 1: the guard's one read of the lockstep verdict) and where the
#                  first sync happens in "error" mode                       (benchmarks/gpu_check_pieces.py)
#   guard_overhead benchmarks/bench_guard_overhead.py --device cuda
#   model          benchmarks/bench_model.py --device cuda: step time vs Wan, achieved TFLOP/s and MFU
#   fp16_overflow  a real fp16 GradScaler overflow (initial scale 2^30), end to end through the guard
#   async_stall    the async checkpoint's stall of the training loop with pinned host buffers vs a sync save
#   cuda_oom       a real CUDA OOM (set_per_process_memory_fraction) in an attached loop's forward: the step
#                  skipped, the memory released, the next step applied (a dry run: "skipped", no CUDA)
#   rollback_memory an in-place rollback from the copy kept in host memory: the copy pinned, the restored state
#                  bitwise the files' one, seconds from memory vs from the files (benchmarks/bench_rollback.py)
#   guard_memory   benchmarks/bench_guard_memory.py --device cuda: vidstab's extra peak (max_memory_allocated)
#                  and the guard's own host time per step at 50 / 500 / 5,000 parameter tensors, where the
#                  user's step runs on the device and leaves the host's caches to the guard
# A dry run measures nothing about a GPU: its JSON says "dry_run": true and every piece "cuda": false.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; elif [[ $# -gt 0 ]]; then echo "usage: $0 [--dry-run]" >&2; exit 2; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
STARTED=$(date +%s)

piece() {  # piece NAME TIME_LIMIT_S COMMAND...: run it, keep its output, exit status and duration
  local name=$1 limit=$2 start
  shift 2
  start=$(date +%s)
  echo "== $name (limit ${limit}s): $*" >&2
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  echo $? >"$LOGS/$name.rc"
  echo $(( $(date +%s) - start )) >"$LOGS/$name.seconds"
  tail -n 3 "$LOGS/$name.log" | cut -c1-300 >&2
}

if [[ $DRY_RUN == 1 ]]; then
  # Side by side: a dry run measures nothing, and each piece is mostly its imports (~5 s on a CPU); the pieces of
  # gpu_check_pieces.py share one interpreter, each with its own log, exit status and seconds.
  echo "== sync_debug fp16_overflow async_stall cuda_oom rollback_memory (one interpreter, limit 600s)" >&2
  timeout 600 python benchmarks/gpu_check_pieces.py sync_debug fp16_overflow async_stall cuda_oom rollback_memory \
    --dry-run --logs "$LOGS" &
  piece guard_overhead 240 python benchmarks/bench_guard_overhead.py --device cpu --quick --models mlp --warmup 1 &
  piece model 240 python benchmarks/bench_model.py --quick --no_factorized &
  piece guard_memory 240 python benchmarks/bench_guard_memory.py --smoke &
  wait
else
  piece sync_debug 60 python benchmarks/gpu_check_pieces.py sync_debug
  piece guard_overhead 110 python benchmarks/bench_guard_overhead.py --device cuda --seconds 25 --dit_seconds 25
  piece model 150 python benchmarks/bench_model.py --device cuda
  piece fp16_overflow 50 python benchmarks/gpu_check_pieces.py fp16_overflow
  piece async_stall 50 python benchmarks/gpu_check_pieces.py async_stall
  piece cuda_oom 60 python benchmarks/gpu_check_pieces.py cuda_oom
  piece rollback_memory 60 python benchmarks/gpu_check_pieces.py rollback_memory
  piece guard_memory 60 python benchmarks/bench_guard_memory.py --device cuda --cycles 6
fi

python - "$LOGS" "$DRY_RUN" "$(( $(date +%s) - STARTED ))" <<'PY'
import json, sys
from pathlib import Path

logs, dry_run, seconds = Path(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
pieces = {}
for name in ("sync_debug", "guard_overhead", "model", "fp16_overflow", "async_stall", "cuda_oom", "rollback_memory",
             "guard_memory"):
    if not (logs / f"{name}.rc").exists():  # its interpreter ended before the piece did (a timeout, a crash)
        pieces[name] = {"rc": None, "timed_out": None, "seconds": None, "result": None, "tail": ["never finished"]}
        continue
    lines = (logs / f"{name}.log").read_text(errors="replace").splitlines()
    rc = int((logs / f"{name}.rc").read_text())
    result = None
    for line in reversed(lines):
        try:
            result = json.loads(line)
            break
        except ValueError:
            continue
    entry = {"rc": rc, "timed_out": rc in (124, 137), "seconds": int((logs / f"{name}.seconds").read_text()), "result": result}
    if rc != 0 or result is None:
        entry["tail"] = lines[-8:]
    pieces[name] = entry
try:
    import torch
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not dry_run else "cpu"
except Exception as exc:  # noqa: BLE001 -- the summary line must always print
    device = f"unknown ({exc})"
ok = all(p["rc"] == 0 and p["result"] is not None for p in pieces.values())
print(json.dumps({"gpu_check": "vidstab", "dry_run": dry_run, "device": device, "seconds": seconds, "ok": ok, "pieces": pieces}))
sys.exit(0 if ok else 1)
PY
