"""Qwen2.5-VL: vision tower, decoder with M-RoPE, HF conversion."""
