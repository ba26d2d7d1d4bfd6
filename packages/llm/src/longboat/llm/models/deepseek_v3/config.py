"""DeepSeek-V3 architecture config and flavors.

``DeepseekV3Config`` extends core's ``DecoderModelConfig`` with multi-head latent attention
(low-rank q and kv, the decoupled rotary key), DeepSeekMoE (shared experts, sigmoid routing
with a load-balancing bias, group-limited top-k), the first dense layers, YaRN rotary scaling
and multi-token prediction. Fields of the base keep their meaning where MLA has one:
``num_query_groups`` equals ``num_attention_heads`` (no GQA), ``head_dim`` is the query/key
head width ``qk_nope_head_dim + qk_rope_head_dim``, ``ffn_hidden_size`` the dense layers'
SwiGLU width and ``moe_ffn_hidden_size`` one routed expert's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from longboat.core.config.errors import ConfigError, ConfigProblem
from longboat.core.megatron.decoder_config import ARCH_FIELDS, DecoderModelConfig


@dataclass
class DeepseekV3Config(DecoderModelConfig):
    """A DeepSeek-V3 decoder (DeepSeek-V3, Moonlight, Kimi K2); defaults are the tiny flavor."""

    name: str = "deepseek_v3"
    num_layers: int = 3
    num_query_groups: int = 4
    head_dim: int = 24
    norm_eps: float = 1e-6
    num_experts: int = 8
    moe_ffn_hidden_size: int | None = 32
    moe_aux_loss: str = "megatron"
    """The balance loss: megatron's sequence-wise ``seq_aux_loss`` (``auto`` means it too)."""
    q_lora_rank: int | None = 32
    """Rank of the query's low-rank projection (HF ``q_lora_rank``; None: a full q projection)."""
    kv_lora_rank: int = 16
    """Rank of the shared key/value latent (HF ``kv_lora_rank``)."""
    qk_nope_head_dim: int = 16
    """Per-head query/key width without rotary (HF ``qk_nope_head_dim``)."""
    qk_rope_head_dim: int = 8
    """Per-head rotary query/key width; the rotary key is one head shared by all (HF
    ``qk_rope_head_dim``)."""
    v_head_dim: int = 16
    """Per-head value width (HF ``v_head_dim``)."""
    first_k_dense: int = 1
    """Leading layers with a dense SwiGLU instead of experts (HF ``first_k_dense_replace``)."""
    num_shared_experts: int = 1
    """Shared experts every token passes through, one SwiGLU of width
    ``num_shared_experts * moe_ffn_hidden_size`` (HF ``n_shared_experts``)."""
    moe_router_num_groups: int = 2
    """Expert groups of group-limited routing (HF ``n_group``; 1: no groups)."""
    moe_router_group_topk: int = 1
    """Groups a token may route into (HF ``topk_group``)."""
    moe_routed_scaling_factor: float = 2.5
    """Scale of the routed experts' weights (HF ``routed_scaling_factor``)."""
    moe_router_bias_update_rate: float = 1e-3
    """Aux-loss-free balancing: after every step each expert's routing bias moves by this
    much toward balance (+rate below the mean load, -rate above; 0: the bias stays as
    loaded). HF stores the bias as ``mlp.gate.e_score_correction_bias``."""
    yarn_factor: float | None = None
    """YaRN rotary scaling factor (HF ``rope_scaling.factor``; None: plain rotary)."""
    yarn_original_max_position_embeddings: int = 4096
    """Context length before YaRN scaling."""
    yarn_beta_fast: float = 32.0
    """YaRN's fast boundary (rotations per context)."""
    yarn_beta_slow: float = 1.0
    """YaRN's slow boundary."""
    yarn_mscale: float = 1.0
    """YaRN attention scale numerator (HF ``rope_scaling.mscale``)."""
    yarn_mscale_all_dim: float = 0.0
    """YaRN attention scale denominator (HF ``rope_scaling.mscale_all_dim``); the softmax
    scale is multiplied by its mscale squared."""
    mtp_num_layers: int = 0
    """Multi-token prediction depth (HF ``num_nextn_predict_layers``; 0: off). Each depth
    predicts one token further from the previous depth's hidden states."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the multi-token prediction loss (its mean over depths) in the objective."""
    index_topk: int | None = None
    """DeepSeek-V3.2 sparse attention (DSA): keys each query attends to, chosen by the
    lightning indexer (HF ``index_topk``; None: dense MLA, DeepSeek-V3)."""
    index_n_heads: int = 4
    """Heads of the lightning indexer (HF ``index_n_heads``); with ``index_topk`` only."""
    index_head_dim: int = 16
    """Per-head width of the lightning indexer (HF ``index_head_dim``); its first
    ``qk_rope_head_dim`` channels are rotated."""
    index_loss_coeff: float = 0.0
    """Weight of the indexer's KL loss against the main attention's distribution (V3.2's
    warm-up / distillation objective of the indexer; it trains the indexer only). 0: off;
    the top-k choice carries no gradient, so the indexer's weights then stay as loaded."""

    def __post_init__(self) -> None:
        # ``auto`` (the base's default, which a composed model group may carry) is this
        # family's one balance loss, megatron's sequence-wise term.
        if self.moe_aux_loss == "auto":
            self.moe_aux_loss = "megatron"

    def architecture(self) -> dict[str, object]:
        """The fields a checkpoint's weights fix, the base's and MLA / DeepSeekMoE's."""
        return {name: getattr(self, name) for name in DEEPSEEK_V3_ARCH_FIELDS}

    def validate(self, *, prefix: str = "model") -> None:
        """Base checks plus MLA / DeepSeekMoE consistency: one ``ConfigError`` with a problem
        per offending key."""
        super().validate(prefix=prefix)
        problems: list[ConfigProblem] = []

        def bad(key: str, message: str, fix: str) -> None:
            value = getattr(self, key)
            problems.append(ConfigProblem(key=f"{prefix}.{key}", message=message, value=value,
                                          fix=fix))  # fmt: skip

        heads = self.num_attention_heads
        if self.num_query_groups != heads:
            bad("num_query_groups", "multi-head latent attention has no GQA",
                f"set it to the head count, {heads}")  # fmt: skip
        width = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.head_dim != width:
            bad("head_dim", "is the query/key head width qk_nope_head_dim + qk_rope_head_dim",
                f"set it to {width}")  # fmt: skip
        if self.qk_rope_head_dim % 2:
            bad("qk_rope_head_dim", "must be even", "use an even rotary width")
        for key in ("qk_norm", "attention_bias"):
            if getattr(self, key):
                bad(key, "DeepSeek-V3 has none", "set it to false")
        for key in ("rope_scaling_factor", "mrope_section"):
            if getattr(self, key) is not None:
                bad(key, "DeepSeek-V3 scales its rotary with YaRN", "use model.yarn_factor")
        if not self.num_experts:
            bad("num_experts", "DeepSeek-V3 routes experts", "set it > 0")
        elif self.moe_topk < 2:
            bad("moe_topk", "the sigmoid router renormalises its top-k weights", "use >= 2")
        if not self.moe_norm_topk_prob:
            bad("moe_norm_topk_prob", "megatron's sigmoid router always renormalises its "
                "top-k weights", "set it true")  # fmt: skip
        if not 0 <= self.first_k_dense <= self.num_layers:
            bad("first_k_dense", "is more dense layers than the model has",
                f"use 0..{self.num_layers}")  # fmt: skip
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if groups < 1 or (self.num_experts and self.num_experts % groups):
            bad("moe_router_num_groups", f"must divide num_experts={self.num_experts}",
                "use a divisor of the expert count (1: no groups)")  # fmt: skip
        elif not 1 <= group_topk <= groups:
            bad("moe_router_group_topk", f"must be in 1..{groups}", "pick a group count")
        elif groups > 1 and self.moe_topk != 2 * group_topk:
            # A group scores by the sum of its two best experts (DeepSeek-V3); megatron sums
            # moe_topk / group_topk of them, so the two agree only at this ratio.
            bad("moe_router_group_topk", f"with expert groups moe_topk={self.moe_topk} must "
                "be twice it (a group scores by its two best experts)",
                f"set it to {self.moe_topk // 2} or moe_router_num_groups=1")  # fmt: skip
        if self.moe_aux_loss not in ("megatron", "auto"):
            bad("moe_aux_loss", "DeepSeek-V3 balances with the sequence-wise loss "
                "(megatron's seq_aux_loss, weight moe_aux_loss_coeff)", "set it to megatron")  # fmt: skip
        if self.mtp_num_layers < 0:
            bad("mtp_num_layers", "must be >= 0", "0 turns multi-token prediction off")
        if self.moe_router_bias_update_rate < 0:
            bad("moe_router_bias_update_rate", "must be >= 0", "0 keeps the bias fixed")
        if self.index_topk is not None:
            if self.index_topk < 1:
                bad("index_topk", "must be >= 1", "null turns sparse attention off")
            if self.q_lora_rank is None:
                bad("index_topk", "the indexer reads the q latent, so DSA needs q_lora_rank",
                    "set model.q_lora_rank or index_topk=null")  # fmt: skip
            if self.index_head_dim < self.qk_rope_head_dim or self.index_head_dim % 2:
                bad("index_head_dim", f"must be even and >= qk_rope_head_dim="
                    f"{self.qk_rope_head_dim}", "widen the indexer head")  # fmt: skip
            if self.index_n_heads < 1:
                bad("index_n_heads", "must be >= 1", "give the indexer a head")
            if self.layer_backend == "te":
                bad("index_topk", "sparse attention runs on the longboat or local layers",
                    "set model.layer_backend=auto")  # fmt: skip
            if self.index_loss_coeff < 0:
                bad("index_loss_coeff", "must be >= 0", "0 turns the indexer loss off")
        if problems:
            raise ConfigError(problems)

    def validate_parallel(self, *, tp: int, pp: int, ep: int, vpp: int | None = None) -> None:
        """Base checks (TP divides heads, PP the layers, EP the experts); sparse attention
        (megatron's absorbed MLA) splits heads across tensor-parallel ranks only with sequence
        parallelism, which the llm stack does not run: it takes TP 1."""
        super().validate_parallel(tp=tp, pp=pp, ep=ep, vpp=vpp)
        if self.index_topk is not None and tp > 1:
            raise ConfigError(
                [
                    ConfigProblem(
                        key="parallel.tensor_parallel",
                        message="DeepSeek-V3.2's sparse attention runs at tensor parallel 1",
                        value=tp,
                        fix="use expert, pipeline or data parallelism",
                    )
                ]
            )


