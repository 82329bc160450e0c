"""The one import-path resolver of the tools: imports only code the user trusts.

An incident bundle or a checkpoint travels ("replay it on a laptop"), so what it names is data from a
stranger, not an instruction. Importing a module runs its code, and calling a factory runs it too; a bundle
naming ``os:system`` as its model factory would otherwise run a shell command. So, in the spirit of
``transformers``' ``trust_remote_code``, a name is imported only when it is

- **vidstab's own**: a ``torch.nn.Module`` subclass under ``vidstab.`` or a diffusers model class (``class``
  specs: only ``from_config`` is called, or for a recorded LoRA fine-tune ``from_pretrained`` on safetensors
  files and ``add_adapter``: :mod:`vidstab.tools.replay.adapters`), or one of the replay entry points in
  :data:`BUILTIN_CALLABLES`;
- **named by the user**: on the command line (``vidstab audit --model mod:fn``), or allowed explicitly
  (``vidstab replay --trust MODULE``, ``replay(..., trust=["MODULE"])``): a module name trusts that module
  and its submodules, ``module:attr`` that one object.

Anything else is refused with :class:`UntrustedImportError` *before* anything is imported; the message says
what is named and how to allow it. The current folder and a bundle's folder are never put on ``sys.path``:
a trusted module of your own must be importable (installed, or its folder on ``PYTHONPATH``).
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import importlib
import importlib.util
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["BUILTIN_CALLABLES", "UntrustedImportError", "ImportPathError", "parse_import_path", "resolve",
           "trusted", "current_trust"]

#: Functions of vidstab that a bundle may name as a model factory or loss function: each only builds a
#: model or computes a loss from its arguments.
BUILTIN_CALLABLES = frozenset({
    "vidstab.reference.objective:replay_loss",
    "vidstab.faults:model_with_module_fault",
    "vidstab.tools.replay.output_grad:output_grad_loss",
})
#: Packages whose ``torch.nn.Module`` classes a ``class`` spec may name (rebuilt with ``from_config``, or
#: ``from_pretrained`` on safetensors files plus LoRA adapters for a recorded fine-tune).
MODEL_CLASS_PACKAGES = ("vidstab", "diffusers")

# Names the user allowed for the replay now running (nested specs, e.g. a fault factory wrapping a model
# spec, are resolved under the same trust).
_TRUST: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("vidstab_trust", default=frozenset())


class ImportPathError(ValueError):
    """An import path is malformed, or names a module or attribute that does not exist."""


class UntrustedImportError(ImportPathError):
    """An import path names code the user has not trusted; nothing was imported."""


def parse_import_path(path: Any, what: str) -> tuple[str, str]:
    """``"package.module:attr"`` (or ``"package.module.attr"``) -> ``(module, attr)``; ``what`` names it in errors."""
    if not isinstance(path, str) or not path.strip():
        raise ImportPathError(f"{what} must be an import path 'module:name', got {path!r}")
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    if not module or not attr or not all(p.isidentifier() for p in module.split(".") + attr.split(".")):
        raise ImportPathError(f"{what} {path!r} is not an import path of the form 'module:name'")
    return module, attr


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _allowed_by(module: str, attr: str, trust: Iterable[str]) -> bool:
    for entry in trust:
        if ":" in entry:
            if entry == f"{module}:{attr}":
                return True
        elif _under(module, entry):
            return True
    return False


def _top_level_names(tree: ast.Module) -> dict[str, str]:
    """Names a module's source binds at its top level: ``{name: "class" | "import" | "other"}``."""
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = "class"
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.setdefault((alias.asname or alias.name).split(".")[0], "import")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.setdefault(node.name, "other")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    names.setdefault(target.id, "other")
    return names


