"""longboat.embodied."""
