#!/usr/bin/env bash
# The GPU run of the token-count graphs (issue 16), in parts that each fit one device command (< 10 min):
#   bash benchmarks/prefill_graphs_gpu.sh quick   # token-graph GPU tests + Qwen3 TTFT (a first look)
#   bash benchmarks/prefill_graphs_gpu.sh tests   # pytest -m gpu, the whole suite
#   bash benchmarks/prefill_graphs_gpu.sh bench   # TTFT both shapes, nano-vllm workload with/without the graphs
#   bash benchmarks/prefill_graphs_gpu.sh retest  # the GPU tests of the runner and demos, then bench
#   bash benchmarks/prefill_graphs_gpu.sh structured # GPU tests of runner/engine/sampler + structured outputs' cost
#   bash benchmarks/prefill_graphs_gpu.sh tiles   # attention GPU tests + the prefill kernel's tilings + Qwen3 TTFT
#   bash benchmarks/prefill_graphs_gpu.sh ttft    # one stream at a time through serve vs offline prefill, then profile
#   bash benchmarks/prefill_graphs_gpu.sh serveab # serving at 2048 tokens per step, chunk_time_ratio 2.5 vs 0, one run
#   bash benchmarks/prefill_graphs_gpu.sh close   # the whole GPU suite, structured outputs' cost, TTFT (graphs only)
#   bash benchmarks/prefill_graphs_gpu.sh pool    # `nanoserve bench graphs`, Qwen3-0.6B shape: pool MiB, capture s
#   bash benchmarks/prefill_graphs_gpu.sh cli     # `nanoserve bench latency|throughput|serve` on the Qwen3-0.6B shape
#   bash benchmarks/prefill_graphs_gpu.sh profile # TTFT both shapes, + GPU time by kernel kind per length
#   bash benchmarks/prefill_graphs_gpu.sh serve [TOKENS]  # serving benchmark, Qwen3-0.6B shape; TOKENS: the
#                                                 # server's --max-num-batched-tokens (default: the engine's)
# Wheels the image lacks (fastapi, uvicorn, pyzmq, msgspec, openai, gguf, ...) are carried in .whl/.
source benchmarks/gpu_env.sh
SHAPE="--model benchmarks/shapes/qwen3-0.6b --load-format dummy --skip-tokenizer-init"
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
    ttft)  # (the per-process timeline of benchmarks/serve_timeline.py is in results/serve_timeline_qwen3_h200.json)
        python3 benchmarks/serve.py --model qwen3-0.6b --max-concurrency 1 --num-prompts 40 --drop-check-prompts 0 \
            --out "$OUT/serve_ttft_qwen3.json" 2>&1 | grep -E "server c=|offline c=|TTFT|TPOT" | tail -6
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
    pool)  # (graph_pool.py's allocator-segment comparison is in results/graph_pool_h200.json)
        python3 -m nanoserve bench graphs $SHAPE --max-num-seqs 256 --enable-prefix-caching false \
            --json "$OUT/graphs_qwen3.json" --png "$OUT/graphs_qwen3.png" 2>&1 | tail -30 ;;
    cli)
        python3 -m nanoserve bench latency $SHAPE --input-len 1024 --output-len 128 --batch-size 8 \
            --output-json "$OUT/bench_latency.json" 2>&1 | tail -8
        python3 -m nanoserve bench throughput $SHAPE --input-len 1024 --output-len 128 --num-prompts 1000 \
            --output-json "$OUT/bench_throughput.json" 2>&1 | tail -2
        python3 -m nanoserve serve benchmarks/shapes/qwen3-0.6b --load-format dummy --skip-tokenizer-init \
            --served-model-name qwen3 --port 8011 > "$OUT/serve_cli.log" 2>&1 &
        server=$!
        until python3 -c "import httpx; httpx.get('http://127.0.0.1:8011/health').raise_for_status()" 2>/dev/null
        do sleep 2; kill -0 $server || break; done
        python3 -m nanoserve bench serve --port 8011 --model qwen3 --tokenizer benchmarks/shapes/qwen3-0.6b \
            --output-json "$OUT/bench_serve.json" 2>&1 | tail -28
        kill -INT $server; wait $server ;;
    profile)
        python3 benchmarks/prompt_latency.py --profile --out "$OUT/prompt_latency.json" 2>&1 | grep -v Warning | tail -8 ;;
    serve)
        budget=${2:-}
        python3 benchmarks/serve.py --model qwen3-0.6b --out "$OUT/serve_qwen3${budget:+_$budget}.json" \
            ${budget:+--server-arg=--max-num-batched-tokens=$budget} 2>&1 | tail -25 ;;
esac
