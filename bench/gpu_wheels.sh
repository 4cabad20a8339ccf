#!/usr/bin/env bash
# Fetch, on a machine with package-registry access, the wheels a GPU machine without it needs
# for bench/gpu_mfu.py's contenders: megatron-core (compiled, for the GPU machine's Python) and
# torchtitan 0.2.2 (the newest for the GPU image's torch 2.11) with the dependencies its
# model, parallelize and loss code import (the rest is in that image), and torchao 0.18.0 (the
# release for torch 2.11) for its float8 converter.
#   bash bench/gpu_wheels.sh [PYTHON_VERSION]    # -> .whl/ (git-ignored), 3.12 by default
set -euo pipefail
cd "$(dirname "$0")/.."
python_version="${1:-3.12}"
platforms=()
for platform in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
                manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$platform")
done
# Pinned: one version each (two of one package stop an offline --no-deps install).
python3 -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version "$python_version" --implementation cp "${platforms[@]}" -d .whl \
  megatron-core==0.19.2 torchtitan==0.2.2 tyro==1.0.17 docstring_parser==0.18.0 \
  typeguard==4.6.0 torchdata==0.11.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
  torchao==0.18.0
ls -1 .whl
