# Sourced by the benchmarks' *_gpu.sh scripts on the device: the wheels the image lacks (carried in .whl/, listed in
# benchmarks/serve_gpu_wheels.txt) into /tmp/site, the repo on PYTHONPATH, the GPU's name into $OUT/gpu.txt.
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        > "$OUT/pip.log" 2>&1 || { echo "wheel install failed"; tail -3 "$OUT/pip.log"; }
fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt"
