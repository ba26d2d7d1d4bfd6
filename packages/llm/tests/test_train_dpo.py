"""DPO (``llm.objective=dpo``): the loss and its gradient against transformers, ln 2 at step
0, a margin that grows, the config refusals, and an exact resume."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from llm_testkit import compose, tiny_overrides

from longboat.core.config.errors import ConfigError
from longboat.core.distributed import run_multiprocess

BETA = 0.1
LN2_FP32 = float(torch.tensor(math.log(2.0), dtype=torch.float32))

# --- (1) parity with transformers -------------------------------------------------------

# megatron parameter -> transformers parameter of the same layout (the fused QKV and gate/up
# projections are left out: their layouts differ).
GRAD_NAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "decoder.layers.0.mlp.linear_fc2.weight": "model.layers.0.mlp.down_proj.weight",
    "decoder.layers.1.self_attention.linear_proj.weight": "model.layers.1.self_attn.o_proj.weight",
}


def _pairs(vocab: int) -> list:
    """Two pairs of random tokens: a shared prompt, answers of different lengths."""
    from longboat.llm.data.preference import PreferencePair

    g = np.random.default_rng(3)
    out = []
    for prompt_len, lengths in ((5, (6, 4)), (3, (3, 8))):
        prompt = g.integers(1, vocab, prompt_len)
        sides = []
        for n in lengths:
            ids = np.concatenate([prompt, g.integers(1, vocab, n)])
            mask = np.r_[np.zeros(prompt_len), np.ones(n)].astype(np.uint8)
            sides += [ids, mask]
        out.append(PreferencePair(*sides, prompt_len=prompt_len, where="test"))
    return out


REF_LOGPS = torch.tensor([-40.0, -20.5, -30.25, -45.0])  # chosen 0, 1, rejected 0, 1


def _megatron_worker(rank: int, world: int, hf_dir: Path) -> tuple[float, dict, dict]:
    from longboat.core.config.schema import OptimConfig, ParallelConfig
    from longboat.core.device import get_accelerator
    from longboat.core.megatron import parallel_state
    from longboat.llm.hf_checkpoint import load_hf, read_hf_config
    from longboat.llm.train.dpo import dpo_objective
    from longboat.llm.train.dpo_data import PreferenceRows
    from longboat.llm.train.lm_step import build_train_step

    cfg = read_hf_config(hf_dir)
    parallel_state.initialize(ParallelConfig(), get_accelerator("cpu"), seed=0)
    try:
        step = build_train_step(
            cfg,
            OptimConfig(),
            precision="fp32",
            device="cpu",
            init_weights=lambda c: load_hf(c, cfg, hf_dir),
            objective=dpo_objective(BETA),
        )
        micro = PreferenceRows(_pairs(cfg.vocab_size), seq_len=16).microbatch([0, 1])
        micro.pop("pair_index")
        micro["ref_logps"] = REF_LOGPS
        loss = float(step.forward_backward([micro]))
        params = dict(step.chunks[0].named_parameters())
        grads = {n: params[n].main_grad.detach().clone() for n in GRAD_NAMES}
        metrics = {k: float(v) for k, v in step.metrics.items()}
        return loss, grads, metrics
    finally:
        parallel_state.destroy()


def _transformers_dpo(hf_dir: Path) -> tuple[torch.Tensor, dict, dict]:
    """The same loss with plain PyTorch on transformers' model: logits -> log-softmax ->
    gather -> sums over the answer tokens -> the DPO formula; and its gradients."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    pairs = _pairs(model.config.vocab_size)
    logps = []
    for side in ("chosen", "rejected"):
        for pair in pairs:
            ids = torch.from_numpy(getattr(pair, f"{side}_ids")).long()[None]
            mask = torch.from_numpy(getattr(pair, f"{side}_mask")).float()[None]
            logp = F.log_softmax(model(ids).logits.float(), dim=-1)
            token = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # log p(ids[t+1] | ..t)
            logps.append((token * mask[:, 1:]).sum())
    pi = torch.stack(logps)
    rewards = BETA * (pi - REF_LOGPS)
    margin = rewards[:2] - rewards[2:]
    loss = -F.logsigmoid(margin).mean()
    loss.backward()
    params = dict(model.named_parameters())
    grads = {n: params[hf].grad.detach().clone() for n, hf in GRAD_NAMES.items()}
    stats = {
        "reward_accuracy": float((margin > 0).float().mean()),
        "reward_margin": float(margin.detach().mean()),
        "chosen_reward": float(rewards[:2].mean()),
        "rejected_reward": float(rewards[2:].mean()),
    }
    return loss.detach(), grads, stats


