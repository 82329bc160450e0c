"""The reference video DiT trainer's building blocks: model, data, VAE and objective.

Nothing in the core ``vidstab`` package imports this sub-package; the trainer in
``recipes/train.py``, the tests and ``scripts/replay.py`` do. It needs the ``[reference]`` extra.
"""
import importlib.util

# The packages of the [reference] extra this package needs at import; av and datasets are imported where used.
_MISSING = [name for name in ("diffusers", "einops", "datasets", "av") if importlib.util.find_spec(name) is None]
if _MISSING:
    raise ImportError(f"vidstab.reference needs the [reference] extra, which is not installed (missing: "
                      f"{', '.join(_MISSING)}): pip install -e \".[reference]\" in your vidstab clone (the distribution "
                      f"vidstab-train; PyPI's 'vidstab' is another package)")

from vidstab.reference.model import VideoDiT  # noqa: E402,F401
