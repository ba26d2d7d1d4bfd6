"""LLaVA-OneVision-style VLM: SigLIP tower -> projector -> anyres packing -> any core decoder.

``build`` makes this rank's model from a ``LlavaOnevisionConfig`` (megatron parallel state
first); ``read_hf_config`` / ``to_hf_config`` / ``load_hf`` / ``save_hf`` read and write the
``LlavaOnevisionForConditionalGeneration`` directory layout (``model.vision_tower.*``,
``model.multi_modal_projector.*``, ``model.image_newline``, ``model.language_model.*``,
``lm_head``), which ``transformers`` loads. ``from_model_config`` composes the model from a
run's ``model`` section (``model.vision`` / ``model.projector`` / ``model.language``).

The image inputs: ``pixel_values [crops, C, S, S]`` (every image's views, base view first,
images in placeholder order) and ``image_grid_thw [images, 3]``, each row ``(views, height,
width)``: the views fed for that image (1: one padded square view, as in a multi-image
sample) and its size in pixels before processing. Videos: ``pixel_values_videos [frames,
C, S, S]`` and ``video_grid_thw [videos, 3]`` rows ``(frames, height, width)``; each frame's
features are pooled to half the grid per side, the video ends with one ``image_newline``
(``longboat.vlm.data.llava_processor`` makes these from video files). The decoder's positions are 1D
(its own rotary embedding), restarting at every packed sample.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule

from longboat.core.config.errors import ConfigError
from longboat.core.megatron.hf_decoder_config import hf_dialect, hf_dialect_for
from longboat.vlm.models.common import (
    build_decoder_stage,
    check_checkpoint_architecture,
    check_model_type,
    check_recompute,
    params_dtype,
    read_config_json,
    read_tensors,
    tower_state,
    write_hf_config,
)
from longboat.vlm.models.llava_onevision.anyres import num_video_tokens, pack_image_features
from longboat.vlm.models.llava_onevision.config import (
    FLAVORS,
    LlavaOnevisionConfig,
    compose,
    flavor,
)
from longboat.vlm.models.peft_layout import PeftLayout
from longboat.vlm.models.projector.config import ProjectorConfig
from longboat.vlm.models.siglip.config import SiglipVisionConfig
from longboat.vlm.models.vlm import VisionLanguageModel

HF_MODEL_TYPE = "llava_onevision"
VISION_PREFIX = "model.vision_tower."
PROJECTOR_PREFIX = "model.multi_modal_projector."
NEWLINE = "model.image_newline"
LANGUAGE_PREFIX = "model.language_model."
PEFT_LAYOUT = PeftLayout(
    language=LANGUAGE_PREFIX,
    vision=(VISION_PREFIX.rstrip("."),),
    projector=(PROJECTOR_PREFIX.rstrip("."),),
    cannot_save={
        "projector": f"the {NEWLINE} it trains with is a bare parameter of transformers' "
        "LlavaOnevisionModel, which PEFT's modules_to_save (whole modules) cannot carry"
    },
)
"""``transformers``' ``LlavaOnevisionForConditionalGeneration`` module names: the decoder's
layers, the SigLIP tower and the projector (what a PEFT adapter of a LoRA run names)."""

__all__ = [
    "FLAVORS",
    "LlavaOnevisionConfig",
    "LlavaOnevisionVision",
    "build",
    "flavor",
    "from_model_config",
    "load_hf",
    "num_video_tokens",
    "read_hf_config",
    "save_hf",
    "text_position_ids",
    "to_hf_config",
    "visual_hf_state",
]


class LlavaOnevisionVision(MegatronModule):
    """Tower + projector + anyres packing: ``(pixel_values, image_grid_thw) -> [tokens, D]``.

    ``merger`` is the projector (with the ``image_newline`` it appends), the part
    ``model.freeze=[projector]`` names.
    """

    def __init__(self, cfg: LlavaOnevisionConfig, *, params_dtype: torch.dtype, kernels: Any):
        from longboat.vlm.models.projector.mlp import build_projector
        from longboat.vlm.models.siglip.model import SiglipVisionModel

        tower = SiglipVisionModel(cfg.vision, params_dtype=params_dtype, kernels=kernels)
        super().__init__(config=tower.config)
        self.cfg = cfg
        self.tower = tower
        self.merger = build_projector(tower.config, cfg.projector)
        width = cfg.language.hidden_size
        self.merger.register_parameter(
            "image_newline",
            torch.nn.Parameter(torch.randn(width, dtype=params_dtype) * width**-0.5),
        )

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        grid = image_grid_thw.tolist()
        views = [int(g[0]) for g in grid]
        if pixel_values.shape[0] != sum(views):
            raise ValueError(
                f"pixel_values holds {pixel_values.shape[0]} views but image_grid_thw describes "
                f"{sum(views)} ({views} per image)"
            )
        hidden = self.tower(pixel_values, layers=cfg.feature_layers)
        feats = self.merger(hidden)
        newline = self.merger.image_newline
        out = []
        for part, (_, height, width) in zip(feats.split(views), grid, strict=True):
            out.append(
                pack_image_features(
                    part,
                    int(height),
                    int(width),
                    newline,
                    grid=cfg.vision.grid,
                    crop=cfg.vision.image_size,
                    pinpoints=cfg.image_grid_pinpoints,
                    vision_aspect_ratio=cfg.vision_aspect_ratio,
                )
            )
        return torch.cat(out)

    def video_features(
        self, pixel_values_videos: torch.Tensor, video_grid_thw: torch.Tensor
    ) -> torch.Tensor:
        """``[sum(frames), C, S, S]`` frames of the videos of ``video_grid_thw`` (rows
        ``(frames, height, width)``) -> ``[tokens, D]``: per frame its features pooled
        bilinearly to ``ceil(grid / 2)`` per side, each video's frames back to back, then
        one ``image_newline``."""
        cfg = self.cfg
        frames = [int(g[0]) for g in video_grid_thw.tolist()]
        if pixel_values_videos.shape[0] != sum(frames):
            raise ValueError(
                f"pixel_values_videos holds {pixel_values_videos.shape[0]} frames but "
                f"video_grid_thw describes {sum(frames)}"
            )
        feats = self.merger(self.tower(pixel_values_videos, layers=cfg.feature_layers))
        g, d = cfg.vision.grid, feats.shape[-1]
        fmap = feats.reshape(-1, g, g, d).permute(0, 3, 1, 2)
        side = -(-g // 2)
        pooled = torch.nn.functional.interpolate(fmap, size=[side, side], mode="bilinear")
        pooled = pooled.permute(0, 2, 3, 1).reshape(-1, side * side, d)
        newline = self.merger.image_newline.to(pooled.dtype)[None]
        out = []
        for part in pooled.split(frames):
            out += [part.reshape(-1, d), newline]
        return torch.cat(out)


class LlavaOnevisionModel(VisionLanguageModel):
    """``VisionLanguageModel`` with LLaVA-OneVision's video path (pooled frame features)."""

    def embed(
        self,
        input_ids: torch.Tensor,
        *,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if pixel_values_videos is None:
            return super().embed(input_ids, **kwargs)  # refuses stray video placeholders
        is_video = input_ids == self.video_token_id
        embeds = super().embed(input_ids.masked_fill(is_video, 0), **kwargs)
        if video_grid_thw is None:
            raise ValueError("pixel_values_videos needs video_grid_thw (frames, height, width)")
        feats = self.vision.video_features(pixel_values_videos, video_grid_thw)
        embeds = embeds.transpose(0, 1)
        embeds = self._scatter(embeds, input_ids, self.video_token_id, feats, "video")
        return embeds.transpose(0, 1).contiguous()


def text_position_ids(
    input_ids: torch.Tensor,
    *,
    image_grid_thw: Any = None,
    video_grid_thw: Any = None,
    seconds_per_grid: Any = None,
    cu_seqlens: Sequence[int] | None = None,
) -> torch.Tensor:
    """``[batch, seq]`` 1D positions, restarting at every ``cu_seqlens`` boundary."""
    b, s = input_ids.shape
    if cu_seqlens is None:
        return torch.arange(s, device=input_ids.device).expand(b, s)
    bounds = torch.as_tensor(list(cu_seqlens), device=input_ids.device).long()
    idx = torch.arange(s, device=input_ids.device)
    start = bounds[torch.bucketize(idx, bounds[1:], right=True)]
    return (idx - start).expand(b, s)


def build(
    cfg: LlavaOnevisionConfig,
    *,
    precision: str = "fp32",
    device_type: str = "cpu",
    kernels: Any = None,
    recompute: tuple[str, ...] = (),
    vision_tensor_parallel: int | None = None,
) -> VisionLanguageModel:
    """The model (tensor and pipeline parallel 1; megatron parallel state initialised).

    ``recompute``: ``vision`` (each tower block) and / or ``language`` (each decoder layer).
    ``vision_tensor_parallel``: null or the decoder's (the tower shares its TP).
    """
    from megatron.core import parallel_state as mps

    from longboat.vlm.models.vision_parallel import resolve_vision_tensor_parallel

    cfg.validate()
    resolve_vision_tensor_parallel(
        vision_tensor_parallel,
        mps.get_tensor_model_parallel_world_size(),
        family="llava_onevision",
        supported=False,
    )
    for key, size in (
        ("parallel.tensor_parallel", mps.get_tensor_model_parallel_world_size()),
        ("parallel.pipeline_parallel", mps.get_pipeline_model_parallel_world_size()),
    ):
        if size > 1:
            raise ConfigError(
                f"llava_onevision: {key.split('.')[1].replace('_', ' ')}ism is not supported yet",
                key=key,
                value=size,
                fix=f"set {key}=1",
            )
    check_recompute(recompute)
    decoder = build_decoder_stage(
        cfg.language, kernels=kernels, precision=precision, device_type=device_type,
        recompute=recompute,
    )  # fmt: skip
    vision = LlavaOnevisionVision(cfg, params_dtype=params_dtype(precision), kernels=kernels)
    vision.tower.recompute = "vision" in recompute
    return LlavaOnevisionModel(
        vision.to(torch.device(device_type)),
        decoder,
        image_token_id=cfg.image_token_id,
        video_token_id=cfg.video_token_id,
        position_ids=text_position_ids,
    )


def from_model_config(model: Any) -> LlavaOnevisionConfig:
    """The config of a run's ``model`` section: flavor ``model.flavor`` with the
    ``model.vision`` / ``model.projector`` / ``model.language`` sections laid over it."""
    return compose(
        flavor(model.flavor),
        vision=dict(model.vision or {}),
        projector=dict(model.projector or {}),
        language=dict(model.language or {}),
    )


# -- Hugging Face ---------------------------------------------------------------------------


def read_hf_config(source: str | Path | dict[str, Any]) -> LlavaOnevisionConfig:
    """The config of a ``LlavaOnevisionForConditionalGeneration`` ``config.json`` (a directory
    or the parsed dict); the decoder's family comes from ``text_config.model_type``."""
    hf, where = read_config_json(source, "LLaVA-OneVision")
    check_model_type(
        hf, where, HF_MODEL_TYPE, fix="point at a LlavaOnevisionForConditionalGeneration checkpoint"
    )
    text = dict(hf.get("text_config") or {})
    text.setdefault("model_type", "qwen2")
    text["tie_word_embeddings"] = bool(
        hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    )
    language = hf_dialect_for(text, where).from_hf_config(text)
    vision_hf = dict(hf.get("vision_config") or {})
    if vision_hf.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise ConfigError(
            f"{where}: vision_config.model_type={vision_hf.get('model_type')!r}: only SigLIP "
            "towers are supported"
        )
    vision = SiglipVisionConfig.from_hf(vision_hf)
    layer = hf.get("vision_feature_layer", -1)
    if not isinstance(layer, int):
        raise ConfigError(f"{where}: vision_feature_layer={layer!r}: only one layer is supported")
    projector = ProjectorConfig(
        hidden_act=str(hf.get("projector_hidden_act", "gelu")),
        bias=bool(hf.get("multimodal_projector_bias", True)),
    ).resolved(vision.hidden_size, language.hidden_size)
    pinpoints = hf.get("image_grid_pinpoints")
    cfg = LlavaOnevisionConfig(
        language=language,
        vision=vision,
        projector=projector,
        image_token_id=int(hf.get("image_token_index", hf.get("image_token_id", 151646))),
        video_token_id=int(hf.get("video_token_index", hf.get("video_token_id", 151647))),
        vision_aspect_ratio=str(hf.get("vision_aspect_ratio", "anyres_max_9")),
        vision_feature_layer=layer,
        vision_feature_select_strategy=str(hf.get("vision_feature_select_strategy", "full")),
    )
    if pinpoints:
        cfg.image_grid_pinpoints = tuple((int(h), int(w)) for h, w in pinpoints)
    cfg.validate()
    return cfg


def to_hf_config(cfg: LlavaOnevisionConfig) -> Any:
    """``transformers.LlavaOnevisionConfig`` for ``cfg``."""
    from transformers import LlavaOnevisionConfig as HFConfig

    text = hf_dialect(cfg.language.name).to_hf_config(cfg.language).to_dict()
    for key in ("architectures", "transformers_version", "dtype", "torch_dtype"):
        text.pop(key, None)
    return HFConfig(
        text_config=text,
        vision_config=cfg.vision.to_hf(),
        image_token_index=cfg.image_token_id,
        video_token_index=cfg.video_token_id,
        projector_hidden_act=cfg.projector.hidden_act,
        multimodal_projector_bias=cfg.projector.bias,
        vision_feature_select_strategy=cfg.vision_feature_select_strategy,
        vision_feature_layer=cfg.vision_feature_layer,
        image_grid_pinpoints=[list(p) for p in cfg.image_grid_pinpoints],
        vision_aspect_ratio=cfg.vision_aspect_ratio,
        tie_word_embeddings=cfg.language.tie_embeddings,
        architectures=["LlavaOnevisionForConditionalGeneration"],
    )


_PROJECTOR = {"linear_fc1": "linear_1", "linear_fc2": "linear_2"}


@dataclass(frozen=True)
class HFLayout:
    """Where a checkpoint keeps each part (transformers' in-memory names, or the older file
    layout of the released checkpoints)."""

    vision: str
    projector: str
    newline: str
    language: str

    @property
    def others(self) -> tuple[str, ...]:
        return (self.vision, self.projector, self.newline)


LAYOUT = HFLayout(VISION_PREFIX, PROJECTOR_PREFIX, NEWLINE, LANGUAGE_PREFIX)
"""What ``save_hf`` writes (the names of ``LlavaOnevisionForConditionalGeneration``)."""
FILE_LAYOUT = HFLayout(
    "vision_tower.", "multi_modal_projector.", "image_newline", "language_model.model."
)
"""The released checkpoints' file names (and what ``save_pretrained`` writes); an untied
head is ``language_model.lm_head.weight`` there."""


def _layout(names: set[str]) -> HFLayout:
    for layout in (LAYOUT, FILE_LAYOUT):
        if f"{layout.language}embed_tokens.weight" in names:
            return layout
    return LAYOUT


def _tower_prefix(names: set[str], layout: HFLayout) -> str:
    nested = layout.vision + "vision_model."
    return nested if any(n.startswith(nested) for n in names) else layout.vision


def vision_to_hf(state: dict[str, torch.Tensor], cfg: LlavaOnevisionConfig) -> dict[str, Any]:
    """HF tensors (``LAYOUT``) of our ``LlavaOnevisionVision`` state dict."""
    from longboat.vlm.models.siglip.vision_hf import siglip_to_hf

    tower = {k[len("tower.") :]: v for k, v in state.items() if k.startswith("tower.")}
    out = siglip_to_hf(tower, cfg.vision, LAYOUT.vision)
    for ours, theirs in _PROJECTOR.items():
        for kind in ("weight", "bias") if cfg.projector.bias else ("weight",):
            out[f"{LAYOUT.projector}{theirs}.{kind}"] = state[f"merger.{ours}.{kind}"]
    out[LAYOUT.newline] = state["merger.image_newline"]
    return out


def vision_from_hf(
    hf: dict[str, torch.Tensor], cfg: LlavaOnevisionConfig, layout: HFLayout = LAYOUT
) -> dict[str, Any]:
    """Our ``LlavaOnevisionVision`` state dict from the HF tensors."""
    from longboat.vlm.models.siglip.vision_hf import siglip_from_hf

    prefix = _tower_prefix(set(hf), layout)
    out = {f"tower.{k}": v for k, v in siglip_from_hf(hf, cfg.vision, prefix).items()}
    for ours, theirs in _PROJECTOR.items():
        for kind in ("weight", "bias") if cfg.projector.bias else ("weight",):
            out[f"merger.{ours}.{kind}"] = hf[f"{layout.projector}{theirs}.{kind}"]
    out["merger.image_newline"] = hf[layout.newline]
    return out


_FILE_HEAD = "language_model.lm_head.weight"


@contextmanager
def _decoder_view(hf_dir: str | Path, index: dict[str, Path]) -> Iterator[Path]:
    """``hf_dir``, or for the released file layout with an untied head (``language_model.
    lm_head.weight``) a temporary directory whose index points at the original files and
    holds the head alone under the ``lm_head.weight`` name the decoder loader reads."""
    if _FILE_HEAD not in index:
        yield Path(hf_dir)
        return
    from safetensors import safe_open
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="llava_head_") as tmp:
        head = Path(tmp) / "head.safetensors"
        with safe_open(str(index[_FILE_HEAD]), "pt") as f:
            save_file({"lm_head.weight": f.get_tensor(_FILE_HEAD)}, str(head))
        weight_map = {k: str(Path(v).resolve()) for k, v in index.items() if k != _FILE_HEAD}
        weight_map["lm_head.weight"] = str(head)
        (Path(tmp) / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
        yield Path(tmp)


@torch.no_grad()
def load_hf(model: VisionLanguageModel, cfg: LlavaOnevisionConfig, hf_dir: str | Path) -> int:
    """Load a LLaVA-OneVision directory into the model after checking that its config
    describes ``cfg``; returns the number of tensors read."""
    from longboat.core.megatron.hf_io import hf_weight_index, load_hf_weights

    check_checkpoint_architecture(cfg.architecture(), read_hf_config(hf_dir).architecture(), hf_dir)
    index = hf_weight_index(hf_dir)
    layout = _layout(set(index))
    others = layout.others
    with _decoder_view(hf_dir, index) as decoder_dir:
        n = load_hf_weights(
            [model.language], cfg.language, decoder_dir, prefix=layout.language,
            other_prefixes=others,
        )  # fmt: skip
    try:
        ours = vision_from_hf(read_tensors(index, others), cfg, layout)
    except KeyError as exc:
        raise ConfigError(f"{hf_dir}: the checkpoint has no tensor {exc}") from None
    state = model.vision.state_dict()
    bad = [f"{k}: {list(v.shape)} != {list(state[k].shape)}" for k, v in ours.items()
           if k in state and tuple(v.shape) != tuple(state[k].shape)]  # fmt: skip
    missing = [k for k in state if k not in ours and not k.endswith("_extra_state")]
    if bad or missing:
        raise ConfigError(f"{hf_dir}: vision tensors do not fit: missing {missing}; shapes {bad}")
    model.vision.load_state_dict(ours, strict=False)
    return n + len(ours)


def visual_hf_state(
    model: VisionLanguageModel, cfg: LlavaOnevisionConfig
) -> dict[str, torch.Tensor]:
    """The tower, the projector and ``image_newline`` under ``transformers``' names
    (``LAYOUT``); the model is not tensor-parallel, so every rank holds them whole."""
    return vision_to_hf(tower_state(model.vision), cfg)


def save_hf(model: VisionLanguageModel, cfg: LlavaOnevisionConfig, out_dir: str | Path) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the layout ``transformers`` loads
    (collective over the world; rank 0 writes)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from longboat.core.megatron.hf_io import gather_hf_state_dict

    out_dir = Path(out_dir)
    state = gather_hf_state_dict([model.language], cfg.language, prefix=LANGUAGE_PREFIX)
    local = tower_state(model.vision)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        state |= vision_to_hf(local, cfg)
        out_dir.mkdir(parents=True, exist_ok=True)
        for old in out_dir.glob("model*.safetensors*"):
            old.unlink()
        tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_hf_config(to_hf_config, cfg, out_dir, rank)
    return out_dir
