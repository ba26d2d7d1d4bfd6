"""longboat.kernels."""
