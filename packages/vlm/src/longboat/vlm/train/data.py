"""The data of a ``longboat-vlm train`` run: conversations -> encoded samples -> packed rows.

``open_run_data(cfg, model_cfg)`` reads the conversations (``data.paths``; the quickstart
generates its own set and tokenizer first), encodes them with the tokenizer's chat template
and a vision processor that matches the model (patch, temporal patch and merge sizes from
the vision tower; ``data.min_pixels`` / ``data.max_pixels``), holds out
``data.eval_fraction`` of the samples (seeded), and packs both splits into rows of
``data.seq_len`` tokens. Problems are found here, before the model is built: a missing or
corrupt image names its row, file and field (or is skipped and counted with
``data.skip_bad_samples=true``), vision token ids that the tokenizer does not have are
named, and so is a tokenizer larger than the model's vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from longboat.core.config.errors import ConfigError


@dataclass
class RunData:
    """The run's packed splits and what the export needs to process inputs again."""

    train: Any
    """``PackedMultimodalDataset`` of the training rows."""
    eval: Any
    """Held-out rows (None without held-out samples)."""
    model_cfg: Any
    """The model config, with the token ids the tokenizer gives."""
    tokenizer: Any
    processor_config: Any
    eval_conversations: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def save_processing(self, out_dir: str | Path) -> None:
        """The tokenizer and ``preprocessor_config.json`` next to an exported model."""
        out = Path(out_dir)
        self.tokenizer.save_pretrained(out)
        p = self.processor_config
        if hasattr(p, "to_hf"):  # a family's own processor settings
            (out / "preprocessor_config.json").write_text(json.dumps(p.to_hf(), indent=2))
            return
        (out / "preprocessor_config.json").write_text(
            json.dumps(
                {
                    "image_processor_type": "Qwen2VLImageProcessor",
                    "patch_size": p.patch_size,
                    "temporal_patch_size": p.temporal_patch_size,
                    "merge_size": p.merge_size,
                    "min_pixels": p.min_pixels,
                    "max_pixels": p.max_pixels,
                    "size": {"shortest_edge": p.min_pixels, "longest_edge": p.max_pixels},
                    "image_mean": list(p.image_mean),
                    "image_std": list(p.image_std),
                    "rescale_factor": p.rescale_factor,
                    "do_resize": True,
                    "do_rescale": True,
                    "do_normalize": True,
                    "do_convert_rgb": True,
                },
                indent=2,
            )
        )


def row_plan(num_rows: int, layout: Any, seed: int, costs: np.ndarray | None = None) -> Any:
    """Core's ``GlobalBatchPlan`` of the packed training rows: epoch ``e`` walks the rows in
    a numpy permutation seeded by ``seed + e``; rank ``r`` trains the step's rows ``r, r + dp,
    ...``, or with ``costs`` (``vlm.dp_balance``, :func:`~longboat.vlm.train.balance.row_costs`)
    the rows dealt by cost. A pure function of the step, for exact resume."""
    from longboat.core.data.batch_plan import GlobalBatchPlan

    return GlobalBatchPlan(
        num_rows, layout, seed=seed, permutation="numpy_summed_seed", deal="micro_major",
        costs=costs,
    )  # fmt: skip


def _with_token_ids(
    model_cfg: Any, tokens: Any, vocab: int, source: str, checkpoint: str | None = None
) -> Any:
    """``model_cfg`` with the tokenizer's vision token ids; errors when they do not fit, or
    (``checkpoint``: the config came from that Hugging Face directory) when the tokenizer
    numbers a vision token differently from the checkpoint, whose embeddings were trained
    with the checkpoint's ids."""
    ids = dict(
        image_token_id=tokens.image_pad_id,
        video_token_id=tokens.video_pad_id,
        vision_start_token_id=tokens.vision_start_id,
        vision_end_token_id=tokens.vision_end_id,
    )
    limit = model_cfg.language.vocab_size
    if vocab > limit:
        raise ConfigError(
            f"the tokenizer {source} has {vocab} tokens but the model's vocabulary is {limit}",
            key="data.tokenizer",
            fix="use the checkpoint's own tokenizer, or a model with a larger vocabulary",
        )
    # A family keeps the ids it uses (LLaVA-style models have no vision start / end tokens).
    has = {f.name for f in dataclasses.fields(model_cfg)}
    ids = {k: v for k, v in ids.items() if k in has}
    if checkpoint:
        clash = {
            k: (getattr(model_cfg, k), v) for k, v in ids.items() if getattr(model_cfg, k) != v
        }
        if clash:
            said = ", ".join(f"{k}: checkpoint {a}, tokenizer {b}" for k, (a, b) in clash.items())
            raise ConfigError(
                f"the tokenizer {source} numbers the vision tokens differently from the "
                f"checkpoint's config.json ({said})",
                key="data.tokenizer",
                fix=f"use the tokenizer saved with the checkpoint (leave data.tokenizer unset to "
                f"take {checkpoint}'s own)",
            )
    return dataclasses.replace(model_cfg, **ids)


