#!/usr/bin/env bash
# Train a small GLM-5.3-Flash-shaped model (KDA + NoPE DSA layers in mHC streams, MoE, MTP; real head widths) for
# 20 steps on mock data, on one GPU, with Megatron-LM's training loop and the GLM-5.3-Flash block spec.
#   bash examples/pretrain_glm53_flash_tiny.sh [megatron|tilelang]
# Environment: NPROC (GPUs, default 1), PARALLEL (extra Megatron-LM flags, e.g. "--tensor-model-parallel-size 2
# --sequence-parallel" or "--pipeline-model-parallel-size 2"; no virtual pipeline stages). The KDA kernel is
# flash-linear-attention's when it is importable (pip install flash-linear-attention), else the torch reference.
# Needs CUDA; on CPU run `megatron-glm5 demo --model glm5.3-flash` instead.
set -euo pipefail
BACKEND=${1:-megatron}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
WORK=${WORK:-$(mktemp -d)}
python3 - "$WORK" <<'PY'
import json, sys
from megatron_glm5.glm5_next.testing import small_flash_config
open(f"{sys.argv[1]}/config.json", "w").write(json.dumps({"model_type": "glm5_next", **small_flash_config()}, indent=2))
PY
python3 -m torch.distributed.run --nproc-per-node "${NPROC:-1}" -m megatron_glm5.pretrain \
  --hf-config "$WORK" --glm5-backend "$BACKEND" \
  --mock-data --tokenizer-type NullTokenizer \
  --seq-length 1024 --micro-batch-size 2 --global-batch-size 8 \
  --train-iters 20 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 \
  --weight-decay 0.01 --clip-grad 1.0 --bf16 \
  --log-interval 1 --eval-iters 0 --eval-interval 1000 \
  --no-rope-fusion --moe-token-dispatcher-type allgather \
  ${PARALLEL:-}
