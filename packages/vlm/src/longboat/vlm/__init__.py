"""longboat-vlm: vision-language models on megatron-core."""
