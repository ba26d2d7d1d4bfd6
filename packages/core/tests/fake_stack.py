"""Test helper: install a throw-away stack through a real entry point.

``write_fake_stack(site_dir, name)`` writes an importable module plus a
``*.dist-info`` with an ``entry_points.txt`` into ``site_dir``; put ``site_dir``
on ``sys.path`` (``monkeypatch.syspath_prepend``) and ``discover_stacks()`` finds
it exactly like an installed wheel. Used by core's config/CLI tests and handy
for any stack that wants to test composition against a tiny config tree.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

FAKE_STACK_MODULE = '''\
"""A fake longboat stack written by the core tests (fake_stack.py)."""

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from longboat.core.config.errors import ProblemCollector
from longboat.core.config.schema import DataConfig, ExperimentConfig, ModelConfig
from longboat.core.stack import Stack


@dataclass
class GPTConfig(ModelConfig):
    """A decoder with the keys the cross-field checks look at."""

    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_layers: int = 6
    num_experts: int = 0


@dataclass
class FilesDataConfig(DataConfig):
    """Data read from files."""

    seq_length: int = 128


@dataclass
class FakeExperimentConfig(ExperimentConfig):
    """Root schema with one extra top-level key."""

    output_dir: str = "outputs/fake"


def check_output_dir(cfg: DictConfig, world_size: int | None, problems: ProblemCollector) -> None:
    """Stack-specific rule: output_dir must not be empty."""
    if not cfg.output_dir:
        problems.add("output_dir", "must not be empty", value=cfg.output_dir, fix="set output_dir")


STACK = Stack(
    name={name!r},
    description="Fake stack for tests.",
    config_dir=Path(__file__).with_name({conf!r}),
    root_schema=FakeExperimentConfig,
    model_schemas={{"gpt": GPTConfig}},
    data_schemas={{"files": "{module}:FilesDataConfig"}},
    console_script="longboat-{name}",
    validators=("{module}:check_output_dir",),
    renamed_keys={{"train.old_steps": "train.steps"}},
)
'''

FAKE_STACK_FILES = {
    "model/gpt.yaml": """\
        name: gpt
        hidden_size: 64
        num_attention_heads: 4
        num_key_value_heads: 2
        num_layers: 6
        """,
    "data/files.yaml": """\
        name: files
        seq_length: 32
        """,
    "experiment/tiny.yaml": """\
        # @package _global_
        defaults:
          - override /model: gpt
          - _self_
        train:
          steps: 5
          micro_batch_size: 2
          global_batch_size: 8
        checkpoint:
          dir: ${output_dir}/checkpoints
        """,
    "experiment/no_model.yaml": """\
        # @package _global_
        train:
          steps: 3
        """,
    "experiment/not_global.yaml": """\
        train:
          steps: 3
        """,
}


def write_fake_stack(site_dir: Path, name: str = "fake", module: str | None = None) -> Path:
    """Write stack ``name`` (module + conf dir + dist-info) into ``site_dir``; return its conf dir.

    The stack has model ``gpt`` (schema ``GPTConfig``), data ``files`` and
    experiments ``tiny``, ``no_model`` and ``not_global``. ``module`` defaults to a
    name derived from ``name``; use distinct names per test to dodge import caches.
    """
    module = module or f"longboat_fake_stack_{name}"
    conf = site_dir / f"{module}_conf"
    for rel, text in FAKE_STACK_FILES.items():
        path = conf / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    (site_dir / f"{module}.py").write_text(
        FAKE_STACK_MODULE.format(name=name, conf=conf.name, module=module)
    )
    dist = site_dir / f"{module}-0.1.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[longboat.stacks]\n{name} = {module}:STACK\n")
    return conf


__all__ = ["write_fake_stack"]
