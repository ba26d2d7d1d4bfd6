"""Pieces every diffusion family shares (no family imports another).

- ``patches``: latents <-> patch tokens and the per-axis rotary angles of a token grid (no
  megatron);
- ``config``: diffusers directory lookup, ``config.json`` reading and flavor lookup (no
  megatron);
- ``layers``: attention dispatch, AdaLN, the torch rotary reference, timestep embedding, the
  blocks' megatron ``TransformerConfig`` and the ``build`` arguments;
- ``family``: the lazy attribute lookup of a family module's ``__init__``.
"""
