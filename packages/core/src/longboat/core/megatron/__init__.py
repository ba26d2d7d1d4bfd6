"""The Megatron backend shared by longboat's llm / vlm / diffusion stacks.

Installed with ``longboat-core[megatron]`` (megatron-core 0.19.x); the only
part of longboat.core that imports megatron.
"""
