"""Parallelism of diffusion transformers beyond megatron's tensor parallel layers.

- :mod:`~longboat.diffusion.parallel.ulysses`: context parallelism over video tokens (Ulysses
  all-to-all around self-attention, tokens sharded along the sequence elsewhere).
"""
