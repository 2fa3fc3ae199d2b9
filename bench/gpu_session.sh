#!/usr/bin/env bash
# One lent GPU's checks and benchmarks in one call (docs/benchmarks/gpu.md).
#
#   bash bench/gpu_session.sh OUTDIR            # on the GPU machine, from the repository root
#   SMOKE=1 bash bench/gpu_session.sh /tmp/out  # the same steps on the CPU, tiny sizes
#
# The GPU machine has torch, transformers, peft and aiohttp but not Steep's other needs:
# wheels of orjson and httptools travel in .whl (see docs/benchmarks/gpu.md) and install
# under /tmp/site. Each step has its own time limit, so one that hangs costs only itself.
# Order: the CUDA paths' correctness; where the torch engine's decode step goes on a GPU
# (cProfile, SDPA's cuDNN backend on and off); issue 17's pool; then the cost-model figures
# of issue 19 (the engine's decode step, the trainer's step), measured once already
# (docs/benchmarks/gpu.md), last, so a short lease loses those first.
set -u
out=${1:?usage: gpu_session.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
py=${PYTHON:-python3}
if [ -d .whl ] && [ -z "${SMOKE:-}" ]; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
models=/tmp/steep-bench-models
if [ -n "${SMOKE:-}" ]; then
  dev=cpu dtype=float32 big=small mid=small cores=0-1
  export STEEP_TEST_DEVICE=cpu
  pool="--runs 1,2 --clients 2 --duration 2 --warmup 1 --flood 2 --flood-batch 2 --max-new-tokens 8"
  step="--batches 1,4 --prompts 16,64 --steps 4"
  prof="--batches 4 --prompts 12 --steps 8"
  pool4="--runs 2 --clients 2 --duration 2 --warmup 1 --flood 0 --max-new-tokens 8"
  tokens=2048
else
  dev=cuda dtype=bfloat16 big=qwen2-1.5b mid=qwen2-0.5b cores=0-15
  pool="--runs 1,4 --clients 16 --batch 128 --duration 12 --warmup 6 --flood 32 --flood-batch 32 --max-new-tokens 32"
  step="--batches 1,8,32,128 --prompts 128,1024 --steps 32"
  prof="--batches 64 --prompts 12 --steps 32"
  pool4="--runs 4 --clients 16 --batch 128 --duration 12 --warmup 6 --flood 0 --max-new-tokens 32"
  tokens=16384
fi
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv 2>&1
  $py -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  nproc
} 2>&1 | tee "$out/env.txt"

echo "== CUDA paths (tests/gpu)"
timeout 120 $py -m pytest --noconftest -p no:cacheprovider -o addopts= tests/gpu -q -rs 2>&1 \
  | tail -40 | tee "$out/gpu-tests.txt"

# Issue 35's figures first: the 1.5B step at 16k tokens (chunked logprobs, with and without
# activation checkpointing, against the whole [T, V] logits: goal under 40 GB, MFU 35%), then a
# 7B-shaped LoRA step on one GPU (its peak memory; the plan says 37 GB at 4k tokens).
if [ -z "${SMOKE:-}" ]; then
  echo "== issue 35: trainer step ($big, $tokens tokens)"
  timeout 200 $py bench/train_step.py --model "$big" --device $dev \
    --cases packed:bf16,packed:bf16:ckpt,packed:bf16:logits --tokens $tokens --warmup 1 --steps 2 \
    --workdir $models --json /tmp/steep-gpu-issue35-1.5b.json 2>&1 | tail -12 \
    | tee "$out/issue35-train-step.txt"
  echo "== issue 35: 7B-shaped LoRA step on one GPU (4096 tokens)"
  timeout 240 $py bench/train_step.py --model qwen2-7b --device $dev --lora-rank 16 \
    --cases packed:bf16:ckpt:lora --tokens 4096 --warmup 1 --steps 1 \
    --workdir $models --json /tmp/steep-gpu-issue35-7b.json 2>&1 | tail -8 \
    | tee -a "$out/issue35-train-step.txt"
fi

for cudnn in on off; do
  echo "== decode step under cProfile ($mid body, 4 adapters, SDPA's cuDNN backend $cudnn)"
  flag=$([ $cudnn = off ] && echo --no-cudnn-sdp)
  timeout 60 $py bench/engine_step.py --model "$mid" --vocab 260 --adapters 4 --device $dev \
    --dtype $dtype $prof $flag --workdir $models --profile "$out/profile-cudnn-$cudnn.txt" 2>&1 \
    | grep "steps:" | tee -a "$out/profiles.txt"
done

echo "== shared pool vs dedicated engines ($mid body, the tiny tokenizer's vocabulary)"
timeout 240 $py bench/pool.py --model "$mid" --vocab 260 --device $dev --dtype $dtype \
  --cores $cores $pool --out /tmp/steep-gpu-pool.json 2>&1 | grep -v "Loading weights\|warn" \
  | tail -20 | tee "$out/pool.txt"

echo "== the same 4 runs, SDPA's cuDNN backend off in every engine"
timeout 120 $py bench/pool.py --model "$mid" --vocab 260 --device $dev --dtype $dtype \
  --cores $cores $pool4 --no-cudnn-attention --out /tmp/steep-gpu-pool-nocudnn.json 2>&1 \
  | grep -v "Loading weights\|warn" | tail -6 | tee -a "$out/pool.txt"

echo "== torch engine decode step ($big)"
timeout 110 $py bench/engine_step.py --model "$big" --device $dev --dtype $dtype $step \
  --workdir $models --json /tmp/steep-gpu-engine-step.json 2>&1 | grep -v "Loading weights\|warn" \
  | tail -16 | tee "$out/engine-step.txt"

echo "== trainer step ($big)"
timeout 130 $py bench/train_step.py --model "$big" --device $dev \
  --cases packed:bf16,packed:bf16:lora --tokens $tokens --warmup 1 --steps 2 \
  --workdir $models --json /tmp/steep-gpu-train-step.json 2>&1 | tail -16 | tee "$out/train-step.txt"
date -u | tee -a "$out/env.txt"
