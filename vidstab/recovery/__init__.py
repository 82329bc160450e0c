"""Recovery: the rollback policy (``policy``: retry budget, LR back-off, data skip), the attached form's own rollback
checkpoints, the in-job rerun of a suspicious step, the LR multiplier, out-of-memory handling, the quarantine of bad
samples and the script's own state kept beside the rollback checkpoints."""
