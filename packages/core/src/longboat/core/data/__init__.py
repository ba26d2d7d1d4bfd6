"""Data primitives shared by every stack (the global batch plan, stateful samplers, sequence
packing, DP balancing).

Import from the submodules, e.g. ``longboat.core.data.sampler``.
"""
