"""Deepstack: vision features added to the decoder's hidden states after its first layers.

The Qwen3-VL tower returns, besides the merged tokens that replace the placeholders, one
feature tensor per deepstack block; after decoder layer ``i`` the ``i``-th of them is added
to the hidden states at the image and video positions (Hugging Face's Qwen3-VL does the
same). megatron's ``GPTModel`` takes no such input, but its ``TransformerBlock`` hands one
``context`` tensor unchanged to every layer, and the decoder has no cross-attention to use
it: ``Qwen3VLModel`` passes the features there as one dense ``[n, s, b, h]`` tensor (zero
away from the vision positions), and a forward hook on each of the first ``n`` layers
(``add_deepstack_hooks``, registered once at build) adds its slice to the layer's output.
The hook reads only the layer's own arguments, so activation recompute replays it exactly;
with pipeline parallelism the features exist on the first stage, which must hold those
layers.
"""

from __future__ import annotations

from typing import Any

import torch

from longboat.vlm.models.vlm import PlaceholderMismatch, VisionLanguageModel, _checks_on


def _add_deepstack(
    layer: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> Any:
    context = kwargs.get("context")
    index = layer.layer_number - 1  # global (0-based) layer index
    if context is None or index >= context.shape[0]:
        return output
    hidden, passed = output
    return hidden + context[index].to(hidden.dtype), passed


def add_deepstack_hooks(decoder: torch.nn.Module, count: int) -> int:
    """Make the first ``count`` decoder layers of megatron ``GPTModel`` ``decoder`` add their
    deepstack feature to their output; returns the number of layers on this stage that do."""
    n = 0
    for layer in decoder.decoder.layers:
        if layer.layer_number <= count:
            layer.register_forward_hook(_add_deepstack, with_kwargs=True)
            n += 1
    return n


class Qwen3VLModel(VisionLanguageModel):
    """``VisionLanguageModel`` whose tower returns ``(merged, deepstack features)`` and whose
    decoder adds the deepstack features after its first layers."""

    def decoder_inputs(
        self,
        input_ids: torch.Tensor,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """``(decoder input [s, b, h], {"context": deepstack [n, s, b, h]})`` (no context
        without vision inputs)."""
        if self.vision is None:
            raise RuntimeError("embed: this pipeline stage holds no vision tower / embedding")
        embeds = self.language.embedding(input_ids=input_ids, position_ids=None)
        embeds = embeds.transpose(0, 1)  # [b, s, h]
        deepstack: list[torch.Tensor] = []
        inputs = (
            (pixel_values, image_grid_thw, self.image_token_id, "image", "pixel_values"),
            (pixel_values_videos, video_grid_thw, self.video_token_id, "video",
             "pixel_values_videos"),
        )  # fmt: skip
        for pixels, grid, token_id, what, key in inputs:
            if pixels is None:
                if _checks_on(input_ids) and bool((input_ids == token_id).any()):
                    raise PlaceholderMismatch(
                        f"input_ids hold {what} placeholder tokens but no {key}"
                    )
                continue
            merged, features = self.encode_vision(pixels, grid)
            embeds = self._scatter(embeds, input_ids, token_id, merged, what)
            if not deepstack:
                deepstack = [torch.zeros_like(embeds) for _ in features]
            mask = (input_ids == token_id).unsqueeze(-1)
            deepstack = [
                d.masked_scatter(mask, f.to(d.dtype))
                for d, f in zip(deepstack, features, strict=True)
            ]
        decoder_input = embeds.transpose(0, 1).contiguous()
        if not deepstack:
            return decoder_input, {}
        return decoder_input, {"context": torch.stack(deepstack).transpose(1, 2).contiguous()}

    def embed(self, input_ids: torch.Tensor, **vision: Any) -> torch.Tensor:
        """The decoder input ``[s, b, h]`` (the deepstack features aside)."""
        return self.decoder_inputs(input_ids, **vision)[0]
