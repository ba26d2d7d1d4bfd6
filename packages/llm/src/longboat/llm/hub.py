"""Hugging Face model ids in ``model.init_from``: ``hf://<owner>/<name>``.

The id resolves to its snapshot in the hub cache (``HF_HUB_CACHE``, as ``huggingface_hub``
lays it out), read without a network request, at config time: the run (and ``config
show``) then sees a local directory. A model not in the cache is named with the command
that downloads it; longboat does not download weights on its own.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["HUB_MODEL_PREFIX", "cached_hub_model", "hub_model_id"]

HUB_MODEL_PREFIX = "hf://"


def hub_model_id(value: object) -> str | None:
    """The model id of an ``hf://<owner>/<name>`` value (not a dataset's), else None."""
    text = str(value) if value is not None else ""
    if not text.startswith(HUB_MODEL_PREFIX) or text.startswith(f"{HUB_MODEL_PREFIX}datasets/"):
        return None
    return text[len(HUB_MODEL_PREFIX) :].strip("/") or None


def cached_hub_model(repo_id: str) -> Path | None:
    """The hub cache's snapshot of model ``repo_id`` (its ``main`` revision), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(
            repo_id, local_files_only=True, cache_dir=os.environ.get("HF_HUB_CACHE")
        )
    except (LocalEntryNotFoundError, ValueError):
        return None
    return Path(path)
