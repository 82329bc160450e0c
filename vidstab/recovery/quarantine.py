"""Quarantine: samples named as bad are kept out of the rest of the run, across epochs and resumes.

A sample named bad by an incident bundle (non-finite or outlier inputs: :func:`vidstab.evidence.capture.sample_report`),
by the in-job rerun (:mod:`vidstab.recovery.rerun`, a reproducible data fault) or by a user goes into the run's
quarantine list, ``RUN_DIR/vidstab/quarantine.jsonl``: one JSON line per sample (``sample_id, reason, step,
bundle, rank, source, time``). Any rank appends whole lines in one ``write`` to a file opened with
``O_APPEND`` (atomic for lines this short), so ranks never lock each other out; the list survives restarts
because it lives in the run folder, not in a checkpoint (loading an older checkpoint must not bring a bad
sample back).

:class:`QuarantinedDataset` wraps a map-style data set for the reference trainer and users' loops: an index
whose sample is quarantined yields the next clean sample instead (its own id with it), so the number of
batches per epoch, every rank's share and the data position a checkpoint records stay what they were: a
resume lands where it should, and no rank runs out of batches before the others. The list is re-read when
the file changed (one ``stat`` per item), so a sample quarantined in epoch 1 is not seen in epoch 2 (a batch a
``DataLoader`` worker prefetched before the sample was named can still bring it once).

``vidstab quarantine RUN_DIR`` lists it, ``--clear`` (all, or ``--sample ID``) releases samples; the report
shows it.

The list is read one bounded line at a time (:mod:`vidstab.files.limits`): a file larger than
``VIDSTAB_MAX_QUARANTINE_BYTES``, a line longer than ``VIDSTAB_MAX_EVENT_LINE_BYTES`` or nested deeper than
``VIDSTAB_MAX_JSON_DEPTH``, or a FIFO or device in its place is refused with :class:`QuarantineError` naming
it (a resume stops there: which samples to keep out cannot be known); a line that is not JSON (cut by a kill)
is skipped.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from ..files.atomic import write_atomic
from ..events import ends_torn
from ..files.limits import TooLarge, bounded_lines, env_name, limits, loads_bounded, not_a_regular_file, read_json_file
from ..run.run_dir import RunDirError
from ..files.strict_json import to_json_safe

__all__ = ["QUARANTINE_FILE", "QuarantineError", "QuarantineList", "QuarantinedDataset", "quarantine_bundle",
           "quarantine_bundle_dir"]

QUARANTINE_FILE = os.path.join("vidstab", "quarantine.jsonl")
MAX_LINE = 4000  # below PIPE_BUF: one O_APPEND write of a line is never interleaved with another rank's


class QuarantineError(RunDirError, ValueError):
    """The run's quarantine list cannot be read within bounds (the message names the file and what to do)."""


