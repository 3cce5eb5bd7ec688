#!/usr/bin/env bash
# The one prepared device check of the H200 speed targets (docs/planner.md; written for one
# H200 on PCIe with a 16-core host, a bare image whose python3 has torch, pytest, numpy and
# tqdm but no cffi, no network, and a 15-minute device budget). About 8 minutes; every step
# has its own time limit and the script goes on when one fails or is skipped. Writes its log and tables under $OUT when set (at most
# 8 files come back from a device run: this writes 7).
#
#   bash scripts/gpu_check.sh                 # from the repository root (or anywhere)
#   bash scripts/gpu_check.sh --dry-run       # the same steps on the CPU with a tiny GPT
#   PYTHON=/path/to/python bash scripts/gpu_check.sh
#
# The kernel is built in place (cext/ via setup.py build_ext --inplace). The device image's
# Python has no cffi (FACTS.md): carry its wheels in .whl/ (git-ignored: echo /.whl/ >>
# .git/info/exclude), fetched here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl cffi pycparser
# and name .whl in the run's carry. They are installed into a scratch folder on PYTHONPATH
# (pip --target, or unzipped when pip is missing); nothing is installed into the image.
#
# Steps: 1 environment; 2 cffi from .whl/ and the kernel built in place (the storage tier's
# I/O engine with it); 2b the storage tier on CUDA (first: it never ran on a GPU); 3 the CUDA tests
# (pytest -m cuda); 4 probes: links and the DRAM-resident CPU Adam in the engine's variant
# (plan.measure_local, saved as profile.json), and the planner's table against FACTS.md;
# 5 the 1.21 B GPT (24 x 2048, bf16, batch 8 x 1024) plain, at ratios 0.3 / 0.5 / 0.7 / 0.9
# and the tuner's pick, each row measured next to the planner's prediction (bench_engine.py):
# iteration time, and the peak device memory (torch.cuda.max_memory_allocated) beside the
# planner's device figure; 6 the engine over FSDP2 on CUDA (1 rank, NCCL), against one process.
# Without a GPU (or with --dry-run) the same steps run on the CPU with a tiny model: that checks
# the script, not the idea.

set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$PWD
PY=${PYTHON:-python3}
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUTDIR=${OUT:-${TMPDIR:-/tmp}/superoffload-gpu-check}
mkdir -p "$OUTDIR"
LOG=$OUTDIR/gpu_check.log
exec > >(tee "$LOG") 2>&1
SITE=${TMPDIR:-/tmp}/superoffload-site
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export SUPEROFFLOAD_CACHE_DIR=${TMPDIR:-/tmp}/superoffload-cache
START=$(date +%s)
status=0
step() { echo; echo "=== $* ($(( $(date +%s) - START )) s) ==="; }
note_fail() { echo "!!! $1 failed (exit $2)"; status=1; }

step "1. environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null \
  || echo "nvidia-smi: not available"
timeout 60 "$PY" - <<'PYEOF'
import os, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__,
      "| cuda", torch.version.cuda, "| available:", torch.cuda.is_available(),
      "| cpus", len(os.sched_getaffinity(0)))
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(0))
for mod in ("numpy", "tqdm", "cffi", "pycparser", "pytest", "hypothesis", "setuptools"):
    try:
        __import__(mod)
        print(f"  {mod}: yes")
    except ImportError:
        print(f"  {mod}: MISSING")
