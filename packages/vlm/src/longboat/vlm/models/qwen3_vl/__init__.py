"""Qwen3-VL (dense): vision tower with deepstack mergers, qwen3 decoder with interleaved
M-RoPE and deepstack injection, HF conversion."""
