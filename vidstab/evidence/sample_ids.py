"""Sample ids for a data set that has none: its indices, so an incident bundle can name the bad sample.

``guard.backward(..., sample_ids=...)`` puts the ids into incident bundles, and ``vidstab replay``'s
leave-one-out names the culprit by them. Most data sets carry no ids; a map-style data set's index is one
(with a seeded sampler it is also where the sample sits in the data). Without ids a bundle names samples by
position in the micro-batch (``#0``, ``#1``, ...) of its step and rank.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["WithSampleIds"]


class WithSampleIds(torch.utils.data.Dataset):
    """Wrap a map-style data set (``len`` + ``[i]``; a torch or Hugging Face ``datasets`` one) so that each
    item carries its index: a dict item gets ``key`` (default ``"sample_ids"``, collated into a tensor of
    ids), a tuple or list item gets the index appended, anything else becomes ``(item, index)``.

    Example::

        loader = DataLoader(vidstab.WithSampleIds(dataset), batch_size=4, shuffle=True)
        ...
        guard.backward(loss, batch=batch, sample_ids=batch["sample_ids"])
    """

    def __init__(self, dataset: Any, key: str = "sample_ids") -> None:
        self.dataset, self.key = dataset, key

    def __len__(self) -> int:
        return len(self.dataset)

    def sample_id(self, index: int) -> int:
        """The id of item ``index`` (its index), without loading it (:class:`vidstab.QuarantinedDataset`)."""
        return index

    def __getitem__(self, index: int) -> Any:
        item = self.dataset[index]
        if isinstance(item, dict):
            if self.key in item:
                raise KeyError(f"WithSampleIds: item {index} already has a {self.key!r} field; pass key=... to choose another")
            return {**item, self.key: index}
        if isinstance(item, (tuple, list)):
            return (*item, index)
        return item, index
