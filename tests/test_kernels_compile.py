"""The TileLang DSA kernels compile for SM90 (sm_90a) on a CPU-only machine, and their interfaces reject bad input.

Compilation needs TileLang and nvcc but no GPU: each factory is built at one small shape (other head dims, the
mma.sync path below 64 heads), at the GLM-5 shape (576 = 512 + 64 RoPE) and, for sparse MLA and the indexer loss's
attention target, at the NoPE shape of GLM-5.3-Flash (512 = 512 + 0: no tail); the top-k select also at KPool's
2048 / 4 = 512 pools. Two compiles at a time in spawned workers (~3 min on 2 cores, less with TileLang's disk cache).
Numerics are checked on the GPU (``tests/gpu/test_kernels_gpu.py``).
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import multiprocessing as mp
import os
import shutil

import pytest
import torch

from megatron_glm5.kernels import _common
from megatron_glm5.kernels.sparse_mla_bwd import deterministic_chunk_rows, sparse_mla_bwd_interface
from megatron_glm5.kernels.sparse_mla_fwd import head_block, sparse_mla_fwd_interface

indexer_mod = importlib.import_module("megatron_glm5.kernels.indexer_topk")  # the package exports a same-named function
loss_mod = importlib.import_module("megatron_glm5.kernels.indexer_loss")
target_mod = importlib.import_module("megatron_glm5.kernels.sparse_attention_target")

SM90 = '{"kind": "cuda", "arch": "sm_90a"}'

# (module, jit getter, args): "small" = other head/latent dims and head counts below 64 (mma.sync path).
COMPILE_CASES = {
    "fwd_ws_small": ("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_ws", (8, 192, 128, 0.125)),
    "fwd_ws_glm": ("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_ws", (64, 576, 512, 1 / 16)),
    # grouped (the default route at 16 heads): 4 queries x 16 heads per CTA over the union of their index sets
    "fwd_ws_grouped_glm": ("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_ws", (16, 576, 512, 1 / 16, 64, 4)),
    "bwd_grouped_glm": ("megatron_glm5.kernels.sparse_mla_bwd", "_jit_bwd", (16, 576, 512, 1 / 16, False, 32, 0, False,
                                                                          0, 4)),
    # experimental: 2 queries x 16 heads (32-row tiles: the dQ accumulator fits without spills)
    "bwd_grouped2_glm": ("megatron_glm5.kernels.sparse_mla_bwd", "_jit_bwd", (16, 576, 512, 1 / 16, False, 32, 0, False,
                                                                           0, 2)),
    # the scores / values split forward (opt-in variant "sv"): P over the RoPE tail tile, and its own P tiles (NoPE)
    "fwd_sv_glm": ("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_sv", (64, 576, 512, 1 / 16)),
    "fwd_sv_nope": ("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_sv", (64, 512, 512, 1 / 16)),
    "fwd_sv_grouped_glm": ("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_sv", (16, 576, 512, 1 / 16, 4)),
    # the ping-pong forward (the default at 64 MMA rows): P of the even block over the RoPE tail tile, or its own (NoPE)
    "fwd_pp_glm": ("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_pp", (64, 576, 512, 1 / 16)),
    "fwd_pp_nope": ("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_pp", (64, 512, 512, 1 / 16)),
    "fwd_pp_grouped_glm": ("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_pp", (16, 576, 512, 1 / 16, 4)),
    # the pp options off (all on by default): masks from the index row in L1, WG1's P copied under its GEMM, index
    # entries loaded after each wait, TileLang's thread-storage syncs
    "fwd_pp_neither_grouped_glm": ("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_pp",
                                   (16, 576, 512, 1 / 16, 4, (216, 216, 72), False, False, False, True)),
    # opt-in: the math warpgroups' handovers through named barriers
    "fwd_pp_named_glm": ("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_pp",
                         (64, 576, 512, 1 / 16, 1, (216, 216, 72), True, True, True, False, True)),
    # opt-in: a persistent grid of 132 CTAs walking (query group, head block) items
    "fwd_pp_persistent_grouped_glm": ("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_pp",
                                      (16, 576, 512, 1 / 16, 4, (216, 216, 72), True, True, True, False, False, 132)),
    # experimental: dKV chunks staged over the KV stage and added by sm90 bulk reductions
    "bwd_bulk_glm": ("megatron_glm5.kernels.sparse_mla_bwd", "_jit_bwd", (16, 576, 512, 1 / 16, False, 32, 0, False,
                                                                         0, 1, "bulk")),
    "bwd_bulk_grouped_nope": ("megatron_glm5.kernels.sparse_mla_bwd", "_jit_bwd", (16, 512, 512, 1 / 16, False, 32,
                                                                                  0, False, 0, 4, "bulk")),
    "fwd_simple_small": ("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_simple", (16, 192, 128, 0.125)),
    "bwd_small_deterministic": ("megatron_glm5.kernels.sparse_mla_bwd", "_jit_bwd", (8, 192, 128, 0.125, True)),
    "bwd_glm": ("megatron_glm5.kernels.sparse_mla_bwd", "_jit_bwd", (64, 576, 512, 1 / 16, False)),
    # NoPE latent (GLM-5.3-Flash): d_qk == d_v, no RoPE tail; same kernels, tail steps left out at trace time
    "fwd_ws_nope": ("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_ws", (64, 512, 512, 1 / 16)),
    "fwd_simple_nope_small": ("megatron_glm5.kernels.sparse_mla_fwd", "_jit_fwd_simple", (16, 128, 128, 0.125)),
    "bwd_nope": ("megatron_glm5.kernels.sparse_mla_bwd", "_jit_bwd", (64, 512, 512, 1 / 16, False)),
    "bwd_nope_small_deterministic": ("megatron_glm5.kernels.sparse_mla_bwd", "_jit_bwd", (8, 128, 128, 0.125, True)),
    "delta_glm": ("megatron_glm5.kernels.sparse_mla_bwd", "_jit_delta", (64, 512)),
    # the key-block dKV pass at 16 heads: the warp-specialised kernel ("wsp", the default)
    "dkv_wsp_glm": ("megatron_glm5.kernels.sparse_mla_dkv", "_jit_dkv_key_blocks_ws", (16, 576, 512, 1 / 16)),
    "dkv_reduce_glm": ("megatron_glm5.kernels.sparse_mla_bwd", "_jit_dkv_reduce", (576, 1)),
    "indexer_logits_small": ("megatron_glm5.kernels.indexer_topk", "_jit_logits", (8, 64)),
    "indexer_logits_glm": ("megatron_glm5.kernels.indexer_topk", "_jit_logits", (32, 128)),
    # the logits kernel without warp specialisation (2 CTAs per SM): the interface's default where the shape fits
    "indexer_logits_plain_glm": ("megatron_glm5.kernels.indexer_topk", "_jit_logits_plain", (32, 128)),
    # 8 queries per CTA over 64-key tiles (a [64, 256] accumulator; measured no faster than the default)
    "indexer_logits_plain_q8": ("megatron_glm5.kernels.indexer_topk", "_jit_logits_plain", (32, 128, 64, 128, 2, 8)),
    # opt-in: tile n + 1's GEMM under tile n's epilogue (two accumulators, 3 or 4 key stages)
    "indexer_logits_overlap_glm": ("megatron_glm5.kernels.indexer_topk", "_jit_logits_overlap", (32, 128)),
    "indexer_logits_overlap4_small": ("megatron_glm5.kernels.indexer_topk", "_jit_logits_overlap",
                                      (8, 64, 64, 128, 2, 4)),
    # ... with TileLang's thread-storage syncs (four barriers per step instead of the kernel's own two)
    "indexer_logits_overlap_synced_glm": ("megatron_glm5.kernels.indexer_topk", "_jit_logits_overlap",
                                          (32, 128, 64, 128, 2, 3, False, True)),
    # opt-in: the select's first radix round counted as the logits are stored, and the select that starts after it
    "indexer_logits_plain_hist_glm": ("megatron_glm5.kernels.indexer_topk", "_jit_logits_plain",
                                      (32, 128, 128, 128, 2, 0, True)),
    "indexer_logits_overlap_hist_glm": ("megatron_glm5.kernels.indexer_topk", "_jit_logits_overlap",
                                        (32, 128, 64, 128, 2, 3, True)),
    "topk_select_pre_hist_glm": ("megatron_glm5.kernels.indexer_topk", "_jit_select",
                                 (2048, 256, 0, 4, 8, True, None, True)),
    "topk_select_small": ("megatron_glm5.kernels.indexer_topk", "_jit_select", (64,)),
    "topk_select_glm": ("megatron_glm5.kernels.indexer_topk", "_jit_select", (2048,)),
    # the select before the lean one (clamped iterations, TileLang's access guards; the GPU test's reference)
    "topk_select_guarded": ("megatron_glm5.kernels.indexer_topk", "_jit_select", (2048, 256, 0, 4, 8, False)),
    # ... and at a top-k below the thread count (TileLang's barrier planner refused one form of its collect there)
    "topk_select_guarded_small": ("megatron_glm5.kernels.indexer_topk", "_jit_select", (64, 256, 0, 4, 8, False)),
    # 11-bit score digits: three radix rounds over the score, a 2048-bin histogram searched 8 bins per thread
    "topk_select_digits11": ("megatron_glm5.kernels.indexer_topk", "_jit_select", (2048, 256, 0, 4, 11)),
    # KPool (GLM-5.3-Flash): the same indexer kernel scores the pool keys, top-(index_topk // P) = 512 pools
    "topk_select_kpool": ("megatron_glm5.kernels.indexer_topk", "_jit_select", (512,)),
    # sparse indexer KL loss (5 kernels, ~20-30 s each cold on 2 cores): index scores at GLM-5's 32 x 128, the
    # indexer backward there (fp32 atomics) and deterministic at 64 index heads (256 threads), the attention target
    # at 16 heads (mma.sync) x 576 and 64 heads (wgmma) x 512 (NoPE: no tail)
    "index_scores_glm": ("megatron_glm5.kernels.indexer_loss", "_jit_index_scores", (32, 128)),
    "index_bwd_glm": ("megatron_glm5.kernels.indexer_loss", "_jit_index_bwd", (32, 128)),  # dki: float2 atomics
    "index_bwd_glm_bulk": ("megatron_glm5.kernels.indexer_loss", "_jit_index_bwd", (32, 128, False, 64, 0, "bulk")),
    # the sparse-MLA backward that also writes the head-summed P (the loss-after-attention target)
    "bwd_glm_target": ("megatron_glm5.kernels.sparse_mla_bwd", "_jit_bwd", (16, 576, 512, 1 / 16, False, 32, 0, True)),
    "index_bwd_64_deterministic": ("megatron_glm5.kernels.indexer_loss", "_jit_index_bwd", (64, 128, True)),
    "attention_target_glm": ("megatron_glm5.kernels.sparse_attention_target", "_jit_target", (16, 576, 1 / 16)),
    "attention_target_nope": ("megatron_glm5.kernels.sparse_attention_target", "_jit_target", (64, 512, 1 / 16)),
}


def _check_pp_source(src: str, lean: bool) -> None:
    """The ``pp`` forward's default build has no TileLang thread-storage syncs and its producer loads the pair's index
    entries before its first wait for a free stage; the build with every option off has both the syncs and the loads
    after that wait."""
    producer = src[src.index("warpgroup_reg_dealloc"):]
    loads_first = producer.index("Idx[") < producer.index("bar_free[0].wait")
    assert ("__sync_thread_partial" not in src) == lean and loads_first == lean, (lean, loads_first)


def _compile_one(case: str) -> tuple[str, int, str]:
    """Worker: build one kernel for sm_90a; returns (case, CUDA source length, the kernel entry's name)."""
    os.environ["TILELANG_DEFAULT_TARGET"] = SM90
    module, getter, args = COMPILE_CASES[case]
    kernel = getattr(importlib.import_module(module), getter)()(*args)
    src = kernel.get_kernel_source()
    if "bulk" in case:  # an option silently dropped would still build: its bulk copies must be in the source
        assert "glm5_bulk_add_f32" in src, case
    if "hist" in case:  # the counts reach the source; the select's only warp match (its first pass) is gone
        matches = src.count("__match_any_sync")
        assert "Hist[" in src and (matches == 0 if case.startswith("topk") else matches > 0), (case, matches)
    if case.startswith("fwd_pp"):  # the pp build options must reach the source
        _check_pp_source(src, lean="neither" not in case)
        named = ["glm5_bar_arrive(8, 256)", "glm5_bar_sync(8, 256)",
                 "glm5_bar_arrive(11, 256)", "glm5_bar_sync(11, 256)"]
        assert all(n in src for n in named) == ("named" in case), case
        # the persistent walk: Q's and the row sums' barriers change phase per item, the per-pair ones run on
        walk = ["bar_q[0].wait((k & 1))", "bar_l[1].wait((k & 1))", "done[0] = (done[0] + item[2])"]
        assert all(w in src for w in walk) == ("persistent" in case), case
    return case, len(src), "__global__" if "__global__" in src else ""


@pytest.fixture(scope="module")
def compiled():
    pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"):
        pytest.skip("nvcc not found: TileLang needs it to build kernels")
    ctx = mp.get_context("spawn")  # TileLang/TVM state does not survive fork reliably
    with cf.ProcessPoolExecutor(max_workers=2, mp_context=ctx) as pool:
        results = {}
        for fut in cf.as_completed([pool.submit(_compile_one, c) for c in COMPILE_CASES]):
            try:
                case, n, entry = fut.result()
                results[case] = (n, entry)
            except Exception as err:  # keep the others; the per-case test reports it
                results.setdefault("_errors", []).append(repr(err))
    return results


@pytest.mark.parametrize("case", sorted(COMPILE_CASES))
def test_kernel_compiles_for_sm90(compiled, case):
    assert case in compiled, f"{case} did not compile: {compiled.get('_errors')}"
    n, entry = compiled[case]
    assert n > 0 and entry == "__global__"


@pytest.mark.parametrize("stages,hist", [(3, False), (4, False), (3, True), (4, True)])
def test_overlapped_logits_kernel_keeps_its_wgmma_in_flight(stages, hist, monkeypatch):
    """The overlapped logits kernel exists to run tile n + 1's ``wgmma`` under tile n's epilogue; ``ptxas``
    serialises every ``wgmma`` of a kernel (warnings C7514 / C7515, or injects waits: C7517) when a non-``wgmma``
    instruction may touch an in-flight accumulator, which an innocent-looking change to the loop (a guard around the
    next GEMM, a GEMM in flight across the loop's back edge) brings back. Also no spills."""
    pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench", "ptxas_regs.py"),
                          "megatron_glm5.kernels.indexer_topk", "_jit_logits_overlap", "32", "128", "--kw",
                          f"stages={stages}", "--kw", f"hist={hist}"], capture_output=True, text=True, cwd=root,
                         timeout=900,
                         env=dict(os.environ, TILELANG_DEFAULT_TARGET=SM90, PYTHONPATH=root))
    report = res.stdout + res.stderr
    assert "Used " in report and " 0 bytes spill stores" in report, report[-2000:]
    for sign in ("C7514", "C7515", "C7517", "Potential Performance Loss", "serialized", "injected"):
        assert sign not in report, report[-2000:]
    # and the overlap itself, which no warning would report lost: in every step the next GEMM is issued, tile n's
    # is waited for with one group left in flight, and only then does the epilogue run
    monkeypatch.setenv("TILELANG_DEFAULT_TARGET", SM90)
    src = indexer_mod._jit_logits_overlap()(32, 128, 64, 128, 2, stages, *((True,) if hist else ()))
    src = src.get_kernel_source()
    loop = src[src.index("for (int ip = 0;"):]
    steps = loop.split("tl::wait_wgmma<1>();")
    assert len(steps) - 1 == 2, len(steps)  # the two accumulators' steps; the stage index is dynamic
    # the kernel's own two barriers per step (TileLang's planner put four), plus the counts' store
    assert loop.count("__syncthreads()") == 2 * (len(steps) - 1) + hist, loop.count("__syncthreads()")
    for before, after in zip(steps[:-1], steps[1:]):
        assert "wgmma_ss" in before.rsplit("__fmul_rn", 1)[-1]  # the next GEMM issued since the last epilogue
        assert "__fmul_rn" in after  # the epilogue after the wait


