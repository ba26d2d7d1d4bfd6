"""SigLIP vision tower: config (``config.py``), megatron model (``model.py``), HF weight mapping (``vision_hf.py``, as in the Qwen towers)."""
