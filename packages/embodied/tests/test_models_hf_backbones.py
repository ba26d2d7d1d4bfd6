"""``model.init_from=<Hugging Face backbone directory>``: tiny random transformers models
(PaliGemma, SigLIP, Gemma for pi0.5; SigLIP2, Qwen3 for GR00T N1.6) built from config with
transformers' own classes, saved with ``save_pretrained``, loaded into a longboat policy of
the same shapes; the loaded part's output is compared with the HF module's on the same
input (fp32, 1e-4), the rest must keep its initialisation, and mismatches name the field
or the key before any weight is copied."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from embodied_testkit import write_tiny_tokenizer
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from longboat.core.checkpoint import CheckpointError  # noqa: E402
from longboat.core.config.compose import compose_experiment  # noqa: E402
from longboat.core.config.errors import ConfigError  # noqa: E402
from longboat.embodied.models.common import ops  # noqa: E402
from longboat.embodied.models.init_from import (  # noqa: E402
    load_initial_weights,
    resolve_model_config,
)
from longboat.embodied.models.pi05.lerobot_export import export_lerobot_pi05  # noqa: E402
from longboat.embodied.models.pi05.lerobot_format import load_lerobot_pi05  # noqa: E402
from longboat.embodied.models.registry import build_model  # noqa: E402
from longboat.embodied.train.export import load_exported_policy  # noqa: E402
from longboat.embodied.train.trainer import train  # noqa: E402

TOL = 1e-4
PI05_LM = tuple(f"joint.layers.{i}.lm." for i in range(4))
"""The tiny pi0.5's Gemma LM layers."""
GROOT_OVERRIDES = {"vision.pos_grid": (4, 4)}  # SigLIP2's position table is square
SIGLIP = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    patch_size=14,
    layer_norm_eps=1e-6,
)
GEMMA = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=128,
    vocab_size=1024,
    rms_norm_eps=1e-6,
)
QWEN3 = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)


def _save(model: torch.nn.Module, directory: Path) -> Path:
    """``save_pretrained`` after jittering every vector (HF inits norms to ones / zeros,
    which would hide a swapped norm or bias)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    return directory


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _load(name: str, directory: Path, overrides: dict | None = None, seed: int = 0):
    cfg = resolve_model_config(name, "tiny", overrides or {}, str(directory))
    torch.manual_seed(seed)
    model = build_model(name, cfg).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    line = load_initial_weights(model, name, str(directory))
    return model, before, line


def _unchanged(model: torch.nn.Module, before: dict, prefixes: tuple[str, ...]) -> None:
    """Every tensor outside ``prefixes`` kept its initialisation (and some exist)."""
    rest = [k for k in before if not k.startswith(prefixes)]
    assert rest
    for k in rest:
        assert torch.equal(model.state_dict()[k], before[k]), k


def _pixels(side: int = 56, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(seed))


def _ids(vocab: int, n: int = 7) -> torch.Tensor:
    return torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(1))


def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()[None, None]


def _last_layer_output(layers: torch.nn.ModuleList, run) -> torch.Tensor:
    """Output of ``layers[-1]`` while ``run()`` executes (before any final norm)."""
    seen = []

    def hook(_module, _args, out):
        seen.append(out[0] if isinstance(out, tuple) else out)

    handle = layers[-1].register_forward_hook(hook)
    try:
        run()
    finally:
        handle.remove()
    return seen[-1]


def _pi05_lm(model, ids: torch.Tensor) -> torch.Tensor:
    """Our pi0.5 VLM layers run causally over text (the Gemma LM's hidden states)."""
    x = model.embed(ids)
    cfg = model.cfg.llm
    cos, sin = ops.rope_tables(ids.shape[1], cfg.head_dim, cfg.rope_theta, ids.device)
    rope = (cos, sin, torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1))
    for layer in model.joint.layers:
        x = layer.lm(x, rope, _causal(ids.shape[1]))
    return x


# ---- pi0.5 -------------------------------------------------------------------------------


def test_pi05_from_siglip_vision_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.SiglipVisionConfig(**SIGLIP, image_size=56)
    hf = transformers.SiglipVisionModel(cfg).eval()
    model, before, line = _load("pi05", _save(hf, tmp_path / "siglip"))
    pix = _pixels()
    with torch.no_grad():
        diff = _max_diff(model.vision(pix)[0], hf(pixel_values=pix).last_hidden_state)
    assert diff < TOL, diff
    _unchanged(model, before, ("vision.",))
    print(line)
    assert "loaded vision tower" in line and "SiglipVisionModel" in line
    assert "initialised:" in line and "projector" in line.split("initialised:")[1]


