"""Latent datasets of diffusion training and their preparation.

- :mod:`~longboat.diffusion.data.shards`: the on-disk format (safetensors shards + manifest).
- :mod:`~longboat.diffusion.data.dataset`: :class:`LatentDataset`, the reader.
- :mod:`~longboat.diffusion.data.batching`: bucketed / packed batches (resumable), collation.
- :mod:`~longboat.diffusion.data.loading`: a data config -> a resumable loader.
- :mod:`~longboat.diffusion.data.prepare`: videos / images + captions -> latents (Wan VAE,
  UMT5; :mod:`~longboat.diffusion.data.media`, :mod:`~longboat.diffusion.data.sources`,
  :mod:`~longboat.diffusion.data.encoders`), the ``data prepare`` command;
  :mod:`~longboat.diffusion.data.tiny_encoders` builds tiny random encoders to try it.
- :mod:`~longboat.diffusion.data.synthetic` / :mod:`~longboat.diffusion.data.preview`: the
  quickstart's moving squares and GIF previews of latents.
- :mod:`~longboat.diffusion.data.schema`: typed configs; :mod:`~longboat.diffusion.data.errors`.
"""

from longboat.diffusion.data.batching import LatentBatchSampler, collate_latents
from longboat.diffusion.data.dataset import LatentDataset
from longboat.diffusion.data.errors import BadSampleError, DataError
from longboat.diffusion.data.loading import LatentLoader, build_latent_loader
from longboat.diffusion.data.prepare import PrepareReport, prepare_latents
from longboat.diffusion.data.preview import latents_to_gif, latents_to_rgb
from longboat.diffusion.data.schema import (
    LatentsDataConfig,
    PrepareConfig,
    SyntheticSquaresDataConfig,
)
from longboat.diffusion.data.shards import LatentRecord
from longboat.diffusion.data.synthetic import caption_embedding, generate_squares

__all__ = [
    "BadSampleError",
    "DataError",
    "LatentBatchSampler",
    "LatentDataset",
    "LatentLoader",
    "LatentRecord",
    "LatentsDataConfig",
    "PrepareConfig",
    "PrepareReport",
    "SyntheticSquaresDataConfig",
    "build_latent_loader",
    "caption_embedding",
    "collate_latents",
    "generate_squares",
    "latents_to_gif",
    "latents_to_rgb",
    "prepare_latents",
]
