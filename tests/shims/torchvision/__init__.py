"""A stand-in for the part of torchvision that diffusers' ``train_unconditional.py`` imports (``transforms``),
used by tests/test_diffusers_example.py only when torchvision is not installed.

Why: torchvision is no dependency of vidstab, and an unpinned ``pip install torchvision`` on a machine with
torch 2.13 resolves to a torchvision that pulls a different torch. The script under test is diffusers'
own; these few image transforms are plain PIL/tensor operations with torchvision's semantics.
"""
