"""Shared fixtures: tiny random HF checkpoints built with transformers' own classes."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

# The test modules import the helpers of llm_testkit.py / pipeline_testkit.py from this folder
# (pytest runs with --import-mode=importlib, which puts no test folder on sys.path).
_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from llm_testkit import make_hf_dir  # noqa: E402

FAMILIES = ("llama3", "qwen3", "qwen3_moe")


def _warm_megatron() -> None:
    # Import megatron once in the parent so forked workers (run_multiprocess) share it:
    # importing megatron-core costs seconds per process on 2 cores.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.models.gpt.gpt_model
        import megatron.core.optimizer
        import megatron.core.pipeline_parallel  # noqa: F401
        import transformers  # noqa: F401

        import longboat.llm.build  # noqa: F401


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny HF checkpoint directory per family (built once per session)."""
    _warm_megatron()
    root = tmp_path_factory.mktemp("hf")
    return {f: make_hf_dir(f, root / f) for f in FAMILIES}


@pytest.fixture(scope="session")
def tokens() -> torch.Tensor:
    """A fixed [2, 12] batch of token ids below the tiny vocab size."""
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """Reference logits of ``transformers`` in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.fixture(scope="session")
def reference_logits(hf_dirs: dict[str, Path], tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' logits of each tiny family on ``tokens``."""
    return {f: hf_logits(d, tokens) for f, d in hf_dirs.items()}
