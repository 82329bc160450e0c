"""vidstab: training-stability tooling for latent video diffusion on Hugging Face Accelerate.

Detect trouble before it happens, capture it precisely when it does, recover on its own.
The core package never imports :mod:`vidstab.reference` (the reference trainer's model and data).
"""

__version__ = "0.1.0"
