#!/usr/bin/env bash
# One prepared check for a CUDA machine (written for one H200 over PCIe, a 15-minute session,
# a bare image whose python3 has torch, pytest, numpy and tqdm but maybe not our other deps,
# and no network). Finishes in ~8 minutes; every step has its own time limit and the script
# goes on when one fails or is skipped. Writes its log and results under $OUT when set.
#
#   bash scripts/gpu_check.sh                 # from the repository root (or anywhere)
#   PYTHON=/path/to/python bash scripts/gpu_check.sh
#   GPU_CHECK_MODEL=gpt2 GPU_CHECK_BATCH=16 GPU_CHECK_SEQ=1024 bash scripts/gpu_check.sh
#
# Steps: 1 environment; 2 the package from the working tree (PYTHONPATH, no install: the
# image's torch is used as it is; the compiled CPU Adam kernel is built in place when cffi
# and a compiler are there, else the torch fallback runs — or carry a prebuilt
# superoffload/kernels/_cpu_adam_cffi.abi3.so); 3 the CUDA tests (files marked `cuda`);
# 4 a throughput comparison: no offload vs ZeRO-Offload-style vs SuperOffload engine, as a
# table; 5 a short `superoffload train` on the GPU.
# Without a GPU it runs the same steps on the CPU with a tiny model (to check the script).

set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$PWD
PY=${PYTHON:-python3}
OUTDIR=${OUT:-${TMPDIR:-/tmp}/superoffload-gpu-check}
mkdir -p "$OUTDIR"
LOG=$OUTDIR/gpu_check.log
exec > >(tee "$LOG") 2>&1
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
START=$(date +%s)
status=0
step() { echo; echo "=== $* ($(( $(date +%s) - START )) s) ==="; }
note_fail() { echo "!!! $1 failed (exit $2)"; status=1; }

step "1. environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null \
  || echo "nvidia-smi: not available"
"$PY" - <<'PYEOF'
import os, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__,
      "| cuda", torch.version.cuda, "| available:", torch.cuda.is_available(),
      "| cpus", os.cpu_count())
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0))
for mod in ("numpy", "tqdm", "cffi", "plotly", "pytest", "hypothesis", "transformers"):
    try:
        __import__(mod)
        print(f"  {mod}: yes")
    except ImportError:
        print(f"  {mod}: MISSING")
PYEOF
CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

step "2. package from the working tree"
BACKEND=$(SUPEROFFLOAD_KERNEL= timeout 60 "$PY" -W ignore -c \
  "import superoffload.kernels as k; print(k.backend())" 2>/dev/null | tail -n 1)
if [ "$BACKEND" != "torch" ]; then
  echo "compiled CPU Adam kernel present (backend: ${BACKEND:-unknown})"
elif [ "${GPU_CHECK_BUILD:-1}" = 1 ] && "$PY" -c "import cffi" 2>/dev/null \
     && command -v cc >/dev/null 2>&1; then
  timeout 150 "$PY" setup.py -q build_ext --inplace >"$OUTDIR/build.log" 2>&1 \
    && echo "compiled CPU Adam kernel built in place" \
    || echo "kernel build failed (see build.log): the torch fallback kernel runs"
else
  echo "cffi or a C compiler missing: the torch fallback kernel runs"
fi
timeout 120 "$PY" -c "
import superoffload as so, superoffload.kernels as k
print('superoffload', so.__version__, '| kernel backend:', k.backend(), '| simd:', k.simd_path())
" || note_fail "import superoffload" $?

step "3. CUDA tests"
mapfile -t CUDA_TESTS < <(grep -l -E "mark\.cuda|pytest\.mark\.cuda" tests/test_*.py 2>/dev/null; \
                          ls tests/test_cuda*.py 2>/dev/null)
CUDA_TESTS=($(printf '%s\n' "${CUDA_TESTS[@]}" | sort -u))
if [ ${#CUDA_TESTS[@]} -eq 0 ]; then
  echo "no test file is marked cuda"
else
  echo "files: ${CUDA_TESTS[*]}"
  timeout 240 "$PY" -m pytest -q -m cuda -p no:cacheprovider -o addopts="" \
    --junitxml="$OUTDIR/cuda_tests.xml" "${CUDA_TESTS[@]}" \
    || note_fail "CUDA tests" $?
fi

step "4. throughput: no offload vs ZeRO-Offload-style vs SuperOffload"
if [ "$CUDA" = 1 ]; then
  BENCH_ARGS=(--device cuda --model "${GPU_CHECK_MODEL:-gpt2}" --dtype bf16
              --batch "${GPU_CHECK_BATCH:-16}" --seq "${GPU_CHECK_SEQ:-1024}"
              --iters 8 --rounds 2 --warmup 3)
else
  echo "no CUDA device: the CPU stands in for it (checks the script, not the idea)"
  BENCH_ARGS=(--device cpu --model tiny --batch 4 --seq 64 --iters 3 --rounds 1 --warmup 1)
fi
timeout 200 "$PY" benchmarks/bench_engine.py "${BENCH_ARGS[@]}" --json >"$OUTDIR/bench.out" 2>&1
rc=$?
grep -v '^{' "$OUTDIR/bench.out"
tail -n 1 "$OUTDIR/bench.out" | grep '^{' >"$OUTDIR/bench.json" || true
[ $rc -eq 0 ] || note_fail "benchmark" $rc

step "5. short training run on the device"
if [ "$CUDA" = 1 ]; then
  TRAIN_ARGS=(--device cuda --steps 60 --model medium)
else
  TRAIN_ARGS=(--device cpu --steps 5 --model tiny --batch 4 --seq 64)
fi
timeout 150 "$PY" -m superoffload train "${TRAIN_ARGS[@]}" --eval-batches 2 --quiet --json \
  --out "$OUTDIR/train" >"$OUTDIR/train.out" 2>&1
rc=$?
grep -v '^{' "$OUTDIR/train.out" | tail -n 8
tail -n 1 "$OUTDIR/train.out" | grep '^{' >"$OUTDIR/train.json" || true
"$PY" - "$OUTDIR/train.json" <<'PYEOF' || true
import json, sys
r = json.load(open(sys.argv[1]))
s = r.get("summary") or {}
print(f"{r['model']} ({r['params'] / 1e6:.1f} M params, {r['dtype']}) on {r['device']}: "
      f"loss {r['first_loss']:.3f} -> {r['final_loss']:.3f} in {r['steps']} steps, "
      f"{r['tokens_per_s']:,.0f} tokens/s")
if s:
    print(f"median iteration {s['wall_s'] * 1e3:.1f} ms, device idle {s['device_idle_frac']:.0%}, "
          f"CPU overlap {s['cpu_overlap_frac']:.0%}, exposed optimizer "
          f"{s['exposed_optimizer_s'] * 1e3:.1f} ms, D2H {s['d2h_gbps_busy']:.1f} / "
          f"H2D {s['h2d_gbps_busy']:.1f} GB/s while busy")
PYEOF
[ $rc -eq 0 ] || note_fail "train" $rc

step "done: status $status (log: $LOG)"
exit $status