@pytest.mark.multiprocess
def test_dpo_loss_and_gradients_match_transformers(hf_dirs: dict[str, Path]) -> None:
    """fp32: the loss within 1e-5, each compared gradient within 1e-5 of its largest entry
    (the same parameters, megatron's model against transformers' Llama)."""
    hf_dir = hf_dirs["llama3"]
    loss, grads, metrics = run_multiprocess(_megatron_worker, 1, hf_dir)[0]
    want_loss, want_grads, want_stats = _transformers_dpo(hf_dir)
    # Not a degenerate case: the reference numbers are far from the model's, the pairs
    # disagree, the gradients are not zero.
    assert float(want_loss) > 0.05 and want_stats["reward_accuracy"] == 0.5
    assert abs(loss - float(want_loss)) < 1e-5, (loss, float(want_loss))
    for name, want in want_grads.items():
        scale = want.abs().max().item()
        assert scale > 1e-4, name
        diff = (grads[name] - want).abs().max().item()
        assert diff <= 1e-5 * max(1.0, scale), f"{name}: max |diff| {diff:.3g} (scale {scale:.3g})"
    for key, want in want_stats.items():
        assert abs(metrics[key] - want) < 1e-5, (key, metrics[key], want)


# --- runs of the product ------------------------------------------------------------------


def make_pairs(root: Path, *, records: int = 40) -> tuple[Path, Path]:
    """(pairs JSONL, tokenizer dir): "count from a" answered upward (chosen) or with the same
    numbers downward (rejected)."""
    from longboat.llm.data.tiny_tokenizer import train_tiny_tokenizer

    recs = []
    for i in range(records):
        a = i % 7
        recs.append(
            {
                "prompt": f"count from {a} please",
                "chosen": " ".join(str(a + k) for k in range(4)),
                "rejected": " ".join(str(a + 3 - k) for k in range(4)),
            }
        )
    root.mkdir(parents=True, exist_ok=True)
    texts = [r[k] for r in recs for k in ("prompt", "chosen", "rejected")]
    tok = Path(train_tiny_tokenizer(texts, root / "tokenizer", vocab_size=256))
    path = root / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path, tok


def dpo_overrides(pairs: Path, tok: Path, out: Path, *, steps: int) -> list[str]:
    return [
        *tiny_overrides(pairs, tok, out, steps=steps),
        "llm.objective=dpo",
        f"llm.dpo.beta={BETA}",
        "data.seq_len=48",
        "optim.lr=1e-3",
    ]


def _rows(out: Path) -> list[dict]:
    path = out / "logs" / "quickstart" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run_worker(rank: int, world: int, overrides: list[str], stop_at: int) -> tuple[int, list]:
    from longboat.llm.train.training import train as run

    def on_step(step: int) -> None:
        if step == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)

    result = run(compose(overrides, world_size=world), on_step=on_step if stop_at else None)
    return result.start_step, result.losses