def _check_class_source(module: str, attr: str, what: str, refuse: Any) -> None:
    """Before a package's module is imported for a model class named by a file: the module must be a plain
    source module (never a ``__main__``, which runs a program) whose source, read without running it,
    defines ``attr`` as a class or imports it (a re-export). A package's root (``diffusers``, ``vidstab``)
    is imported anyway; its lazily exported classes are checked after the import."""
    if "__main__" in module.split(".") or attr.split(".")[0].startswith("__"):
        refuse(f"{module} is a program's entry point (importing it runs it), not a module of model classes")
    if module in MODEL_CLASS_PACKAGES:
        return
    try:
        spec = importlib.util.find_spec(module)  # imports the parent packages only, never `module` itself
    except (ImportError, ValueError) as err:
        raise ImportPathError(f"cannot find module {module!r} named by {what}: {err}") from err
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        if spec is None:
            raise ImportPathError(f"cannot import module {module!r} named by {what}: no such module")
        refuse(f"{module} is not a Python source module ({spec.origin}); its content cannot be checked before it runs")
    try:
        with open(spec.origin, "rb") as fh:
            tree = ast.parse(fh.read(), filename=spec.origin)
    except (OSError, SyntaxError, ValueError) as err:
        refuse(f"{module}'s source cannot be read to check it ({err})")
    kind = _top_level_names(tree).get(attr.split(".")[0])
    if kind not in ("class", "import"):
        refuse(f"{module} defines no class {attr.split('.')[0]!r} (checked in its source, {spec.origin}, "
               "without importing it)")


@contextlib.contextmanager
def trusted(names: Iterable[str]) -> Iterator[frozenset[str]]:
    """Within the block, :func:`resolve` also accepts ``names`` (modules or ``module:attr``)."""
    token = _TRUST.set(_TRUST.get() | frozenset(str(n) for n in names))
    try:
        yield _TRUST.get()
    finally:
        _TRUST.reset(token)


def current_trust() -> frozenset[str]:
    """The names allowed by the enclosing :func:`trusted` blocks."""
    return _TRUST.get()


def resolve(path: str, what: str, *, kind: str = "callable", trust: Iterable[str] = (),
            how_to_allow: str = "vidstab replay --trust {module}") -> Any:
    """Import the object ``path`` names, if it is trusted (see the module docstring); else refuse.

    Args:
        path: ``"module:attr"``.
        what: what names it, for messages (``"model.factory"``, ``"loss.fn"``, ``"--model"``).
        kind: ``"model_class"`` (a ``torch.nn.Module`` class; vidstab's and diffusers' are trusted) or
            ``"callable"`` (a factory or loss function; only :data:`BUILTIN_CALLABLES` are trusted).
        trust: further allowed names (what the user named on the command line), added to :func:`trusted`'s.
        how_to_allow: the hint in the refusal, ``{module}`` and ``{path}`` filled in.

    Raises:
        UntrustedImportError: not trusted (nothing was imported).
        ImportPathError: malformed, or the module/attribute does not exist.
    """
    module, attr = parse_import_path(path, what)
    allowed = _allowed_by(module, attr, current_trust() | frozenset(trust))
    builtin_class = kind == "model_class" and any(_under(module, p) for p in MODEL_CLASS_PACKAGES)
    if not (allowed or builtin_class or f"{module}:{attr}" in BUILTIN_CALLABLES):
        raise UntrustedImportError(
            f"{what} names {module}:{attr}, which is not vidstab's own code; importing it would run it. "
            f"If you trust it, allow it with: {how_to_allow.format(module=module, path=f'{module}:{attr}')}"
        )
    if builtin_class and not allowed:
        def refuse(why: str) -> None:
            raise UntrustedImportError(
                f"{what} names {module}:{attr}: {why}. Nothing was imported. Only model classes of "
                f"{' and '.join(MODEL_CLASS_PACKAGES)} are trusted without asking; if you trust it, allow it with: "
                f"{how_to_allow.format(module=module, path=f'{module}:{attr}')}")

        _check_class_source(module, attr, what, refuse)
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as err:
        missing = getattr(err, "name", None)
        inner = f" (while importing it, module {missing!r} was not found)" if missing and missing != module else ""
        raise ImportPathError(
            f"cannot import module {module!r} named by {what} {path!r}{inner}: {err}. The current folder is "
            f"never searched: install the module or put its folder on PYTHONPATH."
        ) from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImportPathError(f"module {module!r} has no attribute {attr!r} (named by {what} {path!r})")
        obj = getattr(obj, part)
    if builtin_class and not allowed:
        import torch

        # Trusted for its package only as a model class: anything else there (a function) stays refused.
        if not (isinstance(obj, type) and issubclass(obj, torch.nn.Module)):
            raise UntrustedImportError(
                f"{what} names {module}:{attr}, which is not a torch.nn.Module class; only model classes of "
                f"{' and '.join(MODEL_CLASS_PACKAGES)} are trusted without asking. If you trust it, allow it with: "
                f"{how_to_allow.format(module=module, path=f'{module}:{attr}')}"
            )
    return obj