# --------------------------------------------------------------------------------------------------------------------
# Interface validation (CPU tensors: checks run before any TileLang call)
# --------------------------------------------------------------------------------------------------------------------


def _sparse_inputs(t=8, h=16, d=576, k=64):
    q = torch.zeros(t, h, d, dtype=torch.bfloat16)
    kv = torch.zeros(t, d, dtype=torch.bfloat16)
    idx = torch.full((t, k), -1, dtype=torch.int32)
    return q, kv, idx


@pytest.mark.parametrize(
    "mutate,err",
    [
        (lambda q, kv, idx: (q.float(), kv, idx), TypeError),
        (lambda q, kv, idx: (q, kv.half(), idx), TypeError),
        (lambda q, kv, idx: (q, kv, idx.long()), TypeError),
        (lambda q, kv, idx: (q, kv[:, :512].contiguous(), idx), ValueError),
        (lambda q, kv, idx: (q, kv, idx[:4].contiguous()), ValueError),
        (lambda q, kv, idx: (q.transpose(0, 1), kv, idx), ValueError),
        (lambda q, kv, idx: (torch.zeros(8, 129, 576, dtype=torch.bfloat16), kv, idx), ValueError),
        (lambda q, kv, idx: (q, kv, idx[:, :0].contiguous()), ValueError),
    ],
)
def test_sparse_mla_interface_rejects(mutate, err):
    q, kv, idx = mutate(*_sparse_inputs())
    with pytest.raises(err):
        sparse_mla_fwd_interface(q, kv, idx, 1 / 16, 512)


