"""longboat.llm."""
