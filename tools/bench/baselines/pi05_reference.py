"""Reference pi0.5 training loop: openpi's PyTorch training (``scripts/train_pytorch.py``,
``models_pytorch/pi0_pytorch.py``, ``gemma_pytorch.py``) rebuilt from the libraries it uses, as
the ``--model pi05`` baseline of ``tools/bench/vla_throughput.py``.

Model (``Pi05Reference``): ``SiglipVisionModel`` (So400m/14, no pooling head), the linear
``multi_modal_projector``, a Gemma LM and a Gemma action expert (``GemmaModel``s via
``_from_config``). Per layer, as ``compute_layer_complete``: each expert's own norm and q/k/v,
[prefix, suffix] concatenated, rotated and attended once (Gemma's ``eager_attention_forward``
under an additive 4D mask, 0 / -2.3819763e38), each expert's own o_proj, (gated) residuals,
norm and MLP. Layers, embeddings, projections, final norms and the joint pass run under
``torch.utils.checkpoint`` (``_apply_checkpoint``: always on in openpi's training). Precision as
``to_bfloat16_for_selected_params("bfloat16")``: bf16 except the patch embedding, position table
and every norm; the action / time projections stay fp32; no autocast. Flow matching: t =
Beta(1.5, 1) * 0.999 + 0.001 on the device, loss = MSE(noise - action, v_t) averaged over every
(step, dim) of the 32-wide padded chunk. Training images get openpi's on-device augmentation
(base camera: 95% crop, resize back, rotation in [-5, 5] degrees with the ``abs(angle) > 0.1``
host check; every camera: brightness / contrast / saturation; one draw per camera per batch).
Loop (``train_step``): AdamW(betas (0.9, 0.95), eps 1e-8, wd 1e-10) over all parameters (torch's
foreach default, moments in the parameters' dtype), openpi's cosine lr (warm-up 1000 steps to
2.5e-5, decay to 2.5e-6 over 30k), ``clip_grad_norm_(1.0)``, ``loss.item()`` and the grad norm
read every step, no torch.compile (openpi compiles only ``sample_actions``), TF32 on.

Every way this differs from the official code, and why:

1. Random init: the reference is built from the same config as longboat's run, without
   downloading weights: pi0.5's published shapes (the ``full`` flavour) or the tiny flavour,
   read from longboat's ``Pi05Config`` by ``RefShapes.from_pi05_config`` so both loops train the
   same model.
2. openpi patches transformers 4.53 (``transformers_replace``) for an adaRMS ``GemmaRMSNorm``
   and ``_gated_residual``; stock transformers 5.x has neither, so the expert's norms are
   ``AdaRMSNormRef`` (fp32 statistics, zero-initialised ``dense`` -> scale, shift, gate, as the
   patched norm) and the gated residuals are inline.
3. Only the PaliGemma pieces openpi's training uses, not ``PaliGemmaForConditionalGeneration``
   (its tied ``lm_head`` is never called in training, no extra parameters). The expert is a
   ``GemmaModel``: openpi's ``GemmaForCausalLM`` keeps an unused untied ``lm_head`` (257152 x
   1024 = 263M parameters, 0.5 GB bf16, no grad, so AdamW skips it), left out here and in the
   parameter counts.
4. transformers 5.x's Gemma embedding scales by sqrt(hidden) itself; openpi (4.53, unscaled
   ``nn.Embedding``) multiplies after the lookup. Here: ``F.embedding`` on the table, then the
   same explicit multiply, so it is scaled once, as in openpi.
5. The vision embeddings are fp32 and its encoder bf16; a forward hook casts the embeddings'
   output to the encoder's dtype, which stock torch needs for the bf16 LayerNorm (openpi's
   patched SigLIP handles it).
6. No SentencePiece tokenizer (it comes from the hub): the prompt is the task string through longboat's
   byte-level stand-in (capped at the same text length), then one token per real state dim
   (256 bins, ids at the top of the vocab, as longboat), padded to ``max_token_len`` (200 at
   full shapes) like ``TokenizePrompt``. openpi spells the bins as decimal text, several tokens
   per dim, so its prompts are longer; the padded length the model computes on is the same.
7. State bins are clipped to [0, 255] (openpi's ``np.digitize - 1`` gives -1 / 256 outside
   [-1, 1]; longboat clips, and the reference must see the same tokens).
8. ``sincos`` time embedding in fp32 (openpi: periods in fp64, cast to fp32): ~1e-7 relative.
9. No DDP wrapper on one GPU (only its reducer hooks), no EMA, checkpoints or wandb.
10. A batch may carry ``noise`` and ``time`` (the flow-matching draws): only the loss
    alignment uses this, to feed both loops identical draws; its ``augment=False`` skips the
    image augmentation so both loops see the same pixels.
11. The data path (``pi05_reference_data.py``) decodes each frame per sample with PyAV in
    DataLoader workers; the worker count is a benchmark argument, the same for both loops.

Parameter counts vs longboat's ``Pi05`` (same shapes): one extra tensor, the LM's final ``norm``
(``llm.hidden_size`` values; openpi computes it on the prefix and discards it, longboat never
does); the rest maps one to one (``transfer_weights``). Trainable counts differ by the last LM
layer's q_proj / o_proj / post-attention norm / MLP (109M at full shapes): longboat freezes them
(they cannot reach the loss); the reference keeps them trainable, as openpi, with no gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .config_fields import from_cfg, read_shapes

MASK_MIN = -2.3819763e38
"""Additive mask value openpi uses for disallowed keys (``_prepare_attention_masks_4d``)."""


@dataclass(frozen=True, kw_only=True)
class RefShapes:
    """Every shape of the reference pi0.5 (full or the tiny CPU flavour)."""

    vit_hidden: int = from_cfg("vision.hidden_size")
    vit_layers: int = from_cfg("vision.num_layers")
    vit_heads: int = from_cfg("vision.num_heads")
    vit_mlp: int = from_cfg("vision.intermediate_size")
    patch: int = from_cfg("vision.patch_size")
    image_size: int = from_cfg("image.pad_to_square")  # openpi's resize_with_pad target, 224
    vit_eps: float = from_cfg("vision.layer_norm_eps", default=1e-6)
    llm_hidden: int = from_cfg("llm.hidden_size")
    llm_layers: int = from_cfg("llm.num_layers")
    heads: int = from_cfg("llm.num_heads")
    kv_heads: int = from_cfg("llm.num_kv_heads")
    head_dim: int = from_cfg("llm.head_dim")
    llm_mlp: int = from_cfg("llm.intermediate_size")
    vocab: int = from_cfg("llm.vocab_size")
    expert_hidden: int = from_cfg("expert.hidden_size")
    expert_mlp: int = from_cfg("expert.intermediate_size")
    rope_theta: float = from_cfg("llm.rope_theta", default=10000.0)
    rms_eps: float = from_cfg("llm.rms_eps", default=1e-6)
    num_cameras: int = from_cfg("num_cameras", default=3)
    action_dim: int = from_cfg("action_dim")
    max_state_dim: int = from_cfg("max_state_dim")
    horizon: int = from_cfg("action_horizon")
    num_state_bins: int = from_cfg("num_state_bins", default=256)
    bin_offset: int = from_cfg("bin_offset")
    max_token_len: int = from_cfg("max_token_len")
    max_text_tokens: int
    time_min_period: float = from_cfg("time_min_period", default=4e-3)
    time_max_period: float = from_cfg("time_max_period", default=4.0)

    @classmethod
    def from_pi05_config(cls, cfg: Any) -> RefShapes:
        """Shapes from a ``longboat.embodied`` ``Pi05Config`` (duck-typed)."""
        size = cfg.image.pad_to_square
        if size is None:
            raise ValueError("the pi0.5 reference needs image.pad_to_square (openpi: 224)")
        grid = size // cfg.vision.patch_size
        if tuple(cfg.vision.pos_grid) != (grid, grid):
            raise ValueError(
                f"vision.pos_grid={cfg.vision.pos_grid} must be {grid}x{grid} for {size}px "
                "images (SigLIP's position table is not interpolated)"
            )
        if cfg.llm.rope_theta != cfg.expert.rope_theta:
            raise ValueError("both experts must share the RoPE base (one rotary table)")
        text = max(4, min(32, cfg.max_token_len - cfg.max_state_dim))
        return read_shapes(cls, cfg, max_text_tokens=text)

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch) ** 2


class AdaRMSNormRef(nn.Module):
    """openpi's patched ``GemmaRMSNorm(use_adarms=True)``: fp32 RMS, ``dense(cond)`` -> (scale,
    shift, gate), ``x * (1 + scale) + shift`` in fp32; returns it in x's dtype and the gate."""

    def __init__(self, dim: int, cond_dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * dim)
        nn.init.zeros_(self.dense.weight)
        nn.init.zeros_(self.dense.bias)

    def forward(self, x: Tensor, cond: Tensor) -> tuple[Tensor, Tensor]:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        scale, shift, gate = self.dense(cond)[:, None].chunk(3, dim=-1)
        normed = normed * (1 + scale.float()) + shift.float()
        return normed.to(x.dtype), gate.to(x.dtype)


