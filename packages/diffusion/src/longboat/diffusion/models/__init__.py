"""Diffusion transformer families (one folder each) and their registry (``registry.py``)."""
