"""The reference trainer's video data sets: moving shapes, and a folder of real video files decoded with PyAV."""

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from vidstab.reference.data import (
    BadSampleError,
    collate_videos,
    moving_shapes_dataset,
    validate_video,
    video_folder_dataset,
)

pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------------------------------------------------
# Moving shapes
# ----------------------------------------------------------------------------------------------------


def test_moving_shapes_same_seed_gives_bitwise_same_videos():
    a = moving_shapes_dataset(6, 5, 16, seed=3)
    b = moving_shapes_dataset(6, 5, 16, seed=3)
    assert torch.equal(a[:]["video"], b[:]["video"])
    assert a["sample_id"] == b["sample_id"]


def test_moving_shapes_different_seed_gives_different_videos():
    a = moving_shapes_dataset(6, 5, 16, seed=3)[:]["video"]
    b = moving_shapes_dataset(6, 5, 16, seed=4)[:]["video"]
    assert not torch.equal(a, b)


def test_moving_shapes_shape_range_and_ids():
    ds = moving_shapes_dataset(4, 9, 32, seed=7)
    assert len(ds) == 4
    video = ds[2]["video"]
    assert isinstance(video, torch.Tensor)
    assert video.dtype == torch.float32 and video.shape == (9, 3, 32, 32)
    all_videos = ds[:]["video"]
    assert all_videos.min() >= -1.0 and all_videos.max() <= 1.0
    assert torch.isfinite(all_videos).all()
    assert ds["sample_id"] == [f"shapes-s7-{i:05d}" for i in range(4)]
    # The ids of the first videos do not depend on how many videos are asked for.
    assert moving_shapes_dataset(2, 9, 32, seed=7)["sample_id"] == ds["sample_id"][:2]


def test_moving_shapes_actually_move():
    video = moving_shapes_dataset(3, 5, 16, seed=0)[:]["video"]
    frame_change = (video[:, 1:] - video[:, :-1]).abs().amax(dim=(1, 2, 3, 4))
    assert (frame_change > 0.1).all(), "every video should change from frame to frame"


def test_collate_videos_stacks_a_batch():
    ds = moving_shapes_dataset(3, 5, 16, seed=0)
    batch = collate_videos([ds[0], ds[1], ds[2]])
    assert batch["video"].shape == (3, 5, 3, 16, 16)
    assert batch["sample_ids"] == ds["sample_id"]


# ----------------------------------------------------------------------------------------------------
# validate_video (shared by both data sets)
# ----------------------------------------------------------------------------------------------------


def test_validate_video_rejects_non_finite_values_naming_sample_and_file():
    video = torch.zeros(5, 3, 8, 8)
    video[3, 1, 2, 2] = float("nan")
    with pytest.raises(BadSampleError, match="non-finite") as info:
        validate_video(video, "clips/bad.mp4", 5, file="/data/clips/bad.mp4")
    assert "clips/bad.mp4" in str(info.value) and "/data/clips/bad.mp4" in str(info.value)
    assert "frame 3" in str(info.value)
    assert info.value.sample_id == "clips/bad.mp4"

    video[3, 1, 2, 2] = float("inf")
    with pytest.raises(BadSampleError, match="non-finite"):
        validate_video(video, "x", 5)


@pytest.mark.parametrize(
    ("video", "problem"),
    [
        (torch.zeros(4, 3, 8, 8), "has 4 frames, need 5"),
        (torch.zeros(5, 8, 8), "expected shape"),
        (torch.zeros(5, 1, 8, 8), "expected shape"),
        (torch.zeros(5, 3, 0, 8), "empty"),
        (np.zeros((5, 3, 8, 8), dtype=np.float32), "torch.Tensor"),
    ],
)
def test_validate_video_rejects_bad_shapes(video, problem):
    with pytest.raises(BadSampleError, match=problem):
        validate_video(video, "sample-1", 5)


def test_validate_video_returns_a_good_video_unchanged():
    video = torch.rand(5, 3, 8, 8) * 2 - 1
    assert validate_video(video, "ok", 5) is video


