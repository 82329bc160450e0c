"""2. Model: attention implementation and activation magnitudes (one dry-run forward, hooks removed after)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .findings import finding
from .loss_source import _code_only

# Activation magnitudes that leave too little headroom: fp16's largest finite value is 65504.
ACTIVATION_LIMIT_FP32 = 1e4

ACTIVATION_LIMIT_FP16 = 3e4


def _is_attention(module: torch.nn.Module) -> bool:
    name = type(module).__name__.lower()
    return "attention" in name or "attn" in name


class _DryRunProbe:
    """Hooks and patches for one dry-run forward.

    A module stack kept by forward pre/post hooks tells, at any moment, which module is running; softmax and
    ``scaled_dot_product_attention`` are wrapped to count calls against the innermost attention-like module
    on the stack (or the innermost module). Forward hooks record each module's largest |activation| and
    whether its output has non-finite values, in execution order.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        # "blocks.0.attn (Attention)": the qualified name a user can find, and the class for context.
        self.names = {m: f"{n or '<root>'} ({type(m).__name__})" for n, m in model.named_modules()}
        self.stack: list[torch.nn.Module] = []
        self.softmax_calls: dict[str, int] = {}
        self.sdpa_calls: dict[str, int] = {}
        self.absmax: dict[str, float] = {}
        self.nonfinite_order: list[str] = []
        self._inside = False
        self._handles: list = []
        self._saved: list[tuple[Any, str, Any]] = []

    def _owner(self) -> str:
        for module in reversed(self.stack):
            if _is_attention(module):
                return self.names[module]
        return self.names[self.stack[-1]] if self.stack else "<outside the model>"

    def _counting(self, original: Callable, table: dict[str, int]) -> Callable:
        def wrapper(*args, **kwargs):
            if self._inside:  # F.softmax calls Tensor.softmax: count the outermost call only
                return original(*args, **kwargs)
            owner = self._owner()
            table[owner] = table.get(owner, 0) + 1
            self._inside = True
            try:
                return original(*args, **kwargs)
            finally:
                self._inside = False

        return wrapper

    def _record(self, module: torch.nn.Module, output: Any) -> None:
        name = self.names[module]
        for t in _tensors(output):
            if not t.is_floating_point() or t.numel() == 0:
                continue
            t = t.detach()
            finite = torch.isfinite(t)
            if not bool(finite.all()):
                if name not in self.nonfinite_order:
                    self.nonfinite_order.append(name)
                t = t[finite]
                if t.numel() == 0:
                    continue
            self.absmax[name] = max(self.absmax.get(name, 0.0), float(t.abs().max()))

    def __enter__(self) -> "_DryRunProbe":
        import torch.nn.functional as F

        for obj, attr, table in (
            (torch, "softmax", self.softmax_calls),
            (F, "softmax", self.softmax_calls),
            (torch.Tensor, "softmax", self.softmax_calls),
            (F, "scaled_dot_product_attention", self.sdpa_calls),
        ):
            original = getattr(obj, attr)
            self._saved.append((obj, attr, original))
            setattr(obj, attr, self._counting(original, table))

        def pre(module, args):
            self.stack.append(module)

        def post(module, args, output):
            if self.stack and self.stack[-1] is module:
                self.stack.pop()
            self._record(module, output)

        for module in self.model.modules():
            self._handles.append(module.register_forward_pre_hook(pre))
            self._handles.append(module.register_forward_hook(post))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        for obj, attr, original in reversed(self._saved):
            setattr(obj, attr, original)
        self.stack.clear()


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a module output (tensor, tuple/list, dict, dataclass-like ``BaseOutput``)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from _tensors(item)


def guess_example_inputs(model: torch.nn.Module) -> tuple | None:
    """Tiny inputs for a diffusers-style video model (``config.in_channels`` and optionally ``patch_size``):
    ``(latents [1, C, 2pt, 2ph, 2pw], timestep [1])``; ``None`` when the model does not say enough."""
    config = getattr(model, "config", None)
    channels = getattr(config, "in_channels", None) if config is not None else None
    if not isinstance(channels, int):
        return None
    patch = getattr(config, "patch_size", None) or (1, 2, 2)
    if isinstance(patch, int):
        patch = (1, patch, patch)
    try:
        param = next(model.parameters())
        device, dtype = param.device, param.dtype
    except StopIteration:
        device, dtype = torch.device("cpu"), torch.float32
    shape = (1, channels, *(2 * int(p) for p in patch))
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(shape, generator=generator).to(device, dtype)
    return latents, torch.full((1,), 500, device=device)


