"""The llm stack's model families, one folder each (``config.py``: flavors; ``__init__.py``:
the ``FAMILY`` object), found by convention through ``Stack.families_package``: look one up
with ``longboat.core.family.find_family("llm", name)``. ``family.py`` holds what they share
(``LLMFamily``, the HF adapter, FLOPs per sample)."""
