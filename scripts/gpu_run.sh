#!/usr/bin/env bash
# Runs on the lent H200 (device tool): GPU tests, then the engine benchmark on a random 8b
# checkpoint, then the official generator on the same GPU. Logs and JSON go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# steerling declares Python >= 3.13; its code runs on the image's 3.12.
python3 -m pip install -q --no-index --no-deps --no-compile --ignore-requires-python --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 CDE_HOME=/tmp/cde
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
STAGE=${1:-all}
if [[ $STAGE == all || $STAGE == tests ]]; then
  python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
fi
if [[ $STAGE == all || $STAGE == bench ]]; then
  python3 -m cde bench engine --preset 8b --concurrency "${CONC:-1,4,16,32}" --prompt-len 64 --max-tokens 256 \
    --attribution --json "$OUT/bench_8b.json" ${PROFILE:+--profile "$OUT/profile.txt"} 2>&1 | tee "$OUT/bench_8b.log"
fi
if [[ $STAGE == all || $STAGE == compare ]]; then
  # Steering cost at 16 concurrent (half the requests steer), then the official generator.
  python3 -m cde make-model --preset 8b --dtype bfloat16 --device cuda /tmp/m8b > /dev/null
  python3 -m cde bench engine --model /tmp/m8b --concurrency 16 --max-tokens 256 --attribution --steering \
    --json "$OUT/bench_16_steer.json" 2>&1 | tail -3 | tee "$OUT/bench_16_steer.log"
  python3 -m cde bench engine --model /tmp/m8b --concurrency 16 --max-tokens 256 --compare-attribution \
    --json "$OUT/bench_16_attr.json" 2>&1 | tail -3 | tee "$OUT/bench_16_attr.log"
  python3 scripts/bench_official.py /tmp/m8b --batch 1,4 --json "$OUT/official.json" 2>&1 | tail -3 | tee "$OUT/official.log"
fi