def audit_model(
    model: torch.nn.Module,
    example_inputs: tuple | Mapping | None = None,
    *,
    dry_run_fn: Callable[[], Any] | None = None,
    precision: str = "no",
    activation_limit: float | None = None,
) -> list[dict]:
    """One no-grad dry-run forward that finds manual-softmax attention and dangerous activation magnitudes.

    Args:
        model: the model to inspect (left as it was: hooks and patches are removed afterwards).
        example_inputs: positional args (tuple) or keyword args (mapping) for ``model(...)``; guessed for
            diffusers-style video models when neither this nor ``dry_run_fn`` is given.
        dry_run_fn: a callable running a forward of ``model`` itself (e.g. the trainer's loss on one
            micro-batch); takes precedence over ``example_inputs``.
        precision: ``"no"``, ``"bf16"`` or ``"fp16"`` (fp16 lowers the activation limit).
        activation_limit: largest acceptable |activation|; default 1e4, or 3e4 under fp16 (max 65504).

    Findings: ``model.attention`` (warn) for each attention-like module that calls softmax without
    ``F.scaled_dot_product_attention``; ``model.sdpa`` (info) summarising SDPA use; ``model.activations``
    (warn) for modules above the limit; ``model.nonfinite`` (block) naming the first module whose output
    is NaN/Inf; ``model.dry_run`` (warn) when the forward could not run (then only a source scan is done).
    """
    if activation_limit is None:
        activation_limit = ACTIVATION_LIMIT_FP16 if precision == "fp16" else ACTIVATION_LIMIT_FP32
    findings: list[dict] = []
    guessed = False
    if dry_run_fn is None and example_inputs is None:
        example_inputs = guess_example_inputs(model)
        guessed = example_inputs is not None
    if dry_run_fn is None and example_inputs is None:
        findings.append(finding(
            "model.dry_run", "warn",
            f"no dry run: give example inputs for {type(model).__name__} to check attention and activations; "
            "only the attention source scan ran",
        ))
        return findings + _static_attention_scan(model)

    probe = _DryRunProbe(model)
    try:
        with torch.no_grad(), probe:
            if dry_run_fn is not None:
                dry_run_fn()
            elif isinstance(example_inputs, Mapping):
                model(**example_inputs)
            else:
                model(*example_inputs)
    except Exception as err:  # noqa: BLE001 -- any failure of the user's forward becomes a finding
        how = "guessed inputs" if guessed else "the given inputs"
        findings.append(finding(
            "model.dry_run", "warn", f"dry-run forward with {how} failed: {type(err).__name__}: {err}; "
            "only the attention source scan ran",
        ))
        return findings + _static_attention_scan(model)

    for owner, n in sorted(probe.softmax_calls.items()):
        if probe.sdpa_calls.get(owner):
            continue
        findings.append(finding(
            "model.attention", "warn",
            f"{owner} computes softmax itself ({n} calls) instead of torch.nn.functional.scaled_dot_product_attention; "
            "SDPA is fused and numerically safer on long video token sequences (and saves memory)"
            + ("; nn.MultiheadAttention uses SDPA when called with need_weights=False" if "MultiheadAttention" in owner else ""),
            module=owner, softmax_calls=n,
        ))
    n_sdpa = sum(probe.sdpa_calls.values())
    attn_modules = [probe.names[m] for m in model.modules() if _is_attention(m)]
    findings.append(finding(
        "model.sdpa", "info",
        f"{n_sdpa} scaled_dot_product_attention calls in {len(probe.sdpa_calls)} modules; "
        f"{len(attn_modules)} attention-like modules",
        sdpa_calls=probe.sdpa_calls, softmax_calls=probe.softmax_calls,
    ))
    if probe.nonfinite_order:
        first = probe.nonfinite_order[0]
        findings.append(finding(
            "model.nonfinite", "block",
            f"the dry-run forward produces NaN/Inf; first in {first} (then {len(probe.nonfinite_order) - 1} more modules)",
            modules=probe.nonfinite_order,
        ))
    hot = {n: v for n, v in probe.absmax.items() if v > activation_limit}
    if hot:
        worst = max(hot, key=hot.get)
        findings.append(finding(
            "model.activations", "warn",
            f"{len(hot)} modules have activations above {activation_limit:g} (largest {hot[worst]:.3g} in {worst}); "
            f"fp16 overflows at 65504",
            modules=hot, limit=activation_limit, precision=precision,
        ))
    top = sorted(probe.absmax.items(), key=lambda kv: -kv[1])[:10]
    findings.append(finding(
        "model.activation_stats", "info",
        "largest activations: " + ", ".join(f"{n}={v:.3g}" for n, v in top[:5]),
        top=dict(top), guessed_inputs=guessed,
    ))
    return findings


def _static_attention_scan(model: torch.nn.Module) -> list[dict]:
    """Without a forward: attention-like module classes whose forward source calls softmax but not SDPA."""
    findings, seen = [], set()
    for name, module in model.named_modules():
        cls = type(module)
        if not _is_attention(module) or cls in seen:
            continue
        seen.add(cls)
        try:
            src = _code_only(inspect.getsource(cls.forward))
        except (OSError, TypeError):
            continue
        if "softmax" in src and "scaled_dot_product_attention" not in src:
            findings.append(finding(
                "model.attention", "warn",
                f"{cls.__name__} (e.g. {name or '<root>'}) calls softmax in its forward and not "
                "scaled_dot_product_attention (source scan; heuristic)",
                module=name, cls=cls.__name__,
            ))
    return findings
