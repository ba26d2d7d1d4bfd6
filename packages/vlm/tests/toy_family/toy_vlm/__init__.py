"""A toy VLM family kept outside the vlm package (tests/toy_family, found through
``LONGBOAT_FAMILY_PATH``), written the way a user adds a family without editing longboat."""

from types import ModuleType

from longboat.vlm.models.registry import vlm_family


def _implementation() -> ModuleType:
    from . import model

    return model


FAMILY = vlm_family(
    "toy_vlm",
    implementation=_implementation,
    flavors=("tiny",),
    hf_model_types=("toy_vlm",),
    description="toy VLM: Qwen2.5-VL's tower and a 2-layer decoder (a test family)",
)
