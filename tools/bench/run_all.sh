#!/usr/bin/env bash
# Every GPU benchmark in one go, as run for benchmarks/results/*_<date>.*:
#
#   RESULTS=benchmarks/results bash tools/bench/run_all.sh
#
# from the repo root on a machine with one GPU (two for the scaling runs, which are skipped
# with one GPU; the results record the GPU's name), with megatron-core 0.19, hydra, av, liger-kernel and diffusers importable and
# the longboat packages installed (or PYTHONPATH pointing at packages/*/src). Each step has its
# own time limit (seconds, env LIMIT_*), so one that overruns leaves the others their time;
# results are written as each run ends. ONLY="gpu_tests llm vla diffusion diffusion_align vlm_align llm_align scaling
# scaling_tp_qwen3 moe_scaling vla_scaling vlm_scaling wan_scaling vla_align pi05
# vla_scaling_levers fp8 fp8_align memory moonlight" picks
# steps (default: all but pi05, vla_scaling_levers, fp8, fp8_align, memory and moonlight, which WITH_PI05=1 /
# WITH_VLA_LEVERS=1 / WITH_FP8=1 / WITH_MEMORY=1 / WITH_MOONLIGHT=1 add), so the set can be split
# over several calls.
#
# The two-GPU rows (each its own command below, results named by the script):
#   scaling           llm_scaling: DP=2 vs DP=1 tokens/s (886M shape), TP=2 vs TP=1 loss curve
#   scaling_tp_qwen3  llm_scaling --phases tp --tp-shape qwen3_1_7b: TP=2 vs TP=1 loss curve
#                     judged against the newest llm_loss_alignment_qwen3_1_7b_*.json band, and
#                     both runs' tokens/s
#   moe_scaling       moe_scaling: the 4-layer Qwen3-30B-A3B shape at parallel.expert_parallel=2
#                     vs one GPU (tokens/s, router statistics, loss curves)
#   vla_scaling       vla_scaling: GR00T-N1.6, the CLI's defaults with DDP and with FSDP2,
#                     DP=2 vs DP=1 samples/s
#   vlm_scaling       vlm_scaling: Qwen2.5-VL-3B at LLM TP=2, ViT TP=1 vs the decoder's TP
#   wan_scaling       diffusion_scaling: Wan2.1 T2V-1.3B at 81 frames, longboat-diffusion train at
#                     parallel.context_parallel=2 on two GPUs vs one (tokens/s, target >= 1.7x;
#                     per-step loss equality)
#
# Run names (each script's docstring has the detail): `longboat` is always the CLI's defaults
# for the model; `longboat_<variant>` adds config keys (llm_throughput.VARIANTS:
# compiled = train.compile, no_graph = train.cuda_graph=false, megatron_step = that and
# optim.one_pass_adamw=false;
# vla_throughput.VARIANTS (the defaults: master weights + graph + kernel update): autocast =
# train.master_weights=false, compiled = train.compile, master = master weights, eager
# steps, graphed = both explicit, graphed_fp32master = + train.master_weight_storage=fp32,
# graphed_slices = + train.master_weight_update=slices; diffusion_throughput.VARIANTS:
# recompute = train.recompute=selective (self-attention outputs kept), recompute_full =
# train.recompute=full).
set -u
ONLY=${ONLY:-"gpu_tests llm vla diffusion diffusion_align vlm_align llm_align scaling scaling_tp_qwen3 moe_scaling vla_scaling vlm_scaling wan_scaling vla_align$([ "${WITH_PI05:-0}" = "1" ] && echo " pi05")$([ "${WITH_VLA_LEVERS:-0}" = "1" ] && echo " vla_scaling_levers")$([ "${WITH_FP8:-0}" = "1" ] && echo " fp8 fp8_align")$([ "${WITH_MEMORY:-0}" = "1" ] && echo " memory")$([ "${WITH_MOONLIGHT:-0}" = "1" ] && echo " moonlight")"}
want() { [[ " $ONLY " == *" $1 "* ]]; }
RESULTS=${RESULTS:-benchmarks/results}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1
step() { echo "== $1"; shift; "$@" 2>&1 | grep -v -i "userwarning\|warnings.warn\|deprecat\|MimoModelConfig\|Evict LRU"; }
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)

