"""The reference trainer's VAE and latent cache: encode once, reuse, rebuild on any change, normalise, clamp."""

import json
from pathlib import Path

import pytest
import torch

from vidstab.reference import vae as vae_module
from vidstab.reference.data import BadSampleError, moving_shapes_dataset
from vidstab.reference.vae import (
    LatentCache,
    LatentCacheError,
    build_vae,
    collate_latents,
    encode_to_cache,
    latent_shape,
    tiny_wan_vae_config,
)

pytestmark = pytest.mark.timeout(120)

# Small on purpose: 8 videos of 5 frames at 16x16 -> latents [4, 2, 2, 2].
NUM_VIDEOS, NUM_FRAMES, RES = 8, 5, 16


@pytest.fixture
def data():
    return moving_shapes_dataset(NUM_VIDEOS, NUM_FRAMES, RES, seed=0)


@pytest.fixture
def vae():
    return build_vae(None, seed=0)


class Log(list):
    """Collects log lines; ``"word" in log`` asks whether any line contains it."""

    def __call__(self, message: str) -> None:
        self.append(message)

    def says(self, text: str) -> bool:
        return any(text in line for line in self)


def test_encodes_once_then_reuses(tmp_path: Path, data, vae):
    cache_dir = tmp_path / "latent_cache"
    first = encode_to_cache(data, vae, cache_dir, log=Log())
    assert first.rebuilt
    assert len(first) == NUM_VIDEOS
    assert sorted(p.name for p in cache_dir.iterdir()) == ["latents-00000.safetensors", "manifest.json"]
    created = json.loads((cache_dir / "manifest.json").read_text())["created"]

    log = Log()
    second = encode_to_cache(data, vae, cache_dir, log=log)
    assert not second.rebuilt
    assert log.says("reusing")
    assert json.loads((cache_dir / "manifest.json").read_text())["created"] == created
    assert torch.equal(first.latents, second.latents)
    assert second.sample_ids == data["sample_id"]


def test_a_hugging_face_dataset_of_the_same_clips_is_the_same_cache(tmp_path: Path, data, vae):
    datasets = pytest.importorskip("datasets")
    hub_style = datasets.Dataset.from_dict({"sample_id": [data[i]["sample_id"] for i in range(len(data))],
                                            "video": [data[i]["video"].numpy() for i in range(len(data))]})
    cache_dir = tmp_path / "latent_cache"
    first = encode_to_cache(data, vae, cache_dir, log=Log())
    log = Log()
    second = encode_to_cache(hub_style, vae, cache_dir, log=log)
    assert log.says("reusing") and second.fingerprint == first.fingerprint
    assert second.sample_ids == first.sample_ids


def test_items_and_batches_have_the_documented_shapes(tmp_path: Path, data, vae):
    cache = encode_to_cache(data, vae, tmp_path / "c", log=Log())
    item = cache[3]
    assert item["sample_id"] == "shapes-s0-00003"
    assert item["latents"].dtype == torch.float32
    assert tuple(item["latents"].shape) == cache.latent_shape == (4, 2, 2, 2)
    assert cache.latent_shape == latent_shape(vae, NUM_FRAMES, RES, RES)

    loader = torch.utils.data.DataLoader(cache, batch_size=4, collate_fn=collate_latents)
    batch = next(iter(loader))
    assert batch["latents"].shape == (4, 4, 2, 2, 2)
    assert batch["sample_ids"] == data["sample_id"][:4]


def test_latents_are_finite_and_normalised(tmp_path: Path, data, vae):
    cache = encode_to_cache(data, vae, tmp_path / "c", log=Log())
    z = cache.latents
    assert torch.isfinite(z).all()
    per_channel = z.transpose(0, 1).flatten(1)
    assert torch.allclose(per_channel.mean(1), torch.zeros(4), atol=1e-4)
    assert torch.allclose(per_channel.std(1, unbiased=False), torch.ones(4), atol=1e-4)

    assert cache.normalization["source"] == "measured"  # random-init VAE: no known statistics
    stats = cache.stats
    assert stats["nonfinite"] == 0 and stats["num_samples"] == NUM_VIDEOS
    assert len(stats["raw"]["mean"]) == 4 and len(stats["normalized"]["std"]) == 4
    extreme = stats["extreme_samples"][0]
    assert extreme["sample_id"] in cache.sample_ids
    assert extreme["absmax"] == pytest.approx(float(z.abs().max()))


def test_encode_logs_latent_statistics(tmp_path: Path, data, vae):
    log = Log()
    encode_to_cache(data, vae, tmp_path / "c", log=log)
    assert log.says("min") and log.says("max") and log.says("std") and log.says("non-finite values: 0")
    assert log.says("most extreme samples") and log.says("shapes-s0-")


