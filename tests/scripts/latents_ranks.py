"""The reference trainer's latent cache on 3 processes (tests/test_latent_cache.py): ``latents_ranks.py OUT``.

Ranks 0 and 1 share one output folder (one disk); rank 2 has its own (another node's disk), already holding the
cache of an earlier run on other videos. Each rank writes ``OUT/rank{R}.json``: the fingerprint and folder of the
cache ``build_latents`` gave it, and whether it built a VAE.
"""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "recipes"), str(REPO / "tests")]

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

import args as train_args  # noqa: E402  (recipes/args.py)
import train  # noqa: E402  (recipes/train.py)
from trainer_utils import FAST  # noqa: E402

FLAGS = [*FAST, "--num_videos", "4"]
out = Path(sys.argv[1])
acc = Accelerator(cpu=True)
rank = acc.process_index
folder = out / ("shared" if rank < 2 else f"node{rank}")
if rank == 2:  # an earlier run's cache on this disk: other videos, another VAE
    earlier = train_args.parse_args(["--output_dir", str(folder), *FLAGS, "--seed", "7"])
    train.encode_latents(earlier, folder / "latent_cache", log=lambda msg: None)
cache, vae = train.build_latents(train_args.parse_args(["--output_dir", str(folder), *FLAGS]), acc)
(out / f"rank{rank}.json").write_text(json.dumps({"fingerprint": cache.fingerprint, "folder": str(cache.cache_dir),
                                                 "vae": vae is not None}))
acc.wait_for_everyone()  # the ranks end together: a process group torn down while a peer still encodes aborts
torch.distributed.destroy_process_group()
