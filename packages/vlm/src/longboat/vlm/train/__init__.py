"""longboat-vlm training."""
