"""What a VLM export carries besides the weights: the special tokens ``generate()`` stops and
pads with, in ``config.json`` and ``generation_config.json``.

Without them ``transformers`` generates past the end of the answer (the text config's
``eos_token_id`` is null). The ids are the source checkpoint's ``generation_config.json``
where the run started from one that has it, else the tokenizer's: its EOS, the chat
template's end-of-turn token ``<|im_end|>`` where the tokenizer has one that is not its EOS,
and its PAD (EOS when it has none).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

END_OF_TURN = "<|im_end|>"
"""The token that closes a turn in the Qwen chat template every VLM family here uses."""


def stop_token_ids(tokenizer: Any) -> dict[str, Any]:
    """``{"eos_token_id": id or [ids], "pad_token_id": id, "bos_token_id": id}`` of
    ``tokenizer`` (keys without a token left out)."""
    eos: list[int] = []
    if tokenizer.eos_token_id is not None:
        eos.append(int(tokenizer.eos_token_id))
    turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if isinstance(turn, int) and turn != tokenizer.unk_token_id and turn not in eos:
        eos.append(turn)
    ids: dict[str, Any] = {}
    if eos:
        ids["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or [None])[0]
    if pad is not None:
        ids["pad_token_id"] = int(pad)
    if getattr(tokenizer, "bos_token_id", None) is not None:
        ids["bos_token_id"] = int(tokenizer.bos_token_id)
    return ids


def write_generation_config(
    out_dir: str | Path, tokenizer: Any, source_dir: str | Path | None = None
) -> dict[str, Any]:
    """Write the stop and pad ids (see the module doc) into ``out_dir/config.json`` (top level
    and ``text_config``) and ``out_dir/generation_config.json``; returns the ids written."""
    from transformers import GenerationConfig

    out = Path(out_dir)
    ids = stop_token_ids(tokenizer)
    generation = None
    if source_dir is not None and (Path(source_dir) / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(str(source_dir))
        for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
            if getattr(generation, key, None) is not None:
                ids[key] = getattr(generation, key)
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    config.update(ids)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].update(ids)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = generation or GenerationConfig()
    for key, value in ids.items():
        setattr(generation, key, value)
    generation.save_pretrained(str(out))
    return ids
