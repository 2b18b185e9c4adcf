#!/usr/bin/env bash
# bash benchmarks/gpu_run.sh [CHECKS] [SECONDS]
#
# On the GPU machine (the device tool's `run`, with carry [".gpu"] from benchmarks/gpu_prepare.py),
# from the repository root: installs the carried wheels beside the machine's own torch, transformers,
# accelerate and peft, prints what it runs on, then runs benchmarks/gpu_check.py on CHECKS (default
# 2,4,3,1,5,6,7,8,9,10: the planner and throughput first) for at most SECONDS (default 540). The results file,
# rewritten after every row, and the log go to $OUT (else benchmarks/results/).
set -uo pipefail
checks=${1:-2,4,3,1,5,6,7,8,9,10}
seconds=${2:-540}
out=${OUT:-benchmarks/results}
name="gpu_check_${checks//,/-}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/wheels/*.whl || exit
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 - <<'PY' || exit
import importlib.metadata as metadata

import torch

names = ("torch", "transformers", "accelerate", "peft", "datasets", "evaluate", "bitsandbytes", "torchao")
print(", ".join(f"{name} {metadata.version(name)}" for name in names), f"| CUDA {torch.version.cuda}")
import bitsandbytes, datasets, evaluate, peft, sklearn, torchao  # noqa: E401,F401  (fail here, not after minutes)
import ft_accum.training.run_setup  # noqa: F401
PY
timeout -s INT "$seconds" python3 benchmarks/gpu_check.py --checks "$checks" --minilm_dir .gpu/minilm --smollm2_dir .gpu/smollm2 \
    --output "$out/$name.json" 2>&1 | tee "$out/$name.log"
