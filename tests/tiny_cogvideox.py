"""A tiny CogVideoX pipeline folder and video clips, offline, for the tests of diffusers' CogVideoX LoRA script.

The pipeline is saved in ``from_pretrained`` layout (``model_index.json``, ``transformer/``, ``vae/``,
``text_encoder/``, ``tokenizer/``, ``scheduler/``), the transformer in fp16 as CogVideoX-2b's is. The
tokenizer is a T5 Unigram tokenizer built with the ``tokenizers`` library over a ten-word vocabulary; the
clips are random 32x32 MPEG-4 videos of 9 frames written with PyAV, with a prompts file and a paths file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

WORDS = "a cat dog runs jumps red blue video of the".split()
TRANSFORMER = {"num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 4, "out_channels": 4, "time_embed_dim": 4,
               "text_embed_dim": 16, "num_layers": 1, "sample_width": 2, "sample_height": 2, "sample_frames": 9,
               "patch_size": 2, "temporal_compression_ratio": 4, "max_text_seq_length": 8}
VAE = {"in_channels": 3, "out_channels": 3, "down_block_types": ["CogVideoXDownBlock3D"] * 4,
       "up_block_types": ["CogVideoXUpBlock3D"] * 4, "block_out_channels": [8, 8, 8, 8], "latent_channels": 4,
       "layers_per_block": 1, "norm_num_groups": 2, "temporal_compression_ratio": 4}
TARGET_MODULES = ["to_k", "to_q", "to_v", "to_out.0"]


def tiny_transformer() -> torch.nn.Module:
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(0)
    return CogVideoXTransformer3DModel(**TRANSFORMER)


def save_pipeline(root: Path) -> Path:
    """The tiny pipeline, saved under ``root``; returns ``root``."""
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDPMScheduler, CogVideoXPipeline
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *[("\u2581" + w, -1.0) for w in WORDS]]
    backend = Tokenizer(models.Unigram(vocab, unk_id=2))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer = T5TokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", extra_ids=0)
    transformer = tiny_transformer()
    torch.manual_seed(1)
    text_encoder = T5EncoderModel(T5Config(vocab_size=len(vocab), d_model=16, d_kv=4, d_ff=16, num_layers=1, num_heads=2))
    vae = AutoencoderKLCogVideoX(**VAE)
    pipe = CogVideoXPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer.half(),
                             scheduler=CogVideoXDPMScheduler())
    pipe.save_pretrained(root)
    return root


def write_clips(root: Path, n: int) -> Path:
    """``n`` clips under ``root/videos`` with ``root/prompts.txt`` and ``root/videos.txt``; returns ``root``."""
    import av

    (root / "videos").mkdir(parents=True)
    rng = np.random.default_rng(0)
    prompts, paths = [], []
    for i in range(n):
        path = f"videos/clip{i}.mp4"
        with av.open(str(root / path), "w") as container:
            stream = container.add_stream("mpeg4", rate=8)
            stream.width = stream.height = 32  # decord reads frames narrower than 32 pixels wrong
            stream.pix_fmt = "yuv420p"
            for _ in range(9):
                frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), format="rgb24")
                container.mux(stream.encode(frame))
            container.mux(stream.encode())
        paths.append(path)
        prompts.append(" ".join(rng.choice(WORDS, 3)))
    (root / "prompts.txt").write_text("\n".join(prompts) + "\n")
    (root / "videos.txt").write_text("\n".join(paths) + "\n")
    return root
