"""llm-specific config checks run by core's validator before any heavy init."""

from __future__ import annotations

from typing import Any

from longboat.core.config.errors import ConfigError


def validate_llm(cfg: Any, world_size: int | None, problems: Any) -> None:
    """Model shape vs parallel sizes (TP divides heads, PP divides layers, EP divides experts);
    ``model.moe_aux_loss`` vs the layout; ``model.moe_experts`` vs LoRA; ``data.format``;
    ``llm.objective`` and ``llm.dpo.*``."""
    data = cfg.get("data") if hasattr(cfg, "get") else None
    if data is not None and data.get("name") == "prepared":
        from longboat.core.config.errors import require_choice
        from longboat.llm.train.schema import DATA_FORMATS

        try:
            require_choice(data.get("format"), DATA_FORMATS, key="data.format", what="data format")
        except ConfigError as exc:
            problems.extend(exc)
        from longboat.llm.data.sft_records import CANONICAL_KEYS

        readable = CANONICAL_KEYS + (_PAIR_KEYS if _objective(cfg) == "dpo" else ())
        unknown = sorted(set(data.get("columns") or {}) - set(readable))
        if unknown:
            problems.add(
                "data.columns",
                f"maps {unknown}, which are not keys longboat reads",
                value=dict(data.get("columns")),
                fix=f"map your record keys onto {', '.join(readable)} "
                "(e.g. data.columns={prompt: question, completion: answer})",
            )
    _check_objective(cfg, data, problems)
    model = cfg.get("model") if hasattr(cfg, "get") else None
    from longboat.core.family import find_family, list_families

    _check_core_keys(cfg, model, problems)
    if model is None or model.get("name") not in list_families("llm"):
        return
    from longboat.llm.moe_aux_loss import pooled_aux_loss_problems
    from longboat.llm.moe_experts import moe_experts_problems

    par = cfg.get("parallel") or {}
    train = cfg.get("train") or {}
    lora = cfg.get("lora") or {}
    family = find_family("llm", model.get("name"))
    schema = family.model_schema()  # the family's model config
    if lora.get("enabled") and not getattr(family, "lora", True):
        problems.add(
            "lora.enabled",
            f"the {family.name} family does not take LoRA adapters",
            value=True,
            fix="train it fully (lora.enabled=false)",
        )
    try:
        model_cfg = schema.from_mapping(model)
        found = pooled_aux_loss_problems(
            model_cfg,
            pipeline_parallel=int(par.get("pipeline_parallel", 1)),
            context_parallel=int(par.get("context_parallel", 1)),
            full_recompute=train.get("recompute") == "full",
        )
        targets = list(lora.get("targets") or ()) if lora.get("enabled") else []
        found = [*found, *lora_target_problems(model_cfg, targets)]
        for p in [*found, *moe_experts_problems(model_cfg, targets)]:
            problems.add(p.key, p.message, value=p.value, fix=p.fix)
    except (TypeError, ValueError):  # malformed values: the schema checks report them
        pass
    try:
        arch = schema.from_mapping(model)
        arch.validate()
        arch.validate_parallel(
            tp=int(par.get("tensor_parallel", 1)),
            pp=int(par.get("pipeline_parallel", 1)),
            ep=int(par.get("expert_parallel", 1)),
            vpp=par.get("virtual_pipeline_parallel"),
        )
    except ConfigError as exc:
        for problem in exc.problems:
            # core's generic validator already checks TP vs heads and PP vs layers.
            if not any(k in problem.message for k in ("num_attention_heads", "num_layers")):
                problems.add(problem.key, problem.message, value=problem.value, fix=problem.fix)


_PAIR_KEYS = ("chosen", "rejected")


def _objective(cfg: Any) -> Any:
    llm = cfg.get("llm") if hasattr(cfg, "get") else None
    return (llm or {}).get("objective", "lm")