def test_sparse_mla_interface_rejects_unsupported_dims_and_bwd_shapes():
    q, kv, idx = _sparse_inputs(d=520)
    with pytest.raises(ValueError, match="d_v"):
        sparse_mla_fwd_interface(q, kv, idx, 1 / 16, 500)
    q, kv, idx = _sparse_inputs()
    out = torch.zeros(8, 16, 512, dtype=torch.bfloat16)
    lse = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="grad_out"):
        sparse_mla_bwd_interface(q, kv, out, lse, out[:4].contiguous(), idx, 1 / 16)
    with pytest.raises(ValueError, match="lse"):
        sparse_mla_bwd_interface(q, kv, out, lse.double(), out, idx, 1 / 16)
    with pytest.raises(ValueError, match=r"dkv_reduce must be one of \('atomic', 'bulk', 'key_blocks'\), got 'tma'"):
        sparse_mla_bwd_interface(q, kv, out, lse, out, idx, 1 / 16, dkv_reduce="tma")
    with pytest.raises(ValueError, match="not with deterministic=True"):
        sparse_mla_bwd_interface(q, kv, out, lse, out, idx, 1 / 16, deterministic=True, dkv_reduce="bulk")


def test_sparse_mla_fwd_variants_and_register_splits():
    """``sv`` and ``pp`` need 64-row tiles (the check runs before any build); the warp-specialised factories refuse
    register splits larger than the CTA's own allocation, which would make ``setmaxnreg`` wait forever (a hang, not
    an error, on the GPU), or moving registers the wrong way; the grouped forward takes only its three schedules;
    ``auto`` is ``pp`` at 64 MMA rows and ``ws`` below."""
    from megatron_glm5.kernels.sparse_mla_fwd import _jit_fwd_pp, _jit_fwd_sv, _jit_fwd_ws, pick_fwd_variant

    assert [pick_fwd_variant(h, 576, 512) for h in (8, 16, 32, 33, 64, 128)] == ["ws"] * 3 + ["pp"] * 3
    assert pick_fwd_variant(64, 576, 512, "ws") == "ws"

    q, kv, idx = _sparse_inputs(h=16)
    with pytest.raises(ValueError, match="64 MMA rows"):
        sparse_mla_fwd_interface(q, kv, idx, 1 / 16, 512, variant="sv")
    with pytest.raises(ValueError, match="64 MMA rows"):
        sparse_mla_fwd_interface(q, kv, idx, 1 / 16, 512, variant="pp")
    with pytest.raises(ValueError, match="'ws', 'sv' or 'pp'"):
        sparse_mla_fwd_interface(q, kv, idx, 1 / 16, 512, variant="simple", group=4)
    pytest.importorskip("tilelang")
    with pytest.raises(ValueError, match="sum to <= 504"):
        _jit_fwd_ws()(64, 576, 512, 1 / 16, 64, 1, (256, 168, 88))
    with pytest.raises(ValueError, match="sum to <= 504"):
        _jit_fwd_sv()(64, 576, 512, 1 / 16, 1, (144, 184, 184))
    with pytest.raises(ValueError, match="increases, so it must be >= 168"):  # an increase below the launch count
        _jit_fwd_sv()(64, 576, 512, 1 / 16, 1, (144, 160, 176))
    with pytest.raises(ValueError, match=r"nreg\[0\] decreases, so it must be <= 168"):  # a decrease above it
        _jit_fwd_sv()(64, 576, 512, 1 / 16, 1, (176, 168, 160))
    with pytest.raises(ValueError, match="64 MMA rows"):
        _jit_fwd_sv()(16, 576, 512, 1 / 16)
    with pytest.raises(ValueError, match="sum to <= 504"):
        _jit_fwd_pp()(64, 576, 512, 1 / 16, 1, (216, 216, 80))
    with pytest.raises(ValueError, match=r"nreg\[0\] increases, so it must be >= 168"):
        _jit_fwd_pp()(64, 576, 512, 1 / 16, 1, (160, 176, 168))
    with pytest.raises(ValueError, match="64 MMA rows"):
        _jit_fwd_pp()(32, 576, 512, 1 / 16)
    with pytest.raises(ValueError, match="named_exchange needs storage_sync=False"):  # barrier ids would collide
        _jit_fwd_pp()(64, 576, 512, 1 / 16, 1, (216, 216, 72), True, True, True, True, True)