@pytest.mark.multiprocess
def test_step_zero_is_ln2_and_the_margin_grows(tmp_path: Path) -> None:
    """(2) with reference = the initial weights the first step's loss is ln 2 (fp32) and no
    pair is yet preferred; (3) eight steps make the chosen answers likelier relative to the
    rejected ones, on the training pairs and on held-out ones."""
    pairs, tok = make_pairs(tmp_path / "data")
    out = tmp_path / "run"
    start, losses = run_multiprocess(_run_worker, 1, dpo_overrides(pairs, tok, out, steps=8), 0)[0]
    assert start == 0 and len(losses) == 8
    assert abs(losses[0] - LN2_FP32) < 1e-6, losses[0]
    rows = _rows(out)
    first = next(r for r in rows if r["step"] == 1)
    assert first["reward_accuracy"] == 0.0  # no chosen reward above its rejected one (all 0)
    assert abs(first["reward_margin"]) < 1e-6 and abs(first["chosen_reward"]) < 1e-6
    start_eval = next(r for r in rows if r["step"] == 0 and "eval_loss" in r)
    assert abs(start_eval["eval_loss"] - LN2_FP32) < 1e-6
    last = next(r for r in rows if r["step"] == 8 and "loss" in r)
    end_eval = [r for r in rows if r["step"] == 8 and "eval_loss" in r][-1]
    # The margin rises (chosen log-probability up relative to rejected).
    assert last["reward_margin"] > 0.2, last
    assert last["chosen_reward"] > last["rejected_reward"]
    assert last["reward_accuracy"] == 1.0
    assert losses[-1] < 0.6 and end_eval["eval_loss"] < 0.6
    assert end_eval["eval_reward_accuracy"] == 1.0


@pytest.mark.multiprocess
def test_dpo_with_lora_starts_at_ln2_and_learns(tmp_path: Path) -> None:
    """With LoRA the reference is the base model (the adapters start at zero): ln 2 first."""
    pairs, tok = make_pairs(tmp_path / "data")
    ov = [*dpo_overrides(pairs, tok, tmp_path / "run", steps=6), "lora.enabled=true",
          "optim.lr=1e-2"]  # fmt: skip
    _, losses = run_multiprocess(_run_worker, 1, ov, 0)[0]
    assert abs(losses[0] - LN2_FP32) < 1e-6 and losses[-1] < losses[0] - 0.05, losses


@pytest.mark.multiprocess
def test_resume_continues_the_dpo_losses_exactly(tmp_path: Path) -> None:
    """(5) stop at step 4 (SIGTERM saves), resume: the same losses as an uninterrupted run,
    the reference log-probabilities read from the checkpoint (not recomputed from the
    trained weights, which would change every loss after the resume)."""
    pairs, tok = make_pairs(tmp_path / "data")
    resume = ["checkpoint.resume=auto", "checkpoint.save_on_exit=true", "checkpoint.keep_last=0"]
    ref_ov = [*dpo_overrides(pairs, tok, tmp_path / "ref", steps=8), *resume]
    _, ref = run_multiprocess(_run_worker, 1, ref_ov, 0)[0]
    ov = [*dpo_overrides(pairs, tok, tmp_path / "run", steps=8), *resume]
    start, first = run_multiprocess(_run_worker, 1, ov, 4)[0]
    assert start == 0 and first == ref[:4]
    start, resumed = run_multiprocess(_run_worker, 1, ov, 0)[0]
    assert start == 4
    assert resumed == ref[4:], "resumed DPO losses differ from the uninterrupted run"
    assert ref[-1] < ref[0]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory: pytest.TempPathFactory, hf_dirs: dict[str, Path]) -> dict:
    """Six DPO steps from one tiny Qwen3 checkpoint in each layout (megatron's random init
    draws differently per pipeline stage, so the runs start from the same HF weights)."""
    root = tmp_path_factory.mktemp("layouts")
    pairs, tok = make_pairs(root / "data")
    base = [
        *dpo_overrides(pairs, tok, root / "one", steps=6),
        f"model.init_from={hf_dirs['qwen3']}",
    ]
    runs = {"one": run_multiprocess(_run_worker, 1, base, 0)[0][1]}
    for name, layout in LAYOUTS.items():
        ov = [*dpo_overrides(pairs, tok, root / name, steps=6), base[-1], *layout]
        runs[name] = [losses for _, losses in run_multiprocess(_run_worker, 2, ov, 0)]
    return runs


