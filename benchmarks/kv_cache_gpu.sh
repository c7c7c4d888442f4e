#!/usr/bin/env bash
# The GPU run of issue 37 (the FP8 KV cache), in parts that each fit one device command (< 10 min):
#   bash benchmarks/kv_cache_gpu.sh kernels   # the fp8 cache's kernel tests (stores, Triton reads, the Gluon decode)
#   bash benchmarks/kv_cache_gpu.sh targets   # kv_cache.py: both models, bf16 and fp8 KV (per-token scales), the
#                                             # 32k step; then fp8 again with the Triton decode (NANOSERVE_GLUON_DECODE=0)
#   bash benchmarks/kv_cache_gpu.sh tests     # pytest -m gpu, the whole suite (4 workers), the memory-hungry window
#                                             # test alone after it
# JSON and logs go under $OUT. Wheels the image lacks are carried in .whl/ (benchmarks/serve_gpu_wheels.txt).
source benchmarks/gpu_env.sh
quiet() { grep -v -e Warning -e INFO; }
case ${1:-kernels} in
    kernels)
        python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_attention_sm90.py tests/kernels/test_kv_fp8.py \
            tests/kernels/test_attention_tail.py tests/kernels/test_rotary_kv.py 2>&1 | tail -25 | tee "$OUT/gpu_tests_kv.log"
        ;;
    targets)
        python3 benchmarks/kv_cache.py --kv auto fp8 --out "$OUT" 2>&1 | quiet | tail -40
        mkdir -p "$OUT/triton" && NANOSERVE_GLUON_DECODE=0 python3 benchmarks/kv_cache.py --kv fp8 --out "$OUT/triton" \
            2>&1 | quiet | tail -20
        ;;
    tests)
        python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests --tb=short \
            --deselect tests/kernels/test_attention_window.py::test_gpu_prefill_window_real_shapes \
            > "$OUT/gpu_tests_full.log" 2>&1  # the whole output: failures' tracebacks
        tail -15 "$OUT/gpu_tests_full.log" | tee "$OUT/gpu_tests.log"
        python3 -m pytest -q -p no:cacheprovider -m gpu \
            tests/kernels/test_attention_window.py::test_gpu_prefill_window_real_shapes 2>&1 | tail -3 \
            | tee -a "$OUT/gpu_tests.log"
        ;;
esac
