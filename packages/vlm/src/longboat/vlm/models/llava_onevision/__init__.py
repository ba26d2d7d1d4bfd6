"""LLaVA-OneVision-style composed VLM: a vision tower, a projector and any core decoder."""

from types import ModuleType

from longboat.vlm.models.registry import vlm_family


def _implementation() -> ModuleType:
    from longboat.vlm.models.llava_onevision import model

    return model


FAMILY = vlm_family(
    "llava_onevision",
    implementation=_implementation,
    flavors=("tiny", "0.5b", "7b"),
    hf_model_types=("llava_onevision",),
    description="LLaVA-OneVision-style composition: SigLIP + projector + any core decoder, anyres tiling, 1D RoPE",
)