def _check_objective(cfg: Any, data: Any, problems: Any) -> None:
    """``llm.objective`` and, for dpo, ``llm.dpo.*`` and what DPO reads and runs on:
    preference files (``data=prepared``, no blend weights, ``data.format=auto``), no
    multi-token prediction and no context parallelism (a pair's log-probability sums a whole
    sequence on one rank)."""
    from longboat.core.config.errors import require_choice
    from longboat.llm.train.schema import DPO_REFERENCES, OBJECTIVES

    objective = _objective(cfg)
    try:
        require_choice(objective, OBJECTIVES, key="llm.objective", what="training objective")
    except ConfigError as exc:
        problems.extend(exc)
        return
    if objective != "dpo":
        return
    dpo = (cfg.get("llm") or {}).get("dpo") or {}
    try:
        require_choice(
            dpo.get("reference", "initial"), DPO_REFERENCES, key="llm.dpo.reference",
            what="DPO reference model",
        )  # fmt: skip
    except ConfigError as exc:
        problems.extend(exc)
    beta = dpo.get("beta", 0.1)
    if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not beta > 0:
        problems.add("llm.dpo.beta", "must be a number > 0", value=beta, fix="e.g. 0.1")
    name = (data or {}).get("name")
    if name != "prepared":
        problems.add(
            "llm.objective",
            f"dpo trains on preference pairs, not on data={name}",
            value="dpo",
            fix="use data=prepared data.paths=[pairs.jsonl] (records with chosen / rejected)",
        )
        return
    if data.get("weights") is not None:
        problems.add(
            "data.weights",
            "is not used by llm.objective=dpo (every pair of data.paths trains equally)",
            value=list(data.get("weights")),
            fix="leave data.weights null",
        )
    if data.get("format", "auto") != "auto":
        problems.add(
            "data.format",
            "is for lm runs; llm.objective=dpo reads preference pairs",
            value=data.get("format"),
            fix="leave data.format=auto",
        )
    mtp = ((cfg.get("model") or {}).get("mtp_num_layers")) or 0
    if mtp:
        problems.add(
            "model.mtp_num_layers",
            "multi-token prediction adds a next-token loss, which llm.objective=dpo does not "
            "train on",
            value=mtp,
            fix="use model.mtp_num_layers=0 for DPO",
        )
    cp = ((cfg.get("parallel") or {}).get("context_parallel")) or 1
    if cp != 1:
        problems.add(
            "parallel.context_parallel",
            "llm.objective=dpo sums each sequence's log-probabilities on one rank",
            value=cp,
            fix="use parallel.context_parallel=1 (tensor / pipeline / data parallel work)",
        )


def _check_core_keys(cfg: Any, model: Any, problems: Any) -> None:
    """``train.recompute_layers`` only with full recompute (megatron's selective recompute
    covers every layer) and within a pipeline stage; ``export.adapter_dir`` only with LoRA."""
    train = cfg.get("train") or {}
    layers = train.get("recompute_layers")
    if isinstance(layers, int) and train.get("recompute") == "selective":
        problems.add(
            "train.recompute_layers",
            "selective recompute covers every layer (megatron recomputes each layer's core "
            "attention)",
            value=layers,
            fix="use train.recompute=full to recompute only the first n layers, or null",
        )
    pp = (cfg.get("parallel") or {}).get("pipeline_parallel") or 1
    total = model.get("num_layers") if model is not None else None
    if isinstance(layers, int) and isinstance(total, int) and layers > total // max(1, pp):
        problems.add(
            "train.recompute_layers",
            f"is more than the {total // max(1, pp)} layers of a pipeline stage",
            value=layers,
            fix=f"use at most {total // max(1, pp)} (null: every layer)",
        )
    adapter = (cfg.get("export") or {}).get("adapter_dir")
    if adapter is not None and not (cfg.get("lora") or {}).get("enabled"):
        problems.add(
            "export.adapter_dir",
            "is where LoRA adapters go, but lora.enabled=false",
            value=adapter,
            fix="set lora.enabled=true, or leave export.adapter_dir null",
        )


def lora_target_problems(model_cfg: Any, targets: list[str]) -> list[Any]:
    """Why ``targets`` cannot be the ``lora.targets`` of ``model_cfg`` (its family's checks,
    e.g. DeepSeek-V3.2's refused ``linear_kv_up_proj``); empty for Llama-style families."""
    from longboat.core.family import find_family

    own = getattr(find_family("llm", model_cfg.name), "lora_targets", None)
    return own.problems(model_cfg, list(targets)) if own is not None and targets else []


def lora_frozen_base(model_cfg: Any) -> tuple[Any, str | None]:
    """``model_cfg`` for a LoRA run, whose base stays as loaded (its family's
    ``lora_targets.frozen_base``, e.g. DeepSeek-V3's expert bias held), and the run's line
    saying so (None: nothing changed)."""
    from longboat.core.family import find_family

    own = getattr(find_family("llm", model_cfg.name), "lora_targets", None)
    hold = getattr(own, "frozen_base", None)
    return (model_cfg, None) if hold is None else hold(model_cfg)


