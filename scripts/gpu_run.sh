#!/usr/bin/env bash
# Runs on the lent H200 (device tool): GPU tests, the engine benchmarks on a random 8b checkpoint,
# FlashBlock tables, then the official generator on the same GPU. Logs and JSON go to $OUT.
# Usage: scripts/gpu_run.sh STAGE...   (tests kernels bench fb long compare official; default: all of
# them; also `startup`: 8b load and time to ready, cold then with warm compile caches; `train` and
# `eval`: the reference model of issue 15, see docs/reference-model.md; `http`: engine vs HTTP, issue 19;
# `inputattr`: input attribution per block and its cost to 16 other requests, issue 17; `structured`: constrained vs
# plain, issue 26; `prefix`: the prefix cache off vs on, issue 30; `swiglu`: c_fc with silu * up fused into a
# Triton GEMM vs cuBLAS + pointwise, issue 29; `normquant`: the fp8 pre-norm and quantization as looped or persistent
# reductions, issue 29; `gemmsweep`: the split-K GEMM's configs at one request, graph-timed (SWEEP_ARGS: --timeline, each CTA's start and end instead; --grid tma|clusters; --prefetch 2, launched as the engine's FP8 calls), issue 29; `siluquant`: the fp8 silu * up quantization kernel's variants, issue 29; `summary`: issue 29's figures of the stages
# run before it in the same call, in one table: `bench long http summary`)
# Env: CONC (bench levels), STEER=1 (bench runs every level again with half of the requests
# steering), ASYNC_AB=1 (bench runs every level planned after the picks, then ahead of them), PROFILE=1 (bench also writes per-level op tables), QUANT=fp8 (bench with --quantization fp8),
# WATCH=S (bench reports the engine's progress every S seconds, with every thread's stack when no pass ran
# for S seconds, and the GPU's load to gpu_load_*.csv), INDUCTOR="KEY=VALUE ..." (bench with those torch._inductor.config values, e.g. INDUCTOR=combo_kernels=True),
# BASE_TREE=abbase (bench runs the same levels first in that tree, made by `scripts/base_tree.sh COMMIT`, to
# $OUT/base: two commits side by side in one call), FB_PROMPTS, LONG_PROMPTS, LONG_CONC,
# LONG_REUSE (`long`'s contexts, concurrency levels and max_reuse values), GPU_TESTS (`tests`: a pytest -k filter).
# CACHE_OUT=1: this call's compile caches to $OUT for the next call to carry in .gpu-cache/ (scripts/gpu_compile_cache.sh).
# FP8_KERNELS="pdl_chain per_shape attn_proj stack" (`fp8kernels`: only those sections of scripts/bench_fp8_kernels.py).
# EVAL_QUANT=fp8: `eval`'s API rows (API=1) served with --quantization fp8. EVAL_PROBLEMS (`train`: held-out
# problems per family at each of its evaluations, 0: none). BASELINE=archive (`eval`: also the steering and
# attribution sections of that model, e.g. cde/demo/reference.tar.xz, to eval_base.md/json).
# Issue 16: `fp8` (bfloat16 beside --quantization fp8), `fp8paths` (fp8 at one request on FP8 GEMMs, then
# weight-only), `tps` (tokens per step 1,2,4; TPS_QUANT=fp8 for the fp8 engine), `fp8dev` (the GPU tests of
# the bf16 and fp8 8b logits: the deviation report, and 0 recompiles). The 128k batch-8 FlashBlock rows:
# LONG_CONC=8 LONG_PROMPTS=130944 scripts/gpu_run.sh long (LONG_REUSE=16 etc. runs one max_reuse at a time, with
# its exact run, if all three do not fit in one call; every finished row is printed as JSON as it completes).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# steerling declares Python >= 3.13; its code runs on the image's 3.12.
rm -rf /tmp/site  # a warm machine keeps the last call's: a wheel taken out of .whl/ must not linger
python3 -m pip install -q --no-index --no-deps --no-compile --ignore-requires-python --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 CDE_HOME=/tmp/cde CDE_8B_DIR=/tmp/m8b
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
scripts/gpu_compile_cache.sh unpack "$CDE_HOME" "$CARD"  # an earlier call's, when carried
STAGES=${*:-tests kernels bench fb long compare official}
case " $STAGES " in  # the random 8b checkpoint, for the stages that use it
  *" tests "*|*" bench "*|*" fb "*|*" compare "*|*" startup "*|*" official "*|*" fp8 "*|*" fp8paths "*|*" tps "*|*" fp8dev "*|*" http "*|*" inputattr "*|*" structured "*|*" prefix "*)
    [[ -f /tmp/m8b/config.json ]] || python3 -m cde make-model --preset 8b --dtype bfloat16 --device cuda /tmp/m8b > /dev/null ;;
