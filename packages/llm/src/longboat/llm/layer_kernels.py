"""The kernel bundle of the llm stack's decoder layers (``longboat.kernels.layers``)."""

from longboat.kernels.layers import longboat_layer_kernels

__all__ = ["longboat_layer_kernels"]