def test_pi05_from_a_dual_siglip_model_reads_past_its_text_tower(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.SiglipConfig(
        vision_config={**SIGLIP, "image_size": 56},
        text_config=dict(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=100,
            projection_size=64,
        ),
    )
    hf = transformers.SiglipModel(cfg).eval()
    model, before, line = _load("pi05", _save(hf, tmp_path / "siglip"))
    pix = _pixels()
    with torch.no_grad():
        diff = _max_diff(model.vision(pix)[0], hf.vision_model(pixel_values=pix).last_hidden_state)
    assert diff < TOL, diff
    _unchanged(model, before, ("vision.",))
    assert "SiglipModel" in line


def test_pi05_from_gemma(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = transformers.GemmaForCausalLM(transformers.GemmaConfig(**GEMMA)).eval()
    model, before, line = _load("pi05", _save(hf, tmp_path / "gemma"))
    ids = _ids(GEMMA["vocab_size"])
    with torch.no_grad():
        theirs = _last_layer_output(hf.model.layers, lambda: hf(input_ids=ids))
        diff = _max_diff(_pi05_lm(model, ids), theirs)
    assert diff < TOL, diff
    _unchanged(model, before, (*PI05_LM, "embed_tokens."))
    assert "loaded language model" in line and "vision" in line.split("initialised:")[1]


def test_pi05_from_paligemma(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.PaliGemmaConfig(
        vision_config={**SIGLIP, "image_size": 56, "vision_use_head": False},
        text_config={**GEMMA, "model_type": "gemma", "use_bidirectional_attention": False},
        projection_dim=64,
    )
    hf = transformers.PaliGemmaForConditionalGeneration(cfg).eval()
    model, before, line = _load("pi05", _save(hf, tmp_path / "paligemma"))
    pix, ids = _pixels(), _ids(GEMMA["vocab_size"])
    with torch.no_grad():
        ours_v = model.vision(pix)[0]
        theirs_v = hf.model.vision_tower(pixel_values=pix).last_hidden_state
        proj = _max_diff(model.projector(theirs_v), hf.model.multi_modal_projector(theirs_v))
        lm = hf.model.language_model
        theirs_lm = _last_layer_output(lm.layers, lambda: lm(input_ids=ids))
        diffs = (_max_diff(ours_v, theirs_v), proj, _max_diff(_pi05_lm(model, ids), theirs_lm))
    assert max(diffs) < TOL, diffs
    _unchanged(model, before, ("vision.", "projector.", "embed_tokens.", *PI05_LM))
    assert "vision tower + projector + language model" in line


def test_pi05_backbone_field_mismatch_names_each_field(tmp_path: Path) -> None:
    torch.manual_seed(0)
    bad = {**GEMMA, "num_key_value_heads": 2, "intermediate_size": 96}
    hf = transformers.GemmaForCausalLM(transformers.GemmaConfig(**bad))
    directory = _save(hf, tmp_path / "gemma")
    with pytest.raises(ConfigError) as err:
        resolve_model_config("pi05", "tiny", {}, str(directory))
    text = str(err.value)
    assert "num_key_value_heads=2" in text and "llm.num_kv_heads=1" in text
    assert "intermediate_size=96" in text and "llm.intermediate_size=128" in text


def test_pi05_backbone_tensor_mismatch_names_each_key(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.SiglipVisionConfig(**SIGLIP, image_size=56)
    directory = _save(transformers.SiglipVisionModel(cfg), tmp_path / "siglip")
    path = directory / "model.safetensors"
    state = load_file(str(path))
    del state["encoder.layers.1.mlp.fc2.bias"]
    state["encoder.layers.0.mlp.fc1.weight"] = torch.zeros(100, 64)
    state["encoder.layers.9.extra.weight"] = torch.zeros(3)
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        resolve_model_config("pi05", "tiny", {}, str(directory))
    text = str(err.value)
    assert "1 missing: encoder.layers.1.mlp.fc2.bias" in text
    assert "1 unexpected: encoder.layers.9.extra.weight" in text
    assert "encoder.layers.0.mlp.fc1.weight: (100, 64) in the file, (128, 64) expected" in text


def test_a_backbone_of_the_other_family_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    directory = _save(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)), tmp_path)
    with pytest.raises(ConfigError, match="'qwen3' model; pi05 initialises from"):
        resolve_model_config("pi05", "tiny", {}, str(directory))


def test_training_starts_from_a_siglip_backbone(tmp_path: Path, capsys) -> None:
    """A run's step-0 vision tower is SigLIP's; everything else is the flavor's init."""
    torch.manual_seed(3)
    hf = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**SIGLIP, image_size=56))
    directory = _save(hf, tmp_path / "siglip")
    tokenizer = write_tiny_tokenizer(tmp_path / "tokenizer")  # LeRobot's prompt: exportable
    cfg = compose_experiment(
        "pi05_tiny",
        [
            f"output_dir={tmp_path / 'run'}",
            f"model.init_from={directory}",
            f"model.tokenizer={tokenizer}",
            "train.steps=1",
            "train.micro_batch_size=2",
            "train.global_batch_size=null",
            "optim.lr=0.0",
            "logging.progress=false",
            "logging.trackers=[]",
            "data.synthetic.num_episodes=2",
            "data.synthetic.episode_length=12",
        ],
        world_size=1,
    )
    result = train(cfg)
    assert len(result.losses) == 1 and torch.isfinite(torch.tensor(result.losses)).all()
    out = capsys.readouterr().out
    assert "model.init_from: loaded vision tower" in out
    assert "Policy pi05/tiny: " in out  # a backbone alone: model.flavor's architecture
    exported = load_exported_policy(tmp_path / "run" / "export")
    ours = exported.state_dict()
    theirs = hf.state_dict()
    assert torch.equal(
        ours["vision.pos_embed"].float(), theirs["embeddings.position_embedding.weight"]
    )
    assert torch.equal(
        ours["vision.blocks.1.fc2.weight"].float(), theirs["encoder.layers.1.mlp.fc2.weight"]
    )
    # ... and goes out in LeRobot's format (the backbone's config.json is no LeRobot base).
    out = export_lerobot_pi05(
        tmp_path / "run" / "export", tmp_path / "out", dataset=tmp_path / "run" / "dataset"
    )
    again, _ = load_lerobot_pi05(out)
    assert torch.equal(again.state_dict()["vision.pos_embed"], ours["vision.pos_embed"].float())


