#!/usr/bin/env bash
# Here, before a `device` run (see benchmarks/device_check.sh): download into .whl (ignored by
# git, carried to the device machine) the wheels of what featcal's calibration needs and the
# device image lacks. The nvidia-h200 image (the device tool's KINDS.md) has Python 3.12, torch,
# transformers, safetensors, pytest, numpy, pandas, pyarrow, huggingface-hub, fsspec, xxhash and
# pyyaml; it lacks datasets (and its dill, multiprocess) and pydantic (and its core,
# annotated-types, typing-inspection). Versions: those this project's .venv holds.
#   PYTHON_VERSION=3.12 benchmarks/device_wheels.sh      # 3.12: the image's Python
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
rm -rf .whl && mkdir .whl
pins=(datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pydantic==2.14.4 pydantic-core==2.50.5
      annotated-types==0.8.0 typing-inspection==0.4.5)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version "${PYTHON_VERSION:-3.12}" --implementation cp "${platforms[@]}" \
  -d .whl "${pins[@]}"
ls -l .whl
