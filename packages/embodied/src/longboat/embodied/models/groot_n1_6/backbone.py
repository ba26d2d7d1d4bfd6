"""GR00T N1.6 backbone: SigLIP2-style ViT -> pixel-unshuffle projector -> Qwen3 truncated
at ``select_layer``, then the LM's final RMSNorm (no LM head)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longboat.embodied.models.common import ops
from longboat.embodied.models.common.image_preprocessing import preprocess_images
from longboat.embodied.models.common.layers import ensure_row_nonempty, positions_from_mask
from longboat.embodied.models.common.lm import DecoderStack
from longboat.embodied.models.common.vit import VisionTransformer
from longboat.embodied.models.groot_n1_6.config import GrootN16Config


class PixelUnshuffleProjector(nn.Module):
    """``mlp1``: 2x2 pixel-unshuffle, LayerNorm(4*Dv) -> Linear -> GELU -> Linear."""

    def __init__(self, vision_dim: int, llm_dim: int, factor: int) -> None:
        super().__init__()
        self.factor = factor
        d_in = vision_dim * factor * factor
        self.norm = nn.LayerNorm(d_in)
        self.fc1 = nn.Linear(d_in, llm_dim)
        self.fc2 = nn.Linear(llm_dim, llm_dim)

    def forward(self, tokens: Tensor, grid: tuple[int, int]) -> Tensor:
        """tokens [N, gh*gw, Dv] -> [N, (gh/f)*(gw/f), D_llm]."""
        n, _, d = tokens.shape
        gh, gw = grid
        x = tokens.transpose(1, 2).reshape(n, d, gh, gw)
        x = F.pixel_unshuffle(x, self.factor).flatten(2).transpose(1, 2)
        x = ops.layer_norm(x, self.norm.weight, self.norm.bias, self.norm.eps)
        return self.fc2(F.gelu(self.fc1(x)))


def insert_image_tokens(
    input_ids: Tensor, attention_mask: Tensor, num_image_tokens: int, image_token_id: int
) -> tuple[Tensor, Tensor]:
    """Prepend ``num_image_tokens`` image placeholders to every row of a text batch (what
    the model does itself unless ``image_tokens_in_text``)."""
    b = input_ids.shape[0]
    img = torch.full(
        (b, num_image_tokens), image_token_id, dtype=input_ids.dtype, device=input_ids.device
    )
    ones = torch.ones(
        (b, num_image_tokens), dtype=attention_mask.dtype, device=attention_mask.device
    )
    return torch.cat([img, input_ids], 1), torch.cat([ones, attention_mask], 1)


class EagleBackbone(nn.Module):
    """Vision-language features for the action head."""

    def __init__(self, cfg: GrootN16Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision = VisionTransformer(cfg.vision)
        self.projector = PixelUnshuffleProjector(
            cfg.vision.hidden_size, cfg.llm.hidden_size, cfg.pixel_unshuffle
        )
        # Layers >= select_layer are never built: their output is never read. Isaac-GR00T
        # pops them from Qwen3 and reads hidden_states[-1], which transformers takes after
        # the model's final norm: the features are that norm of the last kept layer.
        self.llm = DecoderStack(replace(cfg.llm, num_layers=cfg.select_layer), final_norm=True)

    def encode_images(self, images: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """images [B, C, 3, H, W] -> image embeddings [B, C*T, D_llm] (camera-major)."""
        if images.dim() != 5:
            raise ValueError(
                f"batch['images'] must be [B, n_cams, 3, H, W], got {tuple(images.shape)}"
            )
        b, c = images.shape[:2]
        pix = preprocess_images(images, self.cfg.image, train=self.training, generator=generator)
        tokens, grid = self.vision(pix.flatten(0, 1))
        proj = self.projector(tokens.to(self.projector.fc1.weight.dtype), grid)
        return proj.reshape(b, c * proj.shape[1], -1)

    def forward(
        self,
        batch: dict[str, Tensor],
        generator: torch.Generator | None = None,
        check_tokens: bool = True,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Returns (features [B, L, D_llm] fp32, valid mask [B, L], image mask [B, L]).
        ``check_tokens`` validates placeholder counts (a host sync)."""
        image_emb = self.encode_images(batch["images"], generator)
        input_ids, attn = batch["input_ids"], batch["attention_mask"].bool()
        n_img = image_emb.shape[1]
        if not self.cfg.image_tokens_in_text:
            input_ids, attn = insert_image_tokens(input_ids, attn, n_img, self.cfg.image_token_id)
        is_image = input_ids == self.cfg.image_token_id
        if check_tokens:
            counts = is_image.sum(1)
            if bool((counts != n_img).any()):
                where = "in total" if not self.cfg.image_tokens_in_text else ""
                raise ValueError(
                    f"batch['input_ids'] rows hold {counts.tolist()} image tokens (id "
                    f"{self.cfg.image_token_id}) {where} but the images give {n_img} per sample; "
                    "with image_tokens_in_text=True put exactly that many placeholders in each "
                    "row, with False (default) put none"
                )
        emb = self.llm.embed(input_ids)
        dtype = torch.promote_types(emb.dtype, image_emb.dtype)
        emb = emb.to(dtype).masked_scatter(is_image[..., None], image_emb.to(dtype))
        n = input_ids.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=emb.device).tril()
        mask = ensure_row_nonempty(causal[None] & attn[:, None, :])[:, None]
        hidden = self.llm.norm(self.llm(emb, positions_from_mask(attn), mask))
        return hidden.float(), attn, is_image & attn