def test_sparse_mla_bwd_bulk_dkv_refuses_what_it_cannot_stage():
    """The bulk dKV reduction stages a ``[block_s, d_v / dkv_split]`` fp32 chunk in half a KV stage (``d_v / 4`` fp32
    per row) with a thread per slot row; anything else is refused at build time, before any GPU, naming the sizes."""
    pytest.importorskip("tilelang")
    from megatron_glm5.kernels.sparse_mla_bwd import _jit_bwd

    with pytest.raises(ValueError, match="dkv_reduce must be 'atomic' or 'bulk'"):
        _jit_bwd()(16, 576, 512, 1 / 16, False, dkv_reduce="tma")
    with pytest.raises(ValueError, match="d_v=128, dkv_split=2"):  # small latents: 64-wide chunks, 32-float halves
        _jit_bwd()(16, 192, 128, 1 / 8, False, dkv_reduce="bulk")
    with pytest.raises(ValueError, match="dkv_split=2"):  # 256-wide chunks do not fit a 128-float half
        _jit_bwd()(16, 576, 512, 1 / 16, False, dkv_split=2, dkv_reduce="bulk")
    with pytest.raises(ValueError, match="not with deterministic=True"):  # the partial-buffer path has no atomics
        _jit_bwd()(16, 576, 512, 1 / 16, True, dkv_reduce="bulk")


