#!/usr/bin/env bash
# One lent GPU session (docs/benchmarks-gpu.md, "A GPU session"): where a step's time goes (a
# torch.profiler trace of the default recipe and of the plain loop, and a checkpoint's stall),
# the GPU tests, each file in its own process with tracebacks, side by side, then
# `make bench-gpu`, every log under $OUT as it goes.
#   bash bench/gpu_session.sh [trace|tests|bench|parts|all]  (from the repository root; default all)
# The GPU machine has torch, torchvision, lightning and torchmetrics but no Hydra and no network:
# Hydra's three wheels travel in WHEELS (default .whl/, git-ignored) and go into .bench-site/;
# the data in DATA (default data/cifar10-subset, git-ignored). Settings, all optional:
# OUT (logs/gpu_session), TEST_TIMEOUT (s per test file, 150), BUDGET (bench-gpu's, 540),
# AIRBENCH (a copy of airbench94.py, run beside experiment=speedrun_gpu), SECTIONS (bench.gpu's
# --sections, default all but tests), TRACE_MODES (the trace's precisions,
# 32-true,bf16-mixed,16-mixed), TRACE_TIMEOUT (s, 240).
set -u
OUT=${OUT:-logs/gpu_session} WHEELS=${WHEELS:-.whl} DATA=${DATA:-data/cifar10-subset}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
$PY -m pip install -q --upgrade --no-index --no-deps --target .bench-site "$WHEELS"/*.whl || exit 2
export PYTHONPATH=src:.:.bench-site${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1

if [ "${1:-all}" = trace ] || [ "${1:-all}" = all ]; then
  # 20 ordinary steps of each loop in each mode (bench/trace.py): $OUT/trace/trace.{json,md} and
  # the Chrome traces, rewritten after each loop; about 20 s a loop and mode.
  timeout -k 10 "${TRACE_TIMEOUT:-240}" $PY -m bench.trace --device cuda --data-dir "$DATA" \
    --precision "${TRACE_MODES:-32-true,bf16-mixed,16-mixed}" --out "$OUT/trace" \
    2>&1 | tee "$OUT/trace.log"
  # How long a checkpoint holds up the training thread, on and off it (ResNet-18): ~10 s.
  timeout -k 10 120 $PY -m bench.checkpoint_stall --device cuda >"$OUT/checkpoint_stall.json" \
    2>"$OUT/checkpoint_stall.log"
fi

if [ "${1:-all}" = tests ] || [ "${1:-all}" = all ]; then
  # One process per file, all at once (-n 0: no xdist workers inside): a hang or a crash in one
  # cannot hide the others' results, and a lent GPU's minutes are few. They share the GPU
  # safely: none of them times anything, and each reads only its own process's memory peaks.
  start=$SECONDS
  for f in $(grep -rl --include='*.py' "mark.gpu" tests bench/tests | sort); do
    log="$OUT/pytest_$(basename "$f" .py).log"
    ( timeout -k 10 "${TEST_TIMEOUT:-150}" $PY -m pytest -m gpu -n 0 -rfE --tb=short -q \
        -p no:cacheprovider "$f" >"$log" 2>&1
      echo "$f: exit $?, $((SECONDS - start)) s: $(tail -n 1 "$log")" >>"$OUT/pytest_gpu.txt" ) &
  done
  wait
  cat "$OUT/pytest_gpu.txt"
fi

if [ "${1:-all}" = bench ] || [ "${1:-all}" = all ]; then
  # bench.gpu writes bench_gpu.{json,md} after each section; `timeout` is only a backstop.
  BUDGET=${BUDGET:-540}
  timeout -k 10 $((BUDGET + 60)) $PY -m bench.gpu --data-dir "$DATA" --budget "$BUDGET" \
    --tests none --out "$OUT/bench" --doc "$OUT/benchmarks-gpu.md" ${SECTIONS:+--sections "$SECTIONS"} \
    ${AIRBENCH:+--airbench "$AIRBENCH"} 2>&1 | tee "$OUT/bench_gpu.log"
fi

if [ "${1:-all}" = parts ]; then
  # What each part of the default recipe costs a ResNet-18 step (bench/step_parts.py): ~2 min.
  timeout -k 10 "${PARTS_TIMEOUT:-300}" $PY -m bench.step_parts --data-dir "$DATA" \
    --out "$OUT/step_parts.json" 2>&1 | tee "$OUT/step_parts.log"
fi
