"""LeRobot datasets for embodied training: synthetic writer, reader, normalisation, sampling.

Public API (documented in packages/embodied/README.md, "Data"):

- :func:`write_synthetic_dataset`, :class:`EmbodimentSpec` and the known-value functions
  :func:`synthetic_state`, :func:`synthetic_action`, :func:`synthetic_frame`
- :class:`LeRobotDataset` (v2.1 and v3.0), :class:`LeRobotMetadata`
- :class:`MultiLeRobotDataset` (one dataset per embodiment) and :func:`pad_collate`
- :class:`Normalizer`, :class:`EpisodeAwareSampler`
- video backends :class:`PyAVDecoder`, :class:`TorchCodecDecoder`
- errors :class:`LeRobotFormatError`, :class:`VideoDecodeError`; the startup scan
  :func:`verify_dataset` (:class:`VerifyReport`)
"""

from longboat.embodied.data.dataset import LeRobotDataset, delta_indices
from longboat.embodied.data.layout import LeRobotFormatError, VideoDecodeError
from longboat.embodied.data.metadata import EpisodeMeta, LeRobotMetadata
from longboat.embodied.data.mixture import MultiLeRobotDataset, pad_collate
from longboat.embodied.data.normalize import Normalizer
from longboat.embodied.data.sampler import EpisodeAwareSampler
from longboat.embodied.data.synthetic import (
    EmbodimentSpec,
    synthetic_action,
    synthetic_frame,
    synthetic_state,
    write_synthetic_dataset,
)
from longboat.embodied.data.verify import VerifyReport, verify_dataset
from longboat.embodied.data.video_decode import PyAVDecoder, TorchCodecDecoder

__all__ = [
    "EmbodimentSpec",
    "EpisodeAwareSampler",
    "EpisodeMeta",
    "LeRobotDataset",
    "LeRobotFormatError",
    "LeRobotMetadata",
    "MultiLeRobotDataset",
    "Normalizer",
    "PyAVDecoder",
    "TorchCodecDecoder",
    "VerifyReport",
    "VideoDecodeError",
    "delta_indices",
    "pad_collate",
    "synthetic_action",
    "synthetic_frame",
    "synthetic_state",
    "verify_dataset",
    "write_synthetic_dataset",
]