DEFAULT_PIXELS = {"min_pixels": 3136, "max_pixels": 1003520}
"""Image area bounds without a setting or a checkpoint's (Qwen2.5-VL's released ones)."""


def pixel_bounds(data: Any, init_from: str | None) -> tuple[dict[str, int], list[str]]:
    """``{"min_pixels", "max_pixels"}`` images are resized within, and a note saying where
    they came from: ``data.min_pixels`` / ``data.max_pixels`` where set, else the
    ``preprocessor_config.json`` of the checkpoint ``init_from`` (so a fine-tune sees images
    as the checkpoint was trained on them), else ``DEFAULT_PIXELS``."""
    from longboat.vlm.data.processor import VisionProcessorConfig

    source: dict[str, int] = {}
    file = Path(init_from) / "preprocessor_config.json" if init_from else None
    if file is not None and file.is_file():
        hf = VisionProcessorConfig.from_hf(json.loads(file.read_text()))
        source = {"min_pixels": hf.min_pixels, "max_pixels": hf.max_pixels}
    bounds, notes = {}, []
    for key, default in DEFAULT_PIXELS.items():
        mine = getattr(data, key, None)
        bounds[key] = mine if mine is not None else source.get(key, default)
        if mine is not None and key in source and mine != source[key]:
            notes.append(
                f"Images: data.{key}={mine} replaces the checkpoint's {key}={source[key]} "
                f"({file}); the export carries {mine}."
            )
    taken = [k for k in DEFAULT_PIXELS if getattr(data, k, None) is None and k in source]
    if taken:
        said = ", ".join(f"{k}={source[k]}" for k in taken)
        keys = " / ".join(f"data.{k}" for k in taken)
        notes.append(f"Images: {said} from {file} ({keys}=<pixels> to change).")
    return bounds, notes


def _processor(cfg: Any, model_cfg: Any, bounds: dict[str, int]) -> Any:
    from longboat.vlm.data.processor import QwenVisionProcessor, VisionProcessorConfig

    if hasattr(model_cfg, "vision_processor"):  # a family with its own image processing
        return model_cfg.vision_processor(dataclasses.replace(cfg.data, **bounds))
    v = model_cfg.vision
    pcfg = VisionProcessorConfig(
        patch_size=v.patch_size,
        temporal_patch_size=v.temporal_patch_size,
        merge_size=v.spatial_merge_size,
        **bounds,
    )
    return QwenVisionProcessor(pcfg)


