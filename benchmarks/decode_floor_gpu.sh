#!/usr/bin/env bash
# The GPU run of issue 20 (decode at the HBM floor), in parts that each fit one device command (< 10 min):
#   bash benchmarks/decode_floor_gpu.sh final      # the three shapes at b = 1…256 (every timing), the switch sets
#   bash benchmarks/decode_floor_gpu.sh attention  # decode attention alone: b = 1…32, 1k-4k contexts, split rules
#   bash benchmarks/decode_floor_gpu.sh gemv       # Qwen3-0.6B and SmolLM2-135M: GEMV variants in the model
#   bash benchmarks/decode_floor_gpu.sh fp8_sweep llama-3.1-8b  # fp8 tests; fp8 GEMV variants and prefill products
#   bash benchmarks/decode_floor_gpu.sh fp8_final  # bf16 vs fp8 steps and prefill, one run (issue 21's ratios);
#       env MODELS, BLOCKS=1 (also 128x128-block scales), LMHEAD=1 (also the lm_head in fp8)
#   bash benchmarks/decode_floor_gpu.sh products   # each decode product alone: bf16 vs fp8 candidates, rows 1-64
#   LANES="off 2x16x4" bash benchmarks/decode_floor_gpu.sh fp8_lanes  # fp8 decode: CUDA-core tiles vs tensor cores
#   bash benchmarks/decode_floor_gpu.sh fp8_tiles  # the tensor-core fp8 decode's tiles, read with the tail
#   bash benchmarks/decode_floor_gpu.sh tests      # pytest -m gpu, the whole suite
# JSON and logs go under $OUT. Wheels the image lacks are carried in .whl/ (benchmarks/serve_gpu_wheels.txt).
source benchmarks/gpu_env.sh
SETS=${SETS:-all no_prefetch no_fuse_norm no_pdl}
floor() {  # $1: name, then decode_floor.py arguments
    local name=$1; shift
    python3 benchmarks/decode_floor.py "$@" --json "$OUT/decode_floor_$name.json" 2>&1 | grep -v -e Warning -e INFO \
        | tee "$OUT/decode_floor_$name.log" | grep -e "==" -e "^[a-z]" | tail -60
}
case ${1:-final} in
    final) floor final model --switch-sets $SETS ;;
    attention) floor attention attention --waves 4 8 16 --stages 1 3 ;;
    gemv)
        floor gemv_qwen3 model --models qwen3-0.6b --batch-sizes 1 8 32 --gemv-rows 1 8 --switch-sets all
        floor gemv_smollm2 model --models smollm2-135m --batch-sizes 1 8 32 --gemv-rows 1 --switch-sets all ;;
    fp8_sweep)  # $2: the model; its fp8 GEMV variants in the model (FP8_GEMV_TABLE), prefill products (PREFILL_TABLE)
        [ -z "${NO_TESTS:-}" ] && python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 --tb=short tests/kernels/test_fp8.py \
            tests/model/test_quantization.py tests/model/test_fp8_checkpoints.py 2>&1 | tee "$OUT/gpu_tests_fp8.log" | tail -4
        floor "fp8_sweep_$2" model --models "$2" --quantization fp8 --batch-sizes 1 8 32 64 --gemv-rows ${ROWS:-1 8 32 64} \
            --switch-sets ${PREFILL---prefill} ;;
    fp8_final)  # bf16 and fp8 (per channel, then 128x128 blocks) in one run: the ratios
        for m in ${MODELS:-llama-3.1-8b qwen3-0.6b}; do
            floor "bf16_$m" model --models "$m" --batch-sizes 1 8 32 64 --switch-sets --prefill
            floor "fp8_$m" model --models "$m" --batch-sizes 1 8 32 64 --switch-sets --prefill --quantization fp8
            [ -n "${BLOCKS:-}" ] && floor "fp8_blocks_$m" model --models "$m" --batch-sizes 1 8 32 64 --switch-sets \
                --quantization fp8 --fp8-block
            [ -n "${LMHEAD:-}" ] && floor "fp8_lm_head_$m" model --models "$m" --batch-sizes 1 8 32 64 --switch-sets \
                --quantization fp8 --quantize-lm-head
        done ;;
    products)
        floor products_llama products --models llama-3.1-8b --gemv-rows 1 8 32 64
        floor products_qwen3 products --models qwen3-0.6b --gemv-rows 1 8 ;;
    fp8_lanes)  # an fp8 cache's decode kernels, read with and without the exact tail (the engine always has it): the
        # CUDA-core one's tiles (LANES, forced for every group) against the tensor-core one ('off'), bf16 beside
        python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/kernels/test_kv_fp8.py \
            tests/kernels/test_attention_tail.py 2>&1 | tee "$OUT/gpu_tests_fp8_decode.log" | tail -3
        floor fp8_lanes_bf16 attention --attention-shapes qwen3-0.6b llama-3.1-8b --attention-rows 1 64 256 \
            --attention-contexts 512 --waves 3 --stages 3 --kv-formats bf16
        floor fp8_lanes attention --attention-shapes qwen3-0.6b --attention-rows 1 64 128 256 \
            --attention-contexts 512 --waves 3 --stages 1 --kv-formats fp8-token --lanes ${LANES:-off 2x16x4 4x16x4} \
            --tail 0 1
        floor fp8_lanes_4k attention --attention-shapes qwen3-0.6b --attention-rows 8 32 --attention-contexts 4096 \
            --waves 3 --stages 1 --kv-formats fp8-token --lanes ${LANES:-off 2x16x4 4x16x4} --tail 1 ;;
    fp8_tiles)  # the tensor-core fp8 decode kernel's tiles re-swept with the exact tail (as the engine reads): with it
        # the kernel compiles to other register counts (ptxas, Triton 3.6: 64-key tiles 96 registers at 4 warps, 80 at 8;
        # 128-key tiles 128 / 99), so round 8's no-tail ranking may not hold
        floor fp8_tiles attention --attention-shapes qwen3-0.6b llama-3.1-8b --attention-rows 1 64 256 \
            --attention-contexts 512 --waves 3 --stages 1 2 --warps 4 8 --block-n 64 128 --kv-formats fp8-token \
            --lanes off --tail 1
        floor fp8_tiles_32k attention --attention-shapes llama-3.1-8b --attention-rows 16 --attention-contexts 32768 \
            --max-model-len 32768 --waves 3 --stages 1 --warps 4 8 --block-n 64 128 --kv-formats fp8-token \
            --lanes off --tail 1 ;;
    tests)
        python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 --tb=short tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    *) echo "usage: $0 final|attention|gemv|fp8_sweep MODEL|fp8_final|products|fp8_lanes|fp8_tiles|tests"; exit 2 ;;
esac
