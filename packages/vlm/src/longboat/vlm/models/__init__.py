"""Vision-language model families."""