esac
for STAGE in $STAGES; do
  echo "== $STAGE $(date +%T)"
  case $STAGE in
  tests)
    python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_gpu.py ${GPU_TESTS:+-k "$GPU_TESTS"} 2>&1 \
      | tee "$OUT/gpu_tests.log" ;;
  kernels)  # one layer's attention: kernel options and split-KV ways, batch x pages
    python3 scripts/flex_kernel_options.py ${KERNEL_CASES:-} 2>&1 | tee "$OUT/kernels.log" ;;
  bench)
    Q=${QUANT:-none}
    if [[ -n ${BASE_TREE:-} ]]; then  # the same bench on an older tree first, for a side-by-side ratio
      cp -r .whl "$BASE_TREE/" && (cd "$BASE_TREE" && BASE_TREE= CACHE_OUT= OUT="$OUT/base" scripts/gpu_run.sh bench)
    fi
    if [[ -n ${WATCH:-} ]]; then  # the GPU's load beside the watch's reports: a stall on the GPU or the host
      nvidia-smi --query-gpu=timestamp,utilization.gpu,power.draw --format=csv,noheader -lms $((WATCH * 1000)) \
        > "$OUT/gpu_load_$Q.csv" & LOAD_PID=$!
    fi
    python3 -m cde bench engine --model /tmp/m8b --quantization "$Q" --concurrency "${CONC:-1,4,16,32}" --prompt-len 64 \
      --max-tokens 256 --attribution --json "$OUT/bench_8b_$Q.json" ${STEER:+--steering} ${PROFILE:+--profile "$OUT/profile_$Q"} \
      ${ASYNC_AB:+--compare-async-scheduling} \
      ${WATCH:+--watch "$WATCH"} $(for kv in ${INDUCTOR:-}; do printf -- "--inductor %s " "$kv"; done) \
      2>&1 | tee "$OUT/bench_8b_$Q.log"
    [[ -n ${WATCH:-} ]] && kill "$LOAD_PID"
    # issue 29: every level beside the H200's weight-read and tensor-core limits
    python3 -m cde bench roofline "$OUT/bench_8b_$Q.json" 2>&1 | tee "$OUT/roofline_$Q.md" ;;
  fb)  # FlashBlock on the 8b shape: contexts 1k/2k/4k, 16 concurrent
    python3 -m cde bench engine --model /tmp/m8b --concurrency 16 --prompt-len ${FB_PROMPTS:-896,1920,3968} --max-tokens 128 \
      --flashblock-tau 2 --flashblock-max-reuse 4,16,63 --json "$OUT/fb_8b.json" 2>&1 | tee "$OUT/fb_8b.log" ;;
  long)  # FlashBlock on a long-context config (the 8b shape with 4 layers and a 128k context)
    python3 -m cde bench engine --preset 8b --set n_layers=4 --set block_size=131072 --concurrency "${LONG_CONC:-1,8}" \
      --prompt-len ${LONG_PROMPTS:-16256,65408,130944} --max-tokens 128 --flashblock-tau 2 \
      --flashblock-max-reuse "${LONG_REUSE:-4,16,63}" \
      --json "$OUT/fb_long.json" 2>&1 | tee "$OUT/fb_long.log" ;;
  summary)  # issue 29: every figure this call's stages wrote (bench, long, http) in one table with its limits and bars
    python3 -m cde bench roofline $(ls "$OUT"/bench_8b_*.json "$OUT"/fb_long.json "$OUT"/http/http_vs_engine.json \
      2>/dev/null) 2>&1 | tee "$OUT/summary.md" ;;
  compare)  # steering cost at 16 concurrent (half the requests steer), attribution cost
    python3 -m cde bench engine --model /tmp/m8b --concurrency 16 --max-tokens 256 --attribution --steering \
      --json "$OUT/bench_16_steer.json" 2>&1 | tail -3 | tee "$OUT/bench_16_steer.log"
    python3 -m cde bench engine --model /tmp/m8b --concurrency 16 --max-tokens 256 --compare-attribution \
      --json "$OUT/bench_16_attr.json" 2>&1 | tail -3 | tee "$OUT/bench_16_attr.log"
      ;;
  startup)  # `cde serve` of the 8b: weights loaded (page cache warm), then ready; cold compile caches, then a restart
    rm -rf /tmp/cde-startup
    for RUN in cold warm; do
      CDE_HOME=/tmp/cde-startup python3 -m cde serve --model /tmp/m8b --port 0 > "$OUT/startup_$RUN.log" 2>&1 &
      PID=$!
      until grep -q "CDE serving" "$OUT/startup_$RUN.log" || ! kill -0 $PID 2>/dev/null; do sleep 1; done
      URL=$(grep -o "at http://[^ ]*/v1" "$OUT/startup_$RUN.log" | cut -c4-)
      python3 -c "import httpx, sys; r = httpx.post(sys.argv[1] + '/completions', timeout=120, json={'model': 'm8b', 'prompt': 'Hello', 'max_tokens': 64}); print(r.status_code, r.json().get('usage'))" "$URL"
      kill -TERM $PID; wait $PID
      echo "$RUN: $(grep -o 'weights loaded in [^"]*' "$OUT/startup_$RUN.log") | $(grep -o 'CDE serving.*' "$OUT/startup_$RUN.log")"
      echo "$RUN: GEMM configs timed for $(grep -c ' candidates[;)]' "$OUT/startup_$RUN.log") shapes, kept from CDE_HOME for $(grep -c 'kept in' "$OUT/startup_$RUN.log")"
    done 2>&1 | tee "$OUT/startup.txt" ;;
  train)  # the reference model. Run it twice: the second call resumes (state.pt while this machine is
    # warm, else the weights.pt of call 1 carried back as .train/weights.pt). TRAIN_MINUTES of training
    # in all (compiling and evaluating not counted); each call stops after STOP_AFTER wall minutes of
    # its loop, leaving time to evaluate and export inside a 10-minute call.
    RUN=${RUN:-/tmp/cde-run}
    START=()
    if [[ -f $RUN/state.pt ]]; then START=(--resume); elif [[ -f .train/weights.pt ]]; then START=(--init-weights .train/weights.pt); fi
    python3 -m cde.train --out "$RUN" --minutes "${TRAIN_MINUTES:-11}" --stop-after "${STOP_AFTER:-7}" --seed "${SEED:-0}" \
      --rows "${ROWS:-256}" --workers "${WORKERS:-12}" --eval-problems "${EVAL_PROBLEMS:-32}" --device cuda --compile \
      "${START[@]}" 2>&1 | tee "$OUT/train.log"
    cp "$RUN/log.jsonl" "$RUN/weights.pt" "$RUN/model.tar.xz" "$OUT/" ;;
  eval)  # cde eval on the trained model (this machine's last run, else .train/model.tar.xz carried back)
    MODEL=${MODEL:-/tmp/cde-run/model}
    # ARCHIVE=cde/demo/reference.tar.xz: the shipped model; API_ONLY=1: only the HTTP rows (with API=1)
    [[ -f $MODEL/config.json ]] || MODEL=$(python3 -c "from cde.train.export import install; print(install('${ARCHIVE:-.train/model.tar.xz}', '/tmp/cde', 'reference'))")
    # EVAL_ARGS: more `cde eval` options, e.g. "--sections steering --strengths 0,24,28,32"
    [[ -n ${API_ONLY:-} ]] || python3 -m cde eval --model "$MODEL" --device cuda --cuda-graphs --limit "${LIMIT:-100}" \
      ${EVAL_ARGS:-} --json "$OUT/eval.json" 2>&1 | tee "$OUT/eval.md"
    if [[ -n ${BASELINE:-} ]]; then
      BASE=$(python3 -c "from cde.train.export import install; print(install('$BASELINE', '/tmp/cde-base', 'reference'))")
      python3 -m cde eval --model "$BASE" --device cuda --cuda-graphs --limit "${LIMIT:-100}" --sections steering,attribution \
        --json "$OUT/eval_base.json" 2>&1 | tee "$OUT/eval_base.md"
    fi
    if [[ -n ${API:-} ]]; then  # the same rows through the real HTTP API
      python3 -m cde serve --model "$MODEL" --device cuda --max-running 64 --port 0 ${EVAL_QUANT:+--quantization "$EVAL_QUANT"} \
        > "$OUT/serve.log" 2>&1 &
      PID=$!
      until grep -q "CDE serving" "$OUT/serve.log" || ! kill -0 $PID 2>/dev/null; do sleep 1; done
      URL=$(grep -o "at http://[^ ]*/v1" "$OUT/serve.log" | cut -c4- | sed 's|/v1$||')
      python3 -m cde eval --url "$URL" --limit "${LIMIT:-100}" --sections tasks --json "$OUT/eval_api.json" 2>&1 | tee "$OUT/eval_api.md"
      kill -TERM $PID; wait $PID
    fi ;;
  structured)  # issue 26: structured output's cost in one engine per level: plain, every request constrained to a
    # JSON schema, half of them (do the plain half lose anything?); 64-token prompts, 256 new tokens (~3 min)
    python3 -m cde bench engine --model /tmp/m8b --concurrency "${CONC:-1,32}" --prompt-len 64 --max-tokens 256 \
      --constrained --json "$OUT/structured.json" 2>&1 | tee "$OUT/structured.log" ;;
  http)  # issue 19's table: `cde bench engine` vs `cde serve` + `cde bench serve`, attribution off/on, 1 and 32
    # requests, 64-token prompts, 256 new tokens; the first request after startup. ~5 min on an H200.
    python3 scripts/http_vs_engine.py --model /tmp/m8b --device cuda --concurrency 1,32 --prompt-len 64 \
      --max-tokens 256 --out "$OUT/http" 2>&1 | tee "$OUT/http.log" ;;
  fp8)  # issue 16: bfloat16, then --quantization fp8, 64-token prompts, 256 new tokens, attribution on (~6 min)
    for Q in none fp8; do
      python3 -m cde bench engine --model /tmp/m8b --quantization $Q --concurrency "${FP8_CONC:-1,32}" --prompt-len 64 \
        --max-tokens 256 --attribution --json "$OUT/bench_8b_$Q.json" 2>&1 | tee "$OUT/bench_8b_$Q.log" \
        || echo "!! fp8 stage: the $Q bench failed (exit ${PIPESTATUS[0]}), going on"
    done
    grep -h -A3 "^conc |" "$OUT/bench_8b_none.log" "$OUT/bench_8b_fp8.log" 2>/dev/null | tee "$OUT/fp8_tables.txt" ;;
  normquant)  # issue 29: fp8 pre-norm and per-token quantization, Inductor's looped reductions vs persistent rows (~2 min)
    python3 scripts/norm_quant_experiment.py 2>&1 | tee "$OUT/normquant.log" ;;
  siluquant)  # issue 29: the fp8 MLP's silu(gate) * up quantization, one row per program vs looped rows, persistent or not (~1 min)
    python3 scripts/silu_quant_experiment.py 2>&1 | tee "$OUT/siluquant.log" ;;
  fp8paths)  # fp8 at one request: FP8 GEMMs (activations quantized per token) vs weight-only (bf16 rows, ~4 min)
    for ROWS in 0 64; do
      python3 -m cde bench engine --model /tmp/m8b --quantization fp8 --fp8-weight-only-rows $ROWS --concurrency 1 \
        --prompt-len 64 --max-tokens 256 --attribution --json "$OUT/bench_8b_fp8_rows$ROWS.json" \
        ${PROFILE:+--profile "$OUT/profile_fp8_rows$ROWS"} 2>&1 | tee "$OUT/bench_8b_fp8_rows$ROWS.log" \
        || echo "!! fp8paths stage: rows $ROWS failed (exit ${PIPESTATUS[0]})"
    done
    grep -h -A2 "^conc |" "$OUT"/bench_8b_fp8_rows*.log | tee "$OUT/fp8paths.txt" ;;
  tps)  # issue 16: the mechanical throughput of multi-token steps, one engine (~4 min)
    python3 -m cde bench engine --model /tmp/m8b --quantization "${TPS_QUANT:-none}" --concurrency 1,32 \
      --tokens-per-step 1,2,4 --prompt-len 64 --max-tokens 256 --attribution --json "$OUT/bench_8b_tps.json" 2>&1 \
      | tee "$OUT/bench_8b_tps.log" || echo "!! tps stage failed (exit ${PIPESTATUS[0]})" ;;
  fp8dev)  # issue 16: bf16 vs fp32 vs official, fp8 vs bf16 (relative error, mean KL, greedy agreement), 0 recompiles
    python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_gpu.py -k "8b_logits or fp8 or kernel" 2>&1 \
      | tee "$OUT/fp8_dev.log"
    grep -E "8b (bf16|fp8)|logits|passed|failed" "$OUT/fp8_dev.log" | tee "$OUT/fp8_dev_summary.txt" ;;
  inputattr)  # issue 17: seconds of input attribution per 64-token block (steps 1 and 32), and the decode
    # throughput of 16 other requests while one request's input attribution runs (~5 min)
    python3 scripts/bench_input_attribution.py --model /tmp/m8b --steps "${IA_STEPS:-1,32}" --others 16 \
      --max-tokens 256 --json "$OUT/input_attribution.json" 2>&1 | tee "$OUT/input_attribution.log" ;;
  prefix)  # issue 30: 32 requests sharing a 3,840-token prefix (64-token tails, 256 new tokens) and a second turn
    # resending a 3,008-token history, prefix cache off then on, one engine (~3 min). 3,840 + 64 + 256 tokens pass
    # the 8b's 4,096-token context: the random 8b with an 8,192-token one (same weights' shapes and cost per token)
    [[ -f /tmp/m8b8k/config.json ]] || python3 -m cde make-model --preset 8b --dtype bfloat16 --device cuda \
      --set block_size=8192 /tmp/m8b8k > /dev/null
    python3 -m cde bench prefix-cache --model /tmp/m8b8k --json "$OUT/prefix_cache.json" 2>&1 | tee "$OUT/prefix_cache.log" ;;
  fp8kernels)  # issues 16, 29: the split-K Triton GEMM (bf16, fp8), activation quantization, confidence vs before (~3 min)
    python3 scripts/bench_fp8_kernels.py ${FP8_KERNELS:+--only $FP8_KERNELS} 2>&1 | tee "$OUT/fp8_kernels.log" ;;
  gemmsweep)  # issue 29: every split-K GEMM config at one request, graph-timed, beside the autotuner's pick
    python3 scripts/sweep_stream_gemm.py ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/gemm_sweep.log" ;;
  swiglu)  # issue 29: c_fc with silu(gate) * up fused into a Triton GEMM's epilogue vs cuBLAS + pointwise
    python3 scripts/swiglu_gemm_experiment.py 2>&1 | tee "$OUT/swiglu.log" ;;
  official)  # the official generator on the same GPU and checkpoint
    python3 scripts/bench_official.py /tmp/m8b --batch 1,4 --json "$OUT/official.json" 2>&1 | tail -3 | tee "$OUT/official.log" ;;
  esac
done
# The device tool brings back at most 8 files: more (profiles, many stages) travel as one archive,
# with the summary table beside it (and the compile caches, CACHE_OUT=1, beside both).
mkdir -p /tmp/gpu_cache_out && rm -f /tmp/gpu_cache_out/*
[[ -n ${CACHE_OUT:-} ]] && scripts/gpu_compile_cache.sh pack "$CDE_HOME" "$CARD" /tmp/gpu_cache_out
if (( $(find "$OUT" -type f | wc -l) + $(find /tmp/gpu_cache_out -type f | wc -l) > 8 )); then
  tar czf /tmp/gpu_run.tgz -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.md -delete
  mv /tmp/gpu_run.tgz "$OUT/all.tgz"
fi
mv /tmp/gpu_cache_out/* "$OUT/" 2>/dev/null || true
