#!/usr/bin/env bash
# The GPU run of issue 20 (decode at the HBM floor), in parts that each fit one device command (< 10 min):
#   bash benchmarks/decode_floor_gpu.sh small    # Qwen3-0.6B and SmolLM2-135M: timings, switch sets; attention sweep
#   bash benchmarks/decode_floor_gpu.sh llama    # Llama-3.1-8B: timings, switch sets
#   bash benchmarks/decode_floor_gpu.sh sweep    # Qwen3-0.6B: the GEMV variants in the model (1 and 8 rows), switch sets
#   bash benchmarks/decode_floor_gpu.sh sweep2   # SmolLM2-135M (GEMV variants at 1 row) and Llama-3.1-8B: switch sets
#   bash benchmarks/decode_floor_gpu.sh final    # the three shapes at b = 1…256 with the defaults, then the GPU suite
#   bash benchmarks/decode_floor_gpu.sh tests    # pytest -m gpu, the whole suite
# JSON and logs go under $OUT. Wheels the image lacks are carried in .whl/ (benchmarks/serve_gpu_wheels.txt).
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        > "$OUT/pip.log" 2>&1 || { echo "wheel install failed"; tail -3 "$OUT/pip.log"; }
    export PYTHONPATH=/tmp/site:$PWD/src:$PWD
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt"
SETS=${SETS:-all early early_prefetch no_fuse_merge no_fuse_norm no_fuse_silu no_pdl old_rule_1row}
floor() {  # $1: name, then decode_floor.py arguments
    local name=$1; shift
    python3 benchmarks/decode_floor.py "$@" --json "$OUT/decode_floor_$name.json" 2>&1 | grep -v -e Warning -e INFO \
        | tee "$OUT/decode_floor_$name.log" | grep -e "==" -e "^[a-z]" | tail -80
}
case ${1:-small} in
    small)
        floor small model --models qwen3-0.6b smollm2-135m --switch-sets $SETS
        floor attention attention --waves 4 8 16 --stages 1 3 ;;
    llama) floor llama model --models llama-3.1-8b --switch-sets $SETS ;;
    sweep) floor qwen3_sweep model --models qwen3-0.6b --batch-sizes 1 8 32 --gemv-rows 1 8 \
            --switch-sets all prefetch early early_prefetch no_kv_preload no_fuse_norm no_fuse_silu ;;
    sweep2)
        floor smollm2_sweep model --models smollm2-135m --batch-sizes 1 8 32 --gemv-rows 1 \
            --switch-sets all prefetch early early_prefetch no_kv_preload no_fuse_norm
        floor llama_sweep model --models llama-3.1-8b --batch-sizes 1 8 32 \
            --switch-sets all early no_kv_preload fuse_norm_any_k prefetch ;;
    final)
        floor final model --switch-sets all
        "$0" tests ;;
    tests)
        python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 --tb=short tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    *) echo "usage: $0 small|llama|tests"; exit 2 ;;
esac