def test_topk_select_refuses_bad_batch_and_digit_bits():
    pytest.importorskip("tilelang")
    with pytest.raises(ValueError, match="batch >= 1, got 0"):
        indexer_mod._jit_select()(2048, batch=0)
    with pytest.raises(ValueError, match="digit_bits 8, 11 or 12, got 10"):
        indexer_mod._jit_select()(2048, digit_bits=10)
    # the shortlist pass assumes the lean key map and 8-bit digits, and one shortlist entry per thread
    for kwargs in ({"lean": False}, {"digit_bits": 11}, {"shortlist": 512}):
        with pytest.raises(ValueError, match="shortlist needs lean=True, digit_bits=8 and at most 256 entries"):
            indexer_mod._jit_select()(2048, **{"shortlist": 256, **kwargs})
    assert indexer_mod.SHORTLIST <= 256


def test_sparse_mla_head_dims():
    """d_qk = d_v + a RoPE tail that is a multiple of 64, zero included (NoPE); d_v may not exceed d_qk."""
    from megatron_glm5.kernels.sparse_mla_fwd import check_sparse_mla_args

    for d_qk, d_v in ((576, 512), (512, 512), (192, 128), (128, 128)):
        q, kv, idx = _sparse_inputs(d=d_qk, k=2051)  # the KPool width: not a multiple of the 64-slot block
        check_sparse_mla_args(q, kv, idx, d_v)
    q, kv, idx = _sparse_inputs(d=512)
    with pytest.raises(ValueError, match=r"d_v must be in \(0, d_qk=512\], got 640"):
        check_sparse_mla_args(q, kv, idx, 640)
    q, kv, idx = _sparse_inputs(d=544)
    with pytest.raises(ValueError, match="d_qk - d_v"):
        check_sparse_mla_args(q, kv, idx, 512)


