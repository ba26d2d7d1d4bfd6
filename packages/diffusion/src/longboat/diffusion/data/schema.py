"""Typed configs of diffusion data: the two training sources and ``data prepare``.

- :class:`LatentsDataConfig` (``data.name=latents``): prepared latent datasets on disk.
- :class:`SyntheticSquaresDataConfig` (``data.name=synthetic_squares``): the quickstart's
  generated moving squares, written once as a latent dataset and then read like one.
- :class:`PrepareConfig`: ``longboat-diffusion data prepare key=value ...``.

Each has ``validate(prefix)``, which raises one ``ConfigError`` naming every bad key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from longboat.core.config.errors import ProblemCollector
from longboat.core.config.schema import DataConfig

__all__ = [
    "BATCHINGS",
    "LatentsDataConfig",
    "PrepareConfig",
    "SyntheticSquaresDataConfig",
]

BATCHINGS = ("bucket", "pack")
"""``data.batching``: same-shape batches, or several shapes per batch up to a token budget."""
STORE_DTYPES = ("bfloat16", "float32", "float16")
BATCH_DTYPES = ("float32", "bfloat16")


def _positive(p: ProblemCollector, key: str, value: object, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        p.add(key, "must be a positive integer", value=value, fix=fix)


@dataclass
class LatentsDataConfig(DataConfig):
    """Latent datasets written by ``longboat-diffusion data prepare``."""

    name: str = "latents"
    paths: list[str] = field(default_factory=list)
    """Dataset directories (each with a manifest.json); their samples are read together
    (``path``, when set, is read after them)."""
    batching: str = "bucket"
    """``bucket``: every micro-batch holds ``train.micro_batch_size`` samples of one latent
    shape (no padding). ``pack``: samples of different shapes share a micro-batch up to
    ``max_tokens`` model tokens (the model runs them as one varlen sequence)."""
    max_tokens: int | None = None
    """``pack``: model tokens per micro-batch (every sample must fit alone)."""
    patch_size: list[int] = field(default_factory=lambda: [1, 2, 2])
    """The model's (t, h, w) patch, to count tokens for ``pack``."""
    shuffle: bool = True
    """Shuffle the order every epoch (seeded by ``seed`` and the epoch)."""
    drop_last: bool = False
    """``bucket``: drop each shape's last micro-batch when it is not full."""
    verify: bool = False
    """Every shard's SHA-256 and values (no NaN / Inf) are checked the first time a dataset
    is opened and cached per shard file, size and mtime; ``true`` checks every shard again
    at every open (reads every byte)."""
    skip_bad_samples: bool = False
    """Leave out (and count) samples whose latents or text embeddings hold NaN / Inf instead
    of refusing the dataset."""
    dtype: str = "float32"
    """Batch dtype of latents and text embeddings (shards keep their own)."""
    eval_paths: list[str] = field(default_factory=list)
    """Held-out latent datasets: the training run's held-out loss and preview captions come
    from them (empty: no held-out loss, no preview)."""
    caption_dropout: float = 0.0
    """Share of training samples whose caption is replaced by the empty caption's embedding
    (the dataset's ``empty_caption.safetensors``), so the model also learns the unconditional
    velocity classifier-free guidance needs (0: off; e.g. 0.1)."""

    def validate(self, prefix: str = "data") -> None:
        """Raise one ``ConfigError`` naming every bad key."""
        p = ProblemCollector()
        self._check(p, prefix)
        p.raise_if_any()

    def _check(self, p: ProblemCollector, prefix: str) -> None:
        if not self.paths and not self.path and self.name == "latents":
            p.add(
                f"{prefix}.paths",
                "no dataset directories given",
                fix=f"{prefix}.paths=[<dir written by `longboat-diffusion data prepare`>]",
            )
        if self.batching not in BATCHINGS:
            p.add(
                f"{prefix}.batching",
                "unknown batching",
                value=self.batching,
                fix=f"use one of {', '.join(BATCHINGS)}",
            )
        if self.batching == "pack":
            if self.max_tokens is None:
                p.add(
                    f"{prefix}.max_tokens",
                    "packing needs a token budget per micro-batch",
                    fix=f"{prefix}.max_tokens=<tokens, at least the longest sample's>",
                )
            else:
                _positive(p, f"{prefix}.max_tokens", self.max_tokens, "e.g. 32760")
        if len(self.patch_size) != 3 or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in self.patch_size
        ):
            p.add(
                f"{prefix}.patch_size",
                "must be three positive integers (t, h, w)",
                value=list(self.patch_size),
                fix="Wan: [1, 2, 2]",
            )
        if self.dtype not in BATCH_DTYPES:
            p.add(
                f"{prefix}.dtype",
                "unknown batch dtype",
                value=self.dtype,
                fix=f"use one of {', '.join(BATCH_DTYPES)}",
            )
        if self.num_workers < 0:
            p.add(f"{prefix}.num_workers", "must be >= 0", value=self.num_workers)
        if not 0.0 <= float(self.caption_dropout) < 1.0:
            p.add(
                f"{prefix}.caption_dropout",
                "must be in [0, 1)",
                value=self.caption_dropout,
                fix="e.g. 0.1 (0: every caption kept)",
            )


