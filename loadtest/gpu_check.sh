#!/usr/bin/env bash
# The GPU checks in one run, for a machine with a CUDA GPU, torch and Triton (no Ray or FastAPI needed):
# the machine, the CUDA tests (engine on the GPU vs the CPU engine, bf16, async streaming, CLI, TP over NCCL
# where there are 2 GPUs), the Triton kernels compiled vs their torch twin, then the codec benchmark.
#     bash loadtest/gpu_check.sh [OUT_DIR]        (PYTHON=... to pick the interpreter; default python3)
# Exit status: pytest's. Logs and the benchmark's JSON and markdown land in OUT_DIR.
set -u
OUT_DIR=${1:-/tmp/gpu_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$OUT_DIR/machine.txt"
"$PY" -m pytest tests/test_cuda.py tests/test_kernels.py -rs -p no:cacheprovider 2>&1 | tee "$OUT_DIR/pytest.log"
rc=${PIPESTATUS[0]}
"$PY" -m loadtest.bench_codec --out "$OUT_DIR/bench_codec.md" 2>&1 | tee "$OUT_DIR/bench_codec.log"
cp loadtest/results/bench_codec_*.json "$OUT_DIR/" 2>/dev/null
echo "pytest exit status: $rc"
exit "$rc"