DEEPSEEK_V3_ARCH_FIELDS = (
    *ARCH_FIELDS,
    *(
        f.name
        for f in fields(DeepseekV3Config)
        if f.name not in {g.name for g in fields(DecoderModelConfig)}
        and f.name
        not in ("moe_router_bias_update_rate", "mtp_loss_scaling_factor", "index_loss_coeff")
    ),
)
"""Architecture fields of a DeepSeek-V3 checkpoint (the base's and the MLA / MoE shape)."""

_SHARED = dict(
    name="deepseek_v3",
    qk_norm=False,
    attention_bias=False,
    tie_embeddings=False,
    moe_norm_topk_prob=True,
    moe_aux_loss="megatron",
)

FLAVORS: dict[str, DeepseekV3Config] = {
    # 1 dense + 2 MoE layers, low-rank q, two expert groups: every routing feature at work.
    "tiny": DeepseekV3Config(
        flavor="tiny",
        vocab_size=256,
        hidden_size=64,
        num_layers=3,
        num_attention_heads=4,
        num_query_groups=4,
        head_dim=24,
        ffn_hidden_size=128,
        max_position_embeddings=256,
        rope_theta=10000.0,
        norm_eps=1e-6,
        num_experts=8,
        moe_topk=2,
        moe_ffn_hidden_size=32,
        moe_aux_loss_coeff=0.0,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        first_k_dense=1,
        num_shared_experts=1,
        moe_router_num_groups=2,
        moe_router_group_topk=1,
        moe_routed_scaling_factor=2.5,
        **_SHARED,
    ),
    # moonshotai/Moonlight-16B-A3B: no q compression, 64 experts top-6 + 2 shared, no groups.
    "moonlight_16b_a3b": DeepseekV3Config(
        flavor="moonlight_16b_a3b",
        vocab_size=163840,
        hidden_size=2048,
        num_layers=27,
        num_attention_heads=16,
        num_query_groups=16,
        head_dim=192,
        ffn_hidden_size=11264,
        max_position_embeddings=8192,
        rope_theta=50000.0,
        norm_eps=1e-5,
        num_experts=64,
        moe_topk=6,
        moe_ffn_hidden_size=1408,
        moe_aux_loss_coeff=0.001,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        first_k_dense=1,
        num_shared_experts=2,
        moe_router_num_groups=1,
        moe_router_group_topk=1,
        moe_routed_scaling_factor=2.446,
        **_SHARED,
    ),
    # deepseek-ai/DeepSeek-V3 (config only: 671B parameters, 37B active).
    "671b": DeepseekV3Config(
        flavor="671b",
        vocab_size=129280,
        hidden_size=7168,
        num_layers=61,
        num_attention_heads=128,
        num_query_groups=128,
        head_dim=192,
        ffn_hidden_size=18432,
        max_position_embeddings=163840,
        rope_theta=10000.0,
        norm_eps=1e-6,
        num_experts=256,
        moe_topk=8,
        moe_ffn_hidden_size=2048,
        moe_aux_loss_coeff=0.0001,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        first_k_dense=3,
        num_shared_experts=1,
        moe_router_num_groups=8,
        moe_router_group_topk=4,
        moe_routed_scaling_factor=2.5,
        yarn_factor=40.0,
        yarn_original_max_position_embeddings=4096,
        yarn_beta_fast=32.0,
        yarn_beta_slow=1.0,
        yarn_mscale=1.0,
        yarn_mscale_all_dim=1.0,
        mtp_num_layers=1,
        **_SHARED,
    ),
    # moonshotai/Kimi-K2-Instruct (config only): DeepSeek-V3's layer with 384 experts,
    # 64 heads, one dense layer, no groups.
    "kimi_k2": DeepseekV3Config(
        flavor="kimi_k2",
        vocab_size=163840,
        hidden_size=7168,
        num_layers=61,
        num_attention_heads=64,
        num_query_groups=64,
        head_dim=192,
        ffn_hidden_size=18432,
        max_position_embeddings=131072,
        rope_theta=50000.0,
        norm_eps=1e-6,
        num_experts=384,
        moe_topk=8,
        moe_ffn_hidden_size=2048,
        moe_aux_loss_coeff=0.0,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        first_k_dense=1,
        num_shared_experts=1,
        moe_router_num_groups=1,
        moe_router_group_topk=1,
        moe_routed_scaling_factor=2.827,
        yarn_factor=32.0,
        yarn_original_max_position_embeddings=4096,
        yarn_beta_fast=1.0,
        yarn_beta_slow=1.0,
        yarn_mscale=1.0,
        yarn_mscale_all_dim=1.0,
        **_SHARED,
    ),
}
# DeepSeek-V3.2: DeepSeek-V3's layer with the lightning indexer's sparse attention.
FLAVORS["v32_tiny"] = replace(
    FLAVORS["tiny"], flavor="v32_tiny", index_topk=8, index_n_heads=2, index_head_dim=16
)
# deepseek-ai/DeepSeek-V3.2-Exp (config only): the 671B model, 2048 keys per query.
FLAVORS["v32"] = replace(
    FLAVORS["671b"], flavor="v32", index_topk=2048, index_n_heads=64, index_head_dim=128
)
"""The flavors by name (``model.flavor``)."""
