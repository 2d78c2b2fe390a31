#!/usr/bin/env bash
# Starling's check on a GPU machine that has torch with CUDA but no network and no install of
# Starling: run from the repository root, with the wheels it lacks in .whl/ beside the code.
#
#     OUT=/some/dir bash benchmarks/gpu_check.sh [extra arguments for benchmarks/gpu.py]
#
# 1. installs .whl/*.whl (pyzmq, cryptography, ...) into /tmp/site, without dependencies;
# 2. makes `starling` importable without `pip install -e`: .gpusite/starling/<room> links to
#    each code folder, as pyproject.toml's package-dir maps them (starling is a namespace
#    package, so no __init__.py);
# 3. runs benchmarks/gpu.py (at most GPU_BENCH_TIMEOUT_S seconds) into $OUT/gpu.jsonl;
# 4. runs the tests that take another path where CUDA is present (at most GPU_TESTS_TIMEOUT_S
#    seconds; GPU_TESTS_TIMEOUT_S=0 skips them), into $OUT/tests.log.
# Every step runs even if the one before failed; $OUT/status.txt has each step's exit status.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/starling-gpu-check}
SITE=${GPU_CHECK_SITE:-/tmp/site}
mkdir -p "$OUT"
: > "$OUT/status.txt"
status() { echo "$1 $2" | tee -a "$OUT/status.txt"; }

# 1. the wheels this machine lacks
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        2>&1 | tee "$OUT/pip.log"
    status wheels "${PIPESTATUS[0]}"
else
    status wheels "none in .whl/"
fi
export PYTHONPATH="$SITE:$PWD/.gpusite${PYTHONPATH:+:$PYTHONPATH}"

# 2. `starling.<room>` -> ./<room>
mkdir -p .gpusite/starling
for room in cli runtime protocols collectives node compressors tasks data common; do
    ln -sfn "../../$room" ".gpusite/starling/$room"
done
{
    nvidia-smi -L 2>&1
    python3 - <<'EOF'
import platform, torch, zmq, cryptography, msgpack, numpy
import starling.cli.main, starling.runtime, starling.protocols, starling.compressors
print(f"python {platform.python_version()}  torch {torch.__version__} (cuda {torch.version.cuda}, "
      f"available {torch.cuda.is_available()})  pyzmq {zmq.__version__}  cryptography {cryptography.__version__}  "
      f"numpy {numpy.__version__}  starling from {starling.runtime.__file__}")
EOF
} 2>&1 | tee "$OUT/env.log"
status imports "${PIPESTATUS[0]}"

# 3. the device, codecs, staging and simulated swarms on the GPU: one JSON row per measurement
timeout "${GPU_BENCH_TIMEOUT_S:-420}" python3 benchmarks/gpu.py "$@" 2> "$OUT/gpu.stderr" | tee "$OUT/gpu.jsonl"
status bench "${PIPESTATUS[0]}"
# 4. the tests whose path differs where CUDA is present (grep -l cuda tests/)
if [ "${GPU_TESTS_TIMEOUT_S:-120}" != 0 ]; then
    timeout "${GPU_TESTS_TIMEOUT_S:-120}" python3 -m pytest -q -p no:cacheprovider -n 4 \
        tests/compressors/test_compressors_cuda.py tests/collectives/test_staging.py tests/runtime/test_placement.py \
        tests/common/test_common_devices.py tests/cli/test_simulate.py tests/data/test_prefetch.py \
        tests/tasks/test_tasks_cuda.py tests/runtime/test_shard_sync_cuda.py 2>&1 | tee "$OUT/tests.log"
    status tests "${PIPESTATUS[0]}"
else
    status tests skipped
fi

tail -c 3000 "$OUT/gpu.stderr"
cat "$OUT/status.txt"
