"""Accelerator adapters for megatron-core.

megatron-core 0.19 calls CUDA directly in a handful of places: its RNG tracker
(``add``/``fork``, ``_get/_set_cuda_rng_state``), ``GlobalMemoryBuffer``'s
allocation device, ``cuda`` placements in the pipeline schedules, p2p
communication, grad buffers and clip-grad, ``Tensor.cuda()`` for tied embeddings,
and ``'torch.cuda.FloatTensor'`` type checks in the fp16 and distributed
optimizers.  An adapter makes those call sites run on another accelerator.

``AcceleratorMegatronAdapter`` is the general mechanism (any accelerator with
longboat's ``Accelerator`` interface); ``CPUMegatronAdapter`` is what the CPU
accelerator's ``megatron_adapter_ref`` names.  A plugin may subclass it (e.g.
to add call sites) or implement the ``MegatronAdapter`` protocol itself.
CUDA needs no adapter.

Patches are reversible (``uninstall()``) and version-checked: they refuse any
megatron-core other than 0.19.x and fail naming the call site that moved.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, runtime_checkable

from longboat.core.megatron._patching import MegatronPatchError, PatchSet
from longboat.core.megatron._torch_proxy import AcceleratorTorch

SUPPORTED_MEGATRON = (0, 19)
"""megatron-core (major, minor) whose call sites the adapters patch."""

# Modules whose global ``torch`` is replaced: each calls ``torch.cuda.*`` or
# allocates with ``device="cuda"`` on a path longboat uses.
PATCHED_MODULES: tuple[str, ...] = (
    "megatron.core.utils",  # GlobalMemoryBuffer, param hashing, nvtx
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel.random",  # RNG tracker, checkpointing
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.data",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",  # MLA's YaRN
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.transformer.utils",  # default causal mask
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.multi_token_prediction",  # its loss tracker
)


@runtime_checkable
class MegatronAdapter(Protocol):
    """What an accelerator supplies so megatron-core runs on it."""

    name: str
    """Accelerator name the adapter serves (``cpu``, ``xpu``...)."""

    @property
    def installed(self) -> bool:
        """True between ``install()`` and ``uninstall()``."""
        ...

    def install(self) -> None:
        """Patch megatron-core for this accelerator (idempotent)."""
        ...

    def uninstall(self) -> None:
        """Undo every patch ``install()`` applied."""
        ...


def check_megatron_version() -> str:
    """Return megatron-core's version; raise if it is not the supported 0.19.x."""
    from megatron.core import package_info

    major, minor = int(package_info.MAJOR), int(package_info.MINOR)
    if (major, minor) != SUPPORTED_MEGATRON:
        raise MegatronPatchError(
            f"megatron-core {package_info.__version__} is installed; longboat's megatron "
            f"adapters patch the call sites of {SUPPORTED_MEGATRON[0]}.{SUPPORTED_MEGATRON[1]}.x. "
            "Fix: install longboat-core[megatron] (megatron-core>=0.19,<0.20)."
        )
    return str(package_info.__version__)