def _split(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    order = np.random.default_rng(seed).permutation(n).tolist()
    k = round(n * fraction) if n > 1 else 0
    k = min(max(k, 1 if fraction > 0 and n > 1 else 0), n - 1)
    return sorted(order[k:]), sorted(order[:k])


def _cached_samples(
    files: list[str],
    encoder: Any,
    tokenizer_dir: Any,
    data: Any,
    *,
    cache_dir: str | None,
    progress: bool,
) -> Any:
    """``encoded_samples`` of ``files``; with several ranks and a cache, rank 0 builds the
    entry first and the others load it."""
    import torch.distributed as dist

    from longboat.vlm.data.cache import encoded_samples

    def run(bar: bool) -> Any:
        return encoded_samples(
            files,
            encoder,
            tokenizer_dir=tokenizer_dir,
            seq_len=data.seq_len,
            root=data.root,
            skip_bad_samples=data.skip_bad_samples,
            cache_dir=cache_dir,
            progress=bar,
        )

    several = cache_dir is not None and dist.is_initialized() and dist.get_world_size() > 1
    if not several:
        return run(progress)
    got, error = None, None
    if dist.get_rank() == 0:
        try:
            got = run(progress)
        except Exception as exc:  # the others wait at the barrier below, then see it too
            error = exc
    dist.barrier()
    if error is not None:
        raise error
    return got if got is not None else run(False)


class RunProcessing(NamedTuple):
    """How a run turns text and images into model inputs (``run_processing``)."""

    tokenizer: Any
    encoder: Any
    """The ``SampleEncoder`` of the tokenizer and the processor."""
    processor: Any
    model_cfg: Any
    """The model config with the tokenizer's vision token ids."""
    notes: list[str]
    """Where the image size bounds came from (``pixel_bounds``)."""


def run_processing(cfg: Any, model_cfg: Any, tokenizer_dir: str | Path) -> RunProcessing:
    """The tokenizer of ``tokenizer_dir``, the vision processor of the run's model and image
    bounds, and ``model_cfg`` with the tokenizer's vision token ids (errors where they do not
    fit); what the training data is encoded with and what its export carries."""
    from longboat.vlm.data.encoding import SampleEncoder, load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    bounds, notes = pixel_bounds(cfg.data, getattr(cfg.model, "init_from", None))
    processor = _processor(cfg, model_cfg, bounds)
    encoder = SampleEncoder(tokenizer, processor)
    model_cfg = _with_token_ids(
        model_cfg,
        encoder.tokens,
        len(tokenizer),
        str(tokenizer_dir),
        checkpoint=getattr(cfg.model, "init_from", None),
    )
    return RunProcessing(tokenizer, encoder, processor, model_cfg, notes)


def open_run_data(
    cfg: Any, model_cfg: Any, *, progress: bool = False, answer_questions: bool | None = None
) -> RunData:
    """Read, encode and pack the run's data (see the module doc). With ``data.cache_dir`` the
    encoded samples come from (or go to) a cache entry (``longboat.vlm.data.cache``).
    ``progress``: a bar while encoding. ``answer_questions`` (default: whether
    ``vlm.answer_eval_samples`` is set): keep the held-out conversations for answering."""
    from longboat.vlm.data.conversations import read_conversations
    from longboat.vlm.data.packing import PackedMultimodalDataset

    if answer_questions is None:
        answer_questions = getattr(getattr(cfg, "vlm", None), "answer_eval_samples", 0) > 0

    data = cfg.data
    notes: list[str] = []
    if data.name == "shapes":
        from longboat.vlm.data.shapes_dataset import prepare_shapes_dataset

        train_files, eval_files, tokenizer_dir = prepare_shapes_dataset(data, seed=cfg.train.seed)
        paths = [str(p) for p in train_files]
        eval_paths = [str(p) for p in eval_files]
    else:
        paths, eval_paths = list(data.paths), []
        tokenizer_dir = data.tokenizer or cfg.model.init_from
        if tokenizer_dir is None:
            raise ConfigError(
                "no tokenizer",
                key="data.tokenizer",
                fix="give a tokenizer directory (or model.init_from, whose tokenizer is used)",
            )
    tokenizer, encoder, processor, model_cfg, pixel_notes = run_processing(
        cfg, model_cfg, tokenizer_dir
    )
    notes += pixel_notes

    cache_dir = getattr(data, "cache_dir", None)

    def encode(files: list[str]) -> list[Any]:
        got = _cached_samples(
            files, encoder, tokenizer_dir, data, cache_dir=cache_dir, progress=progress
        )
        if got.path is not None:
            how = "reused cache" if got.reused else "encoded into cache"
            notes.append(f"Data: {how} {got.path}.")
        report = got.report
        if report.skipped_bad_media:
            notes.append(
                f"data.skip_bad_samples: skipped {report.skipped_bad_media} sample(s) with "
                f"unreadable media, e.g. {report.bad[0] if report.bad else '?'}"
            )
        return got.samples

    def conversations(files: list[str]) -> list[Any]:
        return [c for f in files for c in read_conversations(f, root=data.root)]

    samples = encode(paths)
    if eval_paths:
        eval_samples = encode(eval_paths)
        eval_convs = conversations(eval_paths) if answer_questions else []
    else:
        keep, held = _split(len(samples), data.eval_fraction, data.seed)
        eval_samples = [samples[i] for i in held]
        samples = [samples[i] for i in keep]
        held_at = {s.where for s in eval_samples}
        convs = conversations(paths) if answer_questions and held_at else []
        eval_convs = [c for c in convs if c.where in held_at]
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id
    kw = dict(
        seq_len=data.seq_len,
        pad_id=int(pad),
        tokens_per_second=getattr(model_cfg, "tokens_per_second", 1),
        positions=getattr(model_cfg, "position_kind", None),
    )
    train = PackedMultimodalDataset(samples, encoder, **kw)
    held_rows = PackedMultimodalDataset(eval_samples, encoder, **kw) if eval_samples else None
    return RunData(
        train=train,
        eval=held_rows,
        model_cfg=model_cfg,
        tokenizer=tokenizer,
        processor_config=processor.config,
        eval_conversations=eval_convs,
        notes=notes,
    )


def _prompt(conv: Any) -> tuple[list[dict[str, str]], str]:
    """The first user turn of ``conv`` (with its image) and the answer it expects."""
    messages = list(conv.messages)
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    first = users[0]
    answer = next(m["content"] for m in messages[first + 1 :] if m["role"] == "assistant")
    return messages[: first + 1], answer.strip()


def answer_held_out(export_dir: str | Path, data: RunData, n: int) -> tuple[int, int, str]:
    """Ask the export (loaded with ``transformers``) the first question of ``n`` held-out
    conversations, greedily; returns ``(right, asked, one example line)``."""
    import torch
    from transformers import AutoModelForImageTextToText

    from longboat.vlm.data.encoding import SampleEncoder, _expand
    from longboat.vlm.data.media import load_image
    from longboat.vlm.data.processor import QwenVisionProcessor
    from longboat.vlm.models.mrope import token_types

    convs = [c for c in data.eval_conversations if c.images][:n]
    if not convs:
        return 0, 0, ""
    llava = hasattr(data.processor_config, "to_hf")  # the LLaVA-OneVision family's processor
    if llava:
        from transformers import LlavaOnevisionForConditionalGeneration

        from longboat.vlm.data.llava_processor import LlavaVisionProcessor

        model = LlavaOnevisionForConditionalGeneration.from_pretrained(str(export_dir)).eval()
        processor = LlavaVisionProcessor(data.processor_config)
    else:
        # Qwen2.5-VL or Qwen3-VL, as the export's config.json says.
        model = AutoModelForImageTextToText.from_pretrained(str(export_dir)).eval()
        processor = QwenVisionProcessor(data.processor_config)
    tok = data.tokenizer
    encoder = SampleEncoder(tok, processor)
    cfg, right, example = data.model_cfg, 0, ""
    markup = encoder.tokens.markup("image")
    for conv in convs:
        messages, want = _prompt(conv)
        image = load_image(conv.images[0], conv.where)
        pixels = processor.preprocess_images([image])
        text = tok.apply_chat_template(
            [
                {"role": m["role"], "content": m["content"].replace("<image>", markup)}
                for m in messages
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
        grid = pixels["image_grid_thw"]
        if llava:
            merged = processor.grid_tokens(grid[0].tolist())
            vision = {"pixel_values": pixels["pixel_values"][None], "image_sizes": grid[:, 1:],
                      "batch_num_images": torch.tensor([1])}  # fmt: skip
        else:
            merged = int(grid.prod()) // data.processor_config.merge_size**2
        ids, _ = _expand(ids, np.zeros_like(ids, dtype=np.uint8), cfg.image_token_id, [merged],
                         "image", conv.where)  # fmt: skip
        input_ids = torch.from_numpy(ids)[None]
        if not llava:
            vision = {
                "mm_token_type_ids": token_types(
                    input_ids, cfg.image_token_id, cfg.video_token_id
                ).int(),
                "pixel_values": pixels["pixel_values"],
                "image_grid_thw": grid,
            }
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                **vision,
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                pad_token_id=tok.pad_token_id,
            )
        got = tok.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True).strip()
        right += int(got == want)
        if not example:
            question = messages[-1]["content"].replace("<image>", "").strip()
            example = f"  e.g. {question!r} -> {got!r} (expected {want!r})"
    return right, len(convs), example
