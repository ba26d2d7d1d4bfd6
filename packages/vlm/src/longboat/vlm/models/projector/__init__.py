"""Projectors from a vision tower's width to a decoder's: config (``config.py``) and the
megatron modules (``mlp.py``)."""
