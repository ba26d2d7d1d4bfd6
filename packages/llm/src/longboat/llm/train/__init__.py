"""LLM training: ``longboat-llm train experiment=<name>`` (see ``loop.run``)."""