def test_denormalize_recovers_the_vae_posterior_mean(tmp_path: Path, data, vae):
    cache = encode_to_cache(data, vae, tmp_path / "c", log=Log())
    video = data[0]["video"].permute(1, 0, 2, 3)[None]  # [1, 3, T, H, W]
    with torch.no_grad():
        expected = vae.encode(video).latent_dist.mean[0]
    assert torch.allclose(cache.denormalize(cache[0]["latents"]), expected, atol=1e-5)


def test_rebuilt_when_the_data_changes(tmp_path: Path, data, vae):
    cache_dir = tmp_path / "c"
    encode_to_cache(data, vae, cache_dir, log=Log())
    log = Log()
    other = moving_shapes_dataset(NUM_VIDEOS, NUM_FRAMES, RES, seed=1)
    cache = encode_to_cache(other, vae, cache_dir, log=log)
    assert cache.rebuilt and log.says("data changed")
    assert cache.sample_ids == other["sample_id"]
    # Same ids, one changed pixel: still a different data set.
    videos = data[:]["video"].clone()
    videos[5, 2, 1, 3, 3] += 0.01
    edited = [{"sample_id": sid, "video": v} for sid, v in zip(data["sample_id"], videos)]
    assert encode_to_cache(edited, vae, cache_dir, log=Log()).rebuilt


def test_rebuilt_when_the_vae_weights_change(tmp_path: Path, data, vae):
    cache_dir = tmp_path / "c"
    first = encode_to_cache(data, vae, cache_dir, log=Log()).latents  # read now: the cache is read lazily from disk
    log = Log()
    second = encode_to_cache(data, build_vae(None, seed=1), cache_dir, log=log)
    assert second.rebuilt and log.says("vae changed")
    assert not torch.equal(first, second.latents)


def test_clamp_bounds_values_and_rebuilds(tmp_path: Path, data, vae):
    cache_dir = tmp_path / "c"
    unclamped = encode_to_cache(data, vae, cache_dir, log=Log()).latents  # read now: the cache is read lazily from disk
    assert unclamped.abs().max() > 1.0

    log = Log()
    clamped = encode_to_cache(data, vae, cache_dir, clamp=1.0, log=log)
    assert clamped.rebuilt and log.says("clamp changed") and log.says("clamped")
    assert clamped.latents.abs().max() <= 1.0
    assert clamped.stats["clamped_values"] == int((unclamped.abs() > 1.0).sum()) > 0
    assert clamped.manifest["clamp"] == 1.0
    # And it is what a reload sees.
    assert LatentCache.load(cache_dir).latents.abs().max() <= 1.0


