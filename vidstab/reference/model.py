"""VideoDiT: the reference spatio-temporal diffusion transformer, in one file.

Read it top to bottom:

1. positional encodings: 3D RoPE (rotate q/k channel pairs by the token's (t, h, w) position) or a fixed 3D
   sin-cos table added to the tokens;
2. ``TimestepEmbedder``: timestep -> sinusoid -> MLP -> conditioning vector ``c``;
3. ``Attention``: fused qkv projection, QK-norm (RMSNorm on q and k), RoPE, and
   ``F.scaled_dot_product_attention`` over all tokens ("full") or within one frame / one spatial
   position ("spatial" / "temporal", used by the factorized layout);
4. ``VideoDiTBlock``: AdaLN-Zero -- every sub-layer is ``x + gate * f(norm(x) * (1 + scale) + shift)``
   with (shift, scale, gate) regressed from ``c``; the regressor is zero-initialised, so every gate
   starts at 0 and every block starts as the identity;
5. ``VideoDiT``: patchify (Conv3d, kernel = stride = patch size) -> blocks -> AdaLN final layer
   (zero-initialised, so the untrained model predicts exactly 0) -> unpatchify.

Shapes: ``B`` batch, ``C`` channels, ``F, H, W`` latent frames/height/width, ``f, h, w`` the patch grid,
``L = f * h * w`` tokens, ``N`` heads, ``D`` head dim (``hidden_size = N * D``).

The model is a diffusers ``ModelMixin`` + ``ConfigMixin``: ``save_pretrained`` / ``from_pretrained`` work,
and ``enable_gradient_checkpointing()`` recomputes each block in the backward pass.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from einops import rearrange
from torch import nn

ATTENTION_TYPES = ("full", "factorized")
POS_EMBEDS = ("rope", "sincos")
ROPE_THETA = 10000.0
TIMESTEP_FREQ_DIM = 256  # width of the sinusoidal timestep features fed to the timestep MLP
RopeTables = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), see rope_tables


# ----------------------------------------------------------------------------------------------------
# 1. Positional encodings


def axis_split(dim: int) -> tuple[int, int, int]:
    """Split ``dim`` channels between the (t, h, w) axes: h and w get ``2 * (dim // 6)`` each, t the rest.

    The same split as Wan's 3D RoPE. Every part is even when ``dim`` is even and ``dim >= 6``.
    """
    hw = 2 * (dim // 6)
    return dim - 2 * hw, hw, hw


def _axis_angles(positions: torch.Tensor, dim: int, theta: float = ROPE_THETA) -> torch.Tensor:
    """Angles ``pos * theta^(-2i/dim)`` for i < dim/2: [len(positions), dim // 2], float64."""
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return positions.to(torch.float64)[:, None] * inv_freq[None, :]


def _grid_angles(grid: tuple[int, int, int], dim: int) -> torch.Tensor:
    """Per-token angles for a (f, h, w) grid, axes concatenated: [f*h*w, dim // 2], float64.

    Tokens are ordered (f, h, w) row-major, as ``rearrange(x, "b c f h w -> b (f h w) c")`` orders them.
    """
    parts = []
    for axis, (n, axis_dim) in enumerate(zip(grid, axis_split(dim))):
        angles = _axis_angles(torch.arange(n), axis_dim)  # [n, axis_dim // 2]
        shape = [1, 1, 1, axis_dim // 2]
        shape[axis] = n
        parts.append(angles.view(shape).expand(*grid, axis_dim // 2))
    return torch.cat(parts, dim=-1).reshape(-1, dim // 2)


def rope_tables(grid: tuple[int, int, int], head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """3D RoPE tables ``(cos, sin)``, each [L, 1, D] float32, to rotate q/k laid out as [B, L, N, D].

    Channel ``i`` of a head is paired with channel ``i + D/2`` ("rotate half"); the D/2 pairs are split
    between the t, h and w axes (``axis_split``), so each pair turns by the angle of its own axis' position.
    ``sin`` carries the rotation's sign (``-sin`` on the first half) so that ``apply_rope`` is one fused op.
    """
    angles = _grid_angles(grid, head_dim)  # [L, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin = torch.cat([-angles.sin(), angles.sin()], dim=-1)
    return cos[:, None].to(device, torch.float32), sin[:, None].to(device, torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, L, N, D] by the tables [L, 1, D]: ``x * cos + roll(x, D/2) * sin``.

    ``roll`` swaps the halves, so pair (x_i, x_{i+D/2}) becomes (x_i cos - x_{i+D/2} sin, x_{i+D/2} cos + x_i sin).
    Computed in float32 (no copy for float32 inputs) and returned in x's dtype. Real-valued on purpose:
    torch.compile fuses it into one kernel (it does not generate code for complex numbers).
    """
    x32 = x.float()
    return torch.addcmul(x32 * cos, x32.roll(x.shape[-1] // 2, dims=-1), sin).type_as(x)


def sincos_table(grid: tuple[int, int, int], dim: int, device, dtype) -> torch.Tensor:
    """Fixed 3D sin-cos embedding [L, dim]: per axis ``[sin(angles), cos(angles)]``, axes concatenated."""
    parts = []
    for axis, (n, axis_dim) in enumerate(zip(grid, axis_split(dim))):
        angles = _axis_angles(torch.arange(n), axis_dim)
        emb = torch.cat([angles.sin(), angles.cos()], dim=-1)  # [n, axis_dim]
        shape = [1, 1, 1, axis_dim]
        shape[axis] = n
        parts.append(emb.view(shape).expand(*grid, axis_dim))
    return torch.cat(parts, dim=-1).reshape(-1, dim).to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------------------------------
# 2. Timestep conditioning


def timestep_features(t: torch.Tensor, dim: int = TIMESTEP_FREQ_DIM, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features of (possibly fractional) timesteps t [B] -> [B, dim], float32 (DiT/ADM style)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    """t [B] -> sinusoidal features -> Linear -> SiLU -> Linear -> c [B, hidden].

    Timesteps live on the scale ``[0, num_train_timesteps]`` (integer DDPM steps, or a flow-matching
    ``sigma * num_train_timesteps``); they are rescaled to [0, 1000] so the sinusoid covers the same
    frequencies whatever ``num_train_timesteps`` is.
    """

    def __init__(self, hidden_size: int, num_train_timesteps: int):
        super().__init__()
        self.scale = 1000.0 / num_train_timesteps
        self.mlp = nn.Sequential(
            nn.Linear(TIMESTEP_FREQ_DIM, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        feats = timestep_features(t * self.scale)
        return self.mlp(feats.to(self.mlp[0].weight.dtype))


# ----------------------------------------------------------------------------------------------------
# 3. Attention


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` whose weight follows the input's dtype (bf16 under autocast, say), so that the fused
    kernel applies instead of a slower mixed-dtype fallback. Same parameters and state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection, QK-norm and optional 3D RoPE.

    ``layout`` picks which tokens attend to each other: "full" (all L tokens), "spatial" (tokens of the
    same frame) or "temporal" (tokens at the same spatial position). The token axis is regrouped with
    einops and every attention runs in ``F.scaled_dot_product_attention`` on a [batch, N, tokens, D] view.
    """

    def __init__(self, hidden_size: int, num_heads: int, layout: str, qk_norm: bool, eps: float):
        super().__init__()
        self.num_heads = num_heads
        self.layout = layout
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        head_dim = hidden_size // num_heads
        self.q_norm = RMSNorm(head_dim, eps=eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, eps=eps) if qk_norm else nn.Identity()
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor, grid: tuple[int, int, int], rope: RopeTables | None) -> torch.Tensor:
        # [B, L, 3C] -> three views [B, L, N, D] (no copy); norm and RoPE act on the last axis.
        qkv = rearrange(self.qkv(x), "b l (three n d) -> b l three n d", three=3, n=self.num_heads)
        q, k, v = qkv.unbind(dim=2)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)

        f = grid[0]
        if self.layout == "full":  # [B, N, L, D] views
            q, k, v = (rearrange(t, "b l n d -> b n l d") for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v)
            out = rearrange(out, "b n l d -> b l (n d)")
        elif self.layout == "spatial":  # one sequence per frame: [B*f, N, h*w, D]
            q, k, v = (rearrange(t, "b (f s) n d -> (b f) n s d", f=f) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v)
            out = rearrange(out, "(b f) n s d -> b (f s) (n d)", f=f)
        else:  # "temporal": one sequence per spatial position: [B*h*w, N, f, D]
            q, k, v = (rearrange(t, "b (f s) n d -> (b s) n f d", f=f) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v)
            out = rearrange(out, "(b s) n f d -> b (f s) (n d)", b=x.shape[0])
        return self.proj(out)


# ----------------------------------------------------------------------------------------------------
# 4. Transformer block


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x * (1 + scale) + shift`` with per-sample shift/scale [B, C] broadcast over the L tokens."""
    return torch.addcmul(shift[:, None], x, 1 + scale[:, None])


class MLP(nn.Module):
    def __init__(self, hidden_size: int, mlp_ratio: float):
        super().__init__()
        inner = int(hidden_size * mlp_ratio)
        self.fc1 = nn.Linear(hidden_size, inner)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(inner, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VideoDiTBlock(nn.Module):
    """AdaLN-Zero transformer block: attention sub-layer(s), then an MLP, each gated by ``c``.

    "full": [full attention, MLP]; "factorized": [spatial attention, temporal attention, MLP].
    ``adaLN`` regresses (shift, scale, gate) for every sub-layer from ``silu(c)``; it is zero-initialised
    (in ``VideoDiT._init_weights``) so the block is exactly the identity at initialisation.
    """

    def __init__(
        self, hidden_size: int, num_heads: int, mlp_ratio: float, attention_type: str, qk_norm: bool, eps: float
    ):
        super().__init__()
        layouts = ["full"] if attention_type == "full" else ["spatial", "temporal"]
        num_sublayers = len(layouts) + 1
        self.norms = nn.ModuleList(
            nn.LayerNorm(hidden_size, eps=eps, elementwise_affine=False) for _ in range(num_sublayers)
        )
        self.attns = nn.ModuleList(Attention(hidden_size, num_heads, layout, qk_norm, eps) for layout in layouts)
        self.mlp = MLP(hidden_size, mlp_ratio)
        self.adaLN = nn.Linear(hidden_size, 3 * hidden_size * num_sublayers)

    def forward(
        self, x: torch.Tensor, c: torch.Tensor, grid: tuple[int, int, int], rope: RopeTables | None
    ) -> torch.Tensor:
        # c is silu(timestep embedding) [B, C]; one (shift, scale, gate) triple per sub-layer.
        mods = self.adaLN(c).chunk(3 * len(self.norms), dim=-1)
        for i, attn in enumerate(self.attns):
            shift, scale, gate = mods[3 * i : 3 * i + 3]
            x = torch.addcmul(x, gate[:, None], attn(modulate(self.norms[i](x), shift, scale), grid, rope))
        shift, scale, gate = mods[-3:]
        return torch.addcmul(x, gate[:, None], self.mlp(modulate(self.norms[-1](x), shift, scale)))


# ----------------------------------------------------------------------------------------------------
# 5. The model


class VideoDiT(ModelMixin, ConfigMixin):
    """Spatio-temporal DiT over video latents: ``forward(x [B, C, F, H, W], t [B]) -> [B, C_out, F, H, W]``.

    Args:
        in_channels: latent channels of the input.
        out_channels: channels of the prediction; ``None`` means ``in_channels``.
        patch_size: (t, h, w) patch size; F, H and W of the input must be divisible by it.
        hidden_size: token width; must be divisible by ``num_heads``.
        num_layers: number of transformer blocks.
        num_heads: attention heads; the head dim ``hidden_size // num_heads`` must be even and >= 6 for
            3D RoPE (it is split between the t, h and w axes).
        mlp_ratio: MLP inner width / hidden_size.
        attention_type: "full" (every token attends to every token) or "factorized" (spatial attention
            within each frame, then temporal attention at each spatial position, in every block).
        pos_embed: "rope" (3D rotary embedding of q and k) or "sincos" (fixed 3D sin-cos added to tokens).
        qk_norm: RMSNorm on q and k (per head) before attention.
        num_train_timesteps: the scale of ``timestep`` (``t`` in [0, num_train_timesteps]).
        eps: epsilon of the LayerNorms and RMSNorms.
    """

    _supports_gradient_checkpointing = True
    _no_split_modules = ["VideoDiTBlock"]
    _repeated_blocks = ["VideoDiTBlock"]
    _keep_in_fp32_modules = ["t_embedder"]  # from_pretrained(torch_dtype=bf16) keeps the timestep MLP in fp32
    _skip_layerwise_casting_patterns = ["patch_embed", "t_embedder", "norm"]

    @register_to_config
    def __init__(
        self,
        in_channels: int = 4,
        out_channels: int | None = None,
        patch_size: tuple[int, int, int] = (1, 2, 2),
        hidden_size: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
        mlp_ratio: float = 4.0,
        attention_type: str = "full",
        pos_embed: str = "rope",
        qk_norm: bool = True,
        num_train_timesteps: int = 1000,
        eps: float = 1e-6,
    ):
        super().__init__()
        patch_size = _validate_config(
            in_channels, out_channels, patch_size, hidden_size, num_layers, num_heads, mlp_ratio,
            attention_type, pos_embed, num_train_timesteps, eps,
        )
        self.patch_size = patch_size
        self.out_channels = out_channels or in_channels
        self.head_dim = hidden_size // num_heads
        self.pos_embed_kind = pos_embed
        self.gradient_checkpointing = False

        self.patch_embed = nn.Conv3d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size)
        self.t_embedder = TimestepEmbedder(hidden_size, num_train_timesteps)
        self.blocks = nn.ModuleList(
            VideoDiTBlock(hidden_size, num_heads, mlp_ratio, attention_type, qk_norm, eps)
            for _ in range(num_layers)
        )
        self.norm_out = nn.LayerNorm(hidden_size, eps=eps, elementwise_affine=False)
        self.adaLN_out = nn.Linear(hidden_size, 2 * hidden_size)
        self.proj_out = nn.Linear(hidden_size, math.prod(patch_size) * self.out_channels)

        self._pos_cache: dict = {}  # (kind, grid, device[, dtype]) -> table; not part of the state dict
        self._init_weights()

    def _init_weights(self) -> None:
        """DiT initialisation: xavier Linears, zero biases, and AdaLN-Zero (modulation + output at 0)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        w = self.patch_embed.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.patch_embed.bias)
        for linear in self.t_embedder.mlp[::2]:
            nn.init.normal_(linear.weight, std=0.02)
        for linear in [block.adaLN for block in self.blocks] + [self.adaLN_out, self.proj_out]:
            nn.init.zeros_(linear.weight)
            nn.init.zeros_(linear.bias)

    def _positions(self, grid: tuple[int, int, int], device, dtype):
        """The RoPE table or the sin-cos table for this patch grid, built once per (grid, device[, dtype])."""
        if self.pos_embed_kind == "rope":
            key = ("rope", grid, device)  # float32 whatever the model's dtype
            if key not in self._pos_cache:
                self._pos_cache[key] = rope_tables(grid, self.head_dim, device)
        else:
            key = ("sincos", grid, device, dtype)
            if key not in self._pos_cache:
                self._pos_cache[key] = sincos_table(grid, self.config.hidden_size, device, dtype)
        return self._pos_cache[key]

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor | float) -> torch.Tensor:
        """Predict from noisy latents ``hidden_states`` [B, C, F, H, W] at ``timestep`` [B] (int or float).

        Returns a plain tensor [B, out_channels, F, H, W].
        """
        if hidden_states.ndim != 5:
            raise ValueError(f"hidden_states must be [B, C, F, H, W], got shape {tuple(hidden_states.shape)}")
        b, _, frames, height, width = hidden_states.shape
        pt, ph, pw = self.patch_size
        if frames % pt or height % ph or width % pw:
            raise ValueError(
                f"(F, H, W) = {(frames, height, width)} must be divisible by patch_size {self.patch_size}"
            )
        timestep = torch.as_tensor(timestep, device=hidden_states.device)
        if timestep.ndim == 0:
            timestep = timestep.expand(b)
        if timestep.shape != (b,):
            raise ValueError(f"timestep must be a scalar or have shape [B] = [{b}], got {tuple(timestep.shape)}")

        grid = (frames // pt, height // ph, width // pw)
        # The weights' dtype: an engine holding bf16 weights without autocast (DeepSpeed bf16) gets fp32 latents.
        hidden_states = hidden_states.to(self.patch_embed.weight.dtype)
        # Tokens [B, L, C] in (f, h, w) order; contiguous, so the residual stream is too.
        x = rearrange(self.patch_embed(hidden_states), "b c f h w -> b (f h w) c").contiguous()
        rope = None
        if self.pos_embed_kind == "rope":
            rope = self._positions(grid, x.device, x.dtype)
        else:
            x = x + self._positions(grid, x.device, x.dtype)

        c = F.silu(self.t_embedder(timestep).to(x.dtype))  # [B, C], shared by every block's adaLN
        for block in self.blocks:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                x = self._gradient_checkpointing_func(block, x, c, grid, rope)
            else:
                x = block(x, c, grid, rope)

        shift, scale = self.adaLN_out(c).chunk(2, dim=-1)
        x = self.proj_out(modulate(self.norm_out(x), shift, scale))
        f, h, w = grid
        return rearrange(
            x, "b (f h w) (pt ph pw c) -> b c (f pt) (h ph) (w pw)", f=f, h=h, w=w, pt=pt, ph=ph, pw=pw
        )


def _validate_config(
    in_channels, out_channels, patch_size, hidden_size, num_layers, num_heads, mlp_ratio,
    attention_type, pos_embed, num_train_timesteps, eps,
) -> tuple[int, int, int]:
    """Raise a ValueError naming the bad field; return patch_size as a tuple of 3 ints."""

    def positive_int(name, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"VideoDiT: {name} must be a positive int, got {value!r}")

    positive_int("in_channels", in_channels)
    if out_channels is not None:
        positive_int("out_channels", out_channels)
    try:
        patch = tuple(patch_size)
    except TypeError:
        patch = ()
    if len(patch) != 3 or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 1 for p in patch):
        raise ValueError(f"VideoDiT: patch_size must be 3 positive ints (t, h, w), got {patch_size!r}")
    positive_int("hidden_size", hidden_size)
    positive_int("num_layers", num_layers)
    positive_int("num_heads", num_heads)
    positive_int("num_train_timesteps", num_train_timesteps)
    if hidden_size % num_heads:
        raise ValueError(f"VideoDiT: hidden_size {hidden_size} must be divisible by num_heads {num_heads}")
    if not mlp_ratio > 0 or int(hidden_size * mlp_ratio) < 1:
        raise ValueError(f"VideoDiT: mlp_ratio must be > 0, got {mlp_ratio!r}")
    if attention_type not in ATTENTION_TYPES:
        raise ValueError(
            f"VideoDiT: unknown attention_type {attention_type!r}; expected one of {ATTENTION_TYPES}"
        )
    if pos_embed not in POS_EMBEDS:
        raise ValueError(f"VideoDiT: unknown pos_embed {pos_embed!r}; expected one of {POS_EMBEDS}")
    head_dim = hidden_size // num_heads
    if pos_embed == "rope" and (head_dim % 2 or head_dim < 6):
        raise ValueError(
            f"VideoDiT: 3D RoPE splits the head dim between the (t, h, w) axes in channel pairs, so "
            f"hidden_size / num_heads must be even and >= 6; got {hidden_size} / {num_heads} = {head_dim}"
        )
    if pos_embed == "sincos" and (hidden_size % 2 or hidden_size < 6):
        raise ValueError(f"VideoDiT: 3D sin-cos needs an even hidden_size >= 6, got {hidden_size}")
    if not eps > 0:
        raise ValueError(f"VideoDiT: eps must be > 0, got {eps!r}")
    return patch