# The GPU-marked tests first (Triton kernels compiled for the GPU vs their references, the
# CUDA-graph and one-pass steps vs eager): the benchmarks below rely on them.
want gpu_tests && step "gpu tests" timeout "${LIMIT_GPU_TESTS:-240}" python3 -m pytest -q \
  -p no:cacheprovider --import-mode=importlib -m gpu -rs packages
want llm && step "llm throughput" timeout "${LIMIT_LLM:-240}" python3 tools/bench/llm_throughput.py \
  --out /tmp/llm_throughput.json --results-dir "$RESULTS" \
  --runs hf_eager,hf_compiled,mcore_local_spec,longboat_megatron_step,longboat_no_graph,longboat_compiled,hf_liger,longboat \
  --steps 10 --warmup 3 --time-budget "$(( ${LIMIT_LLM:-240} - 10 ))"
want vla && step "vla throughput" timeout "${LIMIT_VLA:-240}" python3 tools/bench/vla_throughput.py \
  --out /tmp/vla_throughput.json --results-dir "$RESULTS" \
  --runs reference,longboat,longboat_autocast,longboat_master,longboat_graphed_slices,longboat_graphed_fp32master \
  --batch 32 --steps 20 --warmup 5 --workers 12 \
  --embodiments 8 --episodes 6 --episode-length 80 120 --time-budget "$(( ${LIMIT_VLA:-240} - 10 ))"
# Wan2.1 T2V-1.3B at 480x832, 49 and 81 frames: the DiffSynth-style diffusers loop (checkpointing
# on every block), diffusers with compiled blocks, longboat-diffusion train's defaults.
want diffusion && step "diffusion throughput" timeout "${LIMIT_DIFFUSION:-720}" \
  python3 tools/bench/diffusion_throughput.py --out /tmp/diffusion_throughput.json \
  --results-dir "$RESULTS" --runs hf_ckpt,hf_compiled,longboat --frames 49,81 \
  --steps 10 --warmup 3 --time-budget "$(( ${LIMIT_DIFFUSION:-720} - 15 ))"
# Wan 1.3B at 17 frames, 200 steps: longboat-diffusion train's defaults vs the DiffSynth-style
# loop with the run's optimizer, judged against that loop's own band (SDPA off cuDNN).
want diffusion_align && step "diffusion loss alignment" timeout "${LIMIT_DIFFUSION_ALIGN:-420}" \
  python3 tools/bench/diffusion_loss_alignment.py --out /tmp/diffusion_loss_alignment.json \
  --results-dir "$RESULTS" --frames 17 --steps 200
# Qwen2.5-VL-3B on the vlm_throughput samples (one 8K row a step), 200 steps:
# longboat-vlm train's defaults vs the HF loop with the run's optimizer from one seeded fp32
# checkpoint, judged against that loop's own band (SDPA moved off its default kernel).
want vlm_align && step "vlm loss alignment" timeout "${LIMIT_VLM_ALIGN:-1200}" \
  python3 tools/bench/vlm_loss_alignment.py --out /tmp/vlm_loss_alignment.json \
  --results-dir "$RESULTS" --steps 200
want llm_align && step "llm loss alignment" timeout "${LIMIT_LLM_ALIGN:-200}" python3 tools/bench/llm_loss_alignment.py \
  --out /tmp/llm_loss_alignment.json --results-dir "$RESULTS" --steps 200
if want scaling && [ "$GPUS" -ge 2 ]; then
  step "llm scaling" timeout "${LIMIT_SCALING:-200}" python3 tools/bench/llm_scaling.py \
    --results-dir "$RESULTS" --time-budget "$(( ${LIMIT_SCALING:-200} - 20 ))"
