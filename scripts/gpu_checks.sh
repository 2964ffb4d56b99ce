#!/usr/bin/env bash
# The GPU work, batched (the H200 machine: no network, bundle in .gpu/):
#   source .gpu/install.sh && bash scripts/gpu_checks.sh OUT_DIR STEP...
# Steps: precompile (fill TileLang's disk cache in parallel), kernels (tests/gpu/test_kernels_gpu.py), backends
# (tests/gpu/test_backends_gpu.py), hardening (tests/gpu/test_hardening_gpu.py), lora (tests/gpu/test_lora_gpu.py),
# offload (tests/gpu/test_offload_gpu.py), bench_offload (longest sequence with / without activation offload),
# bench_kernels, bench_flash (KPool selection and NoPE sparse MLA), bench_layer,
# pretrain_megatron, pretrain_tilelang (python -m megatron_glm5.pretrain), pretrain_gpt_client (Megatron-LM's own
# pretrain_gpt.py with both specs: the client in shared/clients/megatron_lm, copied into .mlm/ and carried),
# bench_step (whole training steps of the GLM-5-shaped one-GPU slice through that pretrain_gpt.py: our kernels vs
# megatron-core's, report in OUT_DIR/step.md; needs .mlm/; run precompile first; BENCH_STEP_ARGS adds flags),
# indexer_loss_kernels (tests/gpu/test_indexer_loss_gpu.py: the fused sparse indexer-loss kernels vs the torch oracle;
# builds its kernels in parallel first), rms_norm (tests/gpu/test_rms_norm_gpu.py: the fused Triton RMSNorm vs torch,
# bitwise but for rare one-ulp flips, and its speed), swiglu (tests/gpu/test_swiglu_gpu.py: the fused Triton SwiGLU
# vs its oracle and megatron-core's eager functions, and its speed), moe_permute (tests/gpu/test_moe_permute_gpu.py:
# the gather-sum MoE permutation vs its oracle and megatron-core's, and its speed), rope_cat
# (tests/gpu/test_rope_cat_gpu.py: the fused RoPE + concatenation vs its oracle, and its speed), optim_fusions
# (tests/gpu/test_optim_fusions_gpu.py, test_optimizer_phase_gpu.py: weight-gradient accumulation, fused Adam and the
# device gradient clip vs their oracles, and speed; the deferred gradient checks without a host sync), fused_adamw
# (tests/gpu/test_fused_adamw_gpu.py: the AdamW kernel that writes the bf16 model copies vs torch's fused AdamW and
# copy_, bit for bit, through megatron-core's Float16OptimizerWithFloat16Params too, and its time), expert_wgrad (bench_expert_wgrad.py: the routed experts'
# weight gradients into main_grad, one GEMM per expert vs the grouped GEMM plus the one-launch add),
# zero_groups (tests/gpu/test_zero_groups_gpu.py: the zero-groups kernel vs masked_fill, and speed), mask_ranges
# (tests/gpu/test_mask_ranges_gpu.py: the dense mask's key ranges in one Triton pass vs the torch passes, and speed),
# grouped_wgrad_accum
# (tests/gpu/test_grouped_wgrad_accum_gpu.py: expert weight gradients into main_grad in one launch vs DDP's adds),
# grouped_route (the kernel tests with the grouped sparse MLA, the default route, also in their own autograd calls),
# per_query_route (the backend and RL GPU tests with MEGATRON_GLM5_GROUPED_SPARSE_MLA=0: the per-query kernels the
# route falls back to; bench_step's variant tilelang-grouped-per-query-mla times the step that way), memory_peak
# (what one step of the slice holds at its peak, by source line; MEMORY_ARGS adds flags, e.g. --seqs 32768 65536),
# long_context (tests/gpu/test_long_context_gpu.py: the DSA kernels at 262144 tokens, rows past 2^31 element offsets),
# mlp_chunks_client (Megatron-LM's pretrain_gpt.py with full recompute and --mlp-chunks-for-training 2, both specs),
# memory_cycles (the CUDA tensors a step of the slice leaves in reference cycles, and the objects of each cycle),
# precompile_dkv (the key-block dKV kernels and what their tests build), dkv (tests/gpu/test_sparse_mla_dkv_gpu.py),
# bench_dkv_packed (bench_dkv_key_blocks.py --packed all: the key-block route on packed batches past 8K tokens, and
# whether its rule picked the faster backward), profile_dkv (ncu on one launch of the key-block kernel, 16 heads, 8K,
# schedule $DKV_SCHEDULE, default wsp: OUT_DIR/dkv_ncu.txt with the full set and OUT_DIR/dkv_source.csv for ncu_source_summary.py).
# pp_options (the pp forward's opt-in builds against its default, bitwise: named barriers, the persistent grid),
# logits_overlap (the overlapped indexer logits kernel and the counted first select round against the plain kernel
# and the default select, bitwise), sweep_logits (sweep_dsa_round2.py --sections logits,first_round: every logits
# kernel at 32K causal and packed, and the indexer with the first round counted: OUT_DIR/logits.md),
# sweep_fwd (sweep_sparse_fwd.py, sections $SWEEP_SECTIONS, default fwd64,nope64,fwd16: OUT_DIR/fwd.md),
# kernels_ws (the kernel tests with the ws forward variant), bench_grouped (bench_grouped_experts.py), the indexer
# training clients (indexer_client_sparse: Megatron-LM's pretrain_gpt.py with the sparse indexer loss, both specs;
# indexer_client_warmup: the dense warm-up specs; indexer_pretrain_warmup: python -m megatron_glm5.pretrain with
# --dsa-indexer-warmup), bench_indexer_training, bench_indexer_loss, and the two-GPU runs of the tiny pretraining
# example (multi_tp2, multi_tp2_tilelang, multi_ep2, multi_pp2: need the x2 machine).
# Each step has its own log and time limit; a failing step does not stop the others.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=$1; shift
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1
# kernels built ahead on a machine without a GPU (scripts/tl_cache.py; carry .tlcache): TileLang loads them instead of
# compiling where the keys agree, and compiles as before where they do not
for archive in .tlcache/*.tar.xz; do
  [ -f "$archive" ] && eval "$(python3 scripts/tl_cache.py env "$archive")"
done
run() {  # run NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  echo "===== [gpu_checks] $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n "${TAIL:-30}" "$OUT_DIR/$name.log"
}
for step in "$@"; do
  case "$step" in
    precompile) run precompile 150 python3 scripts/bench/bench_dsa_kernels.py --precompile-only --workers 16 --sections sparse,indexer,kpool,nope ;;
    kernels) run kernels 240 python3 -m pytest tests/gpu/test_kernels_gpu.py -q -s -p no:cacheprovider ;;
    rms_norm) run rms_norm 120 python3 -m pytest tests/gpu/test_rms_norm_gpu.py -q -s -p no:cacheprovider ;;
    swiglu) run swiglu 120 python3 -m pytest tests/gpu/test_swiglu_gpu.py -q -s -p no:cacheprovider ;;
    moe_permute) run moe_permute 120 python3 -m pytest tests/gpu/test_moe_permute_gpu.py -q -s -p no:cacheprovider ;;
    mask_ranges) run mask_ranges 120 python3 -m pytest tests/gpu/test_mask_ranges_gpu.py -q -s -p no:cacheprovider ;;
    zero_groups) run zero_groups 120 python3 -m pytest tests/gpu/test_zero_groups_gpu.py -q -s -p no:cacheprovider ;;
    grouped_wgrad_accum) run grouped_wgrad_accum 120 python3 -m pytest tests/gpu/test_grouped_wgrad_accum_gpu.py -q -s -p no:cacheprovider ;;
    optim_fusions) run optim_fusions 120 python3 -m pytest tests/gpu/test_optim_fusions_gpu.py tests/gpu/test_optimizer_phase_gpu.py tests/gpu/test_deferred_grad_checks_gpu.py -q -s -p no:cacheprovider ;;
    fused_adamw) run fused_adamw 150 python3 -m pytest tests/gpu/test_fused_adamw_gpu.py -q -s -p no:cacheprovider ;;
    expert_wgrad) run expert_wgrad 120 python3 scripts/bench/bench_expert_wgrad.py ;;
    rope_cat) run rope_cat 120 python3 -m pytest tests/gpu/test_rope_cat_gpu.py -q -s -p no:cacheprovider ;;
    pp_options) run pp_options 300 python3 -m pytest tests/gpu/test_kernels_gpu.py -q -s -p no:cacheprovider \
      -k "fwd_pp_options or fwd_pp_persistent" ;;
    logits_overlap) run logits_overlap 300 python3 -m pytest tests/gpu/test_kernels_gpu.py -q -s -p no:cacheprovider \
      -k "logits_overlap or fused_first_round" ;;
    sweep_logits) TAIL=30 run sweep_logits 300 python3 scripts/bench/sweep_dsa_round2.py --sections logits,first_round \
      --workers 16 --out "$OUT_DIR/logits.md" ;;
    sweep_fwd) TAIL=60 run sweep_fwd 300 python3 scripts/bench/sweep_sparse_fwd.py --sections "${SWEEP_SECTIONS:-fwd64,nope64,fwd16}" \
      --out "$OUT_DIR/fwd.md" ;;
    kernels_ws) MEGATRON_GLM5_TEST_FWD_VARIANT=ws run kernels_ws 200 python3 -m pytest tests/gpu/test_kernels_gpu.py -q -s -p no:cacheprovider ;;
    grouped_route) MEGATRON_GLM5_TEST_GROUPED=1 run grouped_route 300 python3 -m pytest tests/gpu/test_kernels_gpu.py \
      -q -s -p no:cacheprovider ;;
    per_query_route) MEGATRON_GLM5_GROUPED_SPARSE_MLA=0 run per_query_route 300 python3 -m pytest \
      tests/gpu/test_backends_gpu.py tests/gpu/test_rl_gpu.py -q -s -p no:cacheprovider ;;
    backends) run backends 240 python3 -m pytest tests/gpu/test_backends_gpu.py -q -s -p no:cacheprovider ;;
    lora) run lora 200 python3 -m pytest tests/gpu/test_lora_gpu.py -q -s -p no:cacheprovider ;;
    indexer_loss_kernels) run indexer_loss_kernels 240 python3 -m pytest tests/gpu/test_indexer_loss_gpu.py -q -s -p no:cacheprovider ;;
    bench_flash) run bench_flash 200 python3 scripts/bench/bench_dsa_kernels.py --sections kpool,nope --out "$OUT_DIR/flash_kernels.md" ;;
    hardening) run hardening 240 python3 -m pytest tests/gpu/test_hardening_gpu.py -q -s -p no:cacheprovider ;;
    grouped) run grouped 120 python3 -m pytest tests/gpu/test_grouped_experts_gpu.py -q -s -p no:cacheprovider ;;
    bench_grouped) run bench_grouped 120 python3 scripts/bench/bench_grouped_experts.py --out "$OUT_DIR/grouped.md" ;;
    offload) run offload 300 python3 -m pytest tests/gpu/test_offload_gpu.py -q -s -p no:cacheprovider ;;
    bench_offload) run bench_offload 590 python3 scripts/bench/bench_offload.py --out "$OUT_DIR/offload.md" ${BENCH_ARGS:-} ;;
    pretrain_gpt_client) TAIL=12 run pretrain_gpt_client 420 bash .mlm/run_pretrain_gpt.sh ;;
    indexer_client_sparse) RUNS="get_glm5_spec get_glm5_tilelang_spec" OUT="$OUT_DIR/mlm_sparse" \
      EXTRA_ARGS="--dsa-indexer-loss-coeff 0.01 --dsa-indexer-use-sparse-loss --train-iters 20" TAIL=6 \
      run indexer_client_sparse 400 bash .mlm/run_pretrain_gpt.sh
      grep -hE "iteration +[0-9]+/" "$OUT_DIR"/mlm_sparse/*.log | sed -E 's/.*(iteration +[0-9]+\/ *[0-9]+).*(lm loss: [^|]*).*(indexer loss: [^|]*).*/\1 | \2 | \3/' ;;
    indexer_client_warmup) RUNS="get_glm5_warmup_spec get_glm5_tilelang_warmup_spec" OUT="$OUT_DIR/mlm_warmup" \
      EXTRA_ARGS="--dsa-indexer-loss-coeff 1.0 --train-iters 20" TAIL=6 \
      run indexer_client_warmup 400 bash .mlm/run_pretrain_gpt.sh
      grep -hE "indexer warm-up|iteration +[0-9]+/" "$OUT_DIR"/mlm_warmup/*.log | sed -E 's/.*(iteration +[0-9]+\/ *[0-9]+).*(lm loss: [^|]*).*(indexer loss: [^|]*).*/\1 | \2 | \3/' ;;
    indexer_pretrain_warmup) PARALLEL="--dsa-indexer-warmup" SAVE=0 run indexer_pretrain_warmup 200 bash examples/pretrain_glm5_tiny.sh tilelang ;;
    bench_indexer_training) TAIL=40 run bench_indexer_training 560 python3 scripts/bench/bench_indexer_training.py --out "$OUT_DIR/indexer_training.md" ${BENCH_ARGS:-} ;;
    bench_indexer_loss) TAIL=40 run bench_indexer_loss 400 python3 scripts/bench/bench_indexer_loss.py --out "$OUT_DIR/indexer_loss.md" ${BENCH_ARGS:-} ;;
    bench_kernels) run bench_kernels 300 python3 scripts/bench/bench_dsa_kernels.py --out "$OUT_DIR/kernels.md" ${BENCH_ARGS:-} ;;
    bench_step) TAIL=40 run bench_step 560 python3 scripts/bench/bench_step.py --out "$OUT_DIR/step.md" --timeout 150 --profile-variants tilelang,tilelang-unfused ${BENCH_STEP_ARGS:-} ;;
    long_context) run long_context 240 python3 -m pytest tests/gpu/test_long_context_gpu.py -q -s -p no:cacheprovider ;;
    mlp_chunks_client) RUNS="get_glm5_tilelang_spec get_glm5_spec" OUT="$OUT_DIR/mlm_chunks" TAIL=8 \
      EXTRA_ARGS="--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --mlp-chunks-for-training 2" \
      run mlp_chunks_client 420 bash .mlm/run_pretrain_gpt.sh ;;
    memory_cycles) TAIL=30 run memory_cycles 200 python3 scripts/bench/memory_peak.py --cycles --seqs 8192 65536 --out "$OUT_DIR/cycles.md" ${MEMORY_ARGS:-} ;;
    memory_peak) TAIL=80 run memory_peak 300 python3 scripts/bench/memory_peak.py --out "$OUT_DIR/memory.md" ${MEMORY_ARGS:-} ;;
    bench_layer) run bench_layer 180 python3 scripts/bench/bench_glm5_layer.py --out "$OUT_DIR/layer.md" ;;
    pretrain_megatron) run pretrain_megatron 150 bash examples/pretrain_glm5_tiny.sh megatron ;;
    pretrain_tilelang) run pretrain_tilelang 150 bash examples/pretrain_glm5_tiny.sh tilelang ;;
    multi_tp2) NPROC=2 SAVE=0 PARALLEL="--tensor-model-parallel-size 2 --sequence-parallel" run multi_tp2 120 bash examples/pretrain_glm5_tiny.sh megatron ;;
    multi_tp2_tilelang) NPROC=2 SAVE=0 PARALLEL="--tensor-model-parallel-size 2 --sequence-parallel" run multi_tp2_tilelang 120 bash examples/pretrain_glm5_tiny.sh tilelang ;;
    multi_ep2) NPROC=2 SAVE=0 PARALLEL="--expert-model-parallel-size 2" run multi_ep2 120 bash examples/pretrain_glm5_tiny.sh megatron ;;
    multi_pp2) NPROC=2 SAVE=0 PARALLEL="--pipeline-model-parallel-size 2" run multi_pp2 120 bash examples/pretrain_glm5_tiny.sh megatron ;;
    precompile_dkv) run precompile_dkv 200 python3 scripts/bench/bench_dkv_key_blocks.py --precompile-only --workers 16 ;;
    dkv) run dkv 240 python3 -m pytest tests/gpu/test_sparse_mla_dkv_gpu.py -q -s -p no:cacheprovider ;;
    bench_dkv_packed) TAIL=20 run bench_dkv_packed 300 python3 scripts/bench/bench_dkv_key_blocks.py --packed all \
      --seqs "" --out "$OUT_DIR/dkv_packed.md" ;;
    profile_dkv) run profile_dkv 240 ncu --set full --profile-from-start off -k regex:main_kernel \
        python3 scripts/bench/profile_bwd.py --heads 16 --seq 8192 --key-blocks "${DKV_SCHEDULE:-wsp}"
      cp "$OUT_DIR/profile_dkv.log" "$OUT_DIR/dkv_ncu.txt"
      run profile_dkv_source 240 ncu --section WarpStateStats --section SourceCounters --page source \
        --print-source sass --csv --profile-from-start off -k regex:main_kernel \
        python3 scripts/bench/profile_bwd.py --heads 16 --seq 8192 --key-blocks "${DKV_SCHEDULE:-wsp}"
      grep -n '"Address"' "$OUT_DIR/profile_dkv_source.log" > /dev/null \
        && sed -n '/"Address"/,$p' "$OUT_DIR/profile_dkv_source.log" > "$OUT_DIR/dkv_source.csv" ;;
    *) echo "unknown step $step" ;;
  esac
done
