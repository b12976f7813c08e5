#!/usr/bin/env bash
# The GPU checks in one run, for a machine with a CUDA GPU, torch and Triton (no Ray or FastAPI needed):
# the machine, the CUDA tests (engine on the GPU vs the CPU engine, bf16, async streaming, CLI, TP over NCCL
# where there are 2 GPUs), the Triton kernels compiled vs their torch twin, then the codec benchmark.
#     bash loadtest/gpu_check.sh [OUT_DIR]        (PYTHON=... to pick the interpreter; default python3)
# With ENGINE_BENCH=1 it then times the engine (needs transformers): a random-weight 0.82B Qwen3-Next-geometry
# checkpoint (loadtest/synth_model.py), bench_engine on it in bfloat16 (TTFT and decode vs `generate`), then
# decode again with the engine replaying CUDA graphs (--decode-graphs), then replaying graphs of compiled steps
# (--compile-decode, batches 1 and 16 only: start-up compiles every batch bucket up to the largest).
# Exit status: pytest's. Logs and the benchmarks' JSON and markdown land in OUT_DIR.
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
"$PY" -m pytest tests/engine/test_cuda.py tests/kernels/test_pack.py -rs -p no:cacheprovider 2>&1 | tee "$OUT_DIR/pytest.log"
rc=${PIPESTATUS[0]}
"$PY" -m loadtest.bench_codec --out "$OUT_DIR/bench_codec.md" 2>&1 | tee "$OUT_DIR/bench_codec.log"
cp loadtest/results/bench_codec_*.json "$OUT_DIR/" 2>/dev/null
if [ "${ENGINE_BENCH:-0}" = 1 ]; then
  "$PY" -m loadtest.synth_model "$OUT_DIR/synth-0.8b" --hidden 2048 --layers 12 2>&1 | tee "$OUT_DIR/bench_engine.log"
  "$PY" -m loadtest.bench_engine --model "$OUT_DIR/synth-0.8b" --device cuda --dtype bfloat16 --repeats 3 \
    --hit-samples 3 --lengths 1024 4096 --batches 1 16 64 --out "$OUT_DIR/bench_engine.md" 2>&1 \
    | tee -a "$OUT_DIR/bench_engine.log"
  "$PY" -m loadtest.bench_engine --model "$OUT_DIR/synth-0.8b" --device cuda --dtype bfloat16 --repeats 3 \
    --batches 1 16 64 --sections decode mixed --decode-graphs --out "$OUT_DIR/bench_engine.md" 2>&1 \
    | tee -a "$OUT_DIR/bench_engine.log"
  "$PY" -m loadtest.bench_engine --model "$OUT_DIR/synth-0.8b" --device cuda --dtype bfloat16 --repeats 3 \
    --batches 1 16 --sections decode --decode-graphs --compile-decode --out "$OUT_DIR/bench_engine.md" 2>&1 \
    | tee -a "$OUT_DIR/bench_engine.log"
  cp loadtest/results/bench_engine_*cuda*.json "$OUT_DIR/" 2>/dev/null
  rm -rf "$OUT_DIR/synth-0.8b"  # 1.6 GB of random weights
fi
echo "pytest exit status: $rc"
exit "$rc"
