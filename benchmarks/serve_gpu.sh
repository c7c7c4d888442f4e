#!/usr/bin/env bash
# The GPU run of the server work (issue 7), in parts that each fit one device command (< 10 min):
#   bash benchmarks/serve_gpu.sh tests    # install the carried wheels; the server's GPU test and core-loop tests
#   bash benchmarks/serve_gpu.sh qwen     # serving benchmark, Qwen3-0.6B shape (+ 0 lost of 1000 at c=256)
#   bash benchmarks/serve_gpu.sh llama    # serving benchmark, Llama-3.1-8B shape
#   bash benchmarks/serve_gpu.sh all      # the three in a row
# Logs and JSON go under $OUT. WHEELS is the folder holding benchmarks/serve_gpu_wheels.txt's wheels.
set -uo pipefail
: "${OUT:?set OUT}"
WHEELS=${WHEELS:-wheels}
part=${1:-all}

install() {
    python -c "import fastapi, uvicorn, zmq, msgspec, openai, xgrammar" 2>/dev/null && return 0
    python -m pip install -q --no-index --no-deps --find-links "$WHEELS" -r benchmarks/serve_gpu_wheels.txt \
        > "$OUT/pip.log" 2>&1 || { echo "installing the wheels failed:"; tail -5 "$OUT/pip.log"; exit 1; }
}

run_tests() {
    python -m pytest -q -p no:cacheprovider tests/engine/test_core_process.py tests/server/test_server_load.py \
        -k "gpu or core_process or 64_concurrent" 2>&1 | tee "$OUT/gpu_tests_server.log" | tail -5
}

bench() {  # $1: name, then serve.py arguments
    local name=$1; shift
    python benchmarks/serve.py "$@" --out "$OUT/serve_$name.json" 2>&1 | tee "$OUT/serve_$name.log" | tail -25
}

install
case $part in
    tests) run_tests ;;
    qwen) bench qwen3 --model qwen3-0.6b ;;
    llama) bench llama --model llama-3.1-8b --drop-check-prompts 0 ;;
    all) run_tests; bench qwen3 --model qwen3-0.6b; bench llama --model llama-3.1-8b --drop-check-prompts 0 ;;
    *) echo "usage: $0 tests|qwen|llama|all"; exit 2 ;;
esac
