"""megatron-core on Kunlun XPUs: core's general accelerator adapter, bound to the xpu device.

Imported only when megatron is used (``KunlunXPUAccelerator.megatron_adapter()``),
so the plugin works without the ``longboat-core[megatron]`` extra.
"""

from __future__ import annotations

from typing import Any


def xpu_megatron_adapter(accelerator: Any) -> Any:
    """An ``AcceleratorMegatronAdapter`` that routes megatron's CUDA call sites to ``accelerator``."""
    try:
        from longboat.core.megatron.adapters import AcceleratorMegatronAdapter
    except ImportError as exc:
        raise ImportError(
            f"megatron on XPU needs longboat-core[megatron] ({exc}). "
            "Fix: pip install 'longboat-core[megatron]'."
        ) from exc
    if accelerator.device_type != "xpu":
        raise ValueError(
            f"xpu_megatron_adapter got a {accelerator.device_type!r} accelerator, expected 'xpu'"
        )
    return AcceleratorMegatronAdapter(accelerator)