def _norm(norm: nn.Module, x: Tensor, cond: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Plain Gemma norm (``cond=None``) or adaRMSNorm: (normed, gate or None)."""
    if isinstance(norm, AdaRMSNormRef):
        assert cond is not None
        return norm(x, cond)
    return norm(x), None


def checkpointed(on: bool, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, under openpi's ``torch.utils.checkpoint`` when ``on``."""
    if on:
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    return fn(*args)


def _gated_residual(x: Tensor, y: Tensor, gate: Tensor | None) -> Tensor:
    return x + y if gate is None else x + y * gate


def sincos_time(t: Tensor, dim: int, min_period: float, max_period: float) -> Tensor:
    """openpi's ``create_sinusoidal_pos_embedding`` (fp32 here, see difference 8)."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float32, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    x = (1.0 / period * 2 * math.pi)[None, :] * t[:, None]
    return torch.cat([torch.sin(x), torch.cos(x)], dim=1)


def prefix_lm_2d_mask(pad_masks: Tensor, ar_masks: Tensor) -> Tensor:
    """big_vision's ``make_att_2d_masks``: key j visible to query i when cumsum(ar)[j] <=
    cumsum(ar)[i] and both are valid. [B, N] bool, [B, N] int -> [B, N, N] bool."""
    cum = torch.cumsum(ar_masks, dim=1)
    att = cum[:, None, :] <= cum[:, :, None]
    return att & (pad_masks[:, None, :] & pad_masks[:, :, None])


class PaliGemmaWithExpertRef(nn.Module):
    """SigLIP + projector + Gemma LM (prefix) and the Gemma action expert (suffix)."""

    def __init__(self, s: RefShapes) -> None:
        super().__init__()
        from transformers import GemmaConfig, GemmaModel, SiglipVisionConfig, SiglipVisionModel

        self.s = s
        vcfg = SiglipVisionConfig(
            hidden_size=s.vit_hidden,
            num_hidden_layers=s.vit_layers,
            num_attention_heads=s.vit_heads,
            intermediate_size=s.vit_mlp,
            patch_size=s.patch,
            image_size=s.image_size,
            hidden_act="gelu_pytorch_tanh",
            layer_norm_eps=s.vit_eps,
            vision_use_head=False,
        )
        self.vision_tower = SiglipVisionModel._from_config(vcfg, attn_implementation="sdpa")
        self.multi_modal_projector = nn.Linear(s.vit_hidden, s.llm_hidden)

        def gemma(width: int, mlp: int, vocab: int) -> Any:
            special = (
                {} if vocab > 2 else dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
            )
            cfg = GemmaConfig(
                **special,
                vocab_size=vocab,
                hidden_size=width,
                intermediate_size=mlp,
                num_hidden_layers=s.llm_layers,
                num_attention_heads=s.heads,
                num_key_value_heads=s.kv_heads,
                head_dim=s.head_dim,
                hidden_act="gelu_pytorch_tanh",
                rms_norm_eps=s.rms_eps,
                max_position_embeddings=8192,
            )
            rope = getattr(cfg, "rope_parameters", None) or {}
            theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
            if theta != s.rope_theta:
                raise ValueError(f"Gemma's RoPE base is {theta}, the config asks {s.rope_theta}")
            return GemmaModel._from_config(cfg, attn_implementation="eager")

        self.language_model = gemma(s.llm_hidden, s.llm_mlp, s.vocab)
        # The expert has no vocabulary (openpi sets its embed_tokens to None after building).
        self.gemma_expert = gemma(s.expert_hidden, s.expert_mlp, 1)
        self.gemma_expert.embed_tokens = None
        we = s.expert_hidden
        for layer in self.gemma_expert.layers:
            layer.input_layernorm = AdaRMSNormRef(we, we, s.rms_eps)
            layer.post_attention_layernorm = AdaRMSNormRef(we, we, s.rms_eps)
        self.gemma_expert.norm = AdaRMSNormRef(we, we, s.rms_eps)
        vm = self.vision_model
        vm.embeddings.register_forward_hook(
            lambda mod, inp, out: out.to(vm.encoder.layers[0].layer_norm1.weight.dtype)
        )

    @property
    def vision_model(self) -> nn.Module:
        """The SigLIP transformer (transformers < 5.2x nests it as ``.vision_model``)."""
        return getattr(self.vision_tower, "vision_model", self.vision_tower)

    def to_bfloat16_for_selected_params(self, precision: str) -> None:
        """openpi's precision layout: everything bf16 except the fp32 keep-list."""
        if precision == "float32":
            self.float()
            return
        self.to(torch.bfloat16)
        emb = self.vision_model.embeddings
        keep = [emb.patch_embedding, emb.position_embedding]
        for stack in (self.language_model, self.gemma_expert):
            keep.append(stack.norm)
            for layer in stack.layers:
                keep += [layer.input_layernorm, layer.post_attention_layernorm]
        for m in keep:
            m.float()

    def embed_image(self, pixels: Tensor) -> Tensor:
        feats = self.vision_tower(pixel_values=pixels).last_hidden_state
        return self.multi_modal_projector(feats.to(self.multi_modal_projector.weight.dtype))

    def embed_language_tokens(self, tokens: Tensor) -> Tensor:
        return F.embedding(tokens, self.language_model.embed_tokens.weight)

    def _layer(
        self, i: int, embeds: list[Tensor], mask: Tensor, position_ids: Tensor, cond: Tensor
    ) -> list[Tensor]:
        """One joint layer (openpi's ``compute_layer_complete``)."""
        layers = [self.language_model.layers[i], self.gemma_expert.layers[i]]
        conds = [None, cond]
        qs, ks, vs, gates = [], [], [], []
        for layer, x, c in zip(layers, embeds, conds, strict=True):
            h, gate = _norm(layer.input_layernorm, x, c)
            gates.append(gate)
            shape = (*h.shape[:-1], -1, self.s.head_dim)
            attn = layer.self_attn
            qs.append(attn.q_proj(h).view(shape).transpose(1, 2))
            ks.append(attn.k_proj(h).view(shape).transpose(1, 2))
            vs.append(attn.v_proj(h).view(shape).transpose(1, 2))
        q, k, v = torch.cat(qs, dim=2), torch.cat(ks, dim=2), torch.cat(vs, dim=2)
        from transformers.models.gemma import modeling_gemma

        dummy = torch.zeros(q.shape[0], q.shape[2], q.shape[3], device=q.device, dtype=q.dtype)
        cos, sin = self.language_model.rotary_emb(dummy, position_ids)
        q, k = modeling_gemma.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        lm_attn = layers[0].self_attn
        att, _ = modeling_gemma.eager_attention_forward(lm_attn, q, k, v, mask, lm_attn.scaling)
        att = att.reshape(q.shape[0], -1, self.s.heads * self.s.head_dim)
        outs, start = [], 0
        for layer, x, c, gate in zip(layers, embeds, conds, gates, strict=True):
            end = start + x.shape[1]
            o = layer.self_attn.o_proj(att[:, start:end].to(layer.self_attn.o_proj.weight.dtype))
            x = _gated_residual(x, o, gate)
            h, gate2 = _norm(layer.post_attention_layernorm, x, c)
            h = _mlp_input(layer, h)
            outs.append(_gated_residual(x, layer.mlp(h), gate2))
            start = end
        return outs

    def forward(
        self, embeds: list[Tensor], mask: Tensor, position_ids: Tensor, cond: Tensor, ckpt: bool
    ) -> list[Tensor]:
        """Joint pass over [prefix, suffix]; returns both final-normed outputs."""
        for i in range(self.s.llm_layers):
            embeds = checkpointed(ckpt, self._layer, i, embeds, mask, position_ids, cond)

        def final_norms(embeds: list[Tensor], cond: Tensor) -> list[Tensor]:
            return [
                _norm(self.language_model.norm, embeds[0], None)[0],
                _norm(self.gemma_expert.norm, embeds[1], cond)[0],
            ]

        return checkpointed(ckpt, final_norms, embeds, cond)


def _mlp_input(layer: nn.Module, h: Tensor) -> Tensor:
    """openpi casts the normed activations to bf16 when the MLP is bf16."""
    w = layer.mlp.up_proj.weight
    return h.to(w.dtype) if w.dtype == torch.bfloat16 else h


def augment_images(x: Tensor, geometric: bool) -> Tensor:
    """openpi's ``preprocess_observation_pytorch`` training augmentation for one camera:
    x [B, H, W, 3] in [-1, 1] -> same; one random draw per call (the whole batch)."""
    x = x / 2.0 + 0.5
    if geometric:
        h, w = x.shape[1:3]
        ch, cw = int(h * 0.95), int(w * 0.95)
        if h - ch > 0 and w - cw > 0:
            sh = torch.randint(0, h - ch + 1, (1,), device=x.device)
            sw = torch.randint(0, w - cw + 1, (1,), device=x.device)
            x = x[:, sh : sh + ch, sw : sw + cw, :]  # tensor indices: a host sync, as openpi
        x = F.interpolate(
            x.permute(0, 3, 1, 2), size=(h, w), mode="bilinear", align_corners=False
        ).permute(0, 2, 3, 1)
        angle = torch.rand(1, device=x.device) * 10 - 5
        if torch.abs(angle) > 0.1:  # host sync, as openpi
            rad = angle * torch.pi / 180.0
            cos_a, sin_a = torch.cos(rad), torch.sin(rad)
            gy, gx = torch.meshgrid(
                torch.linspace(-1, 1, h, device=x.device),
                torch.linspace(-1, 1, w, device=x.device),
                indexing="ij",
            )
            gx = gx.unsqueeze(0).expand(x.shape[0], -1, -1)
            gy = gy.unsqueeze(0).expand(x.shape[0], -1, -1)
            grid = torch.stack([gx * cos_a - gy * sin_a, gx * sin_a + gy * cos_a], dim=-1)
            x = F.grid_sample(
                x.permute(0, 3, 1, 2), grid, mode="bilinear", padding_mode="zeros",
                align_corners=False,
            ).permute(0, 2, 3, 1)  # fmt: skip
    x = x * (0.7 + torch.rand(1, device=x.device) * 0.6)
    mean = x.mean(dim=[1, 2, 3], keepdim=True)
    x = (x - mean) * (0.6 + torch.rand(1, device=x.device) * 0.8) + mean
    gray = x.mean(dim=-1, keepdim=True)
    x = gray + (x - gray) * (0.5 + torch.rand(1, device=x.device) * 1.0)
    return x.clamp(0, 1) * 2.0 - 1.0


class Pi05Reference(nn.Module):
    """openpi's ``PI0Pytorch`` with ``pi05=True``: ``forward(batch) -> per-element loss``."""

    def __init__(self, s: RefShapes) -> None:
        super().__init__()
        self.s = s
        we = s.expert_hidden
        self.paligemma_with_expert = PaliGemmaWithExpertRef(s)
        self.action_in_proj = nn.Linear(s.action_dim, we)
        self.action_out_proj = nn.Linear(we, s.action_dim)
        self.time_mlp_in = nn.Linear(we, we)
        self.time_mlp_out = nn.Linear(we, we)
        self.gradient_checkpointing = True
        self.augment = True

    def set_precision(self, precision: str) -> None:
        """openpi builds ``paligemma_with_expert`` in ``config.dtype`` (bf16 for training)."""
        self.paligemma_with_expert.to_bfloat16_for_selected_params(precision)

    def _ckpt(self, fn: Any, *args: Any) -> Any:
        return checkpointed(self.gradient_checkpointing and self.training, fn, *args)

    def _images(self, batch: dict[str, Tensor]) -> list[Tensor]:
        """[B, C, H, W, 3] uint8 (the loader's layout) or [B, C, 3, H, W] float in [-1, 1]
        -> one [B, 3, H, W] float tensor in [-1, 1] per camera (augmented in training)."""
        images = batch["images"]
        out = []
        for c in range(images.shape[1]):
            x = images[:, c]
            if x.dtype == torch.uint8:  # Observation.from_dict
                x = x.float() / 255.0 * 2.0 - 1.0
            else:
                x = x.float().permute(0, 2, 3, 1)
            if self.training and self.augment:
                x = augment_images(x, geometric=c == 0)  # camera 0 = base, others wrist
            out.append(x.permute(0, 3, 1, 2).contiguous())
        return out

    def embed_prefix(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        pwe = self.paligemma_with_expert
        embs, pads = [], []
        cam_mask = batch["image_mask"].bool()
        for c, img in enumerate(self._images(batch)):
            emb = self._ckpt(pwe.embed_image, img)
            embs.append(emb)
            pads.append(cam_mask[:, c, None].expand(emb.shape[0], emb.shape[1]))

        def lang(tokens: Tensor) -> Tensor:
            e = pwe.embed_language_tokens(tokens)
            return e * math.sqrt(e.shape[-1])

        embs.append(self._ckpt(lang, batch["tokenized_prompt"]))
        pads.append(batch["tokenized_prompt_mask"].bool())
        emb = torch.cat(embs, dim=1)
        pad = torch.cat(pads, dim=1)
        ar = torch.zeros(pad.shape, dtype=torch.int32, device=pad.device)
        return emb, pad, ar

    def embed_suffix(self, x_t: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        s = self.s
        temb = sincos_time(t, s.expert_hidden, s.time_min_period, s.time_max_period).to(t.dtype)
        action_emb = self._ckpt(self.action_in_proj, x_t)

        def time_mlp(x: Tensor) -> Tensor:
            return F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(x))))

        cond = self._ckpt(time_mlp, temb)
        b, h = action_emb.shape[:2]
        pad = torch.ones(b, h, dtype=torch.bool, device=x_t.device)
        ar = torch.zeros(b, h, dtype=torch.int32, device=x_t.device)
        ar[:, 0] = 1  # the prefix never sees the actions; actions see each other
        return action_emb, pad, ar, cond

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        """Per-element flow-matching loss [B, H, action_dim] (the loop takes ``.mean()``)."""
        actions = batch["action"].float()
        if "noise" in batch:
            noise, t = batch["noise"].float(), batch["time"].float()
        else:
            noise = torch.normal(0.0, 1.0, actions.shape, device=actions.device)
            beta = torch.distributions.Beta(
                torch.tensor(1.5, device=actions.device), torch.tensor(1.0, device=actions.device)
            )
            t = beta.sample((actions.shape[0],)) * 0.999 + 0.001
        tt = t[:, None, None]
        x_t = tt * noise + (1 - tt) * actions
        u_t = noise - actions
        prefix, pre_pad, pre_ar = self.embed_prefix(batch)
        suffix, suf_pad, suf_ar, cond = self.embed_suffix(x_t, t)
        pwe = self.paligemma_with_expert
        if pwe.language_model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16:
            prefix, suffix = prefix.to(torch.bfloat16), suffix.to(torch.bfloat16)
        pad = torch.cat([pre_pad, suf_pad], dim=1)
        att_2d = prefix_lm_2d_mask(pad, torch.cat([pre_ar, suf_ar], dim=1))
        position_ids = torch.cumsum(pad, dim=1) - 1
        mask4d = torch.where(att_2d[:, None], 0.0, MASK_MIN)

        def joint(prefix: Tensor, suffix: Tensor, mask4d: Tensor, pos: Tensor, c: Tensor):
            ckpt = self.gradient_checkpointing and self.training
            return pwe([prefix, suffix], mask4d, pos, c, ckpt)[1]

        out = self._ckpt(joint, prefix, suffix, mask4d, position_ids, cond)
        out = out[:, -self.s.horizon :].to(torch.float32)
        v_t = self._ckpt(self.action_out_proj, out)
        return F.mse_loss(u_t, v_t, reduction="none")


