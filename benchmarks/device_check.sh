#!/usr/bin/env bash
# On the device machine (the GPU checks), as one prepared command of the device tool:
#   run(command="bash benchmarks/device_check.sh", carry=[".whl"], timeout_s=580)
# after `benchmarks/device_wheels.sh` here. It installs the carried wheels, then:
#   1. the CUDA test module (tiny CLIP/BERT end to end, bfloat16 and float32 on the GPU against
#      float64 on the CPU; prints the weight differences and seconds);
#   2. ViT-B/32 geometry, 8 experts, 256 images per task (the paper's setting: 53 s and
#      22.8 GiB host RSS reported), float32 (TF32) then bfloat16, with the GPU's GEMM rates (through
#      featcal_core: the image has no Prefect for the `featcal` command).
#   3. 1.1 B Llama geometry (TinyLlama), 4 blocks, 4 experts: time per block in float32 and
#      bfloat16 (benchmarks/llm_block_time.py, through featcal_core).
#   4. (only when named in STEPS) the bfloat16 run of step 2 under torch.profiler: its top
#      operators by host and by device time, and its Chrome trace in $OUT.
# Logs go to $OUT (they come back). Set STEPS="1" to run only the tests (STEPS="1 3": tests and
# Llama; STEPS="2 4": the paper's setting and its profile).
set -uo pipefail
out="${OUT:-/tmp/device-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', \
transformers.__version__, torch.cuda.get_device_name(0))" | tee -a "$out/gpu.txt"
steps="${STEPS:-1 2 3}"
if [[ " $steps " == *" 1 "* ]]; then
  timeout 150 python3 -m pytest -p no:cacheprovider -m cuda -rA -s tests/test_cuda_precision.py 2>&1 \
    | tee "$out/cuda_tests.log"
fi
if [[ " $steps " == *" 2 "* ]]; then
  timeout 210 python3 benchmarks/calibrate_vit_b32.py --library --device cuda --experts 8 --images 256 \
    --precision float32 bfloat16 2>&1 | grep -v "Saving the dataset" | tee "$out/vit_b32_cuda.log"
fi
if [[ " $steps " == *" 3 "* ]]; then
  (cd benchmarks && timeout 200 python3 llm_block_time.py --device cuda --layers 4 \
    --precision float32 bfloat16) 2>&1 | grep -v "Saving the dataset" | tee "$out/llm_blocks_cuda.log"
fi
if [[ " $steps " == *" 4 "* ]]; then
  timeout 200 python3 benchmarks/calibrate_vit_b32.py --library --device cuda --experts 8 --images 256 \
    --precision bfloat16 --torch-profile 30 --trace "$out" 2>&1 | grep -v "Saving the dataset" \
    | tee "$out/vit_b32_cuda_profile.log"
fi