def test_indexer_interface_rejects():
    q = torch.zeros(8, 32, 128, dtype=torch.bfloat16)
    k = torch.zeros(8, 128, dtype=torch.bfloat16)
    w = torch.zeros(8, 32)
    se = torch.zeros(8, dtype=torch.int32)
    f = indexer_mod.indexer_topk_interface
    with pytest.raises(TypeError):
        f(q, k, w.double(), se, se, 4)
    with pytest.raises(ValueError):
        f(q, k, w[:, :16].contiguous(), se, se, 4)
    with pytest.raises(ValueError):
        f(q, k[:, :64].contiguous(), w, se, se, 4)
    with pytest.raises(TypeError):
        f(q, k, w, se.long(), se, 4)
    with pytest.raises(ValueError):
        f(q, k, w, se, se, 0)


def test_tiling_helpers():
    assert [head_block(h) for h in (1, 8, 16, 17, 32, 48, 64, 96, 128)] == [
        (16, 1), (16, 1), (16, 1), (32, 1), (32, 1), (64, 1), (64, 1), (64, 2), (64, 2)
    ]
    idx = torch.tensor([[3, 1, -1, -1], [-1, -1, -1, -1], [-1, 2, -1, 5]], dtype=torch.int32)
    assert _common.row_valid_len(idx, chunk=2).tolist() == [2, 0, 4]
    rows = deterministic_chunk_rows(2048, 64, 576, torch.device("cpu"))
    assert rows % 132 == 0 and rows * 2048 * 576 * 4 <= 2 << 30
    assert indexer_mod.logits_chunk_rows(65536, 4) * 65536 * 4 <= indexer_mod.LOGITS_CHUNK_BYTES


