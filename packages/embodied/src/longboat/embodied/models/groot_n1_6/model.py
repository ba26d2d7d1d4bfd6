"""GR00T N1.6 policy: ``forward(batch) -> {"loss", ...}`` and ``predict_action(batch)``.

Batch dict (all tensors on the model's device):

=================  ===========================  =========================================
key                shape / dtype                meaning
=================  ===========================  =========================================
images             [B, n_cams, 3, H, W]         camera frames, uint8 or float in [0, 1]
input_ids          [B, L] int64                 text tokens; image placeholders are
                                                prepended (or, with
                                                ``image_tokens_in_text``, already present:
                                                n_cams*tokens_per_image per row)
attention_mask     [B, L] bool/int              1 = real token
state              [B, max_state_dim] float     padded proprioception
state_mask         [B, max_state_dim] bool      optional; 1 = real state dim
action             [B, H, max_action_dim]       padded action chunk (training only)
action_mask        broadcastable to action      1 = real (step, dim); loss is masked by it
embodiment_id      [B] int64                    selects per-embodiment weights
noise, time        [B, H, A], [B] (optional)    fix the flow-matching draw (tests, parity)
=================  ===========================  =========================================

Padded state / action entries are zeroed before use, so their values never matter.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from longboat.embodied.models.common.flow_matching import (
    euler_integrate,
    flow_loss_outputs,
    groot_time,
    randn_like_gen,
    training_draw,
    zero_padding,
)
from longboat.embodied.models.common.freezing import FreezingGroups
from longboat.embodied.models.groot_n1_6.action_head import GrootActionHead
from longboat.embodied.models.groot_n1_6.backbone import EagleBackbone
from longboat.embodied.models.groot_n1_6.config import GrootN16Config


class GrootN16(nn.Module):
    """GR00T N1.6-style VLA (our implementation, random init)."""

    config_class = GrootN16Config

    def __init__(self, cfg: GrootN16Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.backbone = EagleBackbone(cfg)
        self.action_head = GrootActionHead(cfg)
        self._value_checks_left = 2

    def parallel_blocks(self) -> list[nn.Module]:
        """Repeated blocks (units of FSDP sharding / activation checkpointing); each is run
        through its own ``forward``."""
        bb = self.backbone
        return [*bb.vision.blocks, *bb.llm.layers, *self.action_head.model.blocks]

    def freezing_groups(self) -> FreezingGroups:
        """Parts for ``apply_freezing``."""
        bb = self.backbone
        return FreezingGroups(
            visual=[bb.vision, bb.projector],
            llm_layers=list(bb.llm.layers),
            # The final norm trains with tune_llm only, as in Isaac-GR00T (its top layers
            # are the only LM weights tune_top_llm_layers opens).
            llm_rest=[m for m in (bb.llm.embed_tokens, bb.llm.norm) if m is not None],
            action_head=[self.action_head],
        )

    def _check(self, batch: dict[str, Tensor], need_action: bool) -> None:
        keys = ["images", "input_ids", "attention_mask", "state", "embodiment_id"]
        keys += ["action"] if need_action else []
        missing = [k for k in keys if k not in batch]
        if missing:
            raise KeyError(f"groot_n1_6 batch is missing {missing}; see GrootN16's docstring")
        s = batch["state"].shape[-1]
        if s != self.cfg.max_state_dim:
            raise ValueError(
                f"batch['state'] has {s} dims, model expects max_state_dim={self.cfg.max_state_dim}"
                " (pad the state)"
            )
        if need_action and batch["action"].shape[-1] != self.cfg.max_action_dim:
            raise ValueError(
                f"batch['action'] has {batch['action'].shape[-1]} dims, model expects "
                f"max_action_dim={self.cfg.max_action_dim} (pad the action)"
            )
        if not self._check_values():
            return
        ids = batch["embodiment_id"]
        if bool(((ids < 0) | (ids >= self.cfg.num_embodiments)).any()):
            raise ValueError(
                f"batch['embodiment_id'] values {ids.tolist()} must be in "
                f"[0, num_embodiments={self.cfg.num_embodiments})"
            )

    def _check_values(self) -> bool:
        # Value checks (embodiment ids, placeholder counts) cost a host sync: run them on
        # the first batches and always on CPU, not on every accelerator step.
        return self._value_checks_left > 0 or self.action_head.vlln.weight.device.type == "cpu"

    def _features(self, batch: dict[str, Tensor], generator: torch.Generator | None):
        """The backbone's (features, valid, is_image), under a named profiler range."""
        with record_function("groot_n1_6.backbone"):
            out = self.backbone(batch, generator, self._check_values())
        self._value_checks_left = max(0, self._value_checks_left - 1)
        return out

    def _condition(self, batch: dict[str, Tensor], generator: torch.Generator | None):
        return self.condition_on_features(*self._features(batch, generator), batch, generator)

    def condition_on_features(
        self,
        features: Tensor,
        valid: Tensor,
        is_image: Tensor,
        batch: dict[str, Tensor],
        generator: torch.Generator | None = None,
    ):
        """The action head's conditioning from given backbone features [B, L, D_llm] (valid /
        image masks [B, L]) and ``batch``'s state and embodiment ids: (cond, state token).
        ``forward`` and ``predict_action`` get the features from the backbone."""
        cond = self.action_head.condition(features, valid, is_image)
        state = zero_padding(batch["state"].float(), batch.get("state_mask"), "state_mask")
        state_tok = self.action_head.encode_state(state, batch["embodiment_id"], generator)
        return cond, state_tok

    def forward(
        self, batch: dict[str, Tensor], generator: torch.Generator | None = None
    ) -> dict[str, Tensor]:
        """Flow-matching training loss. Returns {"loss", "pred_velocity", "target_velocity"}.
        The backbone and the action head run under named ``record_function`` ranges, so a
        profile can split the step between them."""
        self._check(batch, need_action=True)
        features = self._features(batch, generator)
        with record_function("groot_n1_6.action_head"):
            cond, state_tok = self.condition_on_features(*features, batch, generator)
            return self.flow_matching_loss(cond, state_tok, batch, generator)

    def flow_matching_loss(
        self,
        cond,
        state_tok: Tensor,
        batch: dict[str, Tensor],
        generator: torch.Generator | None = None,
    ) -> dict[str, Tensor]:
        """The loss of ``forward`` for a given conditioning (``condition_on_features``)."""
        action, mask, noise, t = training_draw(
            batch,
            generator,
            lambda b, device: groot_time(
                b,
                device=device,
                generator=generator,
                alpha=self.cfg.noise_beta_alpha,
                noise_s=self.cfg.noise_s,
            ),
        )
        tt = t[:, None, None]
        x_t = (1 - tt) * noise + tt * action
        target = action - noise
        pred = self.action_head.velocity(state_tok, x_t, t, batch["embodiment_id"], cond)
        return flow_loss_outputs(pred, target, action, mask)

    @torch.no_grad()
    def predict_action(
        self,
        batch: dict[str, Tensor],
        *,
        num_steps: int | None = None,
        generator: torch.Generator | None = None,
        noise: Tensor | None = None,
    ) -> Tensor:
        """Sample an action chunk [B, action_horizon, max_action_dim] with Euler steps
        (t: 0 -> 1). The backbone runs once."""
        self._check(batch, need_action=False)
        cond, state_tok = self._condition(batch, generator)
        return self.sample_actions(
            cond,
            state_tok,
            batch["embodiment_id"],
            num_steps=num_steps,
            generator=generator,
            noise=noise,
        )

    @torch.no_grad()
    def sample_actions(
        self,
        cond,
        state_tok: Tensor,
        ids: Tensor,
        *,
        num_steps: int | None = None,
        generator: torch.Generator | None = None,
        noise: Tensor | None = None,
    ) -> Tensor:
        """``predict_action`` for a given conditioning (``condition_on_features``)."""
        b = ids.shape[0]
        shape = (b, self.cfg.action_horizon, self.cfg.max_action_dim)
        if noise is None:
            noise = randn_like_gen(torch.empty(shape, device=ids.device), generator)

        def velocity(x: Tensor, t: float) -> Tensor:
            tt = torch.full((b,), t, device=x.device)
            return self.action_head.velocity(state_tok, x, tt, ids, cond).float()

        steps = num_steps or self.cfg.num_inference_steps
        return euler_integrate(velocity, noise.float(), 0.0, 1.0, steps)
