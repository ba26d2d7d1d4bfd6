"""longboat-diffusion: video and image diffusion transformers on megatron-core."""