@dataclass
class SyntheticSquaresDataConfig(LatentsDataConfig):
    """The quickstart's set: coloured squares moving across 16-channel latents, with captions
    (``a red square moving left``) and pseudo text embeddings derived from their words."""

    name: str = "synthetic_squares"
    out_dir: str = "outputs/quickstart_diffusion/data"
    """Where the set is written (reused when it exists with the same settings)."""
    num_samples: int = 256
    """Samples written (cycling through colours, directions and shapes)."""
    shapes: list[list[int]] = field(default_factory=lambda: [[1, 8, 8], [3, 8, 8], [5, 8, 12]])
    """Latent ``[T, H, W]`` shapes (resolutions and lengths); H and W even for a 2x2 patch."""
    latent_channels: int = 16
    """Channels of the latents (Wan: 16)."""
    text_dim: int = 32
    """Width of the pseudo text embeddings (the model's text dim)."""
    start_jitter: int = 1
    """The square starts centred, moved by a seeded offset of at most this many cells per
    axis; larger values make position harder to learn (-1: anywhere)."""
    num_eval_samples: int = 48
    """Samples of the held-out set written beside the training set (the same captions, starts
    drawn with another seed); 0: none."""
    eval_out_dir: str | None = None
    """Where the held-out set is written (default: ``<out_dir>_eval``)."""

    def _check(self, p: ProblemCollector, prefix: str) -> None:
        super()._check(p, prefix)
        _positive(p, f"{prefix}.num_samples", self.num_samples, "e.g. 256")
        _positive(p, f"{prefix}.latent_channels", self.latent_channels, "Wan: 16")
        _positive(p, f"{prefix}.text_dim", self.text_dim, "the model's text dim, e.g. 32")
        if (
            isinstance(self.num_eval_samples, bool)
            or not isinstance(self.num_eval_samples, int)
            or self.num_eval_samples < 0
        ):
            p.add(
                f"{prefix}.num_eval_samples",
                "must be an integer >= 0",
                value=self.num_eval_samples,
                fix="e.g. 48 (0: no held-out set)",
            )
        if (
            isinstance(self.start_jitter, bool)
            or not isinstance(self.start_jitter, int)
            or (self.start_jitter < -1)
        ):
            p.add(
                f"{prefix}.start_jitter",
                "must be an integer >= 0, or -1 (anywhere)",
                value=self.start_jitter,
                fix="e.g. 1",
            )
        if not isinstance(self.latent_channels, bool) and 0 < self.latent_channels < 3:
            p.add(
                f"{prefix}.latent_channels",
                "the squares' colours need at least 3 channels",
                value=self.latent_channels,
                fix="use 16 (Wan)",
            )
        ok = bool(self.shapes) and all(
            len(s) == 3 and all(isinstance(v, int) and v >= 1 for v in s) and min(s[1:]) >= 4
            for s in self.shapes
        )
        if not ok:
            p.add(
                f"{prefix}.shapes",
                "must be a non-empty list of [T, H, W] with T >= 1 and H, W >= 4",
                value=[list(s) for s in self.shapes],
                fix="e.g. [[1, 8, 8], [3, 8, 8], [5, 8, 12]]",
            )


