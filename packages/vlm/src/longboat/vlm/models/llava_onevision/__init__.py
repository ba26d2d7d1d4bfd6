"""LLaVA-OneVision-style composed VLM: a vision tower, a projector and any core decoder."""
