"""The sharded backend: FSDP2 models and their optimizers through ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shards, in parallel; nothing is gathered to one rank. Layout inside
``step_N/`` (besides the files every backend writes: ``trainer.json``, ``scaler.json``, ``rng-rank{R}.*``
and the JSON of other registered objects)::

    dcp/shard-0000R-model-00001-of-00001.safetensors   rank R-1's local shards (HuggingFaceStorageWriter)
    sharded.json       every DCP key -> object, global shape, dtype (main process; checked before loading)
    optimizer.json     the optimizer's non-tensor state by parameter name (lr, betas, ...)

No pickle: DCP's default format pickles its ``.metadata`` and loads non-tensor items with
``torch.load(weights_only=False)``. Here DCP goes through ``HuggingFaceStorageWriter`` /
``HuggingFaceStorageReader`` (safetensors shards whose headers carry each shard's offsets), is given only
tensors and DTensors (that writer would silently write a ``torch.save`` zip for anything else; here a
non-tensor item is refused), and each rank's shard file is streamed from memory and checksummed while
written (:func:`_streaming_writer`), then fsync'd with the checkpoint's other files, so it is verified like
any other.

Optimizer state is keyed by parameter name (``flatten_optimizer_state_dict=True``), so a checkpoint saved
at one world size loads at another (DCP reshards) and a mismatch names the parameter.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch

from ..files import statedict_io as sio
from .config import CheckpointConfig, CheckpointError
from .full_state import FullStateBackend
from ..signals import local_tensor
from .layout import file_stem
from .memory_copy import held_tensors
from .writer import FileSpec

__all__ = ["ShardedBackend", "DCP_DIR", "SHARDED_INDEX", "has_dtensor_params", "is_optimizer"]

logger = logging.getLogger("vidstab.checkpoint")

DCP_DIR = "dcp"
"""Sub-folder of the DCP shards: ``HuggingFaceStorageReader`` reads every ``.safetensors`` file of a folder."""
SHARDED_INDEX = "sharded.json"
_FLAT = None  # StateDictOptions(flatten_optimizer_state_dict=True), built on first use


def _options():
    global _FLAT
    if _FLAT is None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        _FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
    return _FLAT


def has_dtensor_params(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds DTensor parameters (FSDP2 ``fully_shard``, tensor parallel)."""
    return any(hasattr(p, "device_mesh") and hasattr(p, "to_local") for p in module.parameters())


def is_optimizer(obj: Any) -> bool:
    """A ``torch.optim.Optimizer`` (Accelerate's ``AcceleratedOptimizer`` is one; a scheduler, which also has
    an ``optimizer`` attribute, is not)."""
    return isinstance(obj, torch.optim.Optimizer)


def _inner_optimizer(obj: Any) -> torch.optim.Optimizer:
    inner = getattr(obj, "optimizer", obj)  # AcceleratedOptimizer -> the torch optimizer it wraps
    return inner if isinstance(inner, torch.optim.Optimizer) else obj