PYEOF
CUDA=$(timeout 60 "$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
[ "$DRY" = 1 ] && CUDA=0

step "2. cffi from .whl/ and the CPU Adam kernel built in place"
if ! "$PY" -c "import cffi" 2>/dev/null && ls .whl/cffi-*.whl >/dev/null 2>&1; then
  mkdir -p "$SITE"
  if "$PY" -m pip --version >/dev/null 2>&1; then
    timeout 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$SITE" .whl/cffi-*.whl .whl/pycparser-*.whl
  else  # a wheel is a zip archive: unpacked, it is importable as it is
    timeout 60 "$PY" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" \
      "$SITE" .whl/cffi-*.whl .whl/pycparser-*.whl
  fi
  export PYTHONPATH=$PYTHONPATH:$SITE
fi
BACKEND=$(SUPEROFFLOAD_KERNEL= timeout 60 "$PY" -W ignore -c \
  "import superoffload.kernels as k; print(k.backend())" 2>/dev/null | tail -n 1)
if [ "$BACKEND" = "cffi" ]; then
  echo "compiled CPU Adam kernel present"
elif "$PY" -c "import cffi, pycparser" 2>/dev/null && command -v cc >/dev/null 2>&1; then
  if timeout 150 "$PY" setup.py -q build_ext --inplace >"$OUTDIR/build.log" 2>&1; then
    echo "compiled CPU Adam kernel built in place"
  else
    echo "kernel build failed (see build.log): the torch fallback kernel runs"
  fi
else
  echo "cffi (carry .whl/, see the header) or a C compiler missing: the torch fallback runs"
fi
timeout 60 "$PY" -c "
import superoffload as so, superoffload.kernels as k
print('superoffload', so.__version__, '| kernel backend:', k.backend(), '| simd:', k.simd_path())
" || note_fail "import superoffload" $?

step "2b. storage tier on CUDA: pinned slots, CUDA copies, I/O rates (docs/storage.md)"
# First, as the storage tier has never run on a GPU: a GPT with its state in files under
# $TMPDIR trains bit for bit as in host memory (clipping every step: versions undo, replays
# read back), then the disk's rates with the project's I/O engine (plan.measure uses them).
timeout 150 "$PY" - "$CUDA" "${TMPDIR:-/tmp}/superoffload-tier" <<'PYEOF' || note_fail "storage tier" $?
import sys, time, torch
import superoffload as so
from superoffload.models import GPT, gpt_small
from superoffload.storage import AioEngine, measure_storage
from superoffload.telemetry.storage_io import storage_io
cuda, folder = sys.argv[1] == "1", sys.argv[2]
dev = torch.device("cuda" if cuda else "cpu")
g = torch.Generator().manual_seed(1)
data = [(torch.randint(0, 256, (8, 128), generator=g).to(dev),
         torch.randint(0, 256, (8, 128), generator=g).to(dev)) for _ in range(6)]
out = {}
for name, extra in (("memory", {}), ("tier", {"storage_path": folder, "storage_buffer_count": 2})):
    torch.manual_seed(0)
    model = GPT(gpt_small()).to(dev, torch.bfloat16)
    cfg = so.OffloadConfig(device=str(dev), ratio=0.7, bucket_bytes=1 << 18, max_grad_norm=0.3,
                           rollback="snapshot", **extra)
    with so.initialize(model, {"lr": 1e-3}, cfg) as engine:
        t0 = time.perf_counter()
        for x, y in data:
            engine.backward(model(x, y)); engine.step(); engine.zero_grad()
        engine.synchronize()
        out[name] = (engine.master_weights(), time.perf_counter() - t0, engine.stats.replays,
                     storage_io(engine.telemetry.spans()))
diff = max(float((out["memory"][0][k] - out["tier"][0][k]).abs().max()) for k in out["tier"][0])
print(f"tier vs memory: max |diff| {diff:g} (must be 0), replays {out['tier'][2]}, "
      f"{out['tier'][1]:.2f} s vs {out['memory'][1]:.2f} s for 6 steps; backend "
      f"{AioEngine().backend}")
print(out["tier"][3].line() if out["tier"][3] else "no storage spans recorded")
m = measure_storage(folder, size_bytes=1 << 30, block_bytes=1 << 20, queue_depth=32)
print(f"disk under {folder}: read {m.read_gbps:.2f} GB/s, write {m.write_gbps:.2f} GB/s "
      f"({m.backend}, direct={m.direct})")
sys.exit(0 if diff == 0.0 else 1)
PYEOF

step "3. CUDA tests (pytest -m cuda)"
timeout 150 "$PY" -m pytest -q -m cuda -p no:cacheprovider -o addopts="" \
  --junitxml="$OUTDIR/cuda_tests.xml" tests/ 2>&1 | tail -n 15
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || [ "$rc" = 5 ] || note_fail "CUDA tests" "$rc"  # 5: none collected (no GPU)

step "4. probes: links, DRAM-resident CPU Adam (engine variant), the planner vs FACTS.md"
QUICK=False
[ "$CUDA" = 1 ] || QUICK=True
timeout 150 "$PY" - "$OUTDIR/profile.json" "$QUICK" <<'PYEOF' || note_fail "probes" $?
import json, sys
from superoffload import plan
prof = plan.measure_local(quick=sys.argv[2] == "True", force=True, progress=False)
open(sys.argv[1], "w").write(json.dumps(prof.to_dict(), indent=1))
print(f"{prof.name}: host bus {prof.host_mem_bw_gbps:.1f} GB/s (copy "
      f"{prof.extra['host_copy_gbps']:.1f} GB/s), H2D / D2H peak {prof.h2d_gbps:.1f} / "
      f"{prof.d2h_gbps:.1f} GB/s, matmul {prof.device_peak_tflops:.0f} TFLOP/s, "
      f"device cast {prof.device_cast_gelems:.0f} G/s, host cast {prof.host_cast_gelems:.1f} G/s")
print("link GB/s by size:", ", ".join(f"{s / 2**20:g} MiB {h:.1f}/{d:.1f}"
      for (s, h), (_, d) in zip(prof.h2d_table, prof.d2h_table)))
print("CPU Adam, DRAM-resident, bf16 grads in / bf16 copy out (G params/s by threads):",
      ", ".join(f"{t}: {r / 1e9:.2f}" for t, r in prof.cpu_adam_table))
for flag in prof.flags:
    print("FLAG:", flag)
PYEOF
timeout 60 "$PY" -m superoffload simulate --facts h200 >"$OUTDIR/facts.txt" 2>&1 \
  || note_fail "simulate --facts" $?
cat "$OUTDIR/facts.txt"

step "5. 1.21 B GPT: plain, ratios 0.3/0.5/0.7/0.9 and the tuner's pick, measured vs predicted"
if [ "$CUDA" = 1 ]; then
  BENCH_ARGS=(--device cuda --layers 24 --hidden 2048 --heads 16 --dtype bf16 --batch 8
              --seq 1024 --iters 5 --rounds 2 --warmup 2)
else
  echo "no CUDA device: the CPU stands in with a tiny GPT (checks the script, not the idea)"
  BENCH_ARGS=(--device cpu --layers 2 --hidden 64 --heads 2 --batch 4 --seq 64
              --iters 2 --rounds 1 --warmup 1)
fi
PROFILE_ARG=(--profile local)
[ -s "$OUTDIR/profile.json" ] && PROFILE_ARG=(--profile "$OUTDIR/profile.json")
timeout 270 "$PY" benchmarks/bench_engine.py "${BENCH_ARGS[@]}" --ratios 0.3,0.5,0.7,0.9 \
  --tuned --no-zero --sequential "${PROFILE_ARG[@]}" --json >"$OUTDIR/bench.txt" 2>&1
rc=$?
grep -v '^{' "$OUTDIR/bench.txt"
tail -n 1 "$OUTDIR/bench.txt" | grep '^{' >"$OUTDIR/bench.json" || true
[ $rc -eq 0 ] || note_fail "benchmark" $rc
[ -s "$OUTDIR/bench.json" ] && timeout 30 "$PY" - "$OUTDIR/bench.json" <<'PYEOF' || true
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
plain = next(r for r in rows if r["schedule"] == "plain")["iter_ms"]
ours = [r for r in rows if r["schedule"] != "plain"]
best = min(ours, key=lambda r: r["iter_ms"])
tuned = next((r for r in ours if r["schedule"] == "tuned"), None)
errs = [abs(r["error"]) for r in ours if r["error"] is not None]
print(f"H200 speed targets: fastest ours {best['schedule']} {best['iter_ms']:.1f} ms = "
      f"{plain / best['iter_ms']:.2f}x plain (target >= 0.92x at the tuner's pick); ratio 0.7: "
      + ", ".join(f"{plain / r['iter_ms']:.2f}x plain" for r in ours if r["ratio"] == 0.7)
      + " (target >= 0.65x)")
if errs:
    print(f"planner: worst |error| {max(errs):.1%} over {len(errs)} rows (target 15%)")
mem = [(r["schedule"], r["device_peak_mb"], r["device_predicted_mb"], r["device_error"])
       for r in rows if r.get("device_error") is not None]
for name, peak, pred, err in mem:
    print(f"device memory {name}: measured peak {peak:,.0f} MB, planned {pred:,.0f} MB "
          f"({err:+.1%})")
if mem:
    print(f"planner device memory: worst |error| {max(abs(m[3]) for m in mem):.1%} over "
          f"{len(mem)} rows (target 10%)")
if tuned:
    print(f"tuner's pick (ratio {tuned['ratio']}): {tuned['iter_ms']:.1f} ms, "
          f"{tuned['iter_ms'] / best['iter_ms'] - 1:+.1%} vs the fastest row (target within 5%)")
PYEOF

step "6. FSDP2 under the engine on CUDA: 1 rank, NCCL (H2D publish before FSDP2's all-gather)"
# One rank (2 cannot share the one lent GPU): FsdpOffloadEngine (distributed/fsdp/) against the
# single-process OffloadEngine on the same GPT and data, weight-stationary with a GPU tail and
# under weight-flow (FSDP2's CPUOffloadPolicy, pinned host shards), clipping every step so
# speculative steps are rolled back, replayed and published again; every CPU step is slowed
# so each publish lands while the next forward is already waiting. Without the all-gather
# streams waiting on the H2D event (hooks.py wait_publish) FSDP2 could gather stale shards:
# the masters would differ. A negative control runs with that wait removed (printed only: a
# race need not show). docs/distributed.md, "GPU ordering".
if [ "$CUDA" = 1 ]; then
  timeout 180 "$PY" - <<'PYEOF' || note_fail "FSDP2 engine on CUDA" $?
import time, torch
from superoffload.config import OffloadConfig
from superoffload.distributed import init_distributed, shutdown
from superoffload.distributed.fsdp import FsdpOffloadEngine, hooks
from superoffload.models import GPT, gpt_small
from superoffload.runtime import steps
from superoffload.runtime.engine import OffloadEngine

init_distributed(backend="nccl", env={}, timeout_s=120)
dev = torch.device("cuda", 0)
g = torch.Generator().manual_seed(1)
data = [(torch.randint(0, 256, (8, 128), generator=g).to(dev),
         torch.randint(0, 256, (8, 128), generator=g).to(dev)) for _ in range(6)]
run_step = steps.StepTask.run

def slow_step(self):
    time.sleep(0.02)  # the CPU step ends after the next forward started waiting
    return run_step(self)

steps.StepTask.run = slow_step

def train(engine_cls, weights, **kw):
    torch.manual_seed(0)
    model = GPT(gpt_small()).to(dev)
    cfg = OffloadConfig(device="cuda", bucket_bytes=1 << 20, ratio=0.5, weights=weights,
                        max_grad_norm=0.05, speculation="on", telemetry=False)
    with engine_cls(model, {"lr": 3e-3}, cfg, **kw) as engine:
        for x, y in data:
            engine.backward(model(x, y))
            engine.step()
            engine.zero_grad()
        masters = engine.master_weights()
        stats = engine.stats.as_dict()
    return masters, stats

worst = 0.0
for weights in ("stationary", "flow"):
    want, _ = train(OffloadEngine, weights)
    got, stats = train(FsdpOffloadEngine, weights)
    diff = max(float((want[n] - got[n]).abs().max()) for n in want)
    worst = max(worst, diff)
    print(f"{weights}: FSDP2 engine vs one process, max |diff| {diff:.2e}; replays "
          f"{stats['replays']}, clipped {stats['clipped_steps']}")
streams = hooks._all_gather_streams
hooks._all_gather_streams = lambda unit: []  # the negative control: no stream wait
bad, _ = train(FsdpOffloadEngine, "stationary")
hooks._all_gather_streams = streams
want, _ = train(OffloadEngine, "stationary")
print(f"negative control (no all-gather wait on the H2D event): max |diff| "
      f"{max(float((want[n] - bad[n]).abs().max()) for n in want):.2e}")
shutdown()
assert worst <= 1e-6, f"the FSDP2 engine differs from one process by {worst:.2e}"
print("FSDP2 CUDA ordering: OK")
PYEOF
else
  echo "no GPU: skipped (the same engine runs on gloo in tests/test_fsdp_dp.py)"
fi

step "done: status $status (log: $LOG)"
exit $status