class QuarantineList:
    """The run's quarantine list (``RUN_DIR/vidstab/quarantine.jsonl``): add, read, release."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / QUARANTINE_FILE

    # ------------------------------------------------------------------ writing (any rank)
    def add(self, sample_ids: Iterable[Any], reason: str, *, step: int | None = None, bundle: str | None = None,
            rank: int | None = None, source: str = "user") -> list[str]:
        """Quarantine ``sample_ids`` (strings of them: ids are compared as text); returns those newly added."""
        known = self.ids()
        new = [str(s) for s in dict.fromkeys(str(s) for s in sample_ids) if str(s) not in known]
        if not new:
            return []
        lines = []
        for sid in new:
            rec = {"sample_id": sid, "reason": str(reason)[:1000], "step": step, "bundle": bundle, "rank": rank,
                   "source": source, "time": time.time()}
            line = json.dumps(to_json_safe(rec), allow_nan=False, separators=(",", ":"))
            if len(line) > MAX_LINE:
                rec["reason"] = rec["reason"][:200]
                line = json.dumps(to_json_safe(rec), allow_nan=False, separators=(",", ":"))
            lines.append(line + "\n")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if ends_torn(self.path):  # a kill cut the last line: the first new one must not be glued to it
            lines[0] = "\n" + lines[0]
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            for line in lines:  # one write per line: never torn, never interleaved
                os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return new

    # ------------------------------------------------------------------ reading
    def _records(self, notes: list[str] | None = None) -> Iterator[dict]:
        """Every record of the file in order, read one bounded line at a time (module doc); raises
        :class:`QuarantineError` for a file or line beyond the bounds. Lines that are not JSON are skipped
        (noted in ``notes``)."""
        why = not_a_regular_file(self.path)
        if why is not None and why.startswith("missing") and not self.path.is_symlink():
            return
        fix = (f"fix or remove it, or move {self.path} aside to go on with an empty quarantine list (the samples "
               "it named may then be trained on again)")
        if why is not None:
            raise QuarantineError(f"quarantine list {self.path} is {why}, not a regular file; refused unread: {fix}")
        lim = limits()
        size = os.path.getsize(self.path)
        if size > lim.quarantine_bytes:
            raise QuarantineError(f"quarantine list {self.path}: {size} bytes, more than the {lim.quarantine_bytes} "
                                  f"allowed ({env_name('quarantine_bytes')}); refused unread: raise the bound if the "
                                  f"list is really that long, or {fix}")
        with open(self.path, "rb") as fh:
            for number, (line, _) in enumerate(bounded_lines(fh, lim.event_line_bytes), start=1):
                what = f"quarantine list {self.path} line {number}"
                if line is None:
                    raise QuarantineError(f"{what}: longer than {lim.event_line_bytes} bytes "
                                          f"({env_name('event_line_bytes')}); refused: {fix}")
                if not line.strip():
                    continue
                try:
                    rec = loads_bounded(line, what, lim.event_line_bytes, lim.json_depth)  # bytes: UTF-8 or junk
                except TooLarge as e:
                    raise QuarantineError(f"{e}: {fix}") from None
                except ValueError:
                    if notes is not None:
                        notes.append(f"{what}: not JSON (cut by a kill?); skipped")
                    continue
                if isinstance(rec, dict) and "sample_id" in rec:
                    yield rec

    def iter_entries(self, notes: list[str] | None = None) -> Iterator[dict]:
        """The quarantined samples' records as they are read, first entry per id (only the ids are held)."""
        seen: set[str] = set()
        for rec in self._records(notes):
            sid = rec["sample_id"] = str(rec["sample_id"])
            if sid not in seen:
                seen.add(sid)
                yield rec

    def entries(self, notes: list[str] | None = None) -> list[dict]:
        """Every quarantined sample's record, first entry per id, in the order they were added."""
        return list(self.iter_entries(notes))

    def ids(self) -> set[str]:
        """The quarantined sample ids."""
        return {str(rec["sample_id"]) for rec in self._records()}

    def signature(self) -> tuple | None:
        """What changes whenever the list does (inode, size, mtime); None when there is no list."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    # ------------------------------------------------------------------ releasing (the user, between runs)
    def clear(self, sample_ids: Iterable[Any] | None = None) -> list[str]:
        """Release ``sample_ids`` (None: every sample); returns the released ids. The file is replaced
        atomically; a line a live run appends at that moment can be lost, so clear a stopped run."""
        entries = self.entries()
        drop = {e["sample_id"] for e in entries} if sample_ids is None else {str(s) for s in sample_ids}
        keep = [e for e in entries if e["sample_id"] not in drop]
        released = [e["sample_id"] for e in entries if e["sample_id"] in drop]
        if not self.path.exists():
            return []
        body = "".join(json.dumps(e, allow_nan=False, separators=(",", ":")) + "\n" for e in keep)
        write_atomic(self.path, body.encode())
        return released


def quarantine_bundle(run_dir: str | os.PathLike, meta: Mapping[str, Any], bundle: str | None,
                      source: str = "capture") -> list[str]:
    """Quarantine the samples an incident bundle's ``incident.json`` (``meta``) names bad (``bad_sample_ids``,
    with their ``bad_reasons``); positions without an id (``#0``) name no sample and are left out."""
    reasons = meta.get("bad_reasons") if isinstance(meta.get("bad_reasons"), dict) else {}
    named = {str(s) for s in meta.get("sample_ids") or []}
    added = []
    for sid in meta.get("bad_sample_ids") or []:
        if str(sid).startswith("#") or str(sid) not in named:  # a bad sample is one of the batch's
            continue
        why = "; ".join(reasons.get(str(sid)) or []) or "named bad by the incident bundle"
        added += QuarantineList(run_dir).add([sid], why, step=meta.get("step"), bundle=bundle, rank=meta.get("rank"),
                                             source=source)
    return added


def quarantine_bundle_dir(run_dir: str | os.PathLike, bundle: str | os.PathLike) -> list[str]:
    """:func:`quarantine_bundle` of the bundle folder ``bundle`` (its path relative to ``run_dir`` recorded);
    never raises (evidence must not kill the run): a bundle that cannot be read quarantines nothing."""
    try:
        meta = read_json_file(Path(bundle) / "incident.json")
        try:
            rel = str(Path(bundle).resolve().relative_to(Path(run_dir).resolve()))
        except ValueError:
            rel = str(bundle)
        return quarantine_bundle(run_dir, meta, rel)
    except (OSError, ValueError):
        return []


class QuarantinedDataset(torch.utils.data.Dataset):
    """A map-style data set without the run's quarantined samples (see the module docstring).

    Args:
        dataset: the data set (``len`` + ``[i]``).
        run_dir: the run folder whose quarantine list applies.
        sample_id: ``index -> id`` without loading the item; default ``dataset.sample_id(index)`` when the
            data set has that method (:class:`vidstab.WithSampleIds`, the reference latent cache), else the index.
    """

    def __init__(self, dataset: Any, run_dir: str | os.PathLike,
                 sample_id: Callable[[int], Any] | None = None) -> None:
        self.dataset = dataset
        self.quarantine = QuarantineList(run_dir)
        self._sample_id = sample_id or getattr(dataset, "sample_id", None) or (lambda index: index)
        self._signature: tuple | None = ()
        self._ids: set[str] = set()
        self.substituted = 0
        """Items this process served in place of a quarantined one."""
        self.quarantined()  # a list that cannot be read stops the run here, named, not in a data loader worker

    def __len__(self) -> int:
        return len(self.dataset)

    def sample_id(self, index: int) -> Any:
        return self._sample_id(index)

    def quarantined(self) -> set[str]:
        """The quarantined ids as of now (re-read when the list changed)."""
        sig = self.quarantine.signature()
        if sig != self._signature:
            self._signature, self._ids = sig, self.quarantine.ids() if sig is not None else set()
        return self._ids

    def resolve(self, index: int) -> int:
        """The index served for ``index``: itself, or the next one whose sample is not quarantined."""
        bad = self.quarantined()
        if not bad or str(self._sample_id(index)) not in bad:
            return index
        n = len(self.dataset)
        for k in range(1, n):
            j = (index + k) % n
            if str(self._sample_id(j)) not in bad:
                return j
        raise RuntimeError(f"every sample of the data set is quarantined ({self.quarantine.path}); "
                           f"release them with: vidstab quarantine {self.quarantine.run_dir} --clear")

    def __getitem__(self, index: int) -> Any:
        served = self.resolve(index)
        if served != index:
            self.substituted += 1
        return self.dataset[served]
