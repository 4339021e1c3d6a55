#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one bounded run: the Triton KV and GGUF kernels compiled on the
# device against the PyTorch reference, the engine there against the CPU engine, then the kernel and
# engine benchmarks. CI has no GPU (those tests skip there); run this on a machine that has one:
#
#     bash tools/gpu_check.sh [OUT_DIR]        # logs and bench reports land in OUT_DIR (default bench/out/gpu)
#
# Uses the python3 on PATH (with a CUDA build of torch and triton) and the repository in place.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/out/gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
py=${PYTHON:-python3}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$out/gpu.txt"
$py -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" \
    | tee -a "$out/gpu.txt"

echo "== tests on the GPU"
timeout 300 $py -m pytest -q -p no:cacheprovider -rfE -s tests/kvwire_kernels/test_kernels.py \
    tests/kvwire_kernels/test_gguf_triton.py tests/engine/test_cuda.py \
    2>&1 | tee "$out/pytest.log" | grep -v "^tests/.*PASSED" | tail -40

echo "== bench kernels"
timeout 180 $py -m bench kernels --out "$out" 2>&1 | grep -v "attention cases" | tail -75

echo "== bench gguf-kernels (Triton W4A16 against a bf16 matmul, TinyLlama-1.1B shapes)"
timeout 240 $py -m bench gguf-kernels --out "$out" 2>&1 | grep -v "it/s\]\|s/it\]" | tail -130

echo "== bench engine on the GPU"
for model in smollm2-135m tinyllama-1.1b; do
  timeout 240 $py -m bench engine --model "$model" --device cuda --weights bf16,int8 --kv fp8_e4m3,bf16 \
      --peers transformers-bf16 --batches 1,16,64 --batch-ctx 512 --models-dir /tmp/kvwire-models --out "$out" \
      2>&1 | grep -v "it/s\]\|s/it\]" | tail -32
done