fi
if want scaling_tp_qwen3 && [ "$GPUS" -ge 2 ]; then
  # The noise band: the newest Qwen3-1.7B loss alignment (same shape, seed and micro-batch 2).
  BAND=$(ls -t "$RESULTS"/llm_loss_alignment_qwen3_1_7b_*.json \
    benchmarks/results/llm_loss_alignment_qwen3_1_7b_*.json 2>/dev/null | head -1)
  step "llm scaling, TP on the Qwen3-1.7B shape" timeout "${LIMIT_SCALING_TP_QWEN3:-300}" \
    python3 tools/bench/llm_scaling.py --results-dir "$RESULTS" --phases tp \
    --tp-shape qwen3_1_7b --tp-steps 50 ${BAND:+--tp-band "$BAND"} \
    --time-budget "$(( ${LIMIT_SCALING_TP_QWEN3:-300} - 20 ))"
fi
if want moe_scaling && [ "$GPUS" -ge 2 ]; then
  step "moe scaling (EP=2)" timeout "${LIMIT_MOE_SCALING:-480}" python3 tools/bench/moe_scaling.py \
    --out /tmp/moe_scaling.json --results-dir "$RESULTS" --steps 20 --warmup 5 \
    --time-budget "$(( ${LIMIT_MOE_SCALING:-480} - 20 ))"
fi
if want vla_scaling && [ "$GPUS" -ge 2 ]; then
  step "vla scaling (DDP, FSDP2)" timeout "${LIMIT_VLA_SCALING:-360}" python3 tools/bench/vla_scaling.py \
    --out /tmp/vla_scaling.json --results-dir "$RESULTS" \
    --variants longboat,longboat_fsdp --batch 32 --steps 20 --warmup 5 \
    --workers 8 --embodiments 8 --episodes 6 --episode-length 80 120 \
    --time-budget "$(( ${LIMIT_VLA_SCALING:-360} - 20 ))"
fi
if want vla_scaling_levers && [ "$GPUS" -ge 2 ]; then
  step "vla scaling (levers)" timeout "${LIMIT_VLA_SCALING_LEVERS:-300}" python3 tools/bench/vla_scaling.py \
    --out /tmp/vla_scaling_levers.json --results-dir "$RESULTS" \
    --variants longboat_graphed,longboat_master --batch 32 --steps 20 --warmup 5 \
    --workers 8 --embodiments 8 --episodes 6 --episode-length 80 120 \
    --time-budget "$(( ${LIMIT_VLA_SCALING_LEVERS:-300} - 20 ))"
fi
if want vlm_scaling && [ "$GPUS" -ge 2 ]; then
  step "vlm scaling (ViT TP=1 under LLM TP=2)" timeout "${LIMIT_VLM_SCALING:-480}" \
    python3 tools/bench/vlm_scaling.py --out /tmp/vlm_scaling.json --results-dir "$RESULTS" \
    --steps 20 --warmup 3 --time-budget "$(( ${LIMIT_VLM_SCALING:-480} - 20 ))"
fi
if want wan_scaling && [ "$GPUS" -ge 2 ]; then
  # WAN_SCALING_KEYS (e.g. train.recompute=selective) adds keys to both phases: a variant, for
  # when the CLI's defaults do not fit 81 frames on one GPU.
  step "wan scaling (CP=2 vs one GPU, 81 frames)" timeout "${LIMIT_WAN_SCALING:-600}" \
    python3 tools/bench/diffusion_scaling.py --out /tmp/diffusion_scaling.json \
    --results-dir "$RESULTS" --frames 81 --steps 20 --warmup 3 ${WAN_SCALING_KEYS:+--keys $WAN_SCALING_KEYS} \
    --time-budget "$(( ${LIMIT_WAN_SCALING:-600} - 20 ))"
fi
want vla_align && step "vla loss alignment (master weights)" timeout "${LIMIT_VLA_ALIGN:-240}" \
  python3 tools/bench/vla_loss_alignment.py --out /tmp/vla_loss_alignment.json \
  --results-dir "$RESULTS" --steps 200 --batch 8 --master-weights
if want pi05; then
  step "vla throughput pi05" timeout "${LIMIT_PI05:-300}" python3 tools/bench/vla_throughput.py \
    --out /tmp/vla_pi05.json --model pi05 --batch 32 --steps 10 --warmup 3 --workers 8 \
    --runs reference,longboat,longboat_master,longboat_graphed --results-dir "$RESULTS" \
    --time-budget "$(( ${LIMIT_PI05:-300} - 15 ))"
