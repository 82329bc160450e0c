"""The attached form's data: ``loader = guard.track_samples(loader)`` names each micro-batch's samples and skips
quarantined ones.

An unmodified loop hands the guard its model's inputs, never the data set's items, so an incident bundle names
samples by position (``#0``) and nothing can be quarantined. This one line gives the guard what it lacks, without
changing a batch the loop sees:

* the loader's map-style data set becomes a :class:`vidstab.QuarantinedDataset` on the run folder, so a sample
  quarantined (by an incident bundle or the in-job rerun) is not seen again in later epochs nor after a resume;
* the loader's batch sampler records, in the main process, the sample ids of each batch it draws (before any
  worker loads it: the data set's ``sample_id(index)``, else the index, of the sample it will serve), and each
  batch the loop receives takes the next recorded ids. Batches come back in the order they were drawn
  (``in_order``). A batch a worker prefetched just before one of its samples was quarantined can still bring
  that sample once, under the substitute's id.

Refused with a message: an iterable data set (no indices), a loader that dispatches batches from rank 0, a loader
that may reorder batches. A worker killed by a signal (the kernel's OOM killer) is logged as a
``dataloader_worker_killed`` event with the memory history (:mod:`vidstab.run.host_memory`). A loader rebuilt from this one (``accelerator.skip_first_batches``) is not tracked:
skip batches by iterating (``continue``), as diffusers' scripts do.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Iterator

import torch

from ..run.host_memory import ChildrenMemory, record_worker_killed
from ..recovery.quarantine import QuarantinedDataset

if TYPE_CHECKING:
    from .core import Guard


def _recording(cls: type) -> type:
    """``cls`` (the loader's own batch sampler's class) whose ``__iter__`` also hands each drawn batch's sample ids
    to ``_vidstab_drawn``, named when drawn as the data set will serve them (a quarantined sample's substitute)."""

    def __iter__(self: Any) -> Iterator[Any]:
        for indices in cls.__iter__(self):
            self._vidstab_drawn.append([self._vidstab_name(i) for i in indices])
            yield indices

    return type(f"Recording{cls.__name__}", (cls,), {"__iter__": __iter__, "_vidstab_recording": True})


class TrackedLoader:
    """The loader, iterated as before; its batches' sample ids go to the guard (module docstring)."""

    def __init__(self, loader: Any, guard: "Guard") -> None:
        self.loader, self.guard = loader, guard
        base = getattr(loader, "base_dataloader", loader)  # Accelerate's prepared loader wraps a DataLoader
        dataset = getattr(base, "dataset", None)
        why = None
        if type(loader).__name__ == "DataLoaderDispatcher":
            why = "it dispatches batches from rank 0 (Accelerator(dispatch_batches=True)): prepare it with dispatch_batches=False"
        elif dataset is None or isinstance(dataset, torch.utils.data.IterableDataset):
            why = "its data set is not map-style (len + [i]): no index names a sample"
        elif getattr(base, "batch_sampler", None) is None:
            why = "it has no batch sampler (batch_size=None)"
        elif not getattr(base, "in_order", True):
            why = "it may return batches out of order (in_order=False)"
        if why is not None:
            raise ValueError(f"guard.track_samples(loader): cannot name the samples of this loader: {why}. Without "
                             "it, bundles name samples by position and nothing is quarantined")
        if not isinstance(dataset, QuarantinedDataset):
            dataset = QuarantinedDataset(dataset, guard.run_dir)
            object.__setattr__(base, "dataset", dataset)  # DataLoader refuses a new data set once built
        self.dataset = dataset
        sampler = base.batch_sampler
        sampler._vidstab_name = self.sample_id
        if not getattr(sampler, "_vidstab_recording", False):
            sampler._vidstab_drawn = deque()
            sampler.__class__ = _recording(type(sampler))  # still the user's class for isinstance and accelerate
        self.drawn: deque = sampler._vidstab_drawn
        self.workers = ChildrenMemory()
        """The workers' resident memory, read every few batches (:mod:`vidstab.run.host_memory`)."""

    def __iter__(self) -> Iterator[Any]:
        self.drawn.clear()  # what an earlier epoch drew and the loop never took
        patches = self.guard.patches
        batches = iter(self.loader)
        self.workers.new_epoch()
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                break
            except RuntimeError as exc:  # a worker killed by a signal: recorded with the memory history
                g = self.guard
                error = record_worker_killed(exc, g.events, g.step_count, g.rank, g.reporter.host_memory,
                                             self.workers.history)
                if error is None:
                    raise
                raise error from exc
            self.workers.sample()
            patches.sample_ids = self.drawn.popleft() if self.drawn else None
            yield batch
        patches.sample_ids = None

    def sample_id(self, index: int) -> str:
        """The id of the sample served at ``index`` (a quarantined one's substitute)."""
        return str(self.dataset.sample_id(self.dataset.resolve(index)))

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # set_epoch, batch_size, dataset ...: the loader's own
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)