def _streaming_writer(path: str, algo: str, fsync: bool):
    """A ``HuggingFaceStorageWriter`` (``save_distributed``: each rank writes its own shard file, same names,
    same safetensors header metadata, read back by ``HuggingFaceStorageReader``) whose :meth:`write_data`
    streams each rank's tensors straight from memory into the file with :func:`vidstab.files.statedict_io.write_safetensors`:
    checksummed while written (in a second thread), writeback started every 16 MiB, not fsync'd (the
    manager fsyncs every file of the checkpoint in one concurrent batch).

    Why not the stock ``write_data``: torch's ``_write_files_from_queue`` serialises a rank's whole shard into
    one in-memory buffer with ``safetensors.torch.save`` (a full extra copy of the state) before writing it and
    fsyncs each file on its own; that copy was most of what a vidstab sharded save cost beyond a plain
    ``dcp.save`` (``CHANGELOG.md``, "Sharded checkpoints")."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._hf_utils import (CUSTOM_METADATA_KEY, DCP_VERSION_KEY, FORMAT_KEY, FORMAT_VALUE,
                                                        HF_DCP_VERSION, SAVED_OFFSETS_KEY, _gen_file_name)
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class StreamingHFWriter(HuggingFaceStorageWriter):
        def __init__(self) -> None:
            super().__init__(path, save_distributed=True)
            self.sync_files = False
            self.digests: dict[str, sio.FileDigest] = {}
            """Absolute path -> size and checksum of each file this rank wrote."""

        def write_data(self, plan, planner):
            fut: Future = Future()
            if not plan.items:
                fut.set_result([])
                return fut
            if any(i.type == WriteItemType.BYTE_IO for i in plan.items):
                # The sharded backend hands DCP tensors only; a non-tensor would need a pickle.
                raise CheckpointError("sharded checkpoint: DCP was given a non-tensor item "
                                      f"({[i.index.fqn for i in plan.items if i.type == WriteItemType.BYTE_IO][:3]})")
            name = _gen_file_name(1, 1, plan.storage_data.get("shard_index"))
            tensors, offsets, results = {}, {}, []
            for item in plan.items:
                t = planner.resolve_data(item)
                fqn = item.index.fqn
                tensors[fqn] = t
                offsets[fqn] = {SAVED_OFFSETS_KEY: list(item.tensor_data.chunk.offsets)}
                length = t.numel() * t.element_size()
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, 0, length)))
            meta = {CUSTOM_METADATA_KEY: json.dumps(offsets), DCP_VERSION_KEY: str(HF_DCP_VERSION),
                    FORMAT_KEY: FORMAT_VALUE}
            file = os.path.join(os.fspath(self.path), name)
            self.digests[file] = sio.write_safetensors(file, tensors, meta, fsync=False, checksum=algo,
                                                       writeback=fsync)
            fut.set_result(results)
            return fut

    return StreamingHFWriter()


def _per_node_planner(accelerator):
    """A save planner for node-local folders: DCP writes each replicated (non-DTensor) tensor, such as the
    optimizer's ``step`` counters, once in the whole job, on whichever rank it picks; with one folder per
    node, every node's folder must hold its own copy. So replicated items are de-duplicated among each
    node's ranks only (torch's ``dedup_save_plans`` on each node's plans)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_global_save_plan

    # Every rank's node (the rank of its node's local main process), in rank order.
    mine = torch.tensor([accelerator.process_index - accelerator.local_process_index], dtype=torch.int64)
    nodes = [torch.zeros(1, dtype=torch.int64) for _ in range(accelerator.num_processes)]
    dist.all_gather(nodes, mine)
    nodes = [int(n) for n in nodes]

    class PerNodePlanner(DefaultSavePlanner):
        def create_global_plan(self, all_plans):
            out = list(all_plans)
            for node in sorted(set(nodes)):
                ranks = [r for r, n in enumerate(nodes) if n == node]
                for r, plan in zip(ranks, dedup_save_plans([all_plans[r] for r in ranks], True)):
                    out[r] = plan
            # The job-wide metadata (unused by the safetensors writer, which writes none when saving
            # distributed) from a job-wide de-duplication; the plans keep each node's copies.
            _, metadata = create_default_global_save_plan(dedup_save_plans(list(all_plans), True))
            if self.flatten_state_dict:
                merged = {}
                for plan in all_plans:
                    merged.update(plan.planner_data)
                metadata.planner_data = merged
            self.global_plan, self.metadata = out, metadata
            return out, metadata

    return PerNodePlanner()