fi
# FP8 (benchmarks/notes/fp8.md): the FP8 kernels' GPU tests, one decoder layer's linears per
# recipe, then the training step on the Qwen3-1.7B shape with train.precision=fp8 per recipe
# beside the CLI's bf16 default and the fastest HF baseline (FP8_RUNS picks the rows), and the
# 886M shape beside torchtitan's rows (FP8_886M_RUNS).
if want fp8; then
  step "fp8 gpu tests" timeout "${LIMIT_FP8_TESTS:-120}" python3 -m pytest -q -p no:cacheprovider \
    --import-mode=importlib -m gpu -rs packages/kernels/tests/test_fp8_triton.py \
    packages/kernels/tests/test_fp8.py packages/kernels/tests/test_fp8_grouped.py
  [ "${LIMIT_FP8_GEMM:-120}" -gt 0 ] && step "fp8 gemm" timeout "${LIMIT_FP8_GEMM:-120}" \
    python3 tools/bench/fp8_gemm.py --out /tmp/fp8_gemm.json --results-dir "$RESULTS" --shapes qwen3_1_7b
  step "llm throughput fp8" timeout "${LIMIT_FP8:-360}" python3 tools/bench/llm_throughput.py \
    --shape qwen3_1_7b --out /tmp/llm_throughput_fp8.json --results-dir "$RESULTS" \
    --runs "${FP8_RUNS:-longboat,longboat_fp8,longboat_fp8_rowwise,longboat_fp8_tensorwise,hf_compiled}" \
    --steps 10 --warmup 3 --time-budget "$(( ${LIMIT_FP8:-360} - 10 ))"
  # The 886M shape beside torchtitan's bf16 and Float8 rows (skipped rows unless torchtitan 0.2.x
  # and torchao are importable: benchmarks/notes/llm.md lists the wheels).
  step "llm throughput fp8 886m" timeout "${LIMIT_FP8_886M:-420}" python3 tools/bench/llm_throughput.py \
    --out /tmp/llm_throughput_886m_fp8.json --results-dir "$RESULTS" \
    --runs "${FP8_886M_RUNS:-hf_compiled,titan_compiled,titan_float8,longboat,longboat_fp8}" \
    --steps 10 --warmup 3 --time-budget "$(( ${LIMIT_FP8_886M:-420} - 10 ))"
fi
# FP8 on the loss curve: 200 steps of the Qwen3-1.7B shape, train.precision=fp8 against our bf16
# from the same weights and batches, judged within the HF baseline's own noise band.
want fp8_align && step "llm loss alignment fp8" timeout "${LIMIT_FP8_ALIGN:-420}" \
  python3 tools/bench/llm_loss_alignment.py --shape qwen3_1_7b --micro-batch 2 --steps 200 \
  --out /tmp/llm_loss_alignment_fp8.json --results-dir "$RESULTS" --candidate train.precision=fp8
# The memory plan against the measured peak (pi0.5 and GR00T-N1.6, batch 32, CLI defaults, and
# at the references' measured peaks).
want memory && step "memory plan" timeout "${LIMIT_MEMORY:-300}" python3 tools/bench/memory_plan.py \
  --out /tmp/memory_plan.json --results-dir "$RESULTS" --models pi05,groot_n1_6 \
  --budgets "${MEMORY_BUDGETS:-auto,33}" --time-budget "$(( ${LIMIT_MEMORY:-300} - 15 ))"
# DeepSeek-V3 architecture: Moonlight-16B-A3B cut to 4 layers against DeepseekV3ForCausalLM.
want moonlight && step "llm throughput moonlight_4l" timeout "${LIMIT_MOONLIGHT:-300}" \
  python3 tools/bench/llm_throughput.py --shape moonlight_4l --out /tmp/llm_moonlight.json \
  --results-dir "$RESULTS" --runs "${MOONLIGHT_RUNS:-longboat,hf_eager}" --steps 10 --warmup 3 \
  --time-budget "$(( ${LIMIT_MOONLIGHT:-300} - 10 ))"
