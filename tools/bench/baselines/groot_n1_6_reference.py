"""Reference GR00T-N1.6 training loop: the official Isaac-GR00T N1.6 training rebuilt from the
libraries it uses, as the baseline of ``tools/bench/vla_throughput.py``.

Model: the Eagle backbone from ``transformers`` modules via ``_from_config`` (``Siglip2VisionModel``
with N1.6's tower shapes, Eagle's pixel-shuffle ``mlp1``, ``Qwen3ForCausalLM`` without the layers
above ``select_layer``, run with ``output_hidden_states=True`` so the tied LM head runs and its
logits are thrown away), then the flow-matching action head: ``vlln``, category-specific
(per-sample weight gather + bmm) state/action encoders and decoder, and the alternating self /
text-cross / image-cross DiT as diffusers' ``BasicTransformerBlock(norm_type="ada_norm")``.
Loop (``train_step``): HF-Trainer style: bf16 autocast, TF32, fused AdamW (lr 1e-4, wd 1e-5),
``clip_grad_norm_(1.0)``, ``loss.item()`` every step, no torch.compile. The input pipeline
(per-sample whole-episode decode, PIL augmentation, processor) is ``groot_n1_6_reference_data.py``.

Every way this differs from the official code, and why:

1. The DiT is plain torch computing what diffusers' ``Attention`` (``AttnProcessor2_0``: SDPA,
   boolean key mask repeated per head), ``FeedForward`` (``gelu-approximate``) and ``Timesteps``
   + ``TimestepEmbedding`` compute, so the reference needs only ``transformers``. Same ops,
   shapes and launches (one q/k/v/out Linear each,
   one SDPA per block, separate dropout/GELU/Linear launches).
2. Random init: the reference is built from the same config as longboat's run (N1.6's published
   shapes in the ``full`` flavour) without downloading weights. Throughput does not depend on
   the weights' values; the loss alignment copies longboat's initial weights into it.
3. Qwen3 is built with ``select_layer`` layers instead of 28 with the top 12 popped (same kept
   layers and compute; saves init time and memory only).
4. No Eagle chat template / Qwen tokenizer (they come from the hub): the prompt is the task string
   through longboat's byte-level stand-in, after the image placeholders, so both loops see the
   same token count. The official template adds ~20 tokens per sample (only slower).
5. ``attn_implementation="sdpa"``, not ``flash_attention_2``: flash-attn is an optional extra
   that longboat's runs do not use either; SDPA's flash/cuDNN kernels are comparable at these
   lengths.
6. No DeepSpeed / DDP wrapper: one GPU, so DDP would only add its reducer hooks.
7. No future/"target vision" tokens in the DiT sequence ([state, actions] only), as in N1.6
   (N1.5 had 32 extra learned tokens).
8. Single-GPU step only: no gradient accumulation, constant LR (the HF Trainer's schedule step
   costs next to nothing).
9. The vision tower's attention-pooling ``head`` is off (``vision_use_head=False``), as in
   Eagle, which reads ``last_hidden_state``.
10. A batch may carry ``noise`` and ``time`` (the flow-matching draws): only
    ``vla_loss_alignment.py`` uses this, to feed both loops identical draws. Otherwise noise is
    ``torch.randn`` on the device and t a CPU ``Beta(1.5, 1)`` copied over, as in GR00T.
11. The loader's worker count is a benchmark argument (both loops), not the official config's 2
    workers; more workers only help the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config_fields import from_cfg, read_shapes


@dataclass(frozen=True, kw_only=True)
class RefShapes:
    """Every shape of the reference model (full N1.6 or the tiny CPU flavour), read from a
    ``longboat.embodied`` GrootN16Config so both loops run exactly the same model sizes."""

    vit_hidden: int = from_cfg("vision.hidden_size")
    vit_layers: int = from_cfg("vision.num_layers")
    vit_heads: int = from_cfg("vision.num_heads")
    vit_mlp: int = from_cfg("vision.intermediate_size")
    patch: int = from_cfg("vision.patch_size")
    vit_pos_side: int  # Siglip2 position table is vit_pos_side x vit_pos_side, resized per image
    llm_hidden: int = from_cfg("llm.hidden_size")
    llm_layers_kept: int = from_cfg("select_layer")
    llm_heads: int = from_cfg("llm.num_heads")
    llm_kv_heads: int = from_cfg("llm.num_kv_heads")
    llm_head_dim: int = from_cfg("llm.head_dim")
    llm_mlp: int = from_cfg("llm.intermediate_size")
    vocab: int = from_cfg("llm.vocab_size")
    rope_theta: float = from_cfg("llm.rope_theta")
    image_token_id: int = from_cfg("image_token_id")
    dit_layers: int = from_cfg("dit.num_layers")
    dit_heads: int = from_cfg("dit.num_heads")
    dit_head_dim: int = from_cfg("dit.head_dim")
    dit_out: int = from_cfg("dit.output_dim")
    dit_dropout: float = from_cfg("dit.dropout")
    attend_text_every_n_blocks: int = from_cfg("dit.attend_text_every_n_blocks", default=2)
    num_embodiments: int = from_cfg("num_embodiments")
    max_state_dim: int = from_cfg("max_state_dim")
    max_action_dim: int = from_cfg("max_action_dim")
    horizon: int = from_cfg("action_horizon")
    state_hidden: int = from_cfg("state_hidden")
    decoder_hidden: int = from_cfg("action_decoder_hidden")
    max_seq_len: int = from_cfg("max_seq_len")
    timestep_buckets: int = from_cfg("num_timestep_buckets", default=1000)
    tune_top_llm_layers: int = from_cfg("tune_top_llm_layers")
    resize_shortest: int = from_cfg("image.resize_shortest")
    crop_fraction: float = from_cfg("image.crop_fraction")
    multiple_of: int = from_cfg("image.multiple_of")

    @classmethod
    def from_groot_config(cls, cfg: Any) -> RefShapes:
        side = math.isqrt(cfg.vision.pos_grid[0] * cfg.vision.pos_grid[1])
        return read_shapes(cls, cfg, vit_pos_side=max(1, side))

    @property
    def dit_inner(self) -> int:
        return self.dit_heads * self.dit_head_dim


def eagle_pixel_shuffle(x: Tensor, scale_factor: float = 0.5) -> Tensor:
    """Eagle / InternVL ``pixel_shuffle``: [N, w, h, c] -> [N, w/2, h/2, 4c] (its channel order)."""
    n, w, h, c = x.size()
    x = x.view(n, w, int(h * scale_factor), int(c / scale_factor))
    x = x.permute(0, 2, 1, 3).contiguous()
    x = x.view(n, int(h * scale_factor), int(w * scale_factor), int(c / (scale_factor**2)))
    return x.permute(0, 2, 1, 3).contiguous()


class EagleBackboneRef(nn.Module):
    """Siglip2 ViT -> pixel shuffle -> mlp1 -> Qwen3 (truncated) hidden_states[-1]."""

    def __init__(self, s: RefShapes) -> None:
        super().__init__()
        from transformers import (
            Qwen3Config,
            Qwen3ForCausalLM,
            Siglip2VisionConfig,
            Siglip2VisionModel,
        )

        self.s = s
        vcfg = Siglip2VisionConfig(
            hidden_size=s.vit_hidden,
            num_hidden_layers=s.vit_layers,
            num_attention_heads=s.vit_heads,
            intermediate_size=s.vit_mlp,
            patch_size=s.patch,
            num_patches=s.vit_pos_side**2,
            hidden_act="gelu_pytorch_tanh",
            layer_norm_eps=1e-6,
            vision_use_head=False,
        )
        self.vision_model = Siglip2VisionModel._from_config(vcfg, attn_implementation="sdpa")
        d4 = s.vit_hidden * 4
        self.mlp1 = nn.Sequential(
            nn.LayerNorm(d4),
            nn.Linear(d4, s.llm_hidden),
            nn.GELU(),
            nn.Linear(s.llm_hidden, s.llm_hidden),
        )
        lcfg = Qwen3Config(
            hidden_size=s.llm_hidden,
            num_hidden_layers=s.llm_layers_kept,
            num_attention_heads=s.llm_heads,
            num_key_value_heads=s.llm_kv_heads,
            head_dim=s.llm_head_dim,
            intermediate_size=s.llm_mlp,
            vocab_size=s.vocab,
            rope_theta=s.rope_theta,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        )
        self.language_model = Qwen3ForCausalLM._from_config(lcfg, attn_implementation="sdpa")

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        vit = self.vision_model(
            pixel_values=batch["pixel_values"],
            pixel_attention_mask=batch["pixel_attention_mask"],
            spatial_shapes=batch["spatial_shapes"],
        ).last_hidden_state  # [N, gh*gw, D]
        n, _, d = vit.shape
        gh, gw = (int(v) for v in batch["spatial_shapes"][0].tolist())  # host sync, as Eagle
        vit = eagle_pixel_shuffle(vit.reshape(n, gh, gw, d), 0.5).reshape(n, -1, d * 4)
        vit_embeds = self.mlp1(vit)
        input_ids = batch["input_ids"]
        embeds = self.language_model.get_input_embeddings()(input_ids)
        selected = input_ids == self.s.image_token_id
        embeds = embeds.clone()
        embeds[selected] = vit_embeds.reshape(-1, embeds.shape[-1]).to(embeds.dtype)
        out = self.language_model(
            inputs_embeds=embeds, attention_mask=batch["attention_mask"], output_hidden_states=True
        )
        # out.logits ([B, L, vocab]) is computed and discarded, as in the official code.
        return out.hidden_states[-1], batch["attention_mask"], selected


class CategorySpecificLinear(nn.Module):
    """GR00T's per-embodiment linear: ``bmm(x, W[cat_ids]) + b[cat_ids]`` (per-sample gather)."""

    def __init__(self, num_categories: int, input_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.W = nn.Parameter(0.02 * torch.randn(num_categories, input_dim, hidden_dim))
        self.b = nn.Parameter(torch.zeros(num_categories, hidden_dim))

    def forward(self, x: Tensor, cat_ids: Tensor) -> Tensor:
        return torch.bmm(x, self.W[cat_ids]) + self.b[cat_ids].unsqueeze(1)


class CategorySpecificMLP(nn.Module):
    def __init__(
        self, num_categories: int, input_dim: int, hidden_dim: int, output_dim: int
    ) -> None:
        super().__init__()
        self.layer1 = CategorySpecificLinear(num_categories, input_dim, hidden_dim)
        self.layer2 = CategorySpecificLinear(num_categories, hidden_dim, output_dim)

    def forward(self, x: Tensor, cat_ids: Tensor) -> Tensor:
        return self.layer2(F.relu(self.layer1(x, cat_ids)), cat_ids)


def sinusoidal_encoding(timesteps: Tensor, dim: int) -> Tensor:
    """GR00T ``SinusoidalPositionalEncoding``: [B, T] -> [B, T, dim] as [sin, cos]."""
    timesteps = timesteps.float()
    half = dim // 2
    exponent = -torch.arange(half, dtype=torch.float, device=timesteps.device) * (
        math.log(10000.0) / half
    )
    freqs = timesteps.unsqueeze(-1) * exponent.exp()
    return torch.cat([torch.sin(freqs), torch.cos(freqs)], dim=-1)


class MultiEmbodimentActionEncoder(nn.Module):
    def __init__(self, action_dim: int, hidden: int, num_embodiments: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.W1 = CategorySpecificLinear(num_embodiments, action_dim, hidden)
        self.W2 = CategorySpecificLinear(num_embodiments, 2 * hidden, hidden)
        self.W3 = CategorySpecificLinear(num_embodiments, hidden, hidden)

    def forward(self, actions: Tensor, timesteps: Tensor, cat_ids: Tensor) -> Tensor:
        t = actions.shape[1]
        timesteps = timesteps.unsqueeze(1).expand(-1, t)
        a_emb = self.W1(actions, cat_ids)
        tau_emb = sinusoidal_encoding(timesteps, self.hidden).to(dtype=a_emb.dtype)
        x = torch.cat([a_emb, tau_emb], dim=-1)
        h = self.W2(x, cat_ids)
        x = h * torch.sigmoid(h)  # GR00T's swish()
        return self.W3(x, cat_ids)


def diffusers_timesteps(timesteps: Tensor, channels: int) -> Tensor:
    """diffusers ``get_timestep_embedding(flip_sin_to_cos=True, downscale_freq_shift=1)``."""
    half = channels // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=timesteps.device)
    exponent = exponent / (half - 1)
    emb = timesteps[:, None].float() * torch.exp(exponent)[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    return torch.cat([emb[:, half:], emb[:, :half]], dim=-1)


class TimestepEncoder(nn.Module):
    """diffusers ``Timesteps(256)`` + ``TimestepEmbedding`` (linear_1 -> SiLU -> linear_2)."""

    def __init__(self, dim: int, channels: int = 256) -> None:
        super().__init__()
        self.channels = channels
        self.linear_1 = nn.Linear(channels, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, timesteps: Tensor) -> Tensor:
        emb = diffusers_timesteps(timesteps, self.channels).to(self.linear_1.weight.dtype)
        return self.linear_2(F.silu(self.linear_1(emb)))


class AdaLayerNorm(nn.Module):
    """GR00T's AdaLayerNorm: LN(x) * (1 + scale) + shift from SiLU -> Linear(temb)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim * 2)
        self.norm = nn.LayerNorm(dim, eps=1e-5, elementwise_affine=False)

    def forward(self, x: Tensor, temb: Tensor) -> Tensor:
        scale, shift = self.linear(F.silu(temb)).chunk(2, dim=1)
        return self.norm(x) * (1 + scale[:, None]) + shift[:, None]


class DiffusersAttention(nn.Module):
    """What diffusers ``Attention(bias=True, out_bias=True)`` + ``AttnProcessor2_0`` compute."""

    def __init__(self, dim: int, heads: int, dim_head: int, cross_dim: int | None, dropout: float):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.head_dim = dim_head
        self.to_q = nn.Linear(dim, inner, bias=True)
        self.to_k = nn.Linear(cross_dim or dim, inner, bias=True)
        self.to_v = nn.Linear(cross_dim or dim, inner, bias=True)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim, bias=True), nn.Dropout(dropout)])

    def forward(self, x: Tensor, context: Tensor | None, mask: Tensor | None) -> Tensor:
        b = x.shape[0]
        ctx = x if context is None else context
        attn_mask = None
        if mask is not None:
            # prepare_attention_mask: repeat per head, then view as [B, heads, 1, S].
            attn_mask = mask.bool()[:, None, :].repeat_interleave(self.heads, dim=0)
            attn_mask = attn_mask.view(b, self.heads, -1, attn_mask.shape[-1])
        hd = self.head_dim
        q = self.to_q(x).view(b, -1, self.heads, hd).transpose(1, 2)
        k = self.to_k(ctx).view(b, -1, self.heads, hd).transpose(1, 2)
        v = self.to_v(ctx).view(b, -1, self.heads, hd).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        out = out.transpose(1, 2).reshape(b, -1, self.heads * hd).to(q.dtype)
        return self.to_out[1](self.to_out[0](out))


class FeedForward(nn.Module):
    """diffusers ``FeedForward(activation_fn="gelu-approximate", final_dropout=True)``."""

    def __init__(self, dim: int, inner: int, dropout: float) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner)  # GELU(approximate="tanh").proj
        self.net = nn.ModuleList([nn.Dropout(dropout), nn.Linear(inner, dim), nn.Dropout(dropout)])

    def forward(self, x: Tensor) -> Tensor:
        x = F.gelu(self.proj(x), approximate="tanh")
        for m in self.net:
            x = m(x)
        return x


class BasicTransformerBlock(nn.Module):
    """GR00T's ``BasicTransformerBlock`` (norm_type ada_norm, final_dropout)."""

    def __init__(self, s: RefShapes, cross: bool) -> None:
        super().__init__()
        dim = s.dit_inner
        self.norm1 = AdaLayerNorm(dim)
        self.attn1 = DiffusersAttention(
            dim, s.dit_heads, s.dit_head_dim, s.llm_hidden if cross else None, s.dit_dropout
        )
        self.norm3 = nn.LayerNorm(dim, eps=1e-5, elementwise_affine=False)
        self.ff = FeedForward(dim, 4 * dim, s.dit_dropout)
        self.final_dropout = nn.Dropout(s.dit_dropout)

    def forward(self, x: Tensor, temb: Tensor, context: Tensor | None, mask: Tensor | None):
        attn = self.attn1(self.norm1(x, temb), context, mask)
        x = self.final_dropout(attn) + x
        return self.ff(self.norm3(x)) + x


class AlternateVLDiT(nn.Module):
    """Odd blocks self-attend; even blocks cross-attend to text (idx % 2n == 0) or images."""

    def __init__(self, s: RefShapes) -> None:
        super().__init__()
        self.s = s
        dim = s.dit_inner
        self.timestep_encoder = TimestepEncoder(dim)
        self.transformer_blocks = nn.ModuleList(
            BasicTransformerBlock(s, cross=(i % 2 == 0)) for i in range(s.dit_layers)
        )
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.proj_out_1 = nn.Linear(dim, 2 * dim)
        self.proj_out_2 = nn.Linear(dim, s.dit_out)

    def forward(self, x, context, timestep, text_mask, image_mask) -> Tensor:
        temb = self.timestep_encoder(timestep)
        n = self.s.attend_text_every_n_blocks
        for idx, block in enumerate(self.transformer_blocks):
            if idx % 2 == 1:
                x = block(x, temb, None, None)
            elif idx % (2 * n) == 0:
                x = block(x, temb, context, text_mask)
            else:
                x = block(x, temb, context, image_mask)
        shift, scale = self.proj_out_1(F.silu(temb)).chunk(2, dim=1)
        x = self.norm_out(x) * (1 + scale[:, None]) + shift[:, None]
        return self.proj_out_2(x)


class FlowmatchingActionHead(nn.Module):
    def __init__(self, s: RefShapes) -> None:
        super().__init__()
        self.s = s
        d = s.dit_inner
        self.vlln = nn.LayerNorm(s.llm_hidden)
        self.state_encoder = CategorySpecificMLP(
            s.num_embodiments, s.max_state_dim, s.state_hidden, d
        )
        self.action_encoder = MultiEmbodimentActionEncoder(s.max_action_dim, d, s.num_embodiments)
        self.position_embedding = nn.Embedding(s.max_seq_len, d)
        self.model = AlternateVLDiT(s)
        self.action_decoder = CategorySpecificMLP(
            s.num_embodiments, s.dit_out, s.decoder_hidden, s.max_action_dim
        )
        # On the CPU, sampled there and copied over each step, as GR00T's beta_dist.
        cpu = torch.device("cpu")
        self.beta = torch.distributions.Beta(
            torch.tensor(1.5, device=cpu), torch.tensor(1.0, device=cpu)
        )

    def forward(self, feats: Tensor, attn: Tensor, image_mask: Tensor, batch: dict) -> Tensor:
        s = self.s
        vl = self.vlln(feats)
        ids = batch["embodiment_id"]
        state = batch["state"]
        state_features = self.state_encoder(state[:, None], ids)
        actions = batch["action"]
        b = actions.shape[0]
        if "noise" in batch:  # fixed draws (loss-alignment runs feed both loops the same)
            noise, t = batch["noise"].float(), batch["time"].float()
        else:
            noise = torch.randn(actions.shape, device=actions.device, dtype=actions.dtype)
            t = 0.999 * (1 - self.beta.sample([b]).to(actions.device, actions.dtype))
        tt = t[:, None, None]
        noisy = (1 - tt) * noise + tt * actions
        velocity = actions - noise
        t_disc = (t * s.timestep_buckets).long()
        action_features = self.action_encoder(noisy, t_disc, ids)
        pos = torch.arange(action_features.shape[1], device=actions.device)
        action_features = action_features + self.position_embedding(pos).unsqueeze(0)
        sa = torch.cat([state_features, action_features], dim=1)
        text_mask = attn.bool() & ~image_mask
        out = self.model(sa, vl, t_disc, text_mask, image_mask & attn.bool())
        pred = self.action_decoder(out, ids)[:, -actions.shape[1] :]
        mask = batch["action_mask"]
        loss = F.mse_loss(pred, velocity, reduction="none") * mask
        return loss.sum() / mask.sum()


class GR00TN16Reference(nn.Module):
    """Backbone + action head; ``forward(batch) -> loss``."""

    def __init__(self, s: RefShapes) -> None:
        super().__init__()
        self.backbone = EagleBackboneRef(s)
        self.action_head = FlowmatchingActionHead(s)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        feats, attn, image_mask = self.backbone(batch)
        return self.action_head(feats, attn, image_mask, batch)


def apply_reference_freezing(model: GR00TN16Reference, s: RefShapes) -> dict[str, int]:
    """N1.6: ViT, mlp1 and LM frozen (bf16) but the top ``tune_top_llm_layers``; the rest fp32."""
    model.requires_grad_(True)
    bb = model.backbone
    bb.vision_model.requires_grad_(False)
    bb.mlp1.requires_grad_(False)
    lm = bb.language_model
    lm.requires_grad_(False)
    layers = lm.model.layers
    for layer in layers[len(layers) - s.tune_top_llm_layers :]:
        layer.requires_grad_(True)
    counts = {"trainable": 0, "frozen": 0}
    for p in model.parameters():
        p.data = p.data.to(torch.float32 if p.requires_grad else torch.bfloat16)
        counts["trainable" if p.requires_grad else "frozen"] += p.numel()
    return counts


def build_reference(s: RefShapes, device: torch.device | str) -> GR00TN16Reference:
    """Build (on ``device``), freeze and return the reference policy in train mode."""
    with torch.device(device):
        model = GR00TN16Reference(s)
    apply_reference_freezing(model, s)
    return model.train()


def build_optimizer(model: nn.Module, device_type: str) -> torch.optim.Optimizer:
    """HF Trainer's AdamW: decay on all but biases/norms, fused where available."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if (p.ndim < 2 or "norm" in name) else decay).append(p)
    groups = [{"params": decay, "weight_decay": 1e-5}, {"params": no_decay, "weight_decay": 0.0}]
    fused = device_type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, fused=fused)


def to_device(batch: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """HF Trainer ``_prepare_inputs``: every tensor ``.to(device)`` (pinned when the loader pins)."""
    out = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    for key in ("state", "action", "action_mask"):
        out[key] = out[key].float()
    return out


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, Tensor],
    device_type: str,
    bf16: bool = True,
) -> float:
    """One HF-Trainer-style step (autocast, clip 1.0); returns ``loss.item()``, a host sync."""
    autocast = torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=bf16)
    with autocast:
        loss = model(batch)
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach().item())
