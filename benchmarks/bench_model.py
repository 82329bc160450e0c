"""Claim: the reference VideoDiT trains no slower than diffusers' WanTransformer3DModel at matched size.

One training step (forward, fp32 MSE loss, backward) of

* ``ours``            - ``vidstab.reference.model.VideoDiT``: full 3D attention, 3D RoPE, QK-norm, AdaLN-Zero;
* ``wan``             - diffusers' ``WanTransformer3DModel`` built from a config (no weights), as it is;
* ``wan_no_xattn``    - the same Wan with every block's cross-attention (``attn2``) replaced by a stub that
  returns 0: an estimate of Wan without the text conditioning ``ours`` does not have (its ``norm2`` and
  the ``+ 0`` still run);
* ``ours_factorized`` - ours with factorized (spatial, then temporal) attention. Informational only: not the
  same architecture, so not part of the claim.

Matching: hidden width = ``num_heads * attention_head_dim``, the same depth, heads, FFN width
(``ffn_dim = mlp_ratio * hidden``), patch size (1, 2, 2), latent channels and token count (the very same
latents). Wan also needs ``encoder_hidden_states``: it gets [B, 1, 16] (one text token of width 16, the
least it accepts). Its cross-attention still turns every video token into a query and projects the result
back -- two extra hidden x hidden matmuls per block, plus a LayerNorm -- which ``ours`` does not pay;
``wan_no_xattn`` shows how much of the gap that is.

Timing: every model is built and warmed up first; then the timed steps are interleaved round-robin (so
load on the machine hits every model alike) and the median and min of ``--repeats`` steps are reported,
with the median process CPU time per step (all threads) on CPU, which shared machines disturb less.
Gradients are reset to None before each step, outside the timing. Peak memory is the peak of what one
step allocates on top of what was allocated before it (activations, gradients, temporaries; not the
parameters): ``torch.cuda.max_memory_allocated`` on CUDA; on CPU the running sum of the allocation/free
events of ``torch.profiler(profile_memory=True)`` over one extra, untimed step.

    python benchmarks/bench_model.py                     # CPU, fp32, sizes tiny+small: about a minute
    python benchmarks/bench_model.py --device cuda       # bf16 autocast, sizes small+base
    python benchmarks/bench_model.py --quick             # smoke run of the script (size micro), seconds

Throughput: the FLOPs of one step (forward + backward) are counted once per model with
``torch.utils.flop_counter.FlopCounterMode`` (matmuls, convolutions, attention), so achieved TFLOP/s =
FLOPs / median step time, and MFU = achieved / the device's dense peak for the precision
(:data:`PEAK_TFLOPS`, matched on the CUDA device name; ``--peak_tflops`` overrides; none on CPU).

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

MODELS = ("ours", "wan", "wan_no_xattn", "ours_factorized")
#: Dense (no sparsity) peak TFLOP/s by CUDA device-name fragment, (bf16/fp16 tensor core, fp32), vendor data sheets.
PEAK_TFLOPS = {
    "H200": (989.0, 67.0), "H100 SXM": (989.0, 67.0), "H100 PCIe": (756.0, 51.0), "H100": (989.0, 67.0),
    "A100": (312.0, 19.5), "L40S": (362.0, 91.6), "L4": (121.0, 30.3), "A10G": (70.0, 31.2), "RTX 4090": (165.0, 82.6),
}


def peak_tflops(device: torch.device, precision: str, override: float | None) -> float | None:
    """The dense peak of ``device`` at ``precision`` (None when unknown, e.g. on CPU)."""
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, (half, single) in PEAK_TFLOPS.items():
        if fragment in name:
            return half if precision == "bf16" else single
    return None


def step_flops(step) -> int:
    """FLOPs of one call of ``step`` (forward + backward), counted by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return int(counter.get_total_flops())
TEXT_LEN, TEXT_DIM = 1, 16