class AcceleratorMegatronAdapter:
    """Routes megatron-core's CUDA call sites to ``accelerator``."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.name = str(getattr(accelerator, "name", accelerator.device_type))
        self._patches: PatchSet | None = None

    @property
    def installed(self) -> bool:
        return self._patches is not None

    def install(self) -> None:
        if self._patches is not None:
            return
        check_megatron_version()
        patches = PatchSet()
        try:
            self._apply(patches)
        except BaseException:
            patches.undo()
            raise
        self._patches = patches

    def uninstall(self) -> None:
        if self._patches is not None:
            self._patches.undo()
            self._patches = None

    def __enter__(self) -> AcceleratorMegatronAdapter:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # -- the call sites ---------------------------------------------------

    def _apply(self, patches: PatchSet) -> None:
        proxy = AcceleratorTorch(self.accelerator)
        modules = {name: importlib.import_module(name) for name in PATCHED_MODULES}
        for mod in modules.values():
            patches.set_attr(mod, "torch", proxy)
        self._patch_rng(patches, modules["megatron.core.tensor_parallel.random"])
        self._patch_tensor_type_checks(patches)
        self._patch_tensor_cuda_calls(patches)
        self._patch_moe_host_copies(patches)

    def _patch_rng(self, patches: PatchSet, random_mod: Any) -> None:
        acc = self.accelerator

        def get_rng_state(
            device: Any = "cuda", clone: bool = False, graph_safe: bool = False
        ) -> Any:
            if graph_safe:
                raise NotImplementedError(
                    f"graph-safe RNG state needs CUDA graphs; not available on {self.name}"
                )
            return acc.get_rng_state()

        def set_rng_state(new_state: Any, device: Any = -1, graph_safe: bool = False) -> None:
            if graph_safe:
                raise NotImplementedError(
                    f"graph-safe RNG state needs CUDA graphs; not available on {self.name}"
                )
            acc.set_rng_state(new_state)

        patches.set_attr(random_mod, "_get_cuda_rng_state", get_rng_state)
        patches.set_attr(random_mod, "_set_cuda_rng_state", set_rng_state)
        # torch.cuda._lazy_call would queue the callback until CUDA initialises (never, here).
        patches.set_attr(random_mod, "_lazy_call", lambda cb: cb())
        # On CPU the "device" generator *is* the CPU generator, so the tracker's
        # "CPU RNG state changed within GPU RNG context" warning would fire on every fork.
        patches.set_attr(
            random_mod,
            "_longboat_device_rng_is_cpu_rng",
            self.accelerator.device_type == "cpu",
            must_exist=False,
        )
        patches.rewrite_code(
            random_mod.CudaRNGStatesTracker.fork,
            [
                (
                    "if not torch.all(cpu_rng_state == torch.get_rng_state()).item():",
                    "if not _longboat_device_rng_is_cpu_rng and not torch.all("
                    "cpu_rng_state == torch.get_rng_state()).item():",
                )
            ],
        )

    def _tensor_type_prefix(self) -> str:
        dt = self.accelerator.device_type
        return "torch." if dt == "cpu" else f"torch.{dt}."

    def _patch_tensor_type_checks(self, patches: PatchSet) -> None:
        from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

        prefix = self._tensor_type_prefix()
        swap = [("'torch.cuda.", f"'{prefix}")]
        patches.rewrite_code(optimizer.Float16OptimizerWithFloat16Params.__init__, swap)
        patches.rewrite_code(
            distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups, swap
        )
        patches.rewrite_code(clip_grads.clip_grad_by_total_norm_fp32, swap)

    def _patch_tensor_cuda_calls(self, patches: PatchSet) -> None:
        from megatron.core.models.common.language_module import language_module

        # torch here is the module's AcceleratorTorch, so this lands on the accelerator.
        patches.rewrite_code(
            language_module.LanguageModule.setup_embeddings_and_output_layer,
            [("weight.data.cuda()", "weight.data.to(torch.cuda.current_device())")],
        )

    def _patch_moe_host_copies(self, patches: PatchSet) -> None:
        from megatron.core.transformer.moe import moe_utils

        # The alltoall dispatcher needs its split sizes as host numpy arrays; megatron only
        # converts tensors that are on CUDA, so on another device they stayed tensors and
        # torch's all_to_all_single rejected them.
        patches.rewrite_code(
            moe_utils.maybe_move_tensor_to_cpu,
            [
                (
                    "if torch.is_tensor(tensor) and tensor.is_cuda:",
                    "if torch.is_tensor(tensor) and (tensor.is_cuda or as_numpy):",
                ),
                ("if record_stream:", "if record_stream and tensor.is_cuda:"),
            ],
        )


class CPUMegatronAdapter(AcceleratorMegatronAdapter):
    """megatron-core on CPU (gloo): the CPU accelerator's ``megatron_adapter_ref``."""

    def __init__(self, accelerator: Any | None = None) -> None:
        if accelerator is None:
            accelerator = _cpu_accelerator()
        if accelerator.device_type != "cpu":
            raise ValueError(
                f"CPUMegatronAdapter got a {accelerator.device_type!r} accelerator; "
                "use AcceleratorMegatronAdapter for other devices."
            )
        super().__init__(accelerator)


def _cpu_accelerator() -> Any:
    from longboat.core.device import get_accelerator

    return get_accelerator("cpu")
