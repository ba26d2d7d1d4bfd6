"""Closed-loop evaluation of trained policies in simulated suites (``longboat-embodied
eval``; the simulators come with ``longboat-embodied[sim]``).

``suite``: suites as data (one YAML per suite); ``acting``: what acts (an exported policy,
a replayed demonstration); ``rollout``: episodes batched across a gymnasium vector;
``stats``: Wilson intervals; ``report``: results.json / results.md / mp4s; ``runner``: one
evaluation; ``in_training``: ``train.sim_eval`` in a separate process during training.
"""
