#!/usr/bin/env bash
# GLM-5.x through a Megatron-LM checkout's own pretrain_gpt.py, with our block spec:
#   MEGATRON_LM=/path/to/Megatron-LM bash examples/pretrain_gpt_glm5.sh
# Megatron-LM builds the TransformerConfig from its flags, so every architecture flag of the model is spelled out
# (here: GLM-5.2 at full size; shrink --num-layers etc. for a smoke test). get_glm5_spec checks the GLM-specific
# numerics flags and names any that are missing. The IndexShare pattern comes from --dsa-indexer-topk-freq /
# --dsa-indexer-skip-topk-offset. Use `get_glm5_tilelang_spec` for the fused backend.
# MTP: Megatron-LM r0.19's GPT builder builds MTP from its own (non-DSA) layer specs and asserts on DSA, so add
# --mtp-num-layers only with `python -m megatron_glm5.pretrain`, which builds the MTP block itself.
#
# Without Transformer Engine (megatron-glm5 does not need it) keep `--transformer-impl local` (get_glm5_spec names it
# if it is missing). Megatron-LM's default gradient-accumulation fusion runs without apex on CUDA (megatron-glm5's own). Tensor parallelism needs
# CUDA_DEVICE_MAX_CONNECTIONS=1. `--make-vocab-size-divisible-by 1` keeps GLM-5.x's vocabulary (154880) unpadded at
# any TP that divides it, so a checkpoint from `megatron-glm5 convert import` loads with --load (a larger value pads
# the embedding, e.g. 1280 at TP=4 gives 158720 rows, and --load fails on its shape). Documents: pass
# --dataloader-inter-document-masking (THD packing), not --reset-attention-mask / --reset-position-ids (refused).
# If `megatron` resolves to the megatron-core wheel (no megatron/core/datasets/Makefile), Megatron-LM's start-up
# `make` fails: put a `make` that does nothing for that directory on PATH (shared/clients-style stand-in) or use
# `python -m megatron_glm5.pretrain`, which uses the wheel's prebuilt dataset helpers.
set -euo pipefail
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout}"
export CUDA_DEVICE_MAX_CONNECTIONS=1
torchrun --nproc-per-node "${NPROC:-8}" "$MEGATRON_LM/pretrain_gpt.py" \
  --spec megatron_glm5.spec get_glm5_spec \
  --num-layers 78 --hidden-size 6144 --ffn-hidden-size 12288 --num-attention-heads 64 \
  --multi-latent-attention --q-lora-rank 2048 --kv-lora-rank 512 --qk-head-dim 192 --qk-pos-emb-head-dim 64 \
  --v-head-dim 256 --qk-layernorm --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear \
  --untie-embeddings-and-output-weights --position-embedding-type rope --rope-type rope --rotary-base 8000000 \
  --no-rope-fusion --max-position-embeddings 1048576 --make-vocab-size-divisible-by 1 \
  --experimental-attention-variant dsa --dsa-indexer-n-heads 32 --dsa-indexer-head-dim 128 --dsa-indexer-topk 2048 \
  --dsa-indexer-topk-freq 4 --dsa-indexer-skip-topk-offset 3 --dsa-indexer-rope-interleaved \
  --no-dsa-indexer-rotate-activation --dsa-indexer-k-norm-epsilon 1e-6 --dsa-indexer-k-norm-fp32 \
  --num-experts 256 --moe-router-topk 8 --moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048 \
  --moe-layer-freq "([0]*3+[1]*75)" --moe-router-score-function sigmoid --moe-router-enable-expert-bias \
  --moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32 --moe-router-pre-softmax \
  --hidden-dropout 0 --attention-dropout 0 --transformer-impl local \
  --tensor-model-parallel-size 4 --sequence-parallel --pipeline-model-parallel-size 2 \
  --decoder-first-pipeline-num-layers 38 --expert-model-parallel-size 8 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 154880 \
  --seq-length 4096 --micro-batch-size 1 --global-batch-size 64 --train-iters 100 --lr 1e-5 --bf16
