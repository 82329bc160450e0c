"""The PEFT part of the replay spec (vidstab/evidence/adapter_record.py, vidstab/tools/replay/adapters.py): a LoRA-wrapped
diffusers model's class, config, adapter config and base source are recorded as plain JSON, and the replay
rebuilds base + adapter from them alone -- the base as the run loaded it (from_pretrained, safetensors only),
verified by a frozen-base checkpoint's fingerprint -- and refuses, naming the field, what it does not rebuild."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

pytest.importorskip("peft")
from peft import LoraConfig  # noqa: E402

from tiny_cogvideox import TARGET_MODULES, tiny_transformer  # noqa: E402

from vidstab.checkpoint import CheckpointConfig, CheckpointManager  # noqa: E402
from vidstab.evidence.replay_record import model_spec_of  # noqa: E402
from vidstab.tools.replay import ReplayError, build_model  # noqa: E402
from vidstab.tools.replay.rebuild import _load_weights  # noqa: E402


def _pipeline_folder(root: Path) -> Path:
    """A pipeline folder holding the tiny transformer in fp16 (as CogVideoX-2b's is) under ``transformer/``."""
    tiny_transformer().half().save_pretrained(root / "transformer")
    (root / "model_index.json").write_text(json.dumps({"_class_name": "CogVideoXPipeline",
                                                       "transformer": ["diffusers", "CogVideoXTransformer3DModel"]}))
    return root


def _lora_model(root: Path) -> torch.nn.Module:
    """What the script does: the base from the pipeline folder in fp16, cast to fp32, frozen, plus a LoRA
    adapter whose weights then moved away from their initialisation (as training moves them)."""
    from diffusers import CogVideoXTransformer3DModel

    model = CogVideoXTransformer3DModel.from_pretrained(str(root), subfolder="transformer", torch_dtype=torch.float16)
    model.requires_grad_(False)
    model.to(dtype=torch.float32)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=True, target_modules=TARGET_MODULES))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _spec(model: torch.nn.Module) -> dict:
    return json.loads(json.dumps(model_spec_of(model)))  # as incident.json holds it


def _inputs() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"hidden_states": torch.randn(2, 3, 4, 2, 2, generator=g), "encoder_hidden_states": torch.randn(2, 8, 16, generator=g),
            "timestep": torch.tensor([10, 500])}


def test_the_adapter_is_recorded_and_replay_rebuilds_base_and_adapter_over_a_frozen_base_checkpoint(tmp_path):
    root = _pipeline_folder(tmp_path / "pipe")
    model = _lora_model(root)
    spec = _spec(model)
    peft = spec["peft"]
    assert spec["class"] == "diffusers.models.transformers.cogvideox_transformer_3d:CogVideoXTransformer3DModel"
    lora = peft["adapters"]["default"]
    assert lora["peft_type"] == "LORA" and lora["r"] == 4 and lora["target_modules"] == sorted(TARGET_MODULES)
    assert peft["active"] == ["default"] and peft["adapter_dtype"] == "float32"
    assert peft["base"] == {"pretrained": str(root), "subfolder": "transformer", "dtype": "float32"}

    # vidstab's own checkpoint of it holds the adapters only, plus the base's fingerprint
    acc = Accelerator(cpu=True)
    ckpt = CheckpointManager(acc, str(tmp_path / "run"), CheckpointConfig(async_save=False))
    ckpt.register("model", model)
    ckpt.save(1, healthy=True)
    weights = tmp_path / "run" / ckpt.latest_path_str() / "model.safetensors"

    rebuilt = build_model(spec)
    note = _load_weights(rebuilt, weights)
    assert "frozen-base checkpoint" in note and "match the recorded fingerprint" in note
    assert rebuilt.peft_config["default"].r == 4
    original, again = model.state_dict(), rebuilt.state_dict()
    assert original.keys() == again.keys() and all(torch.equal(original[k], again[k]) for k in original)
    assert [n for n, p in rebuilt.named_parameters() if p.requires_grad] == [n for n, p in model.named_parameters() if p.requires_grad]
    with torch.no_grad():
        assert torch.equal(model(**_inputs()).sample, rebuilt(**_inputs()).sample)


def _expect_refused(spec: dict, *words: str) -> None:
    with pytest.raises(ReplayError) as err:
        build_model(spec)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_what_the_replay_does_not_rebuild_is_refused_naming_it(tmp_path):
    root = _pipeline_folder(tmp_path / "pipe")
    spec = _spec(_lora_model(root))

    def changed(**lora) -> dict:
        s = json.loads(json.dumps(spec))
        s["peft"]["adapters"]["default"].update(lora)
        return s

    _expect_refused(changed(init_lora_weights="pissa"), "'pissa'", "reads the base or data")
    _expect_refused(changed(peft_type="LOHA"), "LOHA", "LoRA only")
    _expect_refused(changed(a_field_of_a_newer_peft=3), "a_field_of_a_newer_peft", "install that version")
    _expect_refused(changed(eva_config={"rho": 2.0}), "eva_config", "variant")
    # peft would import the module megatron_core names: refused before peft sees it
    _expect_refused(changed(megatron_config={"tensor_model_parallel_size": 1}, megatron_core="this"), "Megatron")
    assert "this" not in sys.modules

    wrong_dtype = json.loads(json.dumps(spec))
    wrong_dtype["peft"]["base"]["dtype"] = "int8"
    _expect_refused(wrong_dtype, "'int8' is not a floating-point dtype")


def test_a_base_that_is_gone_or_another_is_named_and_the_size_cap_comes_first(tmp_path, monkeypatch):
    root = _pipeline_folder(tmp_path / "pipe")
    spec = _spec(_lora_model(root))
    config_file = root / "transformer" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "num_layers": 2}))
    _expect_refused(spec, f"the base at {root} (subfolder transformer) is not the one the run trained over", "num_layers")

    gone = json.loads(json.dumps(spec))
    gone["peft"]["base"]["pretrained"] = str(tmp_path / "elsewhere")
    _expect_refused(gone, "fine-tuned over the base at", "elsewhere", "cannot be read here")

    # the recorded architecture (adapters included) is counted on the meta device, before any base is read
    monkeypatch.setenv("VIDSTAB_MAX_PARAMS", "5000")
    _expect_refused(gone, "5,912 parameters", "refused before allocating")


def test_a_base_from_the_hub_cache_is_recorded_by_repo_id_and_rebuilt_from_the_cache_only(tmp_path, monkeypatch):
    import huggingface_hub.constants
    from diffusers import CogVideoXTransformer3DModel

    # The hub cache's layout for a repository "tiny/cogvideox" at one commit, holding the pipeline folder.
    repo = tmp_path / "hub" / "models--tiny--cogvideox"
    _pipeline_folder(repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = CogVideoXTransformer3DModel.from_pretrained("tiny/cogvideox", subfolder="transformer", local_files_only=True)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=TARGET_MODULES))
    spec = _spec(model)
    assert spec["peft"]["base"] == {"pretrained": "tiny/cogvideox", "subfolder": "transformer", "dtype": "float32"}
    rebuilt = build_model(spec)
    original, again = model.state_dict(), rebuilt.state_dict()
    assert all(torch.equal(original[k], again[k]) for k in original if "lora_" not in k)