def build_reference(
    s: RefShapes, device: torch.device | str, precision: str = "bfloat16"
) -> Pi05Reference:
    """Build on ``device``, set openpi's precision layout, train mode."""
    with torch.device(device):
        model = Pi05Reference(s)
    model.set_precision(precision)
    return model.train()


def parameter_counts(model: nn.Module) -> dict[str, int]:
    counts = {"trainable": 0, "frozen": 0, "total": 0}
    for p in model.parameters():
        counts["trainable" if p.requires_grad else "frozen"] += p.numel()
        counts["total"] += p.numel()
    return counts


def lr_at(step: int, warmup: int = 1000, peak: float = 2.5e-5, decay_steps: int = 30_000,
          end: float = 2.5e-6) -> float:  # fmt: skip
    """openpi's ``CosineDecaySchedule`` (linear warm-up from peak/(warmup+1), cosine decay)."""
    if step < warmup:
        init = peak / (warmup + 1)
        return init + (peak - init) * step / warmup
    frac = min(1.0, (step - warmup) / max(1, decay_steps - warmup))
    return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * frac))


def build_optimizer(model: nn.Module, lr: float = 2.5e-5) -> torch.optim.Optimizer:
    """openpi's AdamW: every parameter, betas (0.9, 0.95), eps 1e-8, weight decay 1e-10."""
    return torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=1e-10
    )


