#!/usr/bin/env bash
# GLM-5.3-Flash on the GPU machine. flash-linear-attention (fla, the KDA kernel) is an optional dependency: its two
# pure-Python wheels (and einops, which fla-core requires) are downloaded on a machine with network and carried to
# the GPU machine, which has none.
#
#   here (network):  bash scripts/gpu_glm5_next.sh fetch
#                    -> .whl/fla/{flash_linear_attention-0.6.0,fla_core-0.6.0,einops-*}.whl  (.whl/ is git-ignored)
#   GPU machine:     source .gpu/install.sh && bash scripts/gpu_glm5_next.sh run OUT_DIR [STEP...]
#                    (the device tool: command as above, carry=[".gpu", ".whl"])
#
# run installs the wheels into $FLA_SITE (default /tmp/fla-site, --no-deps: torch and triton are the machine's) and
# puts it on PYTHONPATH. fla's TileLang KDA backward backend is switched off (FLA_TILELANG=0, its Triton path is what
# transformers and these checks measure; export FLA_TILELANG=1 to try it).
# Steps (default: precompile tests):
#   precompile         compile fla's chunk_kda at the tests' keys (with the committed configs; autotune them under
#                      FLA_TUNED=0) (scripts/fla_precompile.py, one process per key, in parallel) and fill
#                      TileLang's disk cache for the Flash kernels; later
#                      processes of the same machine then start without tuning or compiling
#   tests              tests/gpu/test_glm5_next_gpu.py: fla chunk_kda vs the torch / fp64 reference (fwd + grads,
#                      bshd + varlen, fp32 + bf16), KDA layer fla vs torch, the fla logit-gap diagnosis, 20 training
#                      steps of small_flash_config on both attention backends
#   pretrain_megatron  python -m megatron_glm5.pretrain --hf-config <small GLM-5.3-Flash> (Megatron-LM loop, mock data,
#   pretrain_tilelang  20 iterations, bf16): examples/pretrain_glm53_flash_tiny.sh (needs .mlm/ for megatron.training)
#   bench_kda          scripts/bench/bench_kda.py: KDA kernel and layer, fla vs the torch reference, 4K / 16K / 64K
#   bench_step         scripts/bench/bench_glm53_step.py: the GLM-5.3-Flash one-GPU slice through Megatron-LM's loop
#                      (needs .mlm/), report in OUT_DIR/glm53_step.md
#   dump_autotune      Triton's autotune records of this machine (fla's choices) as one OUT_DIR/triton_autotune.tar.gz:
#                      python3 scripts/fla_tuned_configs.py triton_autotune.tar.gz --out scripts/fla_configs/<GPU>
#                      turns them into fla config files; FLA_TUNED=1 (the default) makes fla use them (FLA_CONFIG_DIR,
#                      FLA_CACHE_MODE=full: no autotuning at all for the kernels they cover)
#   multi_pp2          pretrain_megatron on 2 GPUs at --pipeline-model-parallel-size 2 (stages of 4 + 4 layers: the mHC streams
#                      cross the boundary into a stage that starts on a KDA layer; MTP on the last stage)
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl/fla
case "${1:-}" in
  fetch)
    mkdir -p "$WHEELS"
    python3 -m pip download --no-deps -d "$WHEELS" flash-linear-attention==0.6.0 fla-core==0.6.0 einops
    ls -l "$WHEELS"
    exit 0 ;;
  run) shift ;;
  *) echo "usage: $0 fetch | run OUT_DIR [tests|pretrain_megatron|pretrain_tilelang|multi_pp2 ...]" >&2; exit 2 ;;
esac
OUT_DIR=$1; shift
mkdir -p "$OUT_DIR"
export FLA_SITE=${FLA_SITE:-/tmp/fla-site}
if [ ! -f "$FLA_SITE/.installed" ]; then
  ls "$WHEELS"/*.whl > /dev/null || { echo "no wheels in $WHEELS: run '$0 fetch' on a machine with network" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$FLA_SITE" "$WHEELS"/*.whl && touch "$FLA_SITE/.installed"
fi
MLM=${MLM:-$PWD/.mlm}  # Megatron-LM (megatron.training) for the pretrain and bench_step steps, when carried
export PYTHONPATH="$PWD:$FLA_SITE${PYTHONPATH:+:$PYTHONPATH}${MLM:+:$MLM}" PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1
export FLA_TILELANG=${FLA_TILELANG:-0}
if [ "${FLA_TUNED:-1}" = 1 ]; then  # fla's config cache (read when fla is imported): see dump_autotune; FLA_TUNED=0 autotunes
  GPU_NAME=$(python3 -c "import re, torch; print(re.sub('[^0-9A-Za-z]+', '_', torch.cuda.get_device_name(0)).strip('_'))")
  if [ -d "scripts/fla_configs/$GPU_NAME" ]; then
    export FLA_CONFIG_DIR="$PWD/scripts/fla_configs/$GPU_NAME" FLA_CACHE_MODE=${FLA_CACHE_MODE:-full}
    echo "fla configs: $FLA_CONFIG_DIR ($FLA_CACHE_MODE)"
  else
    echo "FLA_TUNED=1 but no scripts/fla_configs/$GPU_NAME: fla autotunes as usual"
  fi
fi
python3 -c "import fla, torch, triton; from fla.ops.kda import chunk_kda; print('fla', fla.__version__, '| torch', torch.__version__, '| triton', triton.__version__)"
run() {  # run NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  echo "===== [gpu_glm5_next] $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n "${TAIL:-40}" "$OUT_DIR/$name.log"
}
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(precompile tests)
for step in "${steps[@]}"; do
  case "$step" in
    precompile)
      run precompile_fla ${PRECOMPILE_LIMIT:-240} python3 scripts/fla_precompile.py --keys ${FLA_KEYS:-tests} &
      run precompile_tilelang 200 python3 scripts/bench/bench_dsa_kernels.py --precompile-only --workers 8 --sections kpool,nope,flash_small
      wait ;;
    tests) run tests ${TESTS_LIMIT:-300} python3 -m pytest tests/gpu/test_glm5_next_gpu.py -v -s -p no:cacheprovider ;;
    pretrain_megatron) run pretrain_megatron 200 bash examples/pretrain_glm53_flash_tiny.sh megatron ;;
    pretrain_tilelang) run pretrain_tilelang 200 bash examples/pretrain_glm53_flash_tiny.sh tilelang ;;
    bench_kda) run bench_kda ${BENCH_KDA_LIMIT:-300} python3 scripts/bench/bench_kda.py --out "$OUT_DIR/kda.md" ${BENCH_KDA_ARGS:-} ;;
    bench_step) run bench_step ${BENCH_STEP_LIMIT:-540} python3 scripts/bench/bench_glm53_step.py --out "$OUT_DIR/glm53_step.md" ${BENCH_STEP_ARGS:-} ;;
    dump_autotune)
      cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}; out_abs=$(cd "$OUT_DIR" && pwd)
      (cd "$cache" && find . -name '*.autotune.json' | tar czf "$out_abs/triton_autotune.tar.gz" -T -) &&
        echo "===== [gpu_glm5_next] dump_autotune: $(tar tzf "$OUT_DIR/triton_autotune.tar.gz" | wc -l) records" ;;
    multi_pp2) NPROC=2 PARALLEL="--pipeline-model-parallel-size 2" run multi_pp2 200 \
      bash examples/pretrain_glm53_flash_tiny.sh megatron ;;
    *) echo "unknown step $step" ;;
  esac
done
