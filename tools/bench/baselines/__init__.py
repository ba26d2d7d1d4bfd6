"""The baselines the benchmarks compare longboat against: reference training loops built on the
official libraries (transformers, diffusers), each file listing how it differs from the
official code."""
