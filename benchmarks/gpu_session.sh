#!/usr/bin/env bash
# One lease of a GPU machine, as one prepared script: the checks and benchmarks that need CUDA, each under its
# own time limit inside a deadline, logs and results gathered into one archive.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh [SECONDS] [STEPS...]
#
# SECONDS (default 400) is the deadline for the whole script; every step is cut at it. STEPS picks what runs
# (default: all, in this order): env tests peak train cadence anatomy bench_gpt bench_llama scale model_states
# precision stall. Each step's own limit can be set as LIMIT_<name> (e.g. LIMIT_bench_gpt=240). PARALLEL_TIMED=1
# runs anatomy, bench_gpt and bench_llama at once on their own cores, their timed phases taking turns on the GPU
# (see below).
# The package is installed from this checkout (editable, no dependencies, no index: the machine has no
# network), because torch finds the "dpcs" backend by the package's entry point. Everything lands in
# $OUT/gpu_session.tar.gz (logs/, results/, rc.txt with each step's exit status and seconds).
set -u
DEADLINE=$(( $(date +%s) + ${1:-400} ))
shift || true
STEPS=${*:-env tests peak train cadence anatomy bench_gpt bench_llama scale model_states precision stall}
EXTRA=${EXTRA:-}  # more commands to run with the first, parallel group (diagnostics): "name:command"
OUT=${OUT:-/tmp/gpu_session}
W=$(mktemp -d)
mkdir -p "$W/logs" "$W/results" "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
NCPU=$(nproc)

left() { echo $(( DEADLINE - $(date +%s) )); }
wants() { [[ " $STEPS " == *" $1 "* ]]; }
# step NAME LIMIT CMD...: runs CMD under min(LIMIT, time left), logs to logs/NAME.log, records rc and seconds.
step() {
    local name=$1 limit=$2; shift 2
    local override="LIMIT_$name"; limit=${!override:-$limit}
    local budget; budget=$(left); (( budget > limit )) && budget=$limit
    if (( budget < 10 )); then echo "$name skipped (no time left)" >> "$W/rc.txt"; return; fi
    local t0; t0=$(date +%s)
    timeout -k 5 "$budget" "$@" > "$W/logs/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc seconds=$(( $(date +%s) - t0 )) limit=$budget" >> "$W/rc.txt"
    echo "[$name] rc=$rc in $(( $(date +%s) - t0 )) s: $(tail -n 2 "$W/logs/$name.log" | tr '\n' ' ' | cut -c1-300)"
}

step install 120 $PY -m pip install -q --no-deps --no-build-isolation --no-index -e .

if wants env; then
    { nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
      $PY -c "import torch, transformers, scipy, rich, matplotlib, networkx; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
      echo "cpus $NCPU"; } > "$W/logs/env.log" 2>&1
    cat "$W/logs/env.log"
fi

# The cadence benchmark is CPU work (gloo ranks of one thread): it runs beside the GPU steps on cores of its own.
CADENCE_PID=
if wants cadence && (( NCPU >= 8 )); then
    step cadence 300 taskset -c $(( NCPU - 4 ))-$(( NCPU - 1 )) $PY benchmarks/cadence.py --reps 7 --out "$W/results" &
    CADENCE_PID=$!
    GPU_CPUS="0-$(( NCPU - 5 ))"
else
    GPU_CPUS="0-$(( NCPU - 1 ))"
fi
G=(taskset -c "$GPU_CPUS")

# The GPU's timed phases take one lock in turn (bench.device_to_itself; `flock` from here): the steps below
# may then share the GPU, each compiling on CPU cores of its own, and no step is timed while another's run.
export DPCS_BENCH_DEVICE_LOCK=$W/device.lock
L=(flock "$DPCS_BENCH_DEVICE_LOCK")

# Correctness and memory first, in parallel (none of them is timed). With PARALLEL_TIMED=1 the timed steps
# (anatomy, bench_gpt, bench_llama) start beside them, the CUDA tests holding the device's lock meanwhile.
TIMED=()
for name in anatomy bench_gpt bench_llama; do wants $name && TIMED+=($name); done
PARALLEL_TIMED=${PARALLEL_TIMED:-0}
pids=()
wants tests && { step tests_cuda 180 "${G[@]}" "${L[@]}" $PY -m pytest -q -p no:cacheprovider -rs tests/ops/test_overflow.py \
    tests/ops/test_offload_ops.py tests/passes/rewrite/test_offload.py tests/ops/test_fp8.py tests/test_measure.py \
    tests/cost/test_allocator.py tests/cost/test_budget.py tests/test_checkpoint.py tests/cost/test_hardware.py \
    tests/model_states/test_host_step_overlap.py & pids+=($!); }
wants peak && { step peak_prediction 180 "${G[@]}" $PY benchmarks/peak_prediction.py --device cuda --out "$W/results" & pids+=($!); }
wants train && { step train_gpt 180 "${G[@]}" $PY examples/train_gpt.py --device cuda --steps 12 \
    --telemetry "$W/results/train_gpt_telemetry.jsonl" & pids+=($!); }