def test_bad_sample_error_is_a_value_error_that_survives_pickling():
    # DataLoader workers send exceptions back to the main process by pickling them.
    err = BadSampleError("a.mp4", "too short", file="/d/a.mp4")
    assert isinstance(err, ValueError)
    copy = pickle.loads(pickle.dumps(err))
    assert str(copy) == str(err) and copy.file == "/d/a.mp4" and copy.reason == "too short"
    assert copy.as_record() == {"sample_id": "a.mp4", "file": "/d/a.mp4", "reason": "too short"}


# ----------------------------------------------------------------------------------------------------
# Folder of real video files
# ----------------------------------------------------------------------------------------------------


def _gray_frames(num_frames: int, height: int, width: int) -> np.ndarray:
    """Frames of constant gray ``20 * i`` (frame i), so a decoded frame tells which source frame it was."""
    levels = (np.arange(num_frames) * 20).astype(np.uint8)
    return np.broadcast_to(levels[:, None, None, None], (num_frames, height, width, 3)).copy()


def _write_video(path: Path, frames: np.ndarray, codec: str = "mpeg4") -> Path:
    """Encode uint8 RGB frames ``[T, H, W, 3]`` into a real video file with PyAV."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=8)
        stream.height, stream.width = frames.shape[1], frames.shape[2]
        stream.pix_fmt = "rgb8" if codec == "gif" else "yuv420p"
        if codec == "mpeg4":
            stream.options = {"qscale": "1"}  # near-lossless, so gray levels survive
        for rgb in frames:
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


@pytest.fixture
def video_dir(tmp_path: Path) -> Path:
    """Two good videos (one in a sub-folder, one a GIF) and three bad files."""
    root = tmp_path / "videos"
    _write_video(root / "a_good.mp4", _gray_frames(12, 40, 48))
    _write_video(root / "sub" / "b_good.gif", _gray_frames(6, 24, 24), codec="gif")
    (root / "c_empty.mp4").write_bytes(b"")
    (root / "d_garbage.mkv").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    _write_video(root / "e_short.mp4", _gray_frames(3, 40, 48))
    (root / "notes.txt").write_text("not a video, ignored")
    return root


def test_folder_skip_mode_keeps_good_videos_and_records_bad_ones(video_dir: Path):
    ds, skipped = video_folder_dataset(video_dir, num_frames=5, resolution=16, skip_bad_samples=True)

    assert ds["sample_id"] == ["a_good.mp4", "sub/b_good.gif"]
    videos = ds[:]["video"]
    assert videos.shape == (2, 5, 3, 16, 16) and videos.dtype == torch.float32
    assert videos.min() >= -1.0 and videos.max() <= 1.0

    reasons = {s["sample_id"]: s["reason"] for s in skipped}
    assert set(reasons) == {"c_empty.mp4", "d_garbage.mkv", "e_short.mp4"}
    assert "empty" in reasons["c_empty.mp4"]
    assert "cannot decode" in reasons["d_garbage.mkv"]
    assert "too short" in reasons["e_short.mp4"] and "3 decodable frames" in reasons["e_short.mp4"]
    for record in skipped:
        assert record["file"] == str(video_dir / record["sample_id"])


@pytest.mark.parametrize(
    ("bad_file", "problem"),
    [("c_empty.mp4", "empty"), ("d_garbage.mkv", "cannot decode"), ("e_short.mp4", "too short")],
)
def test_folder_strict_mode_raises_naming_the_file(video_dir: Path, bad_file: str, problem: str):
    # Keep only one bad file, so the error is about that one.
    for other in ("c_empty.mp4", "d_garbage.mkv", "e_short.mp4"):
        if other != bad_file:
            (video_dir / other).unlink()
    with pytest.raises(BadSampleError, match=problem) as info:
        video_folder_dataset(video_dir, num_frames=5, resolution=16)
    assert bad_file in str(info.value)
    assert info.value.file == str(video_dir / bad_file)


def test_folder_samples_frames_with_stride_from_the_start(tmp_path: Path):
    _write_video(tmp_path / "ramp.mp4", _gray_frames(12, 32, 32))
    ds, skipped = video_folder_dataset(tmp_path, num_frames=5, resolution=16, frame_stride=2)
    assert skipped == []
    video = ds[0]["video"]
    # Frame j should be source frame 2j: gray level 40j (out of 255), i.e. 40j / 127.5 - 1 in [-1, 1].
    expected = torch.tensor([40.0 * j for j in range(5)]) / 127.5 - 1.0
    assert torch.allclose(video.mean(dim=(1, 2, 3)), expected, atol=0.05)

    # Asking for more frames than the stride allows is "too short", with the numbers in the message.
    with pytest.raises(BadSampleError, match=r"too short: 12 decodable frames, need at least 13"):
        video_folder_dataset(tmp_path, num_frames=5, resolution=16, frame_stride=3)


def test_folder_resizes_short_side_and_centre_crops(tmp_path: Path):
    # Left half dark, right half bright, on a wide frame: the centre crop keeps both halves equally.
    frames = np.zeros((5, 32, 64, 3), dtype=np.uint8)
    frames[:, :, 32:] = 255
    _write_video(tmp_path / "wide.mp4", frames)
    ds, _ = video_folder_dataset(tmp_path, num_frames=5, resolution=16)
    video = ds[0]["video"]
    assert video.shape == (5, 3, 16, 16)
    assert video[:, :, :, :6].mean() < -0.8 and video[:, :, :, -6:].mean() > 0.8


def test_folder_errors_for_missing_or_empty_folders(tmp_path: Path, video_dir: Path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        video_folder_dataset(tmp_path / "nope", 5, 16)
    (tmp_path / "no_videos").mkdir()
    with pytest.raises(FileNotFoundError, match="no video files"):
        video_folder_dataset(tmp_path / "no_videos", 5, 16)
    # Every file bad, even in skip mode: there is nothing to train on.
    for good in ("a_good.mp4", "sub/b_good.gif"):
        (video_dir / good).unlink()
    with pytest.raises(BadSampleError, match="no usable videos"):
        video_folder_dataset(video_dir, 5, 16, skip_bad_samples=True)


def test_clips_that_rescale_badly_are_warned_about_naming_the_file(tmp_path: Path):
    import warnings as _warnings

    _write_video(tmp_path / "tiny.mp4", _gray_frames(5, 2, 2))
    _write_video(tmp_path / "sliver.mp4", _gray_frames(5, 330, 8))
    _write_video(tmp_path / "fine.mp4", _gray_frames(5, 48, 64))
    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always")
        ds, skipped = video_folder_dataset(tmp_path, num_frames=5, resolution=32)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert any("tiny.mp4" in m and "2x2 frames are upscaled 16.0x (training size 32x32)" in m for m in messages), messages
    assert any("sliver.mp4" in m and "330x8 frames are upscaled 4.0x and centre-cropped, keeping 2% of the picture (training size 32x32)" in m for m in messages), messages
    assert not any("fine.mp4" in m for m in messages), messages
    assert skipped == [] and len(ds) == 3 and ds[0]["video"].shape == (5, 3, 32, 32)


def test_height_and_width_give_non_square_clips(tmp_path: Path):
    _write_video(tmp_path / "a.mp4", _gray_frames(5, 48, 64))
    ds, _ = video_folder_dataset(tmp_path, num_frames=5, resolution=(16, 24))
    assert ds[0]["video"].shape == (5, 3, 16, 24)
    assert moving_shapes_dataset(2, 5, (16, 24), seed=0)[1]["video"].shape == (5, 3, 16, 24)


@pytest.mark.slow
def test_the_trainer_on_2_processes_says_a_bad_video_once_with_the_flag_that_skips_it(tmp_path):
    """A video of ``--data_dir`` that cannot be decoded: the main process names it and the flag, exit code 2, and no
    rank's traceback (the other rank stops with it instead of at its lost peer)."""
    from trainer_utils import run_trainer

    videos = tmp_path / "videos"
    for i in range(2):
        _write_video(videos / f"clip{i}.mp4", _gray_frames(5, 16, 16))
    (videos / "broken.mp4").write_bytes(b"not a video" * 64)
    proc = run_trainer(tmp_path / "out", "--data_dir", str(videos), "--num_frames", "5", "--height", "16", "--width",
                       "16", "--train_batch_size", "1", "--max_train_steps", "1", nproc=2, check=False)
    said = [x for x in proc.stderr.splitlines() if x.startswith("recipes/train.py: error:")]
    assert proc.returncode != 0 and len(said) == 1, proc.stderr[-3000:]
    assert "bad sample 'broken.mp4'" in said[0] and "--skip_bad_samples" in said[0], said
    assert not [x for x in proc.stderr.splitlines() if x.startswith("[rank")], proc.stderr[-3000:]