@pytest.mark.parametrize("damage", ["truncate", "delete", "flip_byte"])
def test_damaged_shard_is_detected_and_rebuilt(tmp_path: Path, data, vae, damage: str):
    cache_dir = tmp_path / "c"
    good = encode_to_cache(data, vae, cache_dir, log=Log()).latents  # read now: the cache is read lazily
    shard = cache_dir / "latents-00000.safetensors"
    raw = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(raw[: len(raw) // 2])
    elif damage == "delete":
        shard.unlink()
    else:
        shard.write_bytes(raw[:-1] + bytes([raw[-1] ^ 0xFF]))

    with pytest.raises(LatentCacheError, match="latents-00000.safetensors"):
        LatentCache.load(cache_dir)
    log = Log()
    cache = encode_to_cache(data, vae, cache_dir, log=log)
    assert cache.rebuilt and log.says("damaged")
    assert torch.equal(cache.latents, good)
    assert not LatentCache.load(cache_dir).rebuilt  # and the new one verifies


def test_large_caches_are_split_into_shards(tmp_path: Path, data, vae, monkeypatch):
    monkeypatch.setattr(vae_module, "SHARD_BYTES", 3 * 4 * 2 * 2 * 2 * 4)  # three samples per shard
    cache = encode_to_cache(data, vae, tmp_path / "c", log=Log())
    shards = sorted(p.name for p in (tmp_path / "c").glob("latents-*.safetensors"))
    assert shards == ["latents-00000.safetensors", "latents-00001.safetensors", "latents-00002.safetensors"]
    loaded = LatentCache.load(tmp_path / "c")
    assert torch.equal(loaded.latents, cache.latents) and loaded.sample_ids == cache.sample_ids


def test_frame_count_must_be_one_plus_four_k(tmp_path: Path, vae):
    bad = moving_shapes_dataset(2, 8, RES, seed=0)
    with pytest.raises(ValueError, match=r"T = 1 \+ 4k.*num_frames=5 or 9"):
        encode_to_cache(bad, vae, tmp_path / "c", log=Log())
    assert not (tmp_path / "c").exists()


def test_non_finite_input_is_refused_naming_the_sample(tmp_path: Path, data, vae):
    items = [{"sample_id": sid, "video": v.clone()} for sid, v in zip(data["sample_id"], data[:]["video"])]
    items[4]["video"][0, 0, 0, 0] = float("inf")
    with pytest.raises(BadSampleError, match="shapes-s0-00004.*non-finite"):
        encode_to_cache(items, vae, tmp_path / "c", log=Log())


def test_refuses_to_replace_a_folder_that_is_not_a_cache(tmp_path: Path, data, vae):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "precious.txt").write_text("keep me")
    with pytest.raises(LatentCacheError, match="not a latent cache"):
        encode_to_cache(data, vae, tmp_path / "c", log=Log())
    assert (tmp_path / "c" / "precious.txt").read_text() == "keep me"


def test_build_vae_is_seeded_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b, c = build_vae(None, seed=5), build_vae(None, seed=5), build_vae(None, seed=6)
    assert torch.equal(torch.get_rng_state(), before)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    assert a.config.z_dim == 4 and not a.training
    assert build_vae(None, seed=0, latent_channels=8).config.z_dim == 8


def test_pretrained_vae_folder_uses_config_statistics(tmp_path: Path, data, vae):
    # A "pretrained" VAE: the tiny one saved with known latent statistics in its config.
    vae.register_to_config(latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[0.5, 0.5, 2.0, 1.0])
    vae.save_pretrained(tmp_path / "pipe" / "vae")
    loaded = build_vae(tmp_path / "pipe", seed=99)  # a pipeline folder: its vae/ sub-folder is used
    assert all(torch.equal(vae.state_dict()[k], v) for k, v in loaded.state_dict().items())

    cache = encode_to_cache(data, loaded, tmp_path / "c", log=Log())
    assert cache.normalization == {"source": "config", "mean": [0.1, -0.2, 0.3, 0.0], "std": [0.5, 0.5, 2.0, 1.0]}
    assert cache.manifest["normalization"]["source"] == "config"
    # Forcing the measured statistics is a different cache.
    log = Log()
    measured = encode_to_cache(data, loaded, tmp_path / "c", normalization="measured", log=log)
    assert measured.rebuilt and log.says("normalization changed")


def test_build_vae_explains_bad_folders(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_vae(tmp_path / "missing", seed=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a diffusers VAE folder"):
        build_vae(tmp_path / "empty", seed=0)
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel"}))
    with pytest.raises(ValueError, match="not an AutoencoderKLWan"):
        build_vae(tmp_path / "unet", seed=0)
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(
        json.dumps({"_class_name": "AutoencoderKLWan", **tiny_wan_vae_config()})
    )
    with pytest.raises(ValueError, match="cannot load the Wan VAE"):
        build_vae(tmp_path / "noweights", seed=0)


def test_reading_a_data_set_larger_than_the_memory_budget_stays_flat(tmp_path: Path):
    """Latents (safe_open per item) and clips (rendered per item) are read without holding the data set."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_data_scale

    budget_mib, clips = 64, 900
    bench_data_scale.write_latent_cache(tmp_path / "c", clips)
    for mode in ("latents_lazy", "videos_lazy"):
        row = bench_data_scale.run_measure(mode, clips, tmp_path / "c")
        assert row["data_mib"] > budget_mib, row  # the data set does not fit the budget...
        assert row["peak_growth_mib"] < budget_mib / 2, row  # ...and reading all of it stays well inside


@pytest.mark.slow
def test_only_the_main_process_builds_the_vae_and_a_rank_that_cannot_see_its_cache_encodes_its_own(tmp_path):
    """The trainer's ``build_latents`` on 3 processes: rank 1 shares the main process's disk and opens the cache
    it checked without a VAE; rank 2's disk holds a stale cache of other videos: it is not taken for the main
    process's (the fingerprints differ), the rank says so and encodes the same videos itself."""
    import os
    import subprocess
    import sys

    from trainer_utils import REPO, free_port

    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--master_addr",
                           "127.0.0.1", "--master_port", str(free_port()),
                           str(REPO / "tests" / "scripts" / "latents_ranks.py"), str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    main, same_disk, other_disk = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3))
    assert main["vae"] and not same_disk["vae"] and same_disk["folder"] == main["folder"]
    assert other_disk["vae"] and other_disk["folder"] == str(tmp_path / "node2" / "latent_cache")
    assert main["fingerprint"] == same_disk["fingerprint"] == other_disk["fingerprint"]
    said = [x for x in (proc.stdout + proc.stderr).splitlines() if "latent cache is not in" in x]
    assert len(said) == 1 and "process 2: the main process's latent cache is not in" in said[0], said