if [[ -n "$EXTRA" ]]; then
    step "${EXTRA%%:*}" 180 "${G[@]}" bash -c "${EXTRA#*:}" & pids+=($!)
fi
(( PARALLEL_TIMED )) || { (( ${#pids[@]} )) && wait "${pids[@]}"; pids=(); }

# Timed work. First where a planned step's time goes (compile against dpcs with and without offload at one
# budget, under the profiler), then the bench. One at a time, or with PARALLEL_TIMED=1 all at once, each pinned
# to its share of the GPU steps' cores (their timed phases still one at a time, by the lock).
cores_of() {  # cores_of I N: the I-th of N equal shares of GPU_CPUS (a range "a-b")
    local a=${GPU_CPUS%-*} b=${GPU_CPUS#*-}; local n=$(( (b - a + 1) / $2 ))
    (( n < 1 )) && n=1
    local lo=$(( a + $1 * n )) hi=$(( a + ($1 + 1) * n - 1 ))
    (( $1 == $2 - 1 || hi > b )) && hi=$b
    (( lo > b )) && lo=$b
    echo "$lo-$hi"
}
i=0
for name in "${TIMED[@]}"; do
    if (( PARALLEL_TIMED )); then T=(taskset -c "$(cores_of $i ${#TIMED[@]})"); else T=("${G[@]}"); fi
    case $name in
        anatomy) cmd=(step step_anatomy 150 "${T[@]}" $PY benchmarks/step_anatomy.py --device cuda --model gpt --steps 10
                      --warmup 2 --out "$W/results") ;;
        bench_gpt) cmd=(step bench_gpt 240 "${T[@]}" $PY benchmarks/bench.py --device cuda --models gpt --steps 10
                        --warmup 2 --out "$W/results/bench_gpt") ;;
        bench_llama) cmd=(step bench_llama 240 "${T[@]}" $PY benchmarks/bench.py --device cuda --models llama
                          --steps 10 --warmup 2 --out "$W/results/bench_llama") ;;
    esac
    if (( PARALLEL_TIMED )); then "${cmd[@]}" & pids+=($!); else "${cmd[@]}"; fi
    i=$(( i + 1 ))
done
(( ${#pids[@]} )) && wait "${pids[@]}"

# At the scale people train (issue 57): a 439M-parameter Llama, 16k tokens a step, each strategy in its own process
# under one 16 GiB cap, then dpcs uncapped at each torch strategy's reserved peak (its runs compile at once and
# time their steps in turn, on the device lock; about 5 minutes).
wants scale && step gpu_scale 330 "${G[@]}" $PY benchmarks/gpu_scale.py --out "$W/results" --logs "$W/logs/gpu_scale" ${SCALE_ARGS:-}

# Model-state levers at scale (issue 60): the 439M Llama with AdamW(fused=True) against int8 and fp16 state on
# the device, state on the host, blocks offloaded with the host step overlapped, and dpcs's choice at 0.7x
# AdamW's peak; writes model_states_cuda.json with the issue's targets checked.
wants model_states && step model_states 300 "${G[@]}" $PY benchmarks/model_states.py --device cuda --models llama \
    --strategies stateless,adamw,fp16,int8,int8_host,fp32_host,offload,offload_overlap --steps 10 --warmup 3 \
    --loss-steps 0 --dpcs-fractions 0.7 --out "$W/results"

# fp8 against bf16 speed (torchao is not on the machine's image: dpcs's own fp8 linears only), at two scales
# (issue 61): the small Llama, where fp8's choice (fp8_*) should keep the linears fp8 loses on (fp8all_*
# converts them all), and two layers of an 8B-class Llama. The hardware profile (with its matmul table) is
# measured first and kept with the results: it is what the choice was made with.
if wants precision; then
    step hardware_profile 60 "${G[@]}" bash -c "dpcs hardware --refresh --json > '$W/results/hardware_profile_cuda.json'"
    step precision_speed 150 "${G[@]}" $PY benchmarks/precision_speed.py --device cuda \
        --strategies bf16,fp8_tensorwise,fp8_rowwise,fp8all_tensorwise --steps 10 --warmup 3 --out "$W/results"
    step precision_speed_8b 150 "${G[@]}" $PY benchmarks/precision_speed.py --device cuda --preset 8b_slice \
        --strategies bf16,fp8_tensorwise,fp8_rowwise --out "$W/results"
fi
wants stall && step checkpoint_stall 90 "${G[@]}" $PY benchmarks/checkpoint_stall.py --device cuda --out "$W/results"

[[ -n "$CADENCE_PID" ]] && wait "$CADENCE_PID"
cat "$W/rc.txt"
tar -czf "$OUT/gpu_session.tar.gz" -C "$W" .
echo "wrote $OUT/gpu_session.tar.gz"
