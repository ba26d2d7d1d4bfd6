#!/usr/bin/env bash
# Every GPU benchmark in one go, as run for benchmarks/results/*_<date>.*:
#
#   RESULTS=benchmarks/results bash tools/bench/run_h200.sh
#
# from the repo root on a machine with one H200 (two for the scaling runs, which are skipped
# with one GPU), with megatron-core 0.19, hydra, av and liger-kernel importable and the
# longboat packages installed (or PYTHONPATH pointing at packages/*/src). Each step has its
# own time limit (seconds, env LIMIT_*), so one that overruns leaves the others their time;
# results are written as each run ends. ONLY="gpu_tests llm vla llm_align scaling vla_scaling
# vla_align pi05" picks steps (default: all but pi05, which WITH_PI05=1 adds), so the set can
# be split over several calls.
#
# Run names (each script's docstring has the detail): `longboat` is always the CLI's defaults
# for the model; `longboat_<variant>` adds config keys (llm_throughput.VARIANTS:
# compiled = train.compile, no_graph = llm.cuda_graph=false, megatron_step = that and
# llm.one_pass_adamw=false;
# vla_throughput.VARIANTS: compiled = train.compile, master = train.master_weights,
# graphed = + train.cuda_graph, graphed_fp32master = + train.master_weight_storage=fp32,
# graphed_kernel = + train.master_weight_update=kernel).
set -u
ONLY=${ONLY:-"gpu_tests llm vla llm_align scaling vla_scaling vla_align$([ "${WITH_PI05:-0}" = "1" ] && echo " pi05")"}
want() { [[ " $ONLY " == *" $1 "* ]]; }
RESULTS=${RESULTS:-benchmarks/results}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1
step() { echo "== $1"; shift; "$@" 2>&1 | grep -v -i "userwarning\|warnings.warn\|deprecat\|MimoModelConfig\|Evict LRU"; }
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)

# The GPU-marked tests first (Triton kernels compiled for the H200 vs their references, the
# CUDA-graph and one-pass steps vs eager): the benchmarks below rely on them.
want gpu_tests && step "gpu tests" timeout "${LIMIT_GPU_TESTS:-240}" python3 -m pytest -q \
  -p no:cacheprovider --import-mode=importlib -m gpu -rs packages
want llm && step "llm throughput" timeout "${LIMIT_LLM:-240}" python3 tools/bench/llm_throughput.py \
  --out /tmp/llm_throughput.json --results-dir "$RESULTS" \
  --runs hf_eager,hf_compiled,mcore_local_spec,longboat_megatron_step,longboat_no_graph,longboat_compiled,hf_liger,longboat \
  --steps 10 --warmup 3 --time-budget "$(( ${LIMIT_LLM:-240} - 10 ))"
want vla && step "vla throughput" timeout "${LIMIT_VLA:-240}" python3 tools/bench/vla_throughput.py \
  --out /tmp/vla_throughput.json --results-dir "$RESULTS" \
  --runs reference,longboat,longboat_master,longboat_graphed,longboat_graphed_kernel,longboat_graphed_fp32master \
  --batch 32 --steps 20 --warmup 5 --workers 12 \
  --embodiments 8 --episodes 6 --episode-length 80 120 --time-budget "$(( ${LIMIT_VLA:-240} - 10 ))"
want llm_align && step "llm loss alignment" timeout "${LIMIT_LLM_ALIGN:-200}" python3 tools/bench/llm_loss_alignment.py \
  --out /tmp/llm_loss_alignment.json --results-dir "$RESULTS" --steps 200
if want scaling && [ "$GPUS" -ge 2 ]; then
  step "llm scaling" timeout "${LIMIT_SCALING:-200}" python3 tools/bench/llm_scaling.py \
    --results-dir "$RESULTS" --time-budget "$(( ${LIMIT_SCALING:-200} - 20 ))"
fi
if want vla_scaling && [ "$GPUS" -ge 2 ]; then
  step "vla scaling" timeout "${LIMIT_VLA_SCALING:-200}" python3 tools/bench/vla_scaling.py \
    --out /tmp/vla_scaling.json --results-dir "$RESULTS" \
    --variants longboat_graphed,longboat_master,longboat --batch 32 --steps 20 --warmup 5 \
    --workers 8 --embodiments 8 --episodes 6 --episode-length 80 120 \
    --time-budget "$(( ${LIMIT_VLA_SCALING:-200} - 20 ))"
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
