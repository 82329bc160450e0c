"""The reference video DiT trainer's building blocks: model, data, VAE and objective.

Nothing in the core ``vidstab`` package imports this sub-package; the trainer in
``recipes/train.py``, the tests and ``scripts/replay.py`` do.
"""
from vidstab.reference.model import VideoDiT  # noqa: E402,F401