LAYOUTS = {
    "tp2": ["parallel.tensor_parallel=2"],
    "pp2": ["parallel.pipeline_parallel=2"],
    "dp2": ["parallel.data_parallel=2"],  # the same pairs, split over ranks
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dpo_losses_match_one_process(layout: str, layout_runs: dict) -> None:
    """fp32: TP / PP / DP only reorder reductions (1e-4, as the LM loss parity), the
    reference pass included (ln 2 at step 0 on every rank)."""
    one = layout_runs["one"]
    assert abs(one[0] - LN2_FP32) < 1e-6 and one[-1] < one[0] - 0.05, one
    for losses in layout_runs[layout]:  # every rank reports the step loss
        diffs = [abs(a - b) for a, b in zip(losses, one, strict=True)]
        assert max(diffs) <= 1e-4, f"{layout}: max |loss - loss_one| = {max(diffs):.2e}"


GRAPH_STEPS = 7  # 3 eager warm-up steps, the capture, 3 replays


def _engine_worker(rank: int, world: int, overrides: list[str]) -> dict:
    """``GRAPH_STEPS`` DPO steps through the gate the engine picks, and what a CUDA capture
    of the graphed step would reject."""
    from longboat.core.config.compose import compose_experiment
    from longboat.core.loop.capture_check import find_capture_hazards
    from longboat.core.loop.nan_guard import NaNGuard
    from longboat.core.train import typed_config
    from longboat.core.train.schedule import RunSchedule
    from longboat.llm.train.training import build_training

    cfg = typed_config(compose_experiment("quickstart", overrides, stack="llm"))
    training = build_training(cfg)
    try:
        guard = NaNGuard(cfg.train.nan_guard)
        schedule = RunSchedule(training.optimizers(), cfg.optim.schedule, cfg.train.steps)
        training.after_resume(0)
        gate = training.make_gate(guard, schedule)
        batches = training.batches(0)
        losses = []
        for step in range(GRAPH_STEPS):
            losses.append(training.step(step, next(batches), gate).loss)
            gate.end_step()
        graph, hazards = training.step_fn.graph_step, []
        if graph is not None:
            micro = [training._on_device(b) for b in next(batches)]
            inputs = training.step_fn.graph_inputs(GRAPH_STEPS, micro)
            hazards = [f"{h.why} at {h.where}" for h in find_capture_hazards(graph._step, inputs)]
        gate.flush()
        gate.close()
        return {
            "graphed": graph is not None,
            "captured": graph is not None and graph.graph.active,
            "hazards": hazards,
            "losses": [float(v) for v in losses],
        }
    finally:
        training.close()


def _graph_overrides(root: Path, name: str, *extra: str) -> list[str]:
    pairs, tok = make_pairs(root / "data")
    one_micro = ("train.global_batch_size=2", "optim.grad_clip=0.0")  # the graph's conditions
    return [*dpo_overrides(pairs, tok, root / name, steps=GRAPH_STEPS), *one_micro, *extra]


@pytest.mark.multiprocess
def test_the_graphed_dpo_step_has_nothing_a_capture_rejects(tmp_path: Path) -> None:
    """train.cuda_graph=true on CPU: the engine's graphed DPO step runs (eagerly), the
    reference values among its inputs, and nothing in it reads the device on the host."""
    over = _graph_overrides(tmp_path, "forced", "train.cuda_graph=true")
    (run,) = run_multiprocess(_engine_worker, 1, over, timeout=400)
    assert run["graphed"] and not run["captured"], run
    assert run["hazards"] == [], run["hazards"]
    assert abs(run["losses"][0] - LN2_FP32) < 1e-6, run["losses"]


@pytest.mark.gpu
def test_the_cuda_graph_dpo_step_matches_eager(tmp_path: Path) -> None:
    """On CUDA the DPO step is captured by default; its fp32 losses over 3 replays follow
    the eager step's within 1e-4 (relative), ln 2 first."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    kw = {"backend": "nccl", "start_method": "spawn", "timeout": 400}
    fp32 = "train.precision=fp32"
    (graphed,) = run_multiprocess(_engine_worker, 1, _graph_overrides(tmp_path, "g", fp32), **kw)
    eager_over = _graph_overrides(tmp_path, "e", fp32, "train.cuda_graph=false")
    (eager,) = run_multiprocess(_engine_worker, 1, eager_over, **kw)
    assert graphed["graphed"] and graphed["captured"], graphed
    assert abs(eager["losses"][0] - math.log(2.0)) < 1e-5
    for a, b in zip(graphed["losses"], eager["losses"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), (graphed["losses"], eager["losses"])


def _recipe_worker(rank: int, world: int, argv: list[str]) -> tuple[list, str | None]:
    from longboat.core.config.compose import compose_experiment
    from longboat.llm.train.training import train as run

    name = next(a.split("=", 1)[1] for a in argv if a.startswith("experiment="))
    overrides = [a for a in argv if not a.startswith("experiment=")]
    result = run(compose_experiment(name, overrides, stack="llm", world_size=world))
    return result.losses, str(result.export_dir) if result.export_dir else None


@pytest.mark.multiprocess
def test_the_readmes_dpo_command_runs_as_written(tmp_path: Path) -> None:
    """The README's DPO command on a tiny Qwen3 checkpoint with its tokenizer and the pairs
    this test made (paths swapped in, short-run sizes added): ln 2 first, a falling loss, a
    transformers export."""
    import re
    import shlex

    from llm_testkit import make_hf_checkpoint

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Preference tuning (DPO)", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(longboat-llm train [^\n]+)\n```", section)
    assert block, "the README's DPO section shows a longboat-llm train command"
    argv = shlex.split(block.group(1))[2:]
    assert "experiment=dpo" in argv
    ckpt, _ = make_hf_checkpoint(tmp_path / "hf")
    pairs, _ = make_pairs(tmp_path / "data")
    argv = [
        f"model.init_from={ckpt}" if a.startswith("model.init_from=")
        else f"data.paths=[{pairs}]" if a.startswith("data.paths=") else a
        for a in argv
    ]  # fmt: skip
    argv += [f"output_dir={tmp_path / 'out'}", "data.seq_len=48", "train.steps=6",
             "train.global_batch_size=4", "train.log_every=1", "optim.lr=1e-3",
             "optim.schedule.warmup_steps=1", "logging.progress=false",
             "logging.trackers=[]"]  # fmt: skip
    losses, export = run_multiprocess(_recipe_worker, 1, argv)[0]
    assert abs(losses[0] - LN2_FP32) < 1e-6 and losses[-1] < losses[0] - 0.05, losses
    assert export is not None and (Path(export) / "model.safetensors").is_file()


# --- (4) refusals -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_pairs(tmp_path_factory.mktemp("pairs"), records=8)


@pytest.mark.parametrize(
    ("extra", "key", "words"),
    [
        (["llm.objective=ppo"], "llm.objective", "unknown training objective"),
        (["llm.dpo.reference=ema"], "llm.dpo.reference", "unknown DPO reference model"),
        (["llm.dpo.beta=0"], "llm.dpo.beta", "must be a number > 0"),
        (["data.format=sft"], "data.format", "reads preference pairs"),
        (["data.weights=[1.0]"], "data.weights", "every pair"),
        (["parallel.context_parallel=2"], "parallel.context_parallel", "one rank"),
    ],
)
def test_bad_dpo_keys_are_refused_at_compose(
    pair_data: tuple[Path, Path], tmp_path: Path, extra: list[str], key: str, words: str
) -> None:
    pairs, tok = pair_data
    with pytest.raises(ConfigError) as info:
        compose([*dpo_overrides(pairs, tok, tmp_path, steps=1), *extra], world_size=2)
    keys = [p.key for p in info.value.problems]
    assert key in keys, keys
    assert words in str(info.value)


def test_dpo_with_multi_token_prediction_is_refused(pair_data: tuple[Path, Path]) -> None:
    pairs, tok = pair_data
    over = ["model=deepseek_v3_tiny", "model.mtp_num_layers=1", "llm.objective=dpo",
            "data=prepared", f"data.paths=[{pairs}]", f"data.tokenizer={tok}"]  # fmt: skip
    compose([*over[:1], *over[2:]])  # accepted without multi-token prediction
    with pytest.raises(ConfigError) as info:
        compose(over)
    assert [p.key for p in info.value.problems] == ["model.mtp_num_layers"]


def test_dpo_on_other_data_kinds_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        compose(["llm.objective=dpo", "data=synthetic"])
    assert [p.key for p in info.value.problems] == ["llm.objective"]
    assert "not on data=synthetic" in str(info.value)


def test_columns_map_pair_keys_only_with_dpo(pair_data: tuple[Path, Path], tmp_path: Path) -> None:
    pairs, tok = pair_data
    base = dpo_overrides(pairs, tok, tmp_path, steps=1)
    compose([*base, "+data.columns={chosen: good}"])  # accepted with dpo
    lm = [o for o in base if o != "llm.objective=dpo"]
    with pytest.raises(ConfigError) as info:
        compose([*lm, "+data.columns={chosen: good}"])
    assert "data.columns" in [p.key for p in info.value.problems]


def test_chats_without_pairs_are_refused_naming_the_file_before_the_build(
    tmp_path: Path,
) -> None:
    """A file of chats: ConfigError naming it and the missing columns, before any process
    group or model exists."""
    import torch.distributed as dist

    from longboat.llm.train.training import build_training

    _, tok = make_pairs(tmp_path / "data", records=4)
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    half = tmp_path / "half.jsonl"
    half.write_text(json.dumps({"prompt": "hi", "chosen": "a", "bad": "b"}) + "\n")
    prepared = tmp_path / "tokens"
    prepared.mkdir()
    (prepared / "tokens.bin").write_bytes(b"")
    cfg = compose(dpo_overrides(prepared, tok, tmp_path / "out", steps=1))
    with pytest.raises(ConfigError, match="is a prepared token dataset; DPO reads the pref"):
        build_training(cfg)
    for path, missing in ((chats, "chosen, rejected"), (half, "rejected")):
        cfg = compose(dpo_overrides(path, tok, tmp_path / "out", steps=1))
        with pytest.raises(ConfigError) as info:
            build_training(cfg)
        message = str(info.value)
        assert str(path) in message and f"lack the column(s) {missing}" in message, message
        assert info.value.problems[0].key == "data.paths"
        assert not dist.is_initialized()


def test_a_bad_record_is_named_with_its_line(pair_data: tuple[Path, Path], tmp_path: Path) -> None:
    from longboat.llm.train.training import build_training

    pairs, tok = pair_data
    bad = tmp_path / "bad.jsonl"
    lines = pairs.read_text().splitlines()
    same = json.dumps({"prompt": "count from 1 please", "chosen": "1 2", "rejected": "1 2"})
    bad.write_text("\n".join([*lines[:3], same, *lines[3:]]) + "\n")
    with pytest.raises(ConfigError) as info:
        build_training(compose(dpo_overrides(bad, tok, tmp_path / "out", steps=1)))
    assert f"{bad}:4" in str(info.value) and "nothing to prefer" in str(info.value)


# --- rows ---------------------------------------------------------------------------------


def test_rows_shift_labels_mask_the_prompt_and_cut_at_seq_len() -> None:
    from longboat.llm.data.preference import PreferencePair
    from longboat.llm.train.dpo_data import PreferenceRows

    ids_c, ids_r = np.arange(10, 18), np.arange(20, 25)  # prompt of 3 tokens, then answers
    pair = PreferencePair(ids_c, (ids_c >= 13).astype(np.uint8), np.r_[ids_c[:3], ids_r[3:]],
                          np.r_[0, 0, 0, 1, 1].astype(np.uint8), 3, "x")  # fmt: skip
    rows = PreferenceRows([pair], seq_len=6)
    b = rows.microbatch([0])
    assert b["tokens"].tolist() == [[10, 11, 12, 13, 14, 15], [10, 11, 12, 23, 0, 0]]
    assert b["labels"].tolist() == [[11, 12, 13, 14, 15, 16], [11, 12, 23, 24, 0, 0]]
    # The mask sits on the positions whose label is an answer token.
    assert b["loss_mask"].tolist() == [[0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0]]
    assert b["pair_index"].tolist() == [0]
    assert rows.truncated == 1 and rows.dropped == 0
    assert len(PreferenceRows([pair], seq_len=2)) == 0  # no answer token left
