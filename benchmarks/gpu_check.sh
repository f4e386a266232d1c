#!/usr/bin/env bash
# One-shot check on a lent GPU (H200, no network): the CUDA tests (the Triton and xFormers kernels
# against the reference) and the throughput benchmark, logs and JSON written under $OUT. Needs
# torch, triton, transformers, numpy and pytest installed; xformers is optional (installed from
# $XFORMERS_WHEEL_DIR when set).
# Budget: well under 8 minutes in all; every step has its own time limit.
#
#   OUT=./gpu_results XFORMERS_WHEEL_DIR=/path/to/wheels bash benchmarks/gpu_check.sh
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-./gpu_results}"
PY="${PYTHON:-python}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1

failed=()
step() {  # step NAME SECONDS CMD...: runs CMD under a time limit, logs its status, keeps going
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "=== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start))s"
    [ "$rc" -eq 0 ] || failed+=("$name")
}

echo "=== gpu_check $(date -u +%FT%TZ) in $PWD, results in $OUT"
nvidia-smi || true

# The package: editable install without touching dependencies; PYTHONPATH covers a failure.
"$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . \
    || echo "note: editable install failed; using PYTHONPATH=$PWD"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c "import xformers.ops" >/dev/null 2>&1; then
    if [ -n "${XFORMERS_WHEEL_DIR:-}" ]; then
        "$PY" -m pip install -q --no-index --no-deps --find-links "$XFORMERS_WHEEL_DIR" xformers \
            || echo "note: xformers install from $XFORMERS_WHEEL_DIR failed"
    fi
    "$PY" -c "import xformers.ops" >/dev/null 2>&1 \
        || echo "note: xformers not importable; its tests skip and its benchmark rows are left out"
fi
"$PY" -m pip list 2>/dev/null | grep -iE '^(torch|triton|xformers|transformers) ' || true

step pytest-gpu 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/pytest_gpu.xml"

# End-to-end throughput at GPU sizes, dummy weights, against HF static batching.
for shape in llama-3.2-1b llama-3.1-8b; do
    step "throughput-$shape" 75 "$PY" -m benchmarks.throughput --load-format dummy \
        --model-config "$shape" --dtype bfloat16 --device cuda --batch-sizes 1,16,64,256 \
        --input-len 128:512 --output-len 64:128 --peers hf-static --tag "throughput-$shape" \
        --output-dir "$OUT"
done

# Tensor parallelism over NCCL (issue 18): a TP=2 run where there are two GPUs.
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
    step throughput-tp2 120 "$PY" -m benchmarks.throughput --load-format dummy \
        --model-config llama-3.2-1b --dtype bfloat16 --device cuda --batch-sizes 1,16 \
        --input-len 128 --output-len 64 --peers '' --tensor-parallel-size 2 \
        --tag throughput-llama-3.2-1b-tp2 --output-dir "$OUT"
else
    echo "note: fewer than two GPUs; the TP=2 step is skipped"
fi

if [ "${#failed[@]}" -eq 0 ]; then
    echo "=== gpu_check: all steps passed in ${SECONDS}s"
else
    echo "=== gpu_check: failed steps: ${failed[*]} (${SECONDS}s)"
    exit 1
fi
