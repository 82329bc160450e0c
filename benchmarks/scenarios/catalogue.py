"""The scenario catalogue: which faults, at which step, on which seeds.

Every scenario runs the same tiny reference DiT on the same built-in latent set (see ``recorder.py``);
only the fault differs. A scenario is fully determined by its fields and a seed, so a recording can be
cached and re-read, and every detector (vidstab's and the baselines) is judged on identical runs.

Faults use the trainer's own grammar (``KIND@STEP[=ARG]``, :mod:`vidstab.faults`), so the same
scenario can be replayed end-to-end with ``recipes/train.py --inject_fault``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

#: Step at which the fault fires: after the LR warm-up (20 steps) and after every vidstab detector and
#: baseline has warmed up (the longest warm-up is Megatron's 100 samples), when the healthy loss has
#: settled (~0.1-0.2 on this model).
FAULT_STEP = 300

#: Seeds of the fault scenarios (each scenario is run once per seed).
FAULT_SEEDS = (0, 1, 2)

#: Seeds and length of the healthy runs. 20 x 1000 = 20,000 healthy steps, so a rate of 1 false alarm
#: per 10,000 steps is measurable (it is 2 alarms in total).
HEALTHY_SEEDS = tuple(range(20))
HEALTHY_STEPS = 1000


@dataclass(frozen=True)
class Scenario:
    """One reproducible training scenario of the tiny reference DiT."""

    name: str
    """Short identifier used in tables and cache file names."""
    description: str
    """One line for the tables: what goes wrong."""
    faults: tuple[str, ...] = ()
    """``--inject_fault`` specs (``KIND@STEP[:RANK][=ARG]``); empty for healthy runs."""
    init_scale: float = 1.0
    """Multiply every parameter by this right after initialisation (1.0: the model's own init)."""
    onset: int = 0
    """First step at which the fault can show (alarms before it are false alarms of a healthy prefix)."""
    steps: int = FAULT_STEP + 200
    """Steps recorded at most (recording stops earlier, ``tail`` steps after the failure point)."""
    seeds: tuple[int, ...] = FAULT_SEEDS
    """Seeds the scenario is run with."""
    tail: int = 50
    """Steps still recorded after the failure point (late alarms count as detected with negative lead)."""
    healthy: bool = False
    """A healthy run: used for false alarms and as the healthy loss level of its seed."""
    cuda_only: bool = False
    """Needs CUDA (fp16 overflow); skipped with a printed note on CPU-only machines."""
    prediction_type: str = "epsilon"
    """Diffusion objective of the run (the healthy reference of a seed uses the same one)."""
    train_args: tuple[str, ...] = field(default=())
    """Extra ``recipes/train.py`` flags for the end-to-end run of this scenario."""

    def variant(self, prediction_type: str, steps: int) -> "Scenario":
        """This (healthy) scenario with another objective and length, named apart in tables and caches."""
        name = self.name if prediction_type == "epsilon" else f"{self.name}_{prediction_type}"
        return replace(self, name=name, prediction_type=prediction_type, steps=steps)

    @property
    def divergent_expected(self) -> bool:
        """Whether the scenario is meant to make the run fail (the recording decides: see ``failure_step``)."""
        return not self.healthy


HEALTHY = Scenario(
    name="healthy", description="no fault", healthy=True, steps=HEALTHY_STEPS, seeds=HEALTHY_SEEDS, tail=0,
)

SCENARIOS: tuple[Scenario, ...] = (
    Scenario("lr_spike_x1000", f"LR x1000 from step {FAULT_STEP} (bad schedule/config)",
             faults=(f"lr_spike@{FAULT_STEP}=1000",), onset=FAULT_STEP),
    Scenario("lr_spike_x100", f"LR x100 from step {FAULT_STEP}",
             faults=(f"lr_spike@{FAULT_STEP}=100",), onset=FAULT_STEP),
    Scenario("lr_ramp_x1.3", f"LR x1.3 per step from step {FAULT_STEP} (exponential grad-norm growth)",
             faults=(f"lr_ramp@{FAULT_STEP}=1.3",), onset=FAULT_STEP),
    Scenario("lr_ramp_x1.1", f"LR x1.1 per step from step {FAULT_STEP} (slow drift to divergence)",
             faults=(f"lr_ramp@{FAULT_STEP}=1.1",), onset=FAULT_STEP),
    Scenario("lr_ramp_x1.05", f"LR x1.05 per step from step {FAULT_STEP} (a slow ramp: warnings long before damage)",
             faults=(f"lr_ramp@{FAULT_STEP}=1.05",), onset=FAULT_STEP),
    Scenario("nan_batch", f"NaN latents in the batch of step {FAULT_STEP} (poisoned sample)",
             faults=(f"nan_batch@{FAULT_STEP}",), onset=FAULT_STEP),
    Scenario("inf_latent", f"one +inf latent value at step {FAULT_STEP}",
             faults=(f"inf_latent@{FAULT_STEP}",), onset=FAULT_STEP),
    Scenario("big_latent", f"one sample's latents x1e4 at step {FAULT_STEP} (finite, unclamped VAE output)",
             faults=(f"big_latent@{FAULT_STEP}=1e4",), onset=FAULT_STEP),
    # The same poisoned sample under flow matching, whose target (noise - latents) carries the 1e4 scale
    # into the loss; under epsilon prediction the DiT's LayerNorms absorb it (see RESULTS.md).
    Scenario("big_latent_flow", f"one sample's latents x1e4 at step {FAULT_STEP}, flow-matching objective",
             faults=(f"big_latent@{FAULT_STEP}=1e4",), onset=FAULT_STEP, prediction_type="flow_matching",
             train_args=("--prediction_type", "flow_matching")),
    Scenario("const_batch", f"constant frames (first frame repeated) at step {FAULT_STEP}",
             faults=(f"const_batch@{FAULT_STEP}",), onset=FAULT_STEP),
    Scenario("overscaled_init_x30", "every weight x30 at initialisation",
             init_scale=30.0, onset=0, steps=HEALTHY_STEPS),
    Scenario("fp16_overflow", "fp16 autocast with a x1e4 latent (GradScaler overflow)", cuda_only=True,
             faults=(f"big_latent@{FAULT_STEP}=1e4",), onset=FAULT_STEP, train_args=("--mixed_precision", "fp16")),
)

#: A subset that runs in seconds (``--quick``): one seed each of a data fault, an LR spike and an LR
#: ramp, and two healthy runs.
QUICK_SCENARIOS = ("nan_batch", "lr_spike_x1000", "lr_ramp_x1.3")
QUICK_SEEDS = (0,)
QUICK_HEALTHY_SEEDS = (0,)  # 1000 healthy steps: the smoke test's floor
QUICK_HEALTHY_STEPS = HEALTHY_STEPS  # the same recordings as a full run (shared cache)


#: The small-batch UNet on the tuning split: ``heldout.py``'s ``unet_eps_small_batch`` (a diffusers
#: ``UNet2DModel``, batches of 2, heavy-tailed gradient norms), healthy, on the held-out split's two small-batch
#: schedules, with tuning seeds. Where the small-batch behaviour of the defaults is chosen (RESULTS.md,
#: "Small-batch UNet on the tuning split"); the held-out draws keep seeds >= 100.
SMALL_BATCH_SEEDS = (0, 1)


def small_batch_runs(seeds: tuple[int, ...] = SMALL_BATCH_SEEDS) -> list:
    """The tuning split's small-batch UNet runs (``heldout.HeldoutRun``: recorded with the held-out recorder,
    which keeps the input RMS the tuning recordings lack), ``SMALL_BATCH_STEPS`` healthy steps each."""
    from . import heldout as H

    return H.healthy_runs((H.SMALL_BATCH_FAMILY,), H.SMALL_BATCH_SCHEDULES, seeds, H.SMALL_BATCH_STEPS)


#: Attention-logit growth on the tuning split: ``heldout.py``'s plain-softmax transformer without QK-norm
#: (``plain_tf_flow``) with its query/key weights x1.1 per step (logits x1.21, draw C's rate: the logits
#: overflow fp32 ~330 steps after the onset), on tuning seeds, at onsets and schedules of its own (the
#: held-out draws use onsets 120 / 180 / 250). Tuning data: where the logit-growth behaviour of the
#: defaults is chosen (RESULTS.md, "Logit growth on the tuning split"); no held-out draw is looked at for it.
LOGIT_GROWTH_SEEDS = (0, 1, 2, 3)
LOGIT_GROWTH_ONSETS = (90, 150, 220)
LOGIT_GROWTH_SCHEDULES = ("cosine_warmup", "step_decay", "batch_change")


def logit_growth_runs(seeds: tuple[int, ...] = LOGIT_GROWTH_SEEDS) -> list:
    """The tuning split's logit-growth runs (``heldout.HeldoutRun``, recorded with the held-out recorder):
    every seed x onset, the schedule rotating with the onset; each run's healthy twin (same family, schedule,
    seed and length) is recorded with it and counts as tuning healthy steps."""
    from . import heldout as H

    arg, steps = H.QK_GROWTH_C
    return [H.HeldoutRun("plain_tf_flow", sched, seed, f"qk_growth@{onset}={arg}", steps=steps)
            for seed in seeds for onset, sched in zip(LOGIT_GROWTH_ONSETS, LOGIT_GROWTH_SCHEDULES)]


#: Input drift on the tuning split: ``heldout.py``'s ``input_drift`` fault (every input x(1 + RATE) per step from
#: the onset: a drifting VAE or data pipeline) on the three batch-4 held-out families, on tuning seeds, at onsets
#: of its own (the held-out draws use onsets 120 / 180 / 250 and only the rate 0.01) and at half, once and twice
#: the draws' rate, the schedule rotating over every held-out schedule. Tuning data: where the input-drift
#: behaviour of the defaults is chosen (RESULTS.md, "Input drift on the tuning split"); no held-out draw is
#: looked at for it.
INPUT_DRIFT_SEEDS = (0, 1, 2, 3)
INPUT_DRIFT_ONSETS = (90, 160, 230)
INPUT_DRIFT_RATES = ("0.005", "0.01", "0.02")


def input_drift_runs(seeds: tuple[int, ...] = INPUT_DRIFT_SEEDS) -> list:
    """The tuning split's input-drift runs (``heldout.HeldoutRun``, recorded with the held-out recorder, 400
    steps): every family x seed x onset x rate; each run's healthy twin (same family, schedule, seed and length)
    is recorded with it and counts as tuning healthy steps."""
    from . import heldout as H

    combos = [(onset, rate) for onset in INPUT_DRIFT_ONSETS for rate in INPUT_DRIFT_RATES]
    return [H.HeldoutRun(fam, H.SCHEDULES[(j + seed) % len(H.SCHEDULES)], seed, f"input_drift@{onset}={rate}")
            for fam in H.FAMILIES for seed in seeds for j, (onset, rate) in enumerate(combos)]


#: Healthy runs of the held-out split's three batch-4 families on tuning seeds (every schedule, 400 steps):
#: tuning data on which a default that acts on those families is checked for false alarms (the DiT
#: catalogue above is one model and one schedule); the held-out draws keep seeds >= 100.
FAMILY_HEALTHY_SEEDS = (0, 1)


def family_healthy_runs(seeds: tuple[int, ...] = FAMILY_HEALTHY_SEEDS) -> list:
    """``heldout.healthy_runs`` of the three batch-4 families, every held-out schedule, on tuning seeds."""
    from . import heldout as H

    return H.healthy_runs(H.FAMILIES, H.SCHEDULES, seeds)


def get(name: str) -> Scenario:
    """The scenario called ``name`` (``"healthy"`` included)."""
    for s in (HEALTHY, *SCENARIOS):
        if s.name == name:
            return s
    raise KeyError(f"no scenario {name!r}; known: {', '.join(s.name for s in (HEALTHY, *SCENARIOS))}")