# ---- GR00T N1.6 --------------------------------------------------------------------------


def _patches(pix: torch.Tensor, p: int) -> torch.Tensor:
    """[B, 3, H, W] -> SigLIP2's [B, N, p*p*3] patches, (row, col, channel) inside each."""
    b, c, h, w = pix.shape
    x = pix.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(b, (h // p) * (w // p), p * p * c)


def test_groot_from_siglip2_vision_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.Siglip2VisionConfig(**SIGLIP, num_patches=16)
    hf = transformers.Siglip2VisionModel(cfg).eval()
    model, before, line = _load("groot_n1_6", _save(hf, tmp_path / "s2"), GROOT_OVERRIDES)
    pix = _pixels()
    with torch.no_grad():
        theirs = hf(
            pixel_values=_patches(pix, 14),
            pixel_attention_mask=torch.ones(2, 16, dtype=torch.long),
            spatial_shapes=torch.tensor([[4, 4], [4, 4]]),
        ).last_hidden_state
        diff = _max_diff(model.backbone.vision(pix)[0], theirs)
        # A larger patch grid (6x6) interpolates the 4x4 table, as SigLIP2 does (GR00T's
        # 16x16 table for its 18x18 patches).
        big = torch.rand(2, 3, 84, 84, generator=torch.Generator().manual_seed(5))
        theirs_big = hf(
            pixel_values=_patches(big, 14),
            pixel_attention_mask=torch.ones(2, 36, dtype=torch.long),
            spatial_shapes=torch.tensor([[6, 6], [6, 6]]),
        ).last_hidden_state
        diff_big = _max_diff(model.backbone.vision(big)[0], theirs_big)
    assert diff < TOL, diff
    assert diff_big < TOL, diff_big
    _unchanged(model, before, ("backbone.vision.",))
    assert "Siglip2VisionModel" in line
    assert "backbone.projector" in line and "action_head" in line


def test_groot_from_qwen3(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)).eval()
    with torch.no_grad():
        hf.model.norm.weight.uniform_(0.5, 1.5)  # a trained final norm is not the identity
    model, before, line = _load("groot_n1_6", _save(hf, tmp_path / "qwen3"), GROOT_OVERRIDES)
    ids, select = _ids(QWEN3["vocab_size"]), model.cfg.select_layer
    llm = model.backbone.llm
    with torch.no_grad():
        ours = llm.norm(llm(llm.embed(ids), torch.arange(7)[None].expand(2, -1), _causal(7)))
        # Isaac-GR00T's EagleBackbone: the layers above select_layer popped, hidden_states[-1]
        # (transformers records the final norm's output last).
        while len(hf.model.layers) > select:
            hf.model.layers.pop(-1)
        theirs = hf(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        diff = _max_diff(ours, theirs)
    assert select < QWEN3["num_hidden_layers"]  # the last HF layer is read past
    assert diff < TOL, diff
    _unchanged(model, before, ("backbone.llm.",))
    assert "loaded language model" in line and "backbone.vision" in line


def test_groot_backbone_field_mismatch_names_each_field(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**QWEN3, "head_dim": 8}))
    directory = _save(hf, tmp_path / "qwen3")
    with pytest.raises(ConfigError) as err:
        resolve_model_config("groot_n1_6", "tiny", GROOT_OVERRIDES, str(directory))
    assert "head_dim=8 but the model has llm.head_dim=16" in str(err.value)
    hf = transformers.Siglip2VisionModel(transformers.Siglip2VisionConfig(**SIGLIP))
    directory = _save(hf, tmp_path / "s2")
    with pytest.raises(ConfigError) as err:
        resolve_model_config("groot_n1_6", "tiny", {}, str(directory))
    text = str(err.value)
    assert "num_patches=256 but the model has vision.pos_grid rows*cols=24" in text
    assert "position table is square" in text