def _index_inputs(t=8, hi=32, di=128, s=8, k=64):
    qi = torch.zeros(t, hi, di, dtype=torch.bfloat16)
    ki = torch.zeros(s, di, dtype=torch.bfloat16)
    w = torch.zeros(t, hi)
    idx = torch.full((t, k), -1, dtype=torch.int32)
    return qi, ki, w, idx


@pytest.mark.parametrize(
    "mutate,err,match",
    [
        (lambda qi, ki, w, idx: (qi.float(), ki, w, idx), TypeError, "qi must be torch.bfloat16"),
        (lambda qi, ki, w, idx: (qi, ki.half(), w, idx), TypeError, "ki must be"),
        (lambda qi, ki, w, idx: (qi, ki, w.double(), idx), TypeError, "w must be torch.float32"),
        (lambda qi, ki, w, idx: (qi, ki, w, idx.long()), TypeError, "topk must be torch.int32"),
        (lambda qi, ki, w, idx: (qi, ki[:, :64].contiguous(), w, idx), ValueError, r"ki must be \[S, 128\]"),
        (lambda qi, ki, w, idx: (qi, ki, w[:, :16].contiguous(), idx), ValueError, r"w must be \[T=8, Hi=32\]"),
        (lambda qi, ki, w, idx: (qi, ki, w, idx[:4].contiguous()), ValueError, r"topk must be \[T=8, K\]"),
        (lambda qi, ki, w, idx: (qi.transpose(0, 1), ki, w, idx), ValueError, "contiguous"),
        (lambda qi, ki, w, idx: (*_index_inputs(hi=72)[:3], idx), ValueError, r"index heads must be in \[1, 64\], got 72"),
        (lambda qi, ki, w, idx: (*_index_inputs(di=96)[:3], idx), ValueError, "multiple of 64"),
        (lambda qi, ki, w, idx: (qi, ki, w, idx[:, :0].contiguous()), ValueError, "at least one slot"),
    ],
)
def test_indexer_loss_index_interfaces_reject(mutate, err, match):
    qi, ki, w, idx = mutate(*_index_inputs())
    with pytest.raises(err, match=match):
        loss_mod.sparse_index_scores_interface(qi, ki, w, idx)
    with pytest.raises(err, match=match):
        loss_mod.index_score_bwd_interface(qi, ki, w, idx, torch.zeros(idx.shape))


