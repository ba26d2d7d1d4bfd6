"""A vision-language model: a vision tower whose merged patch embeddings replace the image and
video placeholder tokens of a megatron decoder's input, with M-RoPE position ids.

The vision tower is any module ``vision(pixel_values, grid_thw) -> [merged_tokens, hidden]``
whose output width is the decoder's ``hidden_size`` (a projector, when the family has one,
is part of the tower). The decoder is megatron-core's ``GPTModel`` built by core from a
decoder (a core ``DecoderModelConfig``, flavors in `core's `decoder_flavors``).

With pipeline parallelism each rank holds one stage: the first has the tower and the
embedding (``vision`` is None elsewhere), every stage computes the position ids and the
packed attention mask from the microbatch, and later stages take their input from the
previous stage through ``set_input_tensor`` (megatron's schedules call it).

With ``vision_split`` (``longboat.vlm.models.vision_parallel``) the tower is unsharded under
a tensor-parallel decoder and ``encode_vision`` divides the images over the TP ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule


class PlaceholderMismatch(ValueError):
    """The number of image / video placeholder tokens differs from the tower's output rows."""


class VisionLanguageModel(MegatronModule):
    """``vision`` + ``language`` (a megatron ``GPTModel``) with placeholder-token merging; a
    megatron module (the decoder's config), so megatron's DDP and optimizer wrap it whole."""

    def __init__(
        self,
        vision: torch.nn.Module | None,
        language: torch.nn.Module,
        *,
        image_token_id: int,
        video_token_id: int,
        position_ids: Callable[..., torch.Tensor],
        vision_split: Any = None,
    ) -> None:
        super().__init__(config=language.config)
        self.vision = vision
        self.vision_split = vision_split
        """``VisionSplit`` when the tower is unsharded under a TP decoder, else None."""
        self.language = language
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self._position_ids = position_ids
        self.model_type = getattr(language, "model_type", None)
        self._varlen_decoder: bool | None = None

    def _packed_mask(self, cu_seqlens: Sequence[int] | torch.Tensor, device: torch.device) -> Any:
        """What the decoder's attention takes for a packed row: the offsets themselves when
        its layers run longboat's attention spec (varlen kernels, no [s, s] mask), else
        megatron's dense block mask (Transformer Engine / megatron's local layers)."""
        if self._varlen_decoder is None:
            from longboat.core.megatron.specs import KernelCoreAttention

            self._varlen_decoder = any(
                isinstance(m, KernelCoreAttention) for m in self.language.modules()
            )
        if self._varlen_decoder:
            return torch.as_tensor(cu_seqlens, dtype=torch.int32).to(device, non_blocking=True)
        return packed_attention_mask(cu_seqlens, device)

    # What megatron's schedules and grad finalisation look up on a stage's model.
    @property
    def pre_process(self) -> bool:
        """Whether this stage embeds the tokens (the first pipeline stage)."""
        return bool(self.language.pre_process)

    @property
    def post_process(self) -> bool:
        """Whether this stage computes logits / losses (the last pipeline stage)."""
        return bool(self.language.post_process)

    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return bool(self.language.share_embeddings_and_output_weights)

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        return self.language.shared_embedding_or_output_weight()

    def set_input_tensor(self, input_tensor: Any) -> None:
        """The previous pipeline stage's hidden states (megatron's schedules set them)."""
        self.language.set_input_tensor(input_tensor)

    def position_ids(
        self,
        input_ids: torch.Tensor,
        *,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        seconds_per_grid: Sequence[float] | None = None,
        cu_seqlens: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """``[3, batch, seq]`` M-RoPE position ids of ``input_ids``."""
        return self._position_ids(
            input_ids,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            seconds_per_grid=seconds_per_grid,
            cu_seqlens=cu_seqlens,
        )

    def encode_vision(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> Any:
        """The tower's output for ``pixels`` / ``grid_thw``; with ``vision_split`` each TP
        rank encodes its share of the images and the outputs are exchanged (collective over
        the TP group)."""
        if self.vision_split is None:
            return self.vision(pixels, grid_thw)
        from longboat.vlm.models.vision_parallel import encode_split

        return encode_split(self.vision, pixels, grid_thw, self.vision_split)

    def _scatter(
        self,
        embeds: torch.Tensor,
        input_ids: torch.Tensor,
        token_id: int,
        features: torch.Tensor,
        what: str,
    ) -> torch.Tensor:
        mask = input_ids == token_id
        n = int(mask.sum()) if _checks_on(input_ids) else features.shape[0]
        if n != features.shape[0]:
            raise PlaceholderMismatch(
                f"{n} {what} placeholder tokens (id {token_id}) in input_ids but the vision "
                f"tower produced {features.shape[0]} {what} embeddings: the placeholders must "
                "come from the processor's grid (one token per merged patch)"
            )
        return embeds.masked_scatter(mask.unsqueeze(-1), features.to(embeds.dtype))

    def embed(
        self,
        input_ids: torch.Tensor,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decoder input ``[seq, batch, hidden]``: token embeddings with vision embeddings in
        the placeholder positions (the first pipeline stage's work)."""
        if self.vision is None:
            raise RuntimeError("embed: this pipeline stage holds no vision tower / embedding")
        embeds = self.language.embedding(input_ids=input_ids, position_ids=None)
        embeds = embeds.transpose(0, 1)  # [b, s, h]
        if pixel_values is not None:
            feats = self.encode_vision(pixel_values, image_grid_thw)
            embeds = self._scatter(embeds, input_ids, self.image_token_id, feats, "image")
        elif _checks_on(input_ids) and bool((input_ids == self.image_token_id).any()):
            raise PlaceholderMismatch("input_ids hold image placeholder tokens but no pixel_values")
        if pixel_values_videos is not None:
            feats = self.encode_vision(pixel_values_videos, video_grid_thw)
            embeds = self._scatter(embeds, input_ids, self.video_token_id, feats, "video")
        elif _checks_on(input_ids) and bool((input_ids == self.video_token_id).any()):
            raise PlaceholderMismatch(
                "input_ids hold video placeholder tokens but no pixel_values_videos"
            )
        return embeds.transpose(0, 1).contiguous()

    def decoder_inputs(
        self, input_ids: torch.Tensor, **vision: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """``(embed(input_ids, **vision), extra keyword arguments of the decoder block)``; a
        family whose decoder takes more than its input from the vision tower (Qwen3-VL's
        deepstack features) returns them in the second part."""
        return self.embed(input_ids, **vision), {}

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cu_seqlens: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Logits ``[batch, seq, vocab]`` (this TP rank's vocabulary shard unless the decoder
        gathers), or with ``labels`` megatron's per-token loss ``[batch, seq]``.

        ``cu_seqlens`` (one packed row): position ids restart per sample and attention stays
        inside each sample (a block-diagonal causal mask). On a pipeline stage after the first,
        the output is the stage's hidden states (the last stage's as above) and the input
        comes from ``set_input_tensor``; the vision inputs are not used there.
        """
        decoder_input = None
        if self.pre_process:
            decoder_input, block_kwargs = self.decoder_inputs(
                input_ids,
                pixel_values=pixel_values,
                image_grid_thw=image_grid_thw,
                pixel_values_videos=pixel_values_videos,
                video_grid_thw=video_grid_thw,
            )
            if block_kwargs:
                kwargs["extra_block_kwargs"] = block_kwargs
        if position_ids is None:
            position_ids = self.position_ids(
                input_ids,
                image_grid_thw=image_grid_thw,
                video_grid_thw=video_grid_thw,
                cu_seqlens=cu_seqlens,
            )
        if attention_mask is None and cu_seqlens is not None:
            attention_mask = self._packed_mask(cu_seqlens, input_ids.device)
        return self.language(
            input_ids,
            position_ids,
            attention_mask,
            decoder_input=decoder_input,
            labels=labels,
            **kwargs,
        )


def _checks_on(input_ids: torch.Tensor) -> bool:
    """Whether the placeholder-count checks run: on host tensors only. On an accelerator a
    count read back would stall the step on the device; the data pipeline has already
    matched every row's placeholders to its grids (``PlaceholderCountError`` at encoding)."""
    return input_ids.device.type == "cpu"


def packed_attention_mask(cu_seqlens: Sequence[int], device: torch.device) -> torch.Tensor:
    """megatron attention mask ``[1, 1, s, s]`` (True = blocked) that keeps each packed sample's
    tokens to themselves; the decoder's causal mask is applied on top."""
    bounds = torch.as_tensor(cu_seqlens, device=device).long()
    s = int(bounds[-1])
    sample = torch.bucketize(torch.arange(s, device=device), bounds[1:], right=True)
    return (sample[:, None] != sample[None, :])[None, None]
