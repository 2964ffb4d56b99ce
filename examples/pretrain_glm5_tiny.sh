#!/usr/bin/env bash
# Train a small GLM-5.2-shaped model (IndexShare + MTP + MoE, real MLA latent dims) for 20 steps on mock data,
# on one GPU, with Megatron-LM's training loop (megatron.training.pretrain) and the GLM-5.x block spec.
#   bash examples/pretrain_glm5_tiny.sh [megatron|tilelang]
# Environment: NPROC (GPUs, default 1), PARALLEL (extra Megatron-LM flags, e.g. "--tensor-model-parallel-size 2
# --sequence-parallel"), SAVE=0 to skip the final checkpoint. Needs CUDA; on CPU run `megatron-glm5 demo` instead.
set -euo pipefail
BACKEND=${1:-megatron}
# Megatron-LM requires this with tensor or context parallelism (kernel ordering of its communication overlap).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
WORK=${WORK:-$(mktemp -d)}
python3 - "$WORK" <<'PY'
import json, sys
from megatron_glm5.testing import small_glm52_config
open(f"{sys.argv[1]}/config.json", "w").write(json.dumps(small_glm52_config(), indent=2))
PY
SAVE_ARGS=$([ "${SAVE:-1}" = 1 ] && echo "--save $WORK/ckpt --save-interval 20" || echo "")
python3 -m torch.distributed.run --nproc-per-node "${NPROC:-1}" -m megatron_glm5.pretrain \
  --hf-config "$WORK" --glm5-backend "$BACKEND" \
  --mock-data --tokenizer-type NullTokenizer \
  --seq-length 1024 --micro-batch-size 2 --global-batch-size 8 \
  --train-iters 20 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 \
  --weight-decay 0.01 --clip-grad 1.0 --bf16 \
  --log-interval 1 --eval-iters 0 --eval-interval 1000 \
  --no-rope-fusion --moe-token-dispatcher-type allgather \
  ${PARALLEL:-} $SAVE_ARGS
