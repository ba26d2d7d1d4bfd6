"""Packing multimodal samples: row layout, labels, per-sample M-RoPE, pixel order, resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from longboat.core.data.packing import IGNORE_INDEX
from longboat.vlm.data.conversations import read_conversations
from longboat.vlm.data.encoding import SampleEncoder, encode_conversations, load_tokenizer
from longboat.vlm.data.errors import DataError, SampleTooLongError
from longboat.vlm.data.loading import load_packed_dataset
from longboat.vlm.data.media import VideoOptions
from longboat.vlm.data.packing import PackedMultimodalDataset, PackedRowStream, sample_position_ids
from longboat.vlm.data.processor import QwenVisionProcessor, VisionProcessorConfig
from longboat.vlm.data.tiny_tokenizer import build_vlm_tokenizer

CFG = VisionProcessorConfig(
    min_pixels=28 * 28 * 4,
    max_pixels=28 * 28 * 12,
    video_min_pixels=28 * 28 * 4,
    video_max_pixels=28 * 28 * 4,
)
TOKENS_PER_SECOND = 2
SEQ_LEN = 96


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory):
    """12 conversations: images of three sizes, two-image samples, a video, text only."""
    root = tmp_path_factory.mktemp("packing")
    info = build_vlm_tokenizer(
        ["user\nhow many? two three", "assistant\nok"], root / "tok", vocab_size=300
    )
    rng = np.random.default_rng(0)
    sizes = [(56, 56), (56, 84), (84, 56)]
    for i, (h, w) in enumerate(sizes):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / f"{i}.png")
    (root / "clip").mkdir()
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)).save(
            root / "clip" / f"{i}.png"
        )
    records = []
    for i in range(12):
        turns = [
            {"from": "human", "value": "how many?"},
            {"from": "gpt", "value": "two " * (i % 4 + 1)},
        ]
        record: dict = {"conversations": turns}
        if i % 4 == 1:
            record["image"] = f"{i % 3}.png"
            turns[0]["value"] = "<image>\n" + turns[0]["value"]
        elif i % 4 == 2:
            record["images"] = [f"{i % 3}.png", f"{(i + 1) % 3}.png"]
            turns[0]["value"] = "<image><image> " + turns[0]["value"]
        elif i == 3:
            record["video"] = "clip"
            turns[0]["value"] = "<video> " + turns[0]["value"]
        records.append(record)
    (root / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tok = load_tokenizer(info.path)
    encoder = SampleEncoder(tok, QwenVisionProcessor(CFG), video=VideoOptions(frames_fps=2.0))
    samples, report = encode_conversations(
        read_conversations(root / "d.jsonl"), encoder, max_len=SEQ_LEN
    )
    assert report.samples == 12
    return root, info, encoder, samples


def _dataset(data, **kw) -> PackedMultimodalDataset:
    _, info, encoder, samples = data
    kw = {
        "seq_len": SEQ_LEN,
        "pad_id": info.pad_token_id,
        "tokens_per_second": TOKENS_PER_SECOND,
    } | kw
    return PackedMultimodalDataset(samples, encoder, **kw)


def test_rows_hold_each_sample_once_with_its_own_layout(data) -> None:
    _, info, encoder, samples = data
    ds = _dataset(data)
    assert len(ds) < len(samples)  # packing put several samples in a row
    seen = sorted(i for r in range(len(ds)) for i in ds[r]["sample_index"])
    assert seen == list(range(len(samples)))
    for r in range(len(ds)):
        row = ds[r]
        members = [samples[i] for i in row["sample_index"]]
        S = SEQ_LEN
        assert row["input_ids"].shape == row["labels"].shape == row["loss_mask"].shape == (1, S)
        assert row["position_ids"].shape == (3, 1, S)
        bounds = np.cumsum([0] + [len(s) for s in members]).tolist()
        want_cu = bounds + ([S] if bounds[-1] < S else [])
        assert row["cu_seqlens"].dtype == torch.int32 and row["cu_seqlens"].tolist() == want_cu
        assert row["max_seqlen"] == max(np.diff(want_cu))
        ids, labels, mask = row["input_ids"][0], row["labels"][0], row["loss_mask"][0]
        assert (ids[bounds[-1] :] == info.pad_token_id).all()
        for s, a, b in zip(members, bounds, bounds[1:], strict=False):
            assert ids[a:b].tolist() == s.input_ids.tolist()
            # labels[i] = the next token of the same sample where it is an assistant target
            for i in range(a, b):
                if i + 1 < b and s.loss_mask[i + 1 - a]:
                    assert labels[i] == ids[i + 1] and mask[i] == 1
                else:
                    assert labels[i] == IGNORE_INDEX and mask[i] == 0
            # M-RoPE positions restart per sample and equal the sample's alone
            alone = sample_position_ids(s, encoder, tokens_per_second=TOKENS_PER_SECOND)
            assert torch.equal(row["position_ids"][:, :, a:b], alone)
        assert (labels[bounds[-1] :] == IGNORE_INDEX).all()
        # Pixels: the members' own, concatenated in token order.
        px = [encoder.pixels(s) for s in members]
        for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
            parts = [p[key] for p in px if p[key] is not None]
            if parts:
                assert torch.equal(row[key], torch.cat(parts)), key
            else:
                assert row[key] is None, key
        merged = (
            int(row["image_grid_thw"].prod(1).sum()) // 4
            if row["image_grid_thw"] is not None
            else 0
        )
        assert int((ids == encoder.tokens.image_pad_id).sum()) == merged


def test_video_row_carries_seconds_and_temporal_positions(data) -> None:
    encoder = data[2]
    ds = _dataset(data)
    r = next(r for r in range(len(ds)) if 3 in ds[r]["sample_index"])
    row = ds[r]
    assert row["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert row["second_per_grid_ts"].tolist() == [1.0]  # 4 frames at 2 fps, kept 4 at 2 fps
    ids = row["input_ids"][0]
    at = torch.nonzero(ids == encoder.tokens.video_pad_id)[:, 0]
    t = row["position_ids"][0, 0, at]
    # 2 temporal steps of 2 x 2 merged tokens; step = tokens_per_second * seconds = 2
    assert (t - t[0]).tolist() == [0] * 4 + [2] * 4


def test_unpacked_rows_hold_one_sample_each(data) -> None:
    ds = _dataset(data, packed=False)
    assert len(ds) == 12
    for r in range(len(ds)):
        row = ds[r]
        assert row["sample_index"] == [r]
        assert row["cu_seqlens"].tolist() == [0, len(data[3][r]), SEQ_LEN]
    # A DataLoader passes the rows through unchanged (no batching: one packed row per step).
    loaded = next(iter(torch.utils.data.DataLoader(ds, batch_size=None)))
    assert loaded.keys() == ds[0].keys() and torch.equal(loaded["input_ids"], ds[0]["input_ids"])


def test_order_is_seeded_and_resume_is_exact(data) -> None:
    ds = _dataset(data)
    order = [r["sample_index"] for r in PackedRowStream(ds, seed=3)]
    assert order == [r["sample_index"] for r in PackedRowStream(ds, seed=3)]
    assert order != [r["sample_index"] for r in PackedRowStream(ds, seed=4)]
    stream = PackedRowStream(ds, seed=3)
    it = iter(stream)
    head = [next(it)["sample_index"] for _ in range(2)]
    state = json.loads(json.dumps(stream.state_dict()))  # a checkpoint round trip
    resumed = PackedRowStream(ds, seed=3)
    resumed.load_state_dict(state)
    rest = [r["sample_index"] for r in resumed]
    assert head + rest == order
    full = next(iter(resumed))  # the next pass is the next epoch: a fresh permutation
    assert resumed.epoch == 1 and full["sample_index"] in order
    # Two data-parallel ranks split each epoch's rows between them.
    ranks = [
        [
            r["sample_index"]
            for r in PackedRowStream(ds, seed=3, num_replicas=2, rank=k, drop_last=True)
        ]
        for k in (0, 1)
    ]
    assert sorted(map(tuple, ranks[0] + ranks[1])) == sorted(map(tuple, order[: len(ds) // 2 * 2]))
    assert ranks[0] == order[0 : len(ds) // 2 * 2 : 2]


def test_resume_refuses_another_plan(data) -> None:
    a, b = _dataset(data), _dataset(data, seq_len=SEQ_LEN + 40)
    stream = PackedRowStream(a, seed=0)
    with pytest.raises(DataError, match="packing plan"):
        PackedRowStream(b, seed=0).load_state_dict(stream.state_dict())


def test_too_long_sample_is_refused(data) -> None:
    _, info, encoder, samples = data
    longest = max(len(s) for s in samples)
    with pytest.raises(
        SampleTooLongError, match=rf"d\.jsonl row \d+ \(line \d+\): {longest} tokens"
    ):
        PackedMultimodalDataset(
            samples, encoder, seq_len=longest - 1, pad_id=info.pad_token_id, tokens_per_second=2
        )


def test_load_packed_dataset_end_to_end(data) -> None:
    root, info, _, samples = data
    lines: list[str] = []
    ds, report = load_packed_dataset(
        root / "d.jsonl",
        tokenizer=info.path,
        processor=QwenVisionProcessor(CFG),
        seq_len=SEQ_LEN,
        tokens_per_second=TOKENS_PER_SECOND,
        video=VideoOptions(frames_fps=2.0),
        log=lines.append,
    )
    assert report.samples == 12 and "records=12, samples=12" in lines[0]
    assert [s.input_ids.tolist() for s in ds.samples] == [s.input_ids.tolist() for s in samples]
    assert 0 < ds.fill <= 1


def _tiny_hf_model(info):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 320,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
            },
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 32,
            "patch_size": CFG.patch_size,
            "spatial_merge_size": CFG.merge_size,
            "temporal_patch_size": CFG.temporal_patch_size,
            "window_size": 112,
            "fullatt_block_indexes": [0],
            "tokens_per_second": TOKENS_PER_SECOND,
        },
        image_token_id=info.image_token_id,
        video_token_id=info.video_token_id,
        vision_start_token_id=info.vision_start_token_id,
        vision_end_token_id=info.vision_end_token_id,
    )
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(cfg).eval()


def test_labels_and_positions_agree_with_transformers(data) -> None:
    """Our pre-shifted labels + loss_mask give transformers' own (internally shifted) loss,
    and our M-RoPE ids equal its get_rope_index, on a sample with images and one with a video."""
    _, info, _, samples = data
    model = _tiny_hf_model(info)
    ds = _dataset(data, packed=False)
    for r in (2, 3):  # two images of different sizes; a video
        row = ds[r]
        n = len(samples[r])
        ids = row["input_ids"][:, :n]
        types = torch.zeros_like(ids, dtype=torch.int32)
        types[ids == info.image_token_id] = 1
        types[ids == info.video_token_id] = 2
        media = {
            k: row[k]
            for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
            if row[k] is not None
        }
        if row["second_per_grid_ts"] is not None:
            media["second_per_grid_ts"] = row["second_per_grid_ts"]
        want_pos, _ = model.model.get_rope_index(
            ids,
            types,
            image_grid_thw=media.get("image_grid_thw"),
            video_grid_thw=media.get("video_grid_thw"),
            second_per_grid_ts=media.get("second_per_grid_ts"),
        )
        assert torch.equal(row["position_ids"][:, :, :n], want_pos)
        target = torch.from_numpy(samples[r].loss_mask)[None].bool()
        hf_labels = torch.where(target, ids, torch.full_like(ids, IGNORE_INDEX))
        with torch.no_grad():
            out = model(input_ids=ids, mm_token_type_ids=types, labels=hf_labels, **media)
        labels, mask = row["labels"][0, :n], row["loss_mask"][0, :n]
        ce = torch.nn.functional.cross_entropy(out.logits[0], labels.clamp(min=0), reduction="none")
        ours = (ce * mask).sum() / mask.sum()
        assert abs(float(ours) - float(out.loss)) < 1e-6, (float(ours), float(out.loss))
