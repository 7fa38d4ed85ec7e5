#!/usr/bin/env bash
# GPU check of fastcomm's CUDA kernels: build, test on CUDA tensors (Triton compiled, not interpreted), time.
#
# Run from the repository root of a fresh copy of the tree on a machine with an NVIDIA GPU:
#     bash benchmarks/gpu_check.sh
# 1. Prints what the machine has (GPU, driver, nvcc, python, torch, triton), since it may reach no registry.
# 2. Uses the system python as it is when it is a virtual environment whose torch sees CUDA; else makes .venv
#    if there is none: on top of the system torch (--system-site-packages) when that torch sees CUDA,
#    otherwise with pip-installed torch==2.13.0 and triton==3.9.0.
# 3. Builds fastcomm._C in place (the CUDA top-k kernel too when torch has CUDA and nvcc is found).
# 4. Runs the op tests on CUDA tensors (Triton compiled) and the control collectives on NCCL, then
#    benchmarks.gpu_ops_timing (every kernel beside memcpy and torch's op, 1M-256M elements, fp32/bf16/fp16)
#    and benchmarks.gpu_step (a DDP and an FSDP2 step on CUDA tensors held bit for bit to the CPU
#    reference; NCCL at world size 1, 2 ranks over gloo).
# Results (gpu_ops_timing_<gpu>.*, gpu_step_<gpu>.*) go to GPU_CHECK_RESULTS (default benchmarks/results).
# Every step runs under `timeout`, sized from one overall budget (GPU_CHECK_BUDGET_S, default 470 s).
# Without an NVIDIA GPU it says so and exits 2 at once (nothing is installed or built).
# Exit status: 0 when every step passed, 2 without a GPU, else the number of failed steps.
set -u -o pipefail
cd "$(dirname "$0")/.."

BUDGET_S=${GPU_CHECK_BUDGET_S:-470}
RESULTS=${GPU_CHECK_RESULTS:-benchmarks/results}
SIZES=${GPU_CHECK_SIZES:-1M,16M,256M}
PYTHON=${PYTHON:-python3}
PY=.venv/bin/python
failed=0
SECONDS=0

step() { printf '\n=== [%3ds] %s\n' "$SECONDS" "$*"; }
# Seconds a step may take: its own cap, or what is left of the budget (at least 10), whichever is less.
allow() { local left=$((BUDGET_S - SECONDS)); ((left < 10)) && left=10; echo $(($1 < left ? $1 : left)); }
run() {  # run CAP_SECONDS NAME CMD...: time-boxed, failure counted and reported, never fatal
  local cap name rc
  cap=$(allow "$1"); name=$2; shift 2
  timeout --kill-after=10 "$cap" "$@"
  rc=$?
  if ((rc == 124 || rc == 137)); then echo "!!! $name: timed out after ${cap}s"; fi
  if ((rc != 0)); then echo "!!! $name: failed (exit $rc)"; failed=$((failed + 1)); fi
  return $rc
}

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv 2>/dev/null || echo "nvidia-smi: not available"
command -v nvcc >/dev/null && nvcc --version | tail -n 2 || echo "nvcc: not on PATH (CUDA_HOME=${CUDA_HOME:-unset})"
echo "cpus: $(nproc)"
"$PYTHON" --version
"$PYTHON" - <<'EOF'
try:
    import torch
    print(f"system torch {torch.__version__}, built for CUDA {torch.version.cuda}, cuda available: "
          f"{torch.cuda.is_available()}")
except ImportError as exc:
    print(f"system torch: none ({exc})")
try:
    import triton
    print(f"system triton {triton.__version__}")
except ImportError as exc:
    print(f"system triton: none ({exc})")
EOF

if ! nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q .; then
  echo "!!! no NVIDIA GPU visible here (nvidia-smi lists none): nothing to check; run this on a GPU machine"
  exit 2
fi

step "virtual environment"
if "$PYTHON" -c "import sys, torch; sys.exit(0 if sys.prefix != sys.base_prefix and torch.cuda.is_available() else 1)" 2>/dev/null; then
  # a venv made from a venv's python sees the base interpreter's packages, not the parent venv's
  echo "the system python is a virtual environment whose torch sees CUDA: using it as it is"
  PY=$(command -v "$PYTHON")
elif [[ -x $PY ]]; then
  echo "using the existing .venv"
elif "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "the system torch sees CUDA: .venv on top of it (--system-site-packages)"
  "$PYTHON" -m venv --system-site-packages .venv
else
  echo "no CUDA torch in the system python: installing torch==2.13.0 and triton==3.9.0 into .venv"
  "$PYTHON" -m venv .venv
  run 240 "pip install torch" $PY -m pip install -q torch==2.13.0 triton==3.9.0 \
    || echo "!!! could not install torch (is a package registry reachable from here?)"
fi
$PY - <<'EOF'
import importlib
for name in ("torch", "triton", "numpy", "pytest", "ninja", "setuptools"):
    try:
        module = importlib.import_module(name)
        print(f"  {name} {getattr(module, '__version__', '?')}")
    except ImportError:
        print(f"  {name}: missing")
EOF
if ! $PY -c "import pytest" 2>/dev/null; then
  run 60 "pip install pytest" $PY -m pip install -q pytest numpy || echo "!!! pytest unavailable: tests cannot run"
fi
if ! $PY -c "import setuptools" 2>/dev/null; then
  run 60 "pip install setuptools" $PY -m pip install -q setuptools || echo "!!! setuptools unavailable: no build"
fi
if ! $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "!!! the venv's torch cannot use a CUDA device: nothing to check here"
  exit 1
fi

step "build fastcomm._C in place (CUDA top-k included when torch has CUDA and nvcc is found)"
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
FASTIO_NO_NATIVE=1 run 120 "build" $PY setup.py build_ext --inplace  # fastio._C is not checked here
$PY -c "import fastcomm; print('\n'.join(f'{op}: {entry}' for op, entry in fastcomm.backend().items()))"

step "op tests on CUDA tensors (Triton compiled: TRITON_INTERPRET unset)"
# The Triton files first: a time box that cuts the run short then cuts test_ops.py's CPU-side cases.
run 120 "tests" env -u TRITON_INTERPRET $PY -m pytest -q -rs -p no:cacheprovider --durations=5 \
  tests/fastcomm/test_triton_topk.py tests/fastcomm/test_triton_quantize.py tests/fastcomm/test_triton_sign.py \
  tests/fastcomm/test_topk_cuda.py tests/fastcomm/test_cuda_groups.py tests/fastcomm/test_ops.py

mkdir -p "$RESULTS"
step "kernel times against memcpy and torch's op (sizes $SIZES) -> $RESULTS"
run 110 "gpu_ops_timing" env -u TRITON_INTERPRET FASTLIB_BENCH_OUTPUT="$RESULTS" \
  $PY -m benchmarks.gpu_ops_timing --sizes "$SIZES" --repeat 5

step "DDP and FSDP2 steps on CUDA tensors against the CPU reference -> $RESULTS"
run 100 "gpu_step" env -u TRITON_INTERPRET FASTLIB_BENCH_OUTPUT="$RESULTS" \
  $PY -m benchmarks.gpu_step --timeout 45

step "done: $failed failed step(s) in ${SECONDS}s"
exit "$failed"
