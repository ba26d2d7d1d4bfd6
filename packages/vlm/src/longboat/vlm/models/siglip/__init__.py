"""SigLIP vision tower: config (``config.py``), megatron model (``model.py``), HF mapping (``hf.py``)."""
