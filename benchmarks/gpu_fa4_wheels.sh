#!/usr/bin/env bash
# Gets flash-attn-4 and its CuTe-DSL wheels onto the GPU box, which has no network, for
# `bash benchmarks/gpu_call.sh fa4` (issue 28). nvidia-cutlass-dsl-libs-cu13 is 92 MB,
# more than one device call carries (64 MiB with the tree), so it travels in two parts
# over two calls made back to back (files in /tmp stay while the machine is warm):
#   bash benchmarks/gpu_fa4_wheels.sh          # here: fills .fa4p1/ and .fa4p2/
#   device call, carry [".fa4p1"]:  mkdir -p /tmp/fa4 && cp .fa4p1/* /tmp/fa4/
#   device call, carry [".fa4p2"]:  cp .fa4p2/* /tmp/fa4/
#   device call, carry [".whl", ".data"]:  bash benchmarks/gpu_call.sh fa4 ...
# gpu_call.sh joins the parts and installs /tmp/fa4/*.whl. The box has einops and
# cuda-bindings already.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .fa4p1 .fa4p2 /tmp/fa4w
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform any"
for p in flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
         nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 \
         torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $PLAT -d /tmp/fa4w "$p"
done
big=$(cd /tmp/fa4w && ls nvidia_cutlass_dsl_libs_cu13-*.whl)
split -b 46000000 -d "/tmp/fa4w/$big" ".fa4p1/$big.part"
mv ".fa4p1/$big.part01" .fa4p2/
find /tmp/fa4w -name '*.whl' ! -name "$big" -exec cp {} .fa4p2/ \;
du -sh .fa4p1 .fa4p2
