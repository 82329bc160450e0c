"""Video data sets for the reference trainer: procedurally generated moving shapes, or a folder of videos.

Both builders return a :class:`VideoClips` data set that renders or decodes a clip when it is read (memory
stays flat however large the data set is); each item has two fields:

- ``sample_id`` (str): a stable name for the sample. It travels with every batch so that an incident
  bundle can say *which* videos were in the step that went wrong.
- ``video`` (float32 ``[T, 3, H, W]``, values in ``[-1, 1]``): frames first, channels second. The VAE
  wants ``[B, 3, T, H, W]``; :mod:`vidstab.reference.vae` does that permutation when it encodes.

Bad inputs are a common cause of training blow-ups (an empty file, a truncated clip, a frame full of NaN),
so both paths go through :func:`validate_video`, and every problem becomes a :class:`BadSampleError`
that names the file and what is wrong -- or, with ``skip_bad_samples=True``, an entry in a list of
skipped samples that the trainer can log.

Decoding uses PyAV directly: ``datasets``' own video feature needs torchcodec, which does not load next to
the CPU build of torch.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "VIDEO_EXTENSIONS",
    "BadSampleError",
    "MovingShapes",
    "VideoClips",
    "VideoFolder",
    "collate_videos",
    "moving_shapes_dataset",
    "validate_video",
    "video_folder_dataset",
]

#: File name endings (lower case) that :func:`video_folder_dataset` treats as videos.
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mkv", ".avi", ".mov", ".gif")


class BadSampleError(ValueError):
    """A video sample that cannot be used: undecodable, empty, too short, wrong shape or non-finite.

    The message names the sample id, the file (when there is one) and the problem, e.g.
    ``bad sample 'clips/a.mp4' (file /data/clips/a.mp4): only 3 frames, need 9 (num_frames=9, frame_stride=1)``.
    """

    def __init__(self, sample_id: str | None, reason: str, file: str | os.PathLike | None = None):
        self.sample_id = sample_id
        self.reason = reason
        self.file = None if file is None else str(file)
        where = f"bad sample {sample_id!r}" if sample_id is not None else "bad sample"
        if self.file is not None:
            where += f" (file {self.file})"
        super().__init__(f"{where}: {reason}")

    def __reduce__(self):
        # Exceptions with a custom __init__ do not pickle by default; DataLoader workers send them back.
        return (type(self), (self.sample_id, self.reason, self.file))

    def as_record(self) -> dict:
        """The JSON-friendly ``{"sample_id", "file", "reason"}`` record used for skipped samples."""
        return {"sample_id": self.sample_id, "file": self.file, "reason": self.reason}


def validate_video(
    video: torch.Tensor, sample_id: str, num_frames: int, file: str | os.PathLike | None = None
) -> torch.Tensor:
    """Check one decoded video ``[T, 3, H, W]`` and return it unchanged, or raise :class:`BadSampleError`.

    Checks, in order: it is a tensor of 4 dimensions with 3 channels, it is not empty, it has exactly
    ``num_frames`` frames, and every value is finite. (Both data set builders call this, so the trainer
    never sees a video that fails it.)
    """
    if not isinstance(video, torch.Tensor):
        raise BadSampleError(sample_id, f"expected a torch.Tensor, got {type(video).__name__}", file)
    if video.ndim != 4 or video.shape[1] != 3:
        raise BadSampleError(sample_id, f"expected shape [T, 3, H, W], got {list(video.shape)}", file)
    if video.numel() == 0:
        raise BadSampleError(sample_id, f"empty video (shape {list(video.shape)})", file)
    if video.shape[0] != num_frames:
        raise BadSampleError(sample_id, f"has {video.shape[0]} frames, need {num_frames}", file)
    finite = torch.isfinite(video)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        first_frame = int((~finite).flatten(1).any(1).nonzero()[0])
        raise BadSampleError(
            sample_id, f"{bad} non-finite values (NaN/Inf), first in frame {first_frame}", file
        )
    return video


# ----------------------------------------------------------------------------------------------------
# Moving shapes
# ----------------------------------------------------------------------------------------------------

#: Shapes drawn per video. A fixed count keeps the generator fully vectorised.
_SHAPES_PER_VIDEO = 2


def _bounce(start: np.ndarray, velocity: np.ndarray, t: np.ndarray, low: np.ndarray, high: np.ndarray):
    """Position at time ``t`` of a point moving at constant ``velocity`` that bounces between low and high.

    Unfolding the reflections turns bouncing into a triangle wave of period ``2 * (high - low)``, so all
    frames of all shapes come out of one array expression instead of a per-frame simulation.
    """
    span = np.maximum(high - low, 1e-6)
    u = np.mod(start - low + velocity * t, 2.0 * span)
    return low + span - np.abs(u - span)


def frame_size(resolution: int | tuple[int, int]) -> tuple[int, int]:
    """``(height, width)`` of a clip from a square side or an ``(height, width)`` pair."""
    if isinstance(resolution, (tuple, list)):
        height, width = (int(v) for v in resolution)
        return height, width
    return int(resolution), int(resolution)


class VideoClips(torch.utils.data.Dataset):
    """A data set of clips produced one item at a time (rendered or decoded on access), so memory stays flat
    however many clips there are.

    ``ds[i]`` is ``{"sample_id": str, "video": float32 [T, 3, H, W] in [-1, 1]}``; ``ds[a:b]`` stacks a range
    into ``{"sample_id": [...], "video": [B, T, 3, H, W]}``; ``ds["sample_id"]`` lists every id (the small
    part of ``datasets.Dataset``'s interface the reference code uses).
    """

    def __init__(self, sample_ids: list[str]) -> None:
        #: Sample ids in data set order.
        self.sample_ids = list(sample_ids)

    def __len__(self) -> int:
        return len(self.sample_ids)

    def _load(self, index: int) -> torch.Tensor:
        raise NotImplementedError

    def __getitem__(self, key):
        if isinstance(key, str):
            if key != "sample_id":
                raise KeyError(f"{key!r}: only 'sample_id' can be read as a column (videos are loaded per item)")
            return list(self.sample_ids)
        if isinstance(key, slice):
            indices = range(*key.indices(len(self)))
            return {"sample_id": [self.sample_ids[i] for i in indices], "video": torch.stack([self._load(i) for i in indices])}
        index = int(key)
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} clips")
        index %= len(self)
        return {"sample_id": self.sample_ids[index], "video": self._load(index)}

    def __iter__(self):
        return (self[i] for i in range(len(self)))


class MovingShapes(VideoClips):
    """Procedural clips (see :func:`moving_shapes_dataset`): parameters drawn up front, each clip rendered on access."""

    def __init__(self, num_videos: int, num_frames: int, resolution: int | tuple[int, int], seed: int) -> None:
        height, width = frame_size(resolution)
        if num_videos < 1 or num_frames < 1 or min(height, width) < 4:
            raise ValueError(
                f"moving_shapes_dataset needs num_videos >= 1, num_frames >= 1 and height, width >= 4, got "
                f"num_videos={num_videos}, num_frames={num_frames}, resolution={resolution}"
            )
        super().__init__([f"shapes-s{seed}-{i:05d}" for i in range(num_videos)])
        self.num_frames, self.height, self.width = num_frames, height, width
        rng = np.random.default_rng(seed)
        n, k, size = num_videos, _SHAPES_PER_VIDEO, float(min(height, width))
        extent = np.array([width, height], dtype=np.float64)  # (x, y)
        # Per-video and per-shape parameters, all drawn up front in a fixed order (determinism): O(n) numbers.
        self.background = rng.uniform(0.0, 0.35, size=(n, 3))  # dark backgrounds
        self.colour = rng.uniform(0.45, 1.0, size=(n, k, 3))  # bright shapes, so they stand out
        self.is_disc = rng.random(size=(n, k)) < 0.5
        self.radius = rng.uniform(0.10, 0.22, size=(n, k)) * size  # half the side of a square
        self.low, self.high = self.radius[..., None], extent - self.radius[..., None]  # [n, k, 2]: centre stays inside
        self.start = rng.uniform(0.0, 1.0, size=(n, k, 2)) * (self.high - self.low) + self.low
        speed = rng.uniform(0.04, 0.12, size=(n, k)) * size  # pixels per frame
        angle = rng.uniform(0.0, 2.0 * np.pi, size=(n, k))
        self.velocity = np.stack([np.cos(angle), np.sin(angle)], axis=-1) * speed[..., None]

    def _load(self, i: int) -> torch.Tensor:
        t = np.arange(self.num_frames, dtype=np.float64)[None, :, None]
        # Centres for every frame: [k, T, 2] (x, y).
        centre = _bounce(self.start[i, :, None, :], self.velocity[i, :, None, :], t, self.low[i, :, None, :], self.high[i, :, None, :])
        # Pixel centres, and the distance of each pixel from each shape: [k, T, H, W].
        grid_x = np.arange(self.width, dtype=np.float64) + 0.5
        grid_y = np.arange(self.height, dtype=np.float64) + 0.5
        dx = grid_x[None, None, None, :] - centre[..., 0, None, None]
        dy = grid_y[None, None, :, None] - centre[..., 1, None, None]
        disc_distance = np.sqrt(dx * dx + dy * dy)
        square_distance = np.maximum(np.abs(dx), np.abs(dy))
        distance = np.where(self.is_disc[i, :, None, None, None], disc_distance, square_distance)
        coverage = np.clip(self.radius[i, :, None, None, None] + 0.5 - distance, 0.0, 1.0)
        # Paint shape by shape over the background (later shapes on top): [T, 3, H, W] in [0, 1].
        frames = np.broadcast_to(self.background[i, None, :, None, None], (self.num_frames, 3, self.height, self.width))
        for j in range(coverage.shape[0]):
            alpha = coverage[j, :, None, :, :]
            frames = frames * (1.0 - alpha) + self.colour[i, j, None, :, None, None] * alpha
        video = torch.from_numpy((frames * 2.0 - 1.0).astype(np.float32))
        return validate_video(video, self.sample_ids[i], self.num_frames)


def moving_shapes_dataset(num_videos: int, num_frames: int, resolution: int | tuple[int, int], seed: int) -> MovingShapes:
    """A procedurally generated data set of coloured squares and discs bouncing around a plain background.

    Every video has its own background colour and two shapes (each a square or a disc with its own colour,
    size, start position and constant velocity) that bounce off the frame edges. Edges are anti-aliased
    (one-pixel coverage ramp) so motion is smooth at small resolutions.

    Deterministic: the same ``seed`` gives bitwise the same videos, a different seed different ones.
    Sample ids are ``shapes-s{seed}-{index:05d}``. Clips are rendered when read (a fraction of a millisecond
    each at 9x32x32), so a data set of any size costs only its parameters in memory.

    ``resolution`` is the square side or an ``(height, width)`` pair. Returns a :class:`VideoClips`:
    ``ds[i]["video"]`` is a float32 tensor ``[num_frames, 3, height, width]`` in ``[-1, 1]``.
    """
    return MovingShapes(num_videos, num_frames, resolution, seed)


# ----------------------------------------------------------------------------------------------------
# Folder of video files
# ----------------------------------------------------------------------------------------------------


def _list_videos(data_dir: Path) -> list[Path]:
    """Every video file under ``data_dir`` (recursive), sorted by relative path so the order is stable."""
    files = [p for p in data_dir.rglob("*") if p.is_file() and p.suffix.lower() in VIDEO_EXTENSIONS]
    return sorted(files, key=lambda p: p.relative_to(data_dir).as_posix())


def _decode_frames(path: Path, sample_id: str, num_frames: int, frame_stride: int) -> np.ndarray:
    """Decode frames 0, stride, 2*stride, ... (``num_frames`` of them) as uint8 ``[T, H, W, 3]`` RGB."""
    import av  # imported here: only the folder path needs PyAV

    if path.stat().st_size == 0:
        raise BadSampleError(sample_id, "empty file (0 bytes)", path)
    frames: list[np.ndarray] = []
    decoded = 0
    broke = ""  # the error that stopped decoding part-way, if any
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise BadSampleError(sample_id, "no video stream", path)
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for index, frame in enumerate(container.decode(stream)):
                decoded = index + 1
                if index % frame_stride == 0:
                    frames.append(frame.to_ndarray(format="rgb24"))
                    if len(frames) == num_frames:
                        break
    except BadSampleError:
        raise
    except Exception as exc:  # PyAV raises many kinds (InvalidDataError, OSError, ...): name them all the same way
        if not frames:
            raise BadSampleError(sample_id, f"cannot decode: {type(exc).__name__}: {exc}", path) from exc
        # A clip that breaks part-way may still hold enough frames; if not, the length check says so.
        broke = f" (decoding stopped: {type(exc).__name__}: {exc})"
    if not frames:
        raise BadSampleError(sample_id, "no decodable frames", path)
    if len(frames) < num_frames:
        need = 1 + (num_frames - 1) * frame_stride
        raise BadSampleError(
            sample_id,
            f"too short: {decoded} decodable frames, need at least {need} "
            f"(num_frames={num_frames}, frame_stride={frame_stride}){broke}",
            path,
        )
    if len({f.shape for f in frames}) > 1:
        raise BadSampleError(sample_id, f"frame size changes within the clip: {sorted({f.shape for f in frames})}", path)
    return np.stack(frames)


#: A source frame side below this many pixels, or a crop that keeps less than this share of the frame, gets a warning.
MIN_SOURCE_SIDE = 16
MIN_KEPT_SHARE = 0.5


def _resize_center_crop(frames: torch.Tensor, resolution: int | tuple[int, int]) -> torch.Tensor:
    """Resize ``[T, 3, H, W]`` (antialiased) so it covers ``resolution`` (side or (height, width)), then crop the centre."""
    _, _, h, w = frames.shape
    out_h, out_w = frame_size(resolution)
    scale = max(out_h / h, out_w / w)
    new_h, new_w = max(out_h, round(h * scale)), max(out_w, round(w * scale))
    if (new_h, new_w) != (h, w):
        frames = F.interpolate(frames, size=(new_h, new_w), mode="bilinear", antialias=True, align_corners=False)
    top, left = (new_h - out_h) // 2, (new_w - out_w) // 2
    return frames[:, :, top : top + out_h, left : left + out_w]


def resize_warning(height: int, width: int, resolution: int | tuple[int, int]) -> str | None:
    """Why rescaling ``height x width`` frames to ``resolution`` loses the picture, or None when it is fine.

    Tiny sources (2x2) are blown up from a handful of pixels; extreme aspect ratios (330x8) are mostly
    cropped away. Both train on something that is not the video.
    """
    out_h, out_w = frame_size(resolution)
    scale = max(out_h / height, out_w / width)
    kept = (out_h * out_w) / (height * width * scale * scale)
    problems = []
    if min(height, width) < MIN_SOURCE_SIDE and scale > 1:
        problems.append(f"upscaled {scale:.1f}x")
    if kept < MIN_KEPT_SHARE:
        problems.append(f"centre-cropped, keeping {kept:.0%} of the picture")
    if not problems:
        return None
    return f"{height}x{width} frames are {' and '.join(problems)} (training size {out_h}x{out_w})"


def load_video_file(
    path: str | os.PathLike,
    sample_id: str,
    num_frames: int,
    resolution: int | tuple[int, int],
    frame_stride: int = 1,
) -> torch.Tensor:
    """Decode one video file into a validated float32 ``[num_frames, 3, height, width]`` in [-1, 1].

    ``resolution`` is the square side or ``(height, width)``. Frames that rescale badly (see
    :func:`resize_warning`) give a ``UserWarning`` naming the file. Raises :class:`BadSampleError`
    (never a bare PyAV error) when the file cannot be used.
    """
    path = Path(path)
    rgb = _decode_frames(path, sample_id, num_frames, frame_stride)
    problem = resize_warning(rgb.shape[1], rgb.shape[2], resolution)
    if problem is not None:
        warnings.warn(f"video {sample_id!r} (file {path}): {problem}", UserWarning, stacklevel=2)
    frames = torch.from_numpy(rgb).permute(0, 3, 1, 2).float()  # [T, 3, H, W], 0..255
    frames = _resize_center_crop(frames, resolution)
    video = (frames / 127.5 - 1.0).clamp_(-1.0, 1.0).contiguous()  # antialiasing can overshoot slightly
    return validate_video(video, sample_id, num_frames, path)


def video_folder_dataset(
    data_dir: str | os.PathLike,
    num_frames: int,
    resolution: int | tuple[int, int],
    *,
    frame_stride: int = 1,
    skip_bad_samples: bool = False,
) -> tuple[VideoFolder, list[dict]]:
    """Decode every video under ``data_dir`` into an in-memory data set of clips.

    Files ending in one of :data:`VIDEO_EXTENSIONS` (any case) are found recursively and sorted by their
    path relative to ``data_dir``, which is also their ``sample_id``. From each file the clip is frames
    ``0, frame_stride, 2*frame_stride, ...`` (``num_frames`` of them), resized so the short side is
    ``resolution`` and centre-cropped to a square (or covers ``(height, width)`` and is centre-cropped to it),
    scaled to ``[-1, 1]``. A frame size that rescales badly (tiny, or an extreme aspect ratio) is warned
    about, naming the file.

    A file that cannot be decoded, is empty, is too short or decodes to non-finite values raises
    :class:`BadSampleError` naming the file and the problem. With ``skip_bad_samples=True`` it is left out
    instead and described in the returned list as ``{"sample_id", "file", "reason"}``.

    Every file is decoded once here to find the bad ones, and nothing is kept: the returned
    :class:`VideoFolder` decodes a clip each time it is read, so memory does not grow with the data set (the
    latent cache is what training reads). Returns ``(VideoFolder, skipped)``.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"video data folder {str(data_dir)!r} does not exist or is not a folder")
    if num_frames < 1 or min(frame_size(resolution)) < 1 or frame_stride < 1:
        raise ValueError(
            f"need num_frames >= 1, resolution >= 1 and frame_stride >= 1, got num_frames={num_frames}, "
            f"resolution={resolution}, frame_stride={frame_stride}"
        )
    files = _list_videos(data_dir)
    if not files:
        raise FileNotFoundError(
            f"no video files ({', '.join(VIDEO_EXTENSIONS)}) found under {str(data_dir)!r}"
        )

    ids: list[str] = []
    kept: list[Path] = []
    skipped: list[dict] = []
    for path in files:
        sample_id = path.relative_to(data_dir).as_posix()
        try:  # a probe: decode and validate now, keep nothing (clips are decoded again when read)
            load_video_file(path, sample_id, num_frames, resolution, frame_stride)
        except BadSampleError as err:
            if not skip_bad_samples:
                raise
            skipped.append(err.as_record())
            continue
        ids.append(sample_id)
        kept.append(path)

    if not ids:
        reasons = "; ".join(f"{s['sample_id']}: {s['reason']}" for s in skipped[:5])
        raise BadSampleError(None, f"no usable videos under {str(data_dir)!r} ({reasons})")
    return VideoFolder(kept, ids, num_frames, resolution, frame_stride), skipped


class VideoFolder(VideoClips):
    """Video files decoded one clip at a time when read (see :func:`video_folder_dataset`)."""

    def __init__(self, files: list[Path], sample_ids: list[str], num_frames: int, resolution: int | tuple[int, int],
                 frame_stride: int = 1) -> None:
        super().__init__(sample_ids)
        self.files, self.num_frames, self.resolution, self.frame_stride = list(files), num_frames, resolution, frame_stride

    def _load(self, index: int) -> torch.Tensor:
        return load_video_file(self.files[index], self.sample_ids[index], self.num_frames, self.resolution, self.frame_stride)


# ----------------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------------


def collate_videos(items: Sequence[dict]) -> dict:
    """Stack data set items into ``{"video": Tensor[B, T, 3, H, W], "sample_ids": list[str]}``."""
    return {
        "video": torch.stack([torch.as_tensor(item["video"]) for item in items]),
        "sample_ids": [str(item["sample_id"]) for item in items],
    }