def lora_targets_of_family(composed: dict[str, Any], given: set[str], problems: Any) -> None:
    """A run that names no ``lora.targets`` adapts its family's default linears (a family's
    ``lora_targets``, e.g. DeepSeek-V3's latent-attention projections); Llama-style families
    keep core's default (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``)."""
    from longboat.core.family import find_family, list_families

    lora = composed.get("lora")
    if isinstance(lora, dict) and lora.get("targets") is not None:
        return
    model = composed.get("model")
    if not isinstance(model, dict) or model.get("name") not in list_families("llm"):
        return
    family = find_family("llm", model["name"])
    own = getattr(family, "lora_targets", None)
    if own is None:
        return
    try:
        cfg = family.model_schema().from_mapping(model)
    except (TypeError, ValueError):  # malformed values: the schema checks report them
        return
    composed.setdefault("lora", {})["targets"] = list(own.default(cfg))


def model_from_checkpoint(composed: dict[str, Any], given: set[str], problems: Any) -> None:
    """With ``model.init_from``, the model is the checkpoint's: its ``config.json`` gives the
    family and every architecture field (whatever the experiment's model group says), and a
    field the command line set (``model.<field>=`` or ``model=<option>``) must agree with it.
    The other model keys (``layer_backend``, ``init_std``, ...) keep their values; the rotary
    table length and the aux-loss weight follow the checkpoint unless given."""
    import json
    from pathlib import Path

    init = (composed.get("model") or {}).get("init_from")
    from longboat.llm.hub import cached_hub_model, hub_model_id

    repo_id = hub_model_id(init)
    if repo_id is not None:  # a Hugging Face id: the run sees its local snapshot
        local = cached_hub_model(repo_id)
        if local is None:
            problems.add(
                "model.init_from",
                f"{init}: the model is not in the Hugging Face hub cache",
                value=str(init),
                fix=f"download it first (huggingface-cli download {repo_id}), or point at a "
                "local directory",
            )
            return
        composed["model"]["init_from"] = init = str(local)
    path = Path(str(init)) / "config.json" if init else None
    if path is None or not path.is_file():
        return  # none, or a missing one: the run's checks name it
    from longboat.llm.hf_checkpoint import family_for_hf_config

    try:
        hf = json.loads(path.read_text())
        ckpt = family_for_hf_config(hf).from_hf_config(hf)
    except ConfigError as exc:
        for problem in exc.problems:
            problems.add(
                "model.init_from", f"{path}: {problem.message}", value=str(init), fix=problem.fix
            )
        return
    except ValueError as exc:  # not JSON
        problems.add("model.init_from", f"{path} is not valid JSON: {exc}", value=str(init))
        return
    model = composed.setdefault("model", {})
    whole_group = "model" in given
    for name in ("name", *ckpt.architecture()):
        theirs = getattr(ckpt, name)
        if (whole_group or f"model.{name}" in given) and model.get(name) != theirs:
            fix = f"drop model.{name}=... from the command line to fine-tune this checkpoint"
            if whole_group:
                fix = "drop model=<option> from the command line: config.json is the model"
            problems.add(
                f"model.{name}",
                f"conflicts with {path} ({name}={theirs!r}): the weights fix the architecture",
                value=model.get(name),
                fix=fix,
            )
        model[name] = theirs
    for name in ("max_position_embeddings", "moe_aux_loss_coeff"):
        if f"model.{name}" not in given:
            model[name] = getattr(ckpt, name)
    model["flavor"] = "hf"
    _data_from_checkpoint(composed, given, Path(str(init)), ckpt.max_position_embeddings)


def _data_from_checkpoint(
    composed: dict[str, Any], given: set[str], init: Any, max_positions: int
) -> None:
    """The tokenizer of a ``prepared`` run is the checkpoint's (when it ships one and the
    command line names none), and rows are no longer than the checkpoint's positions unless
    the command line says so."""
    from longboat.llm.train.checks import TOKENIZER_FILES

    data = composed.get("data")
    if not isinstance(data, dict) or data.get("name") != "prepared":
        return
    if "data.tokenizer" not in given and any((init / n).is_file() for n in TOKENIZER_FILES):
        data["tokenizer"] = str(init)
    seq = data.get("seq_len")
    if "data.seq_len" not in given and isinstance(seq, int) and seq > max_positions:
        data["seq_len"] = max_positions