def test_indexer_loss_target_interface_rejects():
    q = torch.zeros(8, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(8, 576, dtype=torch.bfloat16)
    idx = torch.full((8, 64), -1, dtype=torch.int32)
    lse = torch.zeros(8, 16)
    f = target_mod.sparse_attention_target_interface
    with pytest.raises(TypeError, match="lse must be torch.float32"):
        f(q, kv, idx, lse.double(), 1 / 16)
    with pytest.raises(ValueError, match=r"lse must be \[T=8, H=16\]"):
        f(q, kv, idx, lse[:, :8].contiguous(), 1 / 16)
    with pytest.raises(ValueError, match=r"kv must be \[S, 576\]"):
        f(q, kv[:, :512].contiguous(), idx, lse, 1 / 16)
    with pytest.raises(ValueError, match="multiple of 64 in \\[128, 576\\]"):
        f(torch.zeros(8, 16, 640, dtype=torch.bfloat16), torch.zeros(8, 640, dtype=torch.bfloat16), idx, lse, 1 / 16)
    with pytest.raises(ValueError, match=r"heads per rank must be in \[1, 128\], got 129"):
        f(torch.zeros(8, 129, 576, dtype=torch.bfloat16), kv, idx, torch.zeros(8, 129), 1 / 16)
    with pytest.raises(ValueError, match="dscore must be shaped like topk"):
        loss_mod.index_score_bwd_interface(*_index_inputs(), torch.zeros(8, 32))
