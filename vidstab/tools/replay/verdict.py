"""The one-paragraph verdict of a replay report."""

from __future__ import annotations

from .report import ReplayReport


def _mod(name: str | None) -> str:
    """A module's qualified name for humans; ``""`` is the model's own forward (code between submodules)."""
    if name is None:
        return "no module"
    return f"module {name!r}" if name else "the model's own forward (root module, code between its submodules)"


def _verdict(rep: ReplayReport) -> str:
    parts = []
    if rep.reproduced is True:
        parts.append(f"Reproduces ({rep.reproduction}).")
    elif rep.reproduced is False:
        parts.append(f"Does not reproduce ({rep.reproduction}).")
    else:
        parts.append(f"Reproduction cannot be judged ({rep.reproduction}).")
    if not rep.deterministic:
        parts.append("Two identical replays differed bitwise: suspect non-determinism or faulty hardware before "
                     "data or model.")
    sections = (("Data", rep.data), ("Precision", rep.precision), ("LR", rep.lr), ("Structure", rep.structure))
    implicated = [name for name, s in sections if s.get("implicated")]
    for name, s in sections:
        if s.get("implicated"):
            parts.append(f"{name}: {s.get('summary')}.")
    if rep.reproduced is False and not implicated:
        parts.append("Nothing in this bundle explains the incident on these weights; see the notes "
                     "(checkpoint age, other micro-batches/ranks).")
    elif implicated:
        first = implicated[0]
        fix = {"Data": "Fix the data (drop or re-encode the named samples)",
               "Precision": "Keep the failing op in fp32 or use bf16 instead of fp16",
               "LR": ("Find what set that learning rate (code writing optimizer.param_groups[...]['lr'], the "
                      "scheduler's configuration): the schedule never gives it" if rep.lr.get("outlier")
                      else "Lower the learning rate or lengthen warm-up"),
               "Structure": f"Look at {_mod(rep.structure.get('module'))}"}[first]
        rest = [n if n == "LR" else n.lower() for n, _ in sections if n not in implicated]
        listed = rest[0] if len(rest) == 1 else ", ".join(rest[:-1]) + " and " + rest[-1] if rest else ""
        parts.append(f"{fix}" + (f"; {listed} {'is' if len(rest) == 1 else 'are'} not implicated." if rest else "."))
    else:
        parts.append("Data, precision, LR and structure are not implicated by this replay.")
    if any("fresh initialisation" in n for n in rep.notes):
        parts.append("(Replayed on a fresh initialisation: less meaningful.)")
    return " ".join(parts)
