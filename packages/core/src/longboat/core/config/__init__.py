"""Typed configs, Hydra composition and validation (see the package README)."""

from longboat.core.config.errors import ConfigError, ConfigProblem

__all__ = ["ConfigError", "ConfigProblem"]
