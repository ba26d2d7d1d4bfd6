"""longboat.core."""