def _reader(path: str, index: dict[str, dict]):
    """``HuggingFaceStorageReader`` whose metadata takes each tensor's global shape from ``sharded.json``.

    torch's reader derives a tensor's global size from the shards present in the folder; a node-local
    folder holds only its node's shards, so that size comes out smaller and ``dcp.load`` refuses a size
    mismatch. The chunks listed stay those of the files present; :func:`_check_coverage` refuses a load
    whose shard is not (entirely) there."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    class IndexedReader(HuggingFaceStorageReader):
        def read_metadata(self):
            metadata = super().read_metadata()
            for fqn, md in metadata.state_dict_metadata.items():
                if fqn in index and hasattr(md, "size"):
                    md.size = torch.Size(index[fqn]["shape"])
            return metadata

    return IndexedReader(path)


def _check_coverage(ckpt: str, folder: str, reader, targets: dict[str, dict]) -> None:
    """Refuse to load when a tensor this rank holds (its local shard of a DTensor) is not entirely covered
    by the shards in ``folder``: DCP would leave the uncovered part as it is, silently; or when the shards
    hold it in another dtype (types are checked like shapes, see :mod:`.dtypes`; never cast here)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    metadata = reader.read_metadata().state_dict_metadata
    chunks = {fqn: md.chunks for fqn, md in metadata.items() if hasattr(md, "chunks")}
    for n, sd in targets.items():
        for k, v in sd.items():
            fqn = f"{n}.{k}"
            saved = getattr(getattr(metadata.get(fqn), "properties", None), "dtype", None)
            if saved is not None and saved != v.dtype:
                raise CheckpointError(f"{ckpt}: {fqn} is {str(saved).removeprefix('torch.')} in {folder}, the receiver "
                                      f"holds {str(v.dtype).removeprefix('torch.')} (sharded checkpoints are not cast)")
            if hasattr(v, "device_mesh"):
                shape, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
            else:
                shape, offset = tuple(v.shape), (0,) * v.dim()
            want = 1
            for d in shape:
                want *= d
            have = 0
            for c in chunks.get(fqn, []):
                vol = 1
                for o, s, co, cs in zip(offset, shape, c.offsets, c.sizes):
                    vol *= max(0, min(o + s, co + cs) - max(o, co))
                have += vol
            if have < want:
                raise CheckpointError(
                    f"{ckpt}: {folder} holds no shard for part of {fqn} on this rank (node-local folders of "
                    "save_on_each_node=True hold only their node's shards: resume with the same processes per node, "
                    "or copy every node's dcp/ files into one folder to reshard)")


def all_finite(tensors) -> bool:
    """Whether every value of ``tensors`` (their local shards) is finite: one sum per tensor, one host read.
    A sum propagates NaN/Inf and is much cheaper than ``isfinite`` (no bool tensor per tensor); an fp32 sum
    overflowing on finite weights would itself be a sick model."""
    from ..signals import local_tensor

    flags = [t.sum(dtype=torch.float32) for t in (local_tensor(x.detach()) for x in tensors) if t.numel()]
    return not flags or bool(torch.isfinite(torch.stack(flags).sum()).item())


def _reusing_stager(reuse: bool, pin: bool):
    """A ``dcp.async_save`` stager that copies the state to host memory, reusing last save's buffers when
    ``reuse`` and the state has the same keys and shapes (like the full-state backend's ``reuse_buffers``:
    the stall is then the copy alone, not page faults of fresh allocations). torch's own caching stager
    always pins memory, which fails without CUDA."""
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    from torch.distributed.checkpoint.staging import AsyncStager

    def signature(sd) -> list:
        out = []
        for k, v in sd.items():
            out.append((k, signature(v)) if isinstance(v, dict) else (k, tuple(v.shape), v.dtype))
        return out

    class ReusingStager(AsyncStager):
        _synchronize_after_execute = False

        def __init__(self) -> None:
            self.cache, self.key = None, None

        def stage(self, state_dict):
            key = signature(state_dict)
            if not reuse or self.cache is None or key != self.key:
                self.cache, self.key = _create_cpu_state_dict(state_dict, pin_memory=pin), key
            staged = _copy_state_dict(state_dict, self.cache, non_blocking=pin)
            if pin:
                torch.cuda.synchronize()  # the copies must land before the loop changes the state
            return staged

        def synchronize_staging(self) -> None:
            pass

    return ReusingStager()


