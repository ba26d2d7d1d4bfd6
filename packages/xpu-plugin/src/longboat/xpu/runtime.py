"""Find the XPU runtime: Kunlun's ``torch_xmlir`` first, then torch's native ``torch.xpu``.

Kunlun's XPyTorch (``torch_xmlir``) registers the ``xpu`` device with torch and
uses BKCL for collectives. A torch build with native XPU support exposes
``torch.xpu`` and the ``xccl`` backend. Nothing is imported until asked for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

INSTALL_HINT = (
    "Kunlun's XPU runtime: install the Kunlun SDK's torch_xmlir (XPyTorch) wheel built for "
    f"your torch {torch.__version__.split('+')[0]} (with the XRE driver, so `xpu-smi` lists "
    "the cards and XPU_VISIBLE_DEVICES selects them), or use a torch build with native XPU "
    "support (torch.xpu.is_available() is True)"
)
"""What to install when no XPU runtime is found (shown by ``get_accelerator('xpu')``)."""


@dataclass(frozen=True)
class XPURuntime:
    """The device module that drives the cards and the collective backend that goes with it."""

    kind: str
    """``torch_xmlir`` (Kunlun XPyTorch) or ``native`` (torch.xpu)."""
    module: Any
    """Module with the torch.cuda-like API: device_count, set_device, Stream, Event, ..."""
    dist_backend: str
    """``bkcl`` for torch_xmlir, ``xccl`` for native torch.xpu."""


def _device_count(module: Any) -> int:
    try:
        return int(module.device_count())
    except Exception:  # a half-installed runtime (no driver) raises here
        return 0


def _xmlir_device_module(xmlir: Any) -> Any:
    # torch_xmlir registers itself as torch's "xpu" device module; older releases keep
    # the API on torch_xmlir.xpu instead.
    for candidate in (getattr(xmlir, "xpu", None), getattr(torch, "xpu", None)):
        if candidate is not None and hasattr(candidate, "device_count"):
            return candidate
    return None


@lru_cache(maxsize=1)
def detect_runtime() -> XPURuntime | None:
    """The usable XPU runtime with at least one device, or None."""
    try:
        xmlir = importlib.import_module("torch_xmlir")
    except ImportError:
        xmlir = None
    if xmlir is not None:
        module = _xmlir_device_module(xmlir)
        if module is not None and _device_count(module) > 0:
            return XPURuntime("torch_xmlir", module, "bkcl")
    native = getattr(torch, "xpu", None)
    if native is not None and _safe_available(native):
        return XPURuntime("native", native, "xccl")
    return None


def _safe_available(module: Any) -> bool:
    try:
        return bool(module.is_available()) and _device_count(module) > 0
    except Exception:
        return False
