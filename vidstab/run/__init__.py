"""The run's life: the hang watchdog, torch-elastic restarts, preemption, the run folder and what the run ran with, the
exit fence, host memory, the goodput ledger, the checkpoint interval it calls for, and the resume-fidelity check."""