class ShardedBackend(FullStateBackend):
    """Models (and the optimizers over their parameters) through DCP; everything else as :class:`FullStateBackend`."""

    name = "sharded"

    def __init__(self, accelerator, config: CheckpointConfig) -> None:
        super().__init__(accelerator, config)
        self._stager = None  # dcp.async_save's host-memory stager, kept across saves

    # ------------------------------------------------------------------ pairing
    def _model_of(self, objects: dict[str, Any], opt) -> tuple[str, torch.nn.Module]:
        """The registered model whose parameters ``opt`` updates (``get_optimizer_state_dict`` keys by name)."""
        ids = {id(p) for g in _inner_optimizer(opt).param_groups for p in g["params"]}
        for n, m in objects.items():
            if isinstance(m, torch.nn.Module) and ids & {id(p) for p in self.accelerator.unwrap_model(m).parameters()}:
                return n, self.accelerator.unwrap_model(m)
        raise CheckpointError("a registered optimizer updates no registered model's parameters: register the model "
                              "too (sharded checkpoints store optimizer state by parameter name)")

    def _dcp_state(self, objects: dict[str, Any], through_dcp: set[str] = frozenset()) -> tuple[dict[str, dict], dict[str, dict]]:
        """``({object: {key: tensor/DTensor}}, {object: JSON structure})`` of what goes through DCP: models,
        optimizers (their non-tensor state as the structure) and any other object whose state holds
        DTensors (an EMA of sharded weights: its tensors by the keys of :func:`vidstab.files.statedict_io.flatten`,
        the rest of its state as the structure; also one the checkpoint being loaded, ``through_dcp``, saved
        that way: an EMA saved sharded loads into plain tensors at world size 1)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        from ..signals import is_dtensor

        tensors: dict[str, dict] = {}
        rest: dict[str, Any] = {}
        for n, obj in objects.items():
            if isinstance(obj, torch.nn.Module):
                tensors[n] = dict(get_model_state_dict(self.accelerator.unwrap_model(obj)))
            elif is_optimizer(obj):
                _, model = self._model_of(objects, obj)
                flat = get_optimizer_state_dict(model, _inner_optimizer(obj), options=_options())
                tensors[n] = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
                rest[n] = sio.flatten({k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)})[1]
            else:
                ts, structure = sio.flatten(obj.state_dict(), prefix="t")
                if n in through_dcp or any(is_dtensor(t) for t in ts.values()):
                    tensors[n], rest[n] = ts, structure
        return tensors, rest

    # ------------------------------------------------------------------ save
    def snapshot(self, objects: dict[str, Any], copy: bool, trainer_state: dict, mirror: bool = False) -> list[FileSpec]:
        """This rank's small files, plus one :class:`FileSpec` named :data:`DCP_DIR` whose ``sharded`` state
        the manager hands to DCP (staged to host memory by ``dcp.async_save`` for an async save). ``mirror``: the
        replicated files on every rank too (``write=False`` where another rank writes them), for its in-memory copy."""
        tensors, rest = self._dcp_state(objects)
        files: list[FileSpec] = []
        if self.is_main or mirror:
            index = {}
            for n, sd in tensors.items():
                for k, v in sd.items():
                    index[f"{n}.{k}"] = {"object": n, "shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
            files.append(FileSpec(SHARDED_INDEX, data=sio.dumps({"dir": DCP_DIR, "format": "dcp-huggingface-safetensors",
                                                                 "keys": index}), write=self.is_main))
            for n, structure in rest.items():
                files.append(FileSpec(f"{file_stem(n)}.json", data=sio.dumps(structure), write=self.is_main))
            for n, obj in objects.items():
                if isinstance(obj, torch.nn.Module) or n in rest:
                    continue
                ts, structure = sio.flatten(obj.state_dict(), prefix="t")
                files.append(FileSpec(f"{file_stem(n)}.json", data=sio.dumps(structure), write=self.is_main))
                if ts:
                    files.append(FileSpec(f"{file_stem(n)}.safetensors", write=self.is_main,
                                          tensors={k: v.detach().clone() if copy else v.detach() for k, v in ts.items()}))
        clone = (lambda f, k, t: t.detach().clone()) if copy else (lambda f, k, t: t)
        files += self.common_files(trainer_state, clone, mirror)
        files.append(FileSpec(DCP_DIR, sharded=tensors))
        return files

    def stage_into(self, choose) -> None:
        """Before an async save: ``choose(buffers)`` says which staging buffers it may write into (None: new ones;
        the in-memory copy keeps the last healthy save's)."""
        if self._stager is not None:
            self._stager.cache = choose(self._stager.cache)

    def staged(self) -> dict | None:
        """The state the last async save staged in host memory (this rank's shards)."""
        return self._stager.cache if self._stager is not None else None

    def staged_finite(self, models: list[str]) -> bool:
        """Whether the floating tensors of ``models`` in the last async save's staged copy are all finite
        (this rank's shards; the manager joins every rank's answer). One sum per tensor, as the manager's
        own check of the live parameters."""
        cache = (self._stager.cache if self._stager is not None else None) or {}
        return all_finite(v for n in models for v in (cache.get(n) or {}).values()
                          if isinstance(v, torch.Tensor) and v.is_floating_point())

    def start_write(self, spec: FileSpec, tmp_dir: str, group, copy: bool):
        """Hand ``spec.sharded`` to DCP, writing into ``tmp_dir/dcp``. ``copy``: ``dcp.async_save`` (stages a
        host copy now, writes in DCP's thread; returns its future); else returns a callable that runs
        ``dcp.save`` (in the manager's writer). Either way the result is the writer's file digests."""
        import torch.distributed.checkpoint as dcp

        path = os.path.join(tmp_dir, DCP_DIR)
        writer = _streaming_writer(path, self.config.checksum, self.config.fsync)
        no_dist = group is None
        planner = _per_node_planner(self.accelerator) if self.node_local and not no_dist else None
        if copy:
            if self._stager is None:
                self._stager = _reusing_stager(self.config.reuse_buffers,
                                               self.config.pin_memory and torch.cuda.is_available())
            fut = dcp.async_save(spec.sharded, storage_writer=writer, process_group=group, no_dist=no_dist,
                                 async_stager=self._stager, planner=planner)
            spec.sharded = None  # DCP staged its own copy: drop the references to live state

            def result():
                fut.result()
                return self._digests(writer, tmp_dir)
            return result

        def run():
            dcp.save(spec.sharded, storage_writer=writer, process_group=group, no_dist=no_dist, planner=planner)
            spec.sharded = None
            return self._digests(writer, tmp_dir)
        return run

    @staticmethod
    def _digests(writer, tmp_dir: str) -> dict[str, dict]:
        """Manifest entries of the files this rank's DCP write produced, by path relative to ``tmp_dir``
        (not fsync'd yet: the manager batches the fsyncs)."""
        out = {}
        for p, d in writer.digests.items():
            rel = os.path.relpath(p, tmp_dir).replace(os.sep, "/")
            out[rel] = d.to_json()
        return out

    # ------------------------------------------------------------------ load
    def needed_files(self, objects: dict[str, Any]) -> dict[str, str]:
        out = {SHARDED_INDEX: "sharded tensors"}
        for n, obj in objects.items():
            if not isinstance(obj, torch.nn.Module):
                out[f"{file_stem(n)}.json"] = n
        return out

    @staticmethod
    def keep_file(f: str) -> bool:
        """DCP reads its shards itself: they are verified, not kept in memory."""
        return not f.startswith(DCP_DIR + "/")

    def decode(self, ckpt: str, raw: dict[str, bytes], objects: dict[str, Any]) -> dict:
        out: dict[str, Any] = {"objects": {}, "index": sio.loads(raw[SHARDED_INDEX], SHARDED_INDEX)["keys"]}
        through_dcp = {e["object"] for e in out["index"].values()}
        for n, obj in objects.items():
            if isinstance(obj, torch.nn.Module):
                continue
            structure = sio.loads(raw[f"{file_stem(n)}.json"], f"{file_stem(n)}.json")
            if is_optimizer(obj):
                out["objects"][n] = sio.unflatten(structure, {})
            elif n in through_dcp:
                out["objects"][n] = structure  # its tensors come from DCP (apply)
            else:
                stem = file_stem(n)
                tensors = held_tensors(raw[f"{stem}.safetensors"]) if f"{stem}.safetensors" in raw else {}
                state = sio.unflatten(structure, tensors)
                out["objects"][n] = self.check_types(ckpt, n, obj, state) if tensors else state
        out.update(self.decode_common(raw, ckpt))
        out["ckpt"] = ckpt
        return out

    def apply(self, payload: dict, objects: dict[str, Any], path: str = "", group=None) -> None:
        """Check every parameter's name and shape against the checkpoint, then ``dcp.load`` (all ranks
        together; DCP reshards to this world size), or copy them from the in-memory copy (``payload["staged"]``),
        and load the models, optimizers and other objects."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        ckpt, index = payload["ckpt"], payload["index"]
        targets, _ = self._dcp_state(objects, {e["object"] for e in index.values()})  # initialises empty optimizer states (torch does it the same way)
        for n, sd in targets.items():
            for k, v in sd.items():
                fqn = f"{n}.{k}"
                saved = index.get(fqn)
                if saved is None:
                    raise CheckpointError(f"{ckpt}: {n!r} has no saved state for {k!r} (the model or optimizer "
                                          "differs from the one saved)")
                if list(v.shape) != saved["shape"]:
                    raise CheckpointError(f"{ckpt}: {n}.{k} has shape {tuple(saved['shape'])} in the checkpoint, "
                                          f"this run has {tuple(v.shape)}")
        extra = sorted(k for k, e in index.items()
                       if e["object"] in targets and k[len(e["object"]) + 1:] not in targets[e["object"]])
        if extra:
            raise CheckpointError(f"{ckpt}: saved state this run has no place for: {extra[:5]}")
        if payload.get("staged") is not None:  # the in-memory copy: this rank's shards as staged, same mesh
            self._copy_staged(payload["staged"], targets)
        else:
            self._load_files(ckpt, path, index, targets, group)
        for n, obj in objects.items():
            if isinstance(obj, torch.nn.Module):
                set_model_state_dict(self.accelerator.unwrap_model(obj), targets[n])
            elif is_optimizer(obj):
                _, model = self._model_of(objects, obj)
                flat = {**payload["objects"][n], **targets[n]}
                set_optimizer_state_dict(model, _inner_optimizer(obj), flat, options=_options())
            elif n in targets:  # an object holding DTensors (EMA of sharded weights): DCP loaded them in place
                obj.load_state_dict(sio.unflatten(payload["objects"][n], targets[n]))
            else:
                obj.load_state_dict(payload["objects"][n])
        self.apply_common(payload)

    @staticmethod
    def _copy_staged(staged: dict, targets: dict) -> None:
        """Each target's local shard from the in-memory copy (saved by this rank, in this process: same sharding)."""
        for n, sd in targets.items():
            for k, v in sd.items():
                local_tensor(v).copy_(local_tensor(staged[n][k]))

    def _load_files(self, ckpt: str, path: str, index: dict, targets: dict, group) -> None:
        """``dcp.load`` of the checkpoint's shards into ``targets`` (all ranks together; DCP reshards)."""
        import torch.distributed.checkpoint as dcp

        reader = _reader(os.path.join(path, DCP_DIR), index)
        try:
            _check_coverage(ckpt, os.path.join(path, DCP_DIR), reader, targets)
        except CheckpointError as e:
            error: CheckpointError | None = e
        else:
            error = None
        if group is not None:  # every rank learns whether every rank can load before any enters dcp.load
            import torch.distributed as dist

            flag = torch.tensor([0 if error is None else 1])
            dist.all_reduce(flag, group=group)
            if error is None and int(flag) > 0:
                error = CheckpointError(f"{ckpt}: another rank's folder lacks shards it needs (see its log)")
        if error is not None:
            raise error
        dcp.load(targets, storage_reader=reader, process_group=group, no_dist=group is None)
