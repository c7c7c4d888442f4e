#!/usr/bin/env bash
# The GPU run of the token-count graphs (issue 16), in parts that each fit one device command (< 10 min):
#   bash benchmarks/prefill_graphs_gpu.sh quick   # token-graph GPU tests + Qwen3 TTFT (a first look)
#   bash benchmarks/prefill_graphs_gpu.sh tests   # pytest -m gpu, the whole suite
#   bash benchmarks/prefill_graphs_gpu.sh bench   # TTFT both shapes, nano-vllm workload with/without the graphs
#   bash benchmarks/prefill_graphs_gpu.sh retest  # the GPU tests of the runner and demos, then bench
#   bash benchmarks/prefill_graphs_gpu.sh structured # GPU tests of runner/engine/sampler + structured outputs' cost
#   bash benchmarks/prefill_graphs_gpu.sh tiles   # attention GPU tests + the prefill kernel's tilings + Qwen3 TTFT
#   bash benchmarks/prefill_graphs_gpu.sh ttft    # one streamed request's timeline in serve, then TTFT both shapes
#   bash benchmarks/prefill_graphs_gpu.sh serveab # serving at 2048 tokens per step, chunk_time_ratio 2.5 vs 0, one run
#   bash benchmarks/prefill_graphs_gpu.sh close   # the whole GPU suite, structured outputs' cost, TTFT (graphs only)
#   bash benchmarks/prefill_graphs_gpu.sh pool    # the graph pool: recorded growth vs the allocator's segments
#   bash benchmarks/prefill_graphs_gpu.sh profile # TTFT both shapes, + GPU time by kernel kind per length
#   bash benchmarks/prefill_graphs_gpu.sh serve [TOKENS]  # serving benchmark, Qwen3-0.6B shape; TOKENS: the
#                                                 # server's --max-num-batched-tokens (default: the engine's)
# Wheels the image lacks (fastapi, uvicorn, pyzmq, msgspec, openai, gguf, ...) are carried in .whl/.
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        > "$OUT/pip.log" 2>&1 || { echo "wheel install failed"; tail -3 "$OUT/pip.log"; }
    export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
case ${1:-quick} in
    quick)
        python3 -m pytest -q -p no:cacheprovider -m gpu tests/runner/test_token_graphs.py tests/runner/test_graph_setup.py \
            tests/kernels/test_attention.py tests/kernels/test_rotary_kv.py 2>&1 | tee "$OUT/gpu_tests_quick.log" | tail -15
        python3 benchmarks/prompt_latency.py --models qwen3-0.6b --out "$OUT/prompt_latency_quick.json" 2>&1 \
            | grep -v Warning | tail -20 ;;
    tests)
        python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 --tb=short tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    final)  # the whole GPU suite, then the benchmarks
        "$0" tests; "$0" bench ;;
    retest)  # the tests a fix touched, then the benchmarks
        python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/runner/test_token_graphs.py tests/runner/test_graph_setup.py \
            tests/test_bench_graphs.py tests/test_demos.py 2>&1 | tee "$OUT/gpu_tests_retest.log" | tail -6
        "$0" bench ;;
    bench)
        python3 benchmarks/prompt_latency.py --out "$OUT/prompt_latency.json" 2>&1 | grep -v Warning | tail -8
        python3 benchmarks/throughput.py --variants async async-no-prefill-graphs --out "$OUT" 2>&1 | tail -8 ;;
    structured)  # issue 18's GPU run: the GPU tests of runner, engine and sampler, then structured outputs' overhead
        python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/runner tests/engine tests/test_sampling.py 2>&1 \
            | tee "$OUT/gpu_tests_structured.log" | tail -4
        python3 benchmarks/structured_overhead.py --out "$OUT/structured_overhead.json" 2>&1 | grep -v INFO | tail -12 ;;
    tiles)
        python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_attention.py 2>&1 | tee "$OUT/gpu_tests_attention.log" | tail -3
        python3 benchmarks/prefill_attention_tiles.py --out "$OUT/prefill_attention_tiles.json" 2>&1 | grep -v Warning | tail -60
        python3 benchmarks/prompt_latency.py --models qwen3-0.6b --profile --out "$OUT/prompt_latency_qwen3.json" 2>&1 \
            | grep -v Warning | tail -6 ;;
    ttft)
        python3 benchmarks/serve_timeline.py --out "$OUT/serve_timeline.json" 2>&1 | grep -v Warning | tail -4
        "$0" profile ;;
    serveab)
        for ratio in 2.5 0; do
            python3 benchmarks/serve.py --model qwen3-0.6b --out "$OUT/serve_qwen3_ratio$ratio.json" \
                --server-arg=--chunk-time-ratio=$ratio 2>&1 | grep -E "server c=|offline c=|MISSED|met " | tail -24
        done ;;
    close)
        "$0" tests
        python3 benchmarks/structured_overhead.py --out "$OUT/structured_overhead.json" 2>&1 | grep -v INFO | tail -8
        python3 benchmarks/prompt_latency.py --variants graphs --out "$OUT/prompt_latency.json" 2>&1 | grep -v Warning | tail -4 ;;
    pool)
        python3 benchmarks/graph_pool.py --out "$OUT/graph_pool.json" 2>&1 | tail -8 ;;
    profile)
        python3 benchmarks/prompt_latency.py --profile --out "$OUT/prompt_latency.json" 2>&1 | grep -v Warning | tail -8 ;;
    serve)
        budget=${2:-}
        python3 benchmarks/serve.py --model qwen3-0.6b --out "$OUT/serve_qwen3${budget:+_$budget}.json" \
            ${budget:+--server-arg=--max-num-batched-tokens=$budget} 2>&1 | tail -25 ;;
esac
