"""Parameters and training FLOPs of a DeepSeek-V3 model (MFU)."""

from __future__ import annotations

from longboat.llm.models.deepseek_v3.config import DeepseekV3Config


def _attention_params(cfg: DeepseekV3Config) -> int:
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    q_width = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    q = h * q_width if cfg.q_lora_rank is None else (
        h * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * q_width
    )  # fmt: skip
    kv = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    kv += cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    indexer = 0
    if cfg.index_topk is not None:  # wq_b, wk, the key's LayerNorm, weights_proj
        d, n = cfg.index_head_dim, cfg.index_n_heads
        indexer = int(cfg.q_lora_rank or h) * n * d + h * d + 2 * d + h * n
    return q + kv + heads * cfg.v_head_dim * h + 2 * h + indexer


def param_counts(cfg: DeepseekV3Config) -> tuple[int, int]:
    """``(every parameter, the parameters one token passes through)``, the multi-token
    prediction layers included (each: one MoE layer, its projection and three norms)."""
    h, f = cfg.hidden_size, int(cfg.moe_ffn_hidden_size or 0)
    attn = _attention_params(cfg)
    dense = attn + 3 * h * cfg.ffn_hidden_size
    shared = h * cfg.num_experts + 3 * h * f * cfg.num_shared_experts
    moe_all = attn + shared + cfg.num_experts * 3 * h * f
    moe_active = attn + shared + cfg.moe_topk * 3 * h * f
    emb = (1 if cfg.tie_embeddings else 2) * cfg.vocab_size * h + h
    sparse = cfg.num_layers - cfg.first_k_dense
    mtp = 2 * h * h + 3 * h
    total = (
        emb + cfg.first_k_dense * dense + sparse * moe_all + cfg.mtp_num_layers * (moe_all + mtp)
    )
    active = emb + cfg.first_k_dense * dense + sparse * moe_active
    active += cfg.mtp_num_layers * (moe_active + mtp + cfg.vocab_size * h)  # its head matmul
    return total, active


def _mean_keys(cfg: DeepseekV3Config, seq_len: int) -> float:
    """Keys a query attends to, on average over a causal sequence: (S + 1) / 2, or with
    sparse attention at most ``index_topk`` of them."""
    if cfg.index_topk is None or cfg.index_topk >= seq_len:
        return (seq_len + 1) / 2
    k = cfg.index_topk
    return (k * (k + 1) / 2 + (seq_len - k) * k) / seq_len


def flops_per_sample(cfg: DeepseekV3Config, seq_len: int) -> float:
    """Training FLOPs of one sequence of ``seq_len`` tokens: per token 6 N (N the parameters
    it passes through) plus attention's QK^T (query/key width) and AV (value width) over the
    keys it attends to (half the sequence causally, at most ``index_topk`` with sparse
    attention), forward + backward; with sparse attention also the indexer's scores over the
    causal keys (forward only, forward + backward with an indexer loss)."""
    layers = cfg.num_layers + cfg.mtp_num_layers
    width = cfg.num_attention_heads * (cfg.head_dim + cfg.v_head_dim)
    per_token = 6.0 * param_counts(cfg)[1] + 6.0 * layers * _mean_keys(cfg, seq_len) * width
    if cfg.index_topk is not None:
        passes = 3.0 if cfg.index_loss_coeff else 1.0
        scores = 2.0 * cfg.index_n_heads * cfg.index_head_dim * (seq_len + 1) / 2
        per_token += passes * layers * scores
    return seq_len * per_token
