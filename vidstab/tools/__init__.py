"""The tools layer: ``vidstab audit``, ``replay``, ``report`` and the command line that runs them.

Tools read what the core plugin writes (event logs, incident bundles, checkpoints) and may use heavier
dependencies (matplotlib for the report). The core (guard, signals, detectors, events, capture, checkpoint,
recovery) never imports this package; see docs/ARCHITECTURE.md, "Packages".
"""