@dataclass
class PrepareConfig:
    """``longboat-diffusion data prepare``: videos / images + captions -> a latent dataset.

    Each input is resized to cover ``height x width`` (aspect kept) and centre-cropped; with
    ``sizes``, to the listed size nearest its aspect ratio. Videos keep ``num_frames`` frames
    from their start, taken at ``fps`` (nearest source frame; every native frame with
    ``fps=null``); shorter videos keep the largest ``4k + 1`` frames they have. Images are one
    frame.
    """

    input: str = MISSING
    """A folder of videos / images (captions in sidecar ``<name>.txt`` files), or a JSONL /
    CSV list of ``path, caption``."""
    out: str = MISSING
    """The dataset directory to write (a re-run resumes it)."""
    vae: str | None = None
    """A diffusers ``AutoencoderKLWan`` directory (default: ``<model_dir>/vae``)."""
    text_encoder: str | None = None
    """A transformers ``UMT5EncoderModel`` directory (default: ``<model_dir>/text_encoder``)."""
    tokenizer: str | None = None
    """Its tokenizer directory (default: ``<model_dir>/tokenizer``, else ``text_encoder``)."""
    model_dir: str | None = None
    """A diffusers Wan pipeline directory holding ``vae/``, ``text_encoder/``, ``tokenizer/``,
    or a FLUX pipeline directory (``model_index.json``: its VAE, CLIP and T5 encode images)."""
    root: str | None = None
    """Where relative paths of a list file start (default: the list file's folder)."""
    height: int = 480
    """Pixel height of encoded frames (a multiple of 16)."""
    width: int = 832
    """Pixel width of encoded frames (a multiple of 16)."""
    sizes: list[list[int]] = field(default_factory=list)
    """Several ``[height, width]`` targets (aspect buckets) instead of ``height`` / ``width``."""
    num_frames: int = 81
    """Frames per video, ``4k + 1`` (the Wan VAE encodes the first frame, then 4 per latent)."""
    fps: float | None = 16.0
    """Frame rate frames are taken at (null: consecutive native frames)."""
    max_text_len: int = 512
    """Caption tokens kept (UMT5; Wan: 512)."""
    samples_per_shard: int = 64
    """Samples per safetensors shard (a shard is the unit a resumed run skips)."""
    dtype: str = "bfloat16"
    """Storage dtype of latents and text embeddings."""
    device: str = "auto"
    """Where the encoders run: ``auto``, ``cpu``, ``cuda`` or an accelerator plugin's name."""
    vae_dtype: str = "float32"
    """Dtype the VAE computes in (``float32`` or ``bfloat16``)."""
    text_encoder_dtype: str = "bfloat16"
    """Dtype the text encoder computes in (UMT5-XXL is trained in bf16)."""
    skip_bad_samples: bool = False
    """Skip (and count) corrupt videos / images and missing captions instead of stopping."""
    overwrite: bool = False
    """Start over when ``out`` holds another preparation (different inputs or options)."""

    def validate(self) -> None:
        """Raise one ``ConfigError`` naming every bad key."""
        p = ProblemCollector()
        for key in ("input", "out"):
            if not getattr(self, key):
                p.add(key, "is required", fix=f"{key}=<path>")
        if self.model_dir is None:
            for key in ("vae", "text_encoder"):
                if getattr(self, key) is None:
                    p.add(key, "is required", fix=f"{key}=<dir>, or model_dir=<Wan diffusers dir>")
        sizes = self.sizes or [[self.height, self.width]]
        key = "sizes" if self.sizes else "height/width"
        for s in sizes:
            if len(s) != 2 or any(not isinstance(v, int) or v < 16 or v % 16 for v in s):
                p.add(
                    key,
                    "sizes must be multiples of 16, at least 16 (the VAE's 8x8 and the DiT's 2x2 "
                    "patch)",
                    value=list(s),
                    fix="e.g. height=480 width=832",
                )
                break
        if not isinstance(self.num_frames, int) or self.num_frames < 1 or self.num_frames % 4 != 1:
            p.add(
                "num_frames",
                "must be 4k + 1 (1, 5, 9, ..., 81)",
                value=self.num_frames,
                fix="e.g. num_frames=81 or 49",
            )
        if self.fps is not None and not self.fps > 0:
            p.add("fps", "must be > 0 (or null for native frames)", value=self.fps)
        _positive(p, "max_text_len", self.max_text_len, "Wan: 512")
        _positive(p, "samples_per_shard", self.samples_per_shard, "e.g. 64")
        if self.dtype not in STORE_DTYPES:
            p.add("dtype", "unknown dtype", value=self.dtype, fix=f"one of {STORE_DTYPES}")
        for key in ("vae_dtype", "text_encoder_dtype"):
            if getattr(self, key) not in BATCH_DTYPES:
                p.add(key, "unknown dtype", value=getattr(self, key), fix="float32 or bfloat16")
        p.raise_if_any()

    @property
    def targets(self) -> list[tuple[int, int]]:
        """The ``(height, width)`` targets."""
        return [(int(h), int(w)) for h, w in (self.sizes or [[self.height, self.width]])]