@dataclass(frozen=True)
class Size:
    heads: int
    head_dim: int
    layers: int
    batch: int
    channels: int
    frames: int
    height: int
    width: int
    mlp_ratio: float = 4.0

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def ffn_dim(self) -> int:
        return int(self.hidden * self.mlp_ratio)

    @property
    def tokens(self) -> int:  # per sample, with patch (1, 2, 2)
        return self.frames * (self.height // 2) * (self.width // 2)

    def describe(self) -> str:
        return (f"hidden {self.hidden} = {self.heads} heads x {self.head_dim}, {self.layers} layers, "
                f"ffn {self.ffn_dim}, patch (1,2,2), batch {self.batch} x {self.tokens} tokens "
                f"(latents {self.channels}x{self.frames}x{self.height}x{self.width})")


SIZES = {
    "micro": Size(heads=4, head_dim=16, layers=1, batch=1, channels=4, frames=2, height=16, width=16),  # --quick
    # CPU: each runs in seconds on 2 cores
    "tiny": Size(heads=4, head_dim=16, layers=2, batch=2, channels=4, frames=4, height=32, width=32),
    "small": Size(heads=4, head_dim=32, layers=4, batch=2, channels=4, frames=8, height=32, width=32),
    # GPU
    "base": Size(heads=12, head_dim=64, layers=12, batch=2, channels=16, frames=16, height=64, width=64),
    "large": Size(heads=16, head_dim=64, layers=24, batch=1, channels=16, frames=21, height=60, width=104),
}


class NoCrossAttention(nn.Module):
    """Stands in for a Wan block's ``attn2``: adds 0 (``hidden_states + attn2(...)``)."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states.new_zeros(())


def build_models(size: Size, device: torch.device, factorized: bool) -> dict[str, nn.Module]:
    from diffusers import WanTransformer3DModel

    from vidstab.reference.model import VideoDiT

    ours_kwargs = dict(in_channels=size.channels, patch_size=(1, 2, 2), hidden_size=size.hidden,
                       num_layers=size.layers, num_heads=size.heads, mlp_ratio=size.mlp_ratio,
                       pos_embed="rope", qk_norm=True)
    wan_kwargs = dict(patch_size=(1, 2, 2), num_attention_heads=size.heads, attention_head_dim=size.head_dim,
                      in_channels=size.channels, out_channels=size.channels, text_dim=TEXT_DIM, freq_dim=256,
                      ffn_dim=size.ffn_dim, num_layers=size.layers)
    torch.manual_seed(0)
    models = {
        "ours": VideoDiT(attention_type="full", **ours_kwargs),
        "wan": WanTransformer3DModel(**wan_kwargs),
        "wan_no_xattn": WanTransformer3DModel(**wan_kwargs),
    }
    for block in models["wan_no_xattn"].blocks:
        block.attn2 = NoCrossAttention()
    if factorized:
        models["ours_factorized"] = VideoDiT(attention_type="factorized", **ours_kwargs)
    with torch.no_grad():  # move AdaLN-Zero's zeros (same cost either way; keeps every path non-trivial)
        for name in ("ours", "ours_factorized"):
            for p in models[name].parameters() if name in models else ():
                if not p.any():
                    p.normal_(std=0.02)
    return {name: model.to(device).train() for name, model in models.items()}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_step_memory(step, device: torch.device) -> int | None:
    """Bytes one step allocates at its peak, on top of what was allocated before it."""
    sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns())
        current = peak = 0
        for e in events:
            if str(e.device_type()).endswith("CPU"):
                current += e.nbytes()  # negative for a free
                peak = max(peak, current)
        return peak
    except Exception:  # a private profiler API: report n/a rather than fail the benchmark
        return None


def bench_size(size: Size, args, device: torch.device) -> dict:
    models = build_models(size, device, factorized=not args.no_factorized)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(size.batch, size.channels, size.frames, size.height, size.width, generator=gen).to(device)
    t = torch.randint(0, 1000, (size.batch,), generator=gen).to(device)
    target = torch.randn(x.shape, generator=gen).to(device)
    text = torch.randn(size.batch, TEXT_LEN, TEXT_DIM, generator=gen).to(device)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if args.precision == "bf16" \
        else contextlib.nullcontext

    def make_step(name: str, model: nn.Module):
        def step():
            with autocast():
                out = model(x, t, text, return_dict=False)[0] if name.startswith("wan") else model(x, t)
            F.mse_loss(out.float(), target).backward()

        return step

    steps = {name: make_step(name, model) for name, model in models.items()}
    for name, step in steps.items():
        for _ in range(args.warmup):
            models[name].zero_grad(set_to_none=True)
            step()

    wall = {name: [] for name in steps}
    cpu = {name: [] for name in steps}
    names = list(steps)
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotate who goes first
            models[name].zero_grad(set_to_none=True)
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            steps[name]()
            sync(device)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)

    rows = {}
    peak_tf = peak_tflops(device, args.precision, args.peak_tflops)
    for name, model in models.items():
        model.zero_grad(set_to_none=True)
        peak = peak_step_memory(steps[name], device)
        model.zero_grad(set_to_none=True)
        flops = step_flops(steps[name])
        achieved = flops / statistics.median(wall[name]) / 1e12
        rows[name] = {
            "gflops_per_step": flops / 1e9,
            "achieved_tflops": achieved,
            "mfu": achieved / peak_tf if peak_tf else None,
            "params": sum(p.numel() for p in model.parameters()),
            "ms_median": 1e3 * statistics.median(wall[name]),
            "ms_min": 1e3 * min(wall[name]),
            "cpu_ms_median": 1e3 * statistics.median(cpu[name]) if device.type == "cpu" else None,
            "peak_mb": None if peak is None else peak / 2**20,
        }
    ratios = {}
    for ref in ("wan", "wan_no_xattn"):
        ours, other = rows["ours"], rows[ref]
        ratios[f"time_vs_{ref}"] = ours["ms_median"] / other["ms_median"]
        ratios[f"min_time_vs_{ref}"] = ours["ms_min"] / other["ms_min"]
        if ours["cpu_ms_median"] is not None:
            ratios[f"cpu_time_vs_{ref}"] = ours["cpu_ms_median"] / other["cpu_ms_median"]
        if ours["peak_mb"] and other["peak_mb"]:
            ratios[f"memory_vs_{ref}"] = ours["peak_mb"] / other["peak_mb"]
    noisy = any(r["ms_median"] > 1.25 * r["ms_min"] for r in rows.values())
    return {"config": asdict(size) | {"hidden": size.hidden, "ffn_dim": size.ffn_dim, "tokens": size.tokens},
            "models": rows, "ratios": ratios, "noisy": noisy}


def print_table(name: str, size: Size, res: dict) -> None:
    print(f"\n[{name}] {size.describe()}")
    header = (f"{'model':<17}{'params':>10}{'median ms':>11}{'min ms':>9}{'cpu ms':>9}{'peak MB':>9}"
              f"{'ours/this':>11}{'TFLOP/s':>9}{'MFU':>7}")
    print(header)
    print("-" * len(header))
    ours = res["models"]["ours"]["ms_median"]
    for model in MODELS:
        if model not in res["models"]:
            continue
        r = res["models"][model]
        cpu = "-" if r["cpu_ms_median"] is None else f"{r['cpu_ms_median']:.1f}"
        peak = "n/a" if r["peak_mb"] is None else f"{r['peak_mb']:.1f}"
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        print(f"{model:<17}{r['params'] / 1e6:>9.3f}M{r['ms_median']:>11.1f}{r['ms_min']:>9.1f}{cpu:>9}{peak:>9}"
              f"{ours / r['ms_median']:>11.3f}{r['achieved_tflops']:>9.3f}{mfu:>7}")
    q = res["ratios"]
    for ref in ("wan", "wan_no_xattn"):
        parts = [f"time {q[f'time_vs_{ref}']:.3f} (median)", f"{q[f'min_time_vs_{ref}']:.3f} (min)"]
        if f"cpu_time_vs_{ref}" in q:
            parts.append(f"{q[f'cpu_time_vs_{ref}']:.3f} (cpu)")
        if f"memory_vs_{ref}" in q:
            parts.append(f"peak memory {q[f'memory_vs_{ref}']:.3f}")
        print(f"ours/{ref}: " + ", ".join(parts))
    if res["noisy"]:
        print("warning: some median is > 1.25x its min: the machine was busy and these timings are noisy; "
              "rerun on a quiet machine (or compare the min and cpu ratios)")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description="VideoDiT vs WanTransformer3DModel: step time and peak memory.")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--sizes", default=None,
                        help=f"comma-separated, from {list(SIZES)} (default: tiny,small on cpu; small,base on cuda)")
    parser.add_argument("--precision", default=None, choices=["fp32", "bf16"],
                        help="fp32, or bf16 autocast (default: fp32 on cpu, bf16 on cuda)")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per model, >= 5 (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--no_factorized", action="store_true", help="skip the informational factorized row")
    parser.add_argument("--quick", action="store_true", help="smoke run: size micro, 5 repeats, 1 warm-up step")
    parser.add_argument("--peak_tflops", type=float, default=None, help="dense peak of the device for MFU (default: PEAK_TFLOPS by name)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats, args.warmup = args.sizes or "micro", 5, 1
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available")
    if args.repeats < 5:
        parser.error("--repeats must be >= 5")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sizes = (args.sizes or ("tiny,small" if device.type == "cpu" else "small,base")).split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown size(s) {unknown}; choose from {list(SIZES)}")
    args.precision = args.precision or ("fp32" if device.type == "cpu" else "bf16")

    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} CPU threads"
    print(f"VideoDiT ('ours') vs diffusers WanTransformer3DModel: forward + backward step, {args.precision}, "
          f"{hardware}; median of {args.repeats} timed steps after {args.warmup} warm-up steps, interleaved")
    started = time.perf_counter()
    results = {}
    for s in sizes:
        results[s] = bench_size(SIZES[s], args, device)
        print_table(s, SIZES[s], results[s])
    total = time.perf_counter() - started
    print("\nours/this: ours' median step time over this model's (< 1: ours is faster). cpu ms: process CPU time "
          "per step, all threads.\nwan_no_xattn: Wan with its cross-attention stubbed out; ours_factorized: not a "
          f"matched architecture, for information. Total {total:.0f}s.")

    def rounded(d):
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}

    summary = {
        "bench": "model",
        "device": args.device,
        "hardware": hardware,
        "precision": args.precision,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "quick": args.quick,
        "sizes": {s: {"config": r["config"], "ratios": rounded(r["ratios"]), "noisy": r["noisy"],
                      "models": {m: rounded(v) for m, v in r["models"].items()}} for s, r in results.items()},
        "peak_tflops": peak_tflops(device, args.precision, args.peak_tflops),
        "ours_not_slower_than_wan": all(r["ratios"]["time_vs_wan"] <= 1.0 for r in results.values()),
        "ours_not_slower_than_wan_cpu_time": (all(r["ratios"]["cpu_time_vs_wan"] <= 1.0 for r in results.values())
                                              if device.type == "cpu" else None),
        "total_s": round(total, 1),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