def to_device(batch: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """train_pytorch: every array of the batch ``.to(device)``."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, Tensor],
    step: int,
    *,
    lr: float | None = None,
    grad_clip: float = 1.0,
) -> float:
    """One openpi PyTorch training step; returns ``loss.item()``. ``lr=None``: openpi's cosine
    schedule at ``step``; a number: that constant lr (loss alignment)."""
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step) if lr is None else lr
    loss = model(batch).mean()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _ = float(grad_norm)  # logged every step (a host sync)
    return float(loss.item())


@torch.no_grad()
def transfer_weights(lb: nn.Module, rf: Pi05Reference) -> None:
    """Copy longboat's ``Pi05`` weights into the reference (both fp32, before ``set_precision``);
    the reference's extra LM final norm keeps its identity init (its output is discarded)."""
    pwe = rf.paligemma_with_expert
    copied: set[int] = set()

    def put(dst: Tensor, src: Tensor) -> None:
        if dst.shape != src.shape:
            raise ValueError(f"shape {tuple(src.shape)} -> {tuple(dst.shape)}")
        dst.copy_(src)
        copied.add(id(dst))

    def put_linear(dst: nn.Module, src: nn.Module) -> None:
        put(dst.weight, src.weight)
        put(dst.bias, src.bias)

    vm, v = pwe.vision_model, lb.vision
    put_linear(vm.embeddings.patch_embedding, v.patch_embed)
    put(vm.embeddings.position_embedding.weight, v.pos_embed)
    for blk, layer in zip(v.blocks, vm.encoder.layers, strict=True):
        qkv_w, qkv_b = blk.qkv.weight.chunk(3, 0), blk.qkv.bias.chunk(3, 0)
        for name, w, b in zip(("q_proj", "k_proj", "v_proj"), qkv_w, qkv_b, strict=True):
            put(getattr(layer.self_attn, name).weight, w)
            put(getattr(layer.self_attn, name).bias, b)
        pairs = (
            (blk.out_proj, layer.self_attn.out_proj),
            (blk.layer_norm1, layer.layer_norm1),
            (blk.layer_norm2, layer.layer_norm2),
            (blk.fc1, layer.mlp.fc1),
            (blk.fc2, layer.mlp.fc2),
        )
        for src, dst in pairs:
            put_linear(dst, src)
    put_linear(vm.post_layernorm, v.post_layernorm)
    put_linear(pwe.multi_modal_projector, lb.projector)
    put(pwe.language_model.embed_tokens.weight, lb.embed_tokens.weight)
    for jl, lm_l, ex_l in zip(
        lb.joint.layers, pwe.language_model.layers, pwe.gemma_expert.layers, strict=True
    ):
        for src, dst in ((jl.lm, lm_l), (jl.expert, ex_l)):
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                put(getattr(dst.self_attn, n).weight, getattr(src, n).weight)
            for n in ("gate_proj", "up_proj", "down_proj"):
                put(getattr(dst.mlp, n).weight, getattr(src.mlp, n).weight)
        put(lm_l.input_layernorm.weight, jl.lm.input_norm.weight)
        put(lm_l.post_attention_layernorm.weight, jl.lm.post_attention_norm.weight)
        for src, dst in (
            (jl.expert.input_norm, ex_l.input_layernorm),
            (jl.expert.post_attention_norm, ex_l.post_attention_layernorm),
        ):
            put_linear(dst.dense, src.modulation)
    put_linear(pwe.gemma_expert.norm.dense, lb.expert_norm.modulation)
    for n in ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out"):
        put_linear(getattr(rf, n), getattr(lb, n))
    extra = {id(pwe.language_model.norm.weight)}
    missing = [n for n, p in rf.named_parameters() if id(p) not in copied | extra]
    if missing:
        raise KeyError(f"reference parameters not transferred: {missing[:8]}")


def discretize_state(state: np.ndarray, num_bins: int) -> np.ndarray:
    """openpi's ``np.digitize(state, linspace(-1, 1, bins + 1)[:-1]) - 1``, clipped."""
    bins = np.linspace(-1, 1, num_bins + 1)[:-1]
    return np.clip(np.digitize(state, bins=bins) - 1, 0, num_bins - 1)


def tokenize_prompt(
    text_ids: list[int], state: np.ndarray, s: RefShapes
) -> tuple[np.ndarray, np.ndarray]:
    """openpi's ``TokenizePrompt(discrete_state_input=True)``, as difference 6 describes."""
    ids = list(text_ids[: s.max_text_tokens])
    ids += [int(b) + s.bin_offset for b in discretize_state(state, s.num_state_bins)]
    ids = ids[: s.max_token_len]
    tokens = np.zeros(s.max_token_len, np.int64)
    mask = np.zeros(s.max_token_len, bool)
    tokens[: len(ids)] = ids
    mask[: len(ids)] = True
    return tokens, mask


def reference_batch_from_longboat(batch: dict[str, Tensor], s: RefShapes) -> dict[str, Tensor]:
    """The reference's view of a longboat ``Pi05`` batch: the same pixels, tokens and draws."""
    b = batch["input_ids"].shape[0]
    tokens = np.zeros((b, s.max_token_len), np.int64)
    mask = np.zeros((b, s.max_token_len), bool)
    state_mask = batch.get("state_mask")
    for i in range(b):
        text = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
        st = batch["state"][i].float()
        if state_mask is not None:
            st = st[state_mask[i].bool()]
        tokens[i], mask[i] = tokenize_prompt(text, st.numpy(), s)
    out = {
        "images": batch["images"],
        "image_mask": batch.get("image_mask", torch.ones(b, batch["images"].shape[1], dtype=bool)),
        "tokenized_prompt": torch.from_numpy(tokens),
        "tokenized_prompt_mask": torch.from_numpy(mask),
        "state": batch["state"],
        "action": batch["action"],
    }
    for key in ("noise", "time"):
        if key in batch:
            out[key] = batch[key]
    return out
