#!/usr/bin/env bash
# The GPU run of issue 20 (decode at the HBM floor), in parts that each fit one device command (< 10 min):
#   bash benchmarks/decode_floor_gpu.sh small    # Qwen3-0.6B and SmolLM2-135M: timings, switch sets; attention sweep
#   bash benchmarks/decode_floor_gpu.sh llama    # Llama-3.1-8B: timings, switch sets
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
    tests)
        python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 --tb=short tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    *) echo "usage: $0 small|llama|tests"; exit 2 ;;
esac
