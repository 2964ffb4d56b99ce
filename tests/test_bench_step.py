"""scripts/bench/bench_step.py without a GPU: the flag lists (read back by Megatron-LM's own parser), the FLOP count,
the Megatron-LM log parser, the profiler-trace bucketer on a synthetic trace, the report, and the driver end to end
against a stand-in pretrain_gpt.py that prints Megatron-LM's log lines and writes a trace."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_step", ROOT / "scripts" / "bench" / "bench_step.py")
bs = importlib.util.module_from_spec(_spec)
sys.modules["bench_step"] = bs  # dataclasses look their module up while the class is built
_spec.loader.exec_module(bs)


# --------------------------------------------------------------------------------------------------------------------
# Flags, shapes, FLOPs
# --------------------------------------------------------------------------------------------------------------------


def test_sparse_pairs_match_brute_force():
    for seq in (1, 5, 16, 33):
        for topk in (1, 4, 16, 64):
            assert bs.sparse_pairs(seq, topk) == sum(min(i + 1, topk) for i in range(seq))
    assert bs.sparse_pairs(8192, 8192) == bs.causal_pairs(8192)


def test_moe_pattern_reads_megatron_forms():
    assert bs.moe_pattern("1", 3, True) == (1, 1, 1)
    assert bs.moe_pattern("2", 4, True) == (1, 0, 1, 0)
    assert bs.moe_pattern("([0]*1+[1]*3)", 4, True) == (0, 1, 1, 1)
    assert bs.moe_pattern("[1,0]", 2, False) == (0, 0)
    with pytest.raises(ValueError, match="3 entries for 4 layers"):
        bs.moe_pattern("[0,1,1]", 4, True)


def test_slice_shape_and_flop_count():
    argv = bs.pretrain_argv(bs.VARIANTS["tilelang"], seq=8192, iters=12)
    s = bs.shape_from_argv(argv)
    assert (s.num_layers, s.hidden, s.heads, s.q_lora, s.kv_lora, s.qk_nope, s.qk_rope, s.v_head) == (
        4, 6144, 16, 2048, 512, 192, 64, 256)
    assert (s.index_heads, s.index_dim, s.topk, s.experts, s.router_topk, s.moe_ffn, s.shared_ffn, s.ffn) == (
        32, 128, 2048, 16, 8, 2048, 2048, 12288)
    assert s.moe_pattern == (0, 1, 1, 1) and s.full_layers == [1, 2, 3]
    assert (s.vocab, s.seq, s.global_batch) == (4096, 8192, 2)
    f = bs.flop_count(s)
    pairs = 2048 * 2049 // 2 + (8192 - 2048) * 2048
    assert f["sparse attention"] == 3 * 2 * 4 * 2 * pairs * 16 * (576 + 512)
    assert f["indexer (forward only)"] == 2 * 3 * (16384 * (2048 * 32 * 128 + 6144 * 128 + 6144 * 32)
                                                   + 2 * (8192 * 8193 // 2) * 32 * 128)
    assert f["MoE (router, routed, shared)"] == 3 * 2 * 3 * 16384 * (6144 * 16 + 8 * 3 * 6144 * 2048
                                                                     + 3 * 6144 * 2048)
    assert sum(f.values()) / 1e12 == pytest.approx(160.78, abs=0.01)


def test_extra_args_reach_the_command_and_the_flop_count():
    extra = ["--num-layers", "8", "--moe-layer-freq", "([0]*1+[1]*7)", "--moe-grouped-gemm"]
    argv = bs.pretrain_argv(bs.VARIANTS["mcore-kernels"], seq=4096, iters=12, extra=extra)
    assert argv[-len(extra):] == extra and "--dsa-kernel-backend" in argv
    s = bs.shape_from_argv(argv)
    assert s.num_layers == 8 and s.full_layers == [1, 2, 3, 7] and sum(s.moe_pattern) == 7 and s.seq == 4096
    assert argv[argv.index("--max-position-embeddings") + 1] == "4096"


def test_profiled_run_flags(tmp_path):
    argv = bs.pretrain_argv(bs.VARIANTS["tilelang"], seq=8192, iters=12, profile_step=5, tb_dir=tmp_path / "tb")
    get = lambda flag: argv[argv.index(flag) + 1]  # noqa: E731
    assert get("--train-iters") == "6" and get("--profile-step-start") == "5" and get("--profile-step-end") == "6"
    assert {"--profile", "--use-pytorch-profiler", "--pytorch-profiler-collect-callstack"} <= set(argv)
    assert get("--tensorboard-dir") == str(tmp_path / "tb") and get("--log-memory-interval") == "6"


def test_megatron_parses_the_slice_and_counts_159_tflop(monkeypatch, tmp_path):
    """Megatron-LM's own parser takes every flag of a profiled mcore-kernels run; its FLOP count of the slice is the
    159.1 TFLOP per iteration behind the earlier 211-231 TFLOP/s at 690-750 ms."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.training import num_floating_point_operations

    argv = bs.pretrain_argv(bs.VARIANTS["mcore-kernels"], seq=8192, iters=12, profile_step=5, tb_dir=tmp_path)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    args = parse_args()
    validate_args(args, {})
    assert args.spec == ["megatron_glm5.spec", "get_glm5_spec"] and args.dsa_kernel_backend == "tilelang"
    assert args.profile and args.use_pytorch_profiler and args.pytorch_profiler_collect_callstack
    assert (args.train_iters, args.log_memory_interval, args.moe_layer_freq) == (6, 6, [0, 1, 1, 1])
    args.padded_vocab_size = bs.shape_from_argv(argv).vocab  # set by the tokenizer in a real run
    assert num_floating_point_operations(args, 2) / 1e12 == pytest.approx(159.10, abs=0.01)


# --------------------------------------------------------------------------------------------------------------------
# Megatron-LM log
# --------------------------------------------------------------------------------------------------------------------


def _iteration_line(i: int, n: int, ms: float, tflops: float, loss: float) -> str:
    """Built with megatron.training.training.training_log's format strings."""
    s = " [2026-12-01 10:00:00.000000]"
    s += " iteration {:8d}/{:8d} |".format(i, n)
    s += " consumed samples: {:12d} |".format(2 * i)
    s += " elapsed time per iteration (ms): {:.1f} |".format(ms)
    s += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
    s += f" learning rate: {3e-4:.6E} |"
    s += f" global batch size: {2:5d} |"
    s += " {}: {:.6E} |".format("lm loss", loss)
    s += f" loss scale: {1.0:.1f} |"
    s += f" grad norm: {1.234:.3f} |"
    s += " number of skipped iterations: {:3d} |".format(0)
    s += " number of nan iterations: {:3d} |".format(0)
    return s


def _memory_line(after: int, max_alloc_mb: float) -> str:
    return (f"[Rank 0] (after {after} iterations) memory (MB) | allocated: 41000.00 | max allocated: {max_alloc_mb:.2f}"
            " | reserved: 70000.00 | max reserved: 71000.00")


def test_parse_log_reads_iterations_memory_and_errors():
    text = "\n".join([
        "INFO:megatron.core... unrelated | line: with colons",
        " > number of parameters on (tensor, pipeline) model parallel rank (0, 0): 2449473536",
        _iteration_line(1, 4, 9000.0, 17.7, 8.5),
        _memory_line(1, 60000.0),
        _iteration_line(2, 4, 4800.0, 33.1, 8.4),
        _iteration_line(3, 4, 712.5, 223.3, 8.25),
        _iteration_line(4, 4, 700.5, 227.1, 8.125),
        _memory_line(4, 61440.0),
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "RuntimeError: boom",
        "E1201 10:36:39 failed (exitcode: 1) local_rank: 0 (pid: 7091) of binary: python",  # torchrun's own report
        "Traceback (most recent call last):",
        '  File "run.py", line 9, in <module>',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    ])
    log = bs.parse_log(text)
    assert [it["iteration"] for it in log.iterations] == [1, 2, 3, 4]
    last = log.iterations[-1]
    assert last[bs.MS_KEY] == 700.5 and last[bs.TFLOPS_KEY] == 227.1 and last[bs.LOSS_KEY] == 8.125
    assert last["grad norm"] == 1.234 and last["train_iters"] == 4
    assert [it["iteration"] for it in log.steady(2)] == [3, 4]
    assert log.peak_allocated_mb == 61440.0 and log.memory[0]["after"] == 1
    assert log.params == 2449473536
    assert log.traceback[0].startswith("Traceback") and log.traceback[-1] == "RuntimeError: boom"
    assert log.error == "RuntimeError: boom"  # the worker's error, not torchrun's ChildFailedError


# --------------------------------------------------------------------------------------------------------------------
# Trace bucketer
# --------------------------------------------------------------------------------------------------------------------

MAIN, BWD = 100, 200  # host threads: the Python main thread and the autograd device thread


def _x(cat, name, ts, dur, tid=MAIN, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _launch(corr, ts, tid=MAIN):
    return _x("cuda_runtime", "cudaLaunchKernel", ts, 2, tid, correlation=corr)


def _kernel(corr, name, ts, dur, stream=7, **args):
    e = _x("kernel", name, ts, dur, correlation=corr, stream=stream, **args)
    e.update(pid=0, tid=stream)
    return e


def synthetic_trace() -> list[dict]:
    """One profiler step [0, 1000] us: forward on MAIN, backward on BWD (linked by sequence numbers), optimizer."""
    py = "python_function"
    return [
        _x("user_annotation", "ProfilerStep#5", 0, 1000),
        _x(py, "nn.Module: GPTModel_0", 10, 480),
        _x(py, "megatron/core/transformer/moe/experts.py(1318): forward", 100, 100),
        _x(py, "nn.Module: ColumnParallelLinear_4", 105, 90),
        _x("cpu_op", "aten::mm", 110, 40, **{"Sequence number": 7, "Fwd thread id": 0, "External id": 11}),
        _launch(1, 120), _kernel(1, "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", 130, 50),
        _x(py, "megatron_glm5/tilelang_attention.py(106): compute_topk", 210, 90),
        _launch(2, 220), _kernel(2, "main_kernel", 220, 40),
        _x(py, "nn.Module: TileLangSparseAttention_0", 310, 90),
        _x("cpu_op", "SparseMLAFunction", 315, 75, **{"Sequence number": 9, "Fwd thread id": 0}),
        _launch(3, 320), _kernel(3, "main_kernel", 320, 60),
        _x(py, "megatron/core/transformer/moe/token_dispatcher.py(300): token_dispatch", 400, 50),
        _x("cpu_op", "aten::index_select", 405, 20, **{"External id": 42}),
        _kernel(4, "indexSelectLargeIndex", 410, 10, **{"External id": 42}),  # its launch was not recorded
        _launch(5, 460), _kernel(5, "vectorized_elementwise_kernel", 335, 30, stream=9),  # overlaps kernel 3
        _x(py, "megatron/core/transformer/moe/router.py(50): routing", 470, 20),
        _x(py, "megatron_glm5/moe/router.py(12): aux_loss", 472, 16),
        _x(py, "torch/_tensor.py(1): item", 474, 10),
        _x("cuda_runtime", "cudaStreamSynchronize", 476, 6, correlation=55),
        # backward, on the autograd thread
        _x("cpu_op", f"{bs._BWD}: MmBackward0", 600, 100, BWD, **{"Sequence number": 7, "Fwd thread id": 1}),
        _x("cpu_op", "MmBackward0", 601, 98, BWD, **{"Sequence number": 7, "Fwd thread id": 1}),
        _launch(6, 610, BWD), _kernel(6, "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN", 610, 40),
        _x("cpu_op", f"{bs._BWD}: SparseMLAFunctionBackward", 700, 100, BWD, **{"Sequence number": 9}),
        _launch(7, 705, BWD), _kernel(7, "main_kernel", 705, 85),
        _x(py, "torch/optim/adamw.py(120): step", 850, 100),
        _launch(8, 860), _kernel(8, "void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>>", 860, 40),
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 990, 20, correlation=99),
        {"ph": "i", "cat": "ac2g", "name": "ignored", "ts": 5},
    ]


def test_classify_rules():
    c = bs.classify
    assert c("main_kernel", ["SparseMLAFunction", "nn.Module: TileLangSparseAttention_0"]) == "sparse attention"
    assert c("sparse_mla_bwd_kernel_kernel", []) == "sparse attention"
    assert c("tl_indexer_fwd_kernel_kernel", []) == "indexer + top-k"
    assert c("nvjet_x", ["aten::mm", "megatron/core/experimental_attention_variant/dsa.py(1248): forward_before_topk"]
             ) == "indexer + top-k"
    assert c("nvjet_x", ["aten::mm", "nn.Module: MLP_3", "megatron/core/transformer/moe/experts.py(1318): forward",
                         "nn.Module: MoELayer_0"]) == "expert GEMMs (routed)"
    assert c("elementwise", ["megatron/core/transformer/moe/experts.py(1318): forward"]
             ) == "norms, RoPE, elementwise, copies"
    assert c("nvjet_x", ["megatron/core/transformer/moe/shared_experts.py(195): forward",
                         "megatron/core/transformer/moe/token_dispatcher.py(1): x"]) == "other GEMMs"
    assert c("nvjet_x", ["nn.Module: TopKRouter_0"]) == "MoE router + dispatch/permute"
    assert c("k", ["megatron/core/distributed/distributed_data_parallel.py(400): hook"]) == "optimizer + grad buffers"
    # the DDP wrapper's forward encloses the whole model: it decides nothing
    assert c("nvjet_x", ["megatron/core/distributed/distributed_data_parallel.py(321): forward"]) == "other GEMMs"
    assert c("nvjet_x", ["nn.Module: GLMSparseAttention_0"]) == "other GEMMs"  # its up_v einsum, not the kernel
    # the experts' weight gradients added into DDP's main_grad by our kernel: DDP's adds, moved
    assert c("accumulate_groups_kernel", ["triton/backends/nvidia/driver.py(700): __call__",
                                          "megatron_glm5/kernels/grouped_wgrad_accum.py(72): accumulate_groups",
                                          "megatron_glm5/moe/grouped_experts.py(160): backward"]
             ) == "optimizer + grad buffers"


def test_trace_breakdown_on_a_synthetic_step(tmp_path):
    path = tmp_path / "rank-0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": synthetic_trace()}, f)
    b = bs.trace_breakdown(bs.load_trace(path))
    ms = b.buckets_ms
    assert ms["expert GEMMs (routed)"] == pytest.approx(0.050 + 0.040)  # forward + backward via sequence number 7
    assert ms["indexer + top-k"] == pytest.approx(0.040)
    assert ms["sparse attention"] == pytest.approx(0.060 + 0.085)  # forward + SparseMLAFunctionBackward
    assert ms["MoE router + dispatch/permute"] == pytest.approx(0.010)  # tied by External id
    assert ms["optimizer + grad buffers"] == pytest.approx(0.040)
    assert ms["norms, RoPE, elementwise, copies"] == pytest.approx(0.030 + 0.020)
    assert ms["other GEMMs"] == 0.0
    assert b.kernel_sum_ms == pytest.approx(sum(ms.values()))
    assert b.busy_ms == pytest.approx(b.kernel_sum_ms - 0.030)  # the second stream's kernel overlaps kernel 3
    assert b.wall_ms == pytest.approx(1.010) and b.host_gap_ms == pytest.approx(1.010 - b.busy_ms)
    assert b.steps == 1 and b.linked == pytest.approx(1 - 0.020 / b.kernel_sum_ms) and b.python_frames == 10
    assert b.top[0][:3] == ("main_kernel", "sparse attention", 2)
    # the catch-all by source: kernel 5 was launched at 460, inside the GPT model but no other frame of ours
    assert [(src, calls) for src, calls, _ in b.sources] == [("nn.Module: GPTModel_0", 1),
                                                             ("(no launch recorded)", 1)]
    # the host wait: innermost frame outside torch, and ours
    assert b.syncs == [("megatron_glm5/moe/router.py(12): aux_loss", "cudaStreamSynchronize", 1, pytest.approx(0.006))]
    # GPU idle by the launch that ended it: the step's first 130 us and the forward -> backward gap (420 -> 610 us)
    # both end in an expert GEMM (the backward one through its forward's frames)
    assert b.idle[0] == ("megatron/core/transformer/moe/experts.py(1318): forward", 2, pytest.approx(0.130 + 0.190))
    assert sum(ms for *_, ms in b.idle) == pytest.approx(b.wall_ms - b.busy_ms)


def test_source_of_prefers_model_code_over_library_frames():
    f = ["torch/nn/functional.py(10): linear", "megatron/core/transformer/mlp.py(5): forward",
         "megatron_glm5/glm5/layer.py(7): forward", "nn.Module: MLP_0"]
    assert bs.source_of(f) == "megatron/core/transformer/mlp.py(5): forward < megatron_glm5/glm5/layer.py(7): forward"
    assert bs.source_of(f[2:]) == "megatron_glm5/glm5/layer.py(7): forward"
    assert bs.source_of(["aten::add", "nn.Module: MLP_0"]) == "nn.Module: MLP_0"
    assert bs.source_of([]) == "(no launch recorded)"


# --------------------------------------------------------------------------------------------------------------------
# Driver and report, against a stand-in pretrain_gpt.py
# --------------------------------------------------------------------------------------------------------------------

FAKE_PRETRAIN = '''
import gzip, json, os, sys
sys.path.insert(0, os.environ["BENCH_TEST_DIR"])
from test_bench_step import _iteration_line, _memory_line, synthetic_trace
argv = sys.argv[1:]
get = lambda f: argv[argv.index(f) + 1]
n = int(get("--train-iters"))
slow = 1.25 if "--dsa-kernel-backend" in argv else 1.0
if slow > 1 and os.environ.get("BENCH_TEST_FAIL"):
    print("Traceback (most recent call last):\\nRuntimeError: CUDA out of memory")
    sys.exit(1)
for i in range(1, n + 1):
    print(_iteration_line(i, n, 700.0 * slow + (i % 2), 227.0 / slow, 8.5 - 0.1 * i))
print(_memory_line(n, 60000.0 * slow))
if os.environ.get("GLM5_HOST_TIMERS_OUT"):  # --host-timers: bench_step's sitecustomize installed host_timers
    import time
    import host_timers
    step = host_timers._timed("train_step", lambda: None)
    norm = host_timers._timed("get_grad_norm_fp32", lambda: time.sleep(0.002))
    import gc
    for i in range(n):
        step(); norm(); norm()
        if i == n - 2:
            gc.collect()  # a full collection in a recorded iteration
if "--profile" in argv:
    d = os.path.join(get("--tensorboard-dir"), "..", "torch_profile")
    os.makedirs(d, exist_ok=True)
    with gzip.open(os.path.join(d, "rank-0.json.gz"), "wt") as f:
        json.dump({"traceEvents": synthetic_trace()}, f)
'''


@pytest.fixture
def fake_runs(tmp_path, monkeypatch):
    script = tmp_path / "fake_pretrain_gpt.py"
    script.write_text(FAKE_PRETRAIN)
    monkeypatch.setattr(bs, "torchrun_cmd", lambda python, mlm, port, argv: [sys.executable, str(script), *argv])
    monkeypatch.setattr(bs, "environment", lambda python, env: {"gpu": "Fake GPU", "torch": "x"})
    monkeypatch.setenv("BENCH_TEST_DIR", str(Path(__file__).parent))
    mlm = tmp_path / "mlm"
    mlm.mkdir()
    (mlm / "pretrain_gpt.py").write_text("")
    return ["--mlm", str(mlm), "--out", str(tmp_path / "out" / "step.md"), "--iters", "6", "--skip", "2",
            "--variants", "tilelang,mcore-kernels"]


def test_main_writes_the_report(fake_runs, tmp_path):
    assert bs.main(fake_runs) == 0
    out = tmp_path / "out"
    report = (out / "step.md").read_text()
    assert "Fake GPU" in report and "| `tilelang`: (a) our TileLang kernels | 700.5 ± 0.6; 700.5; 701.0 (#5) |" in report
    assert "| 1.25x |" in report and "| 1.00x |" in report  # speed vs mcore-kernels
    assert "| 6 | 7.9000 | 7.9000 |" in report  # loss per iteration
    assert "| expert GEMMs (routed) | 0.1 (" in report and "Top kernels, `mcore-kernels`" in report
    assert "| peak allocated GiB |" in report and "| 58.59 |" in report
    # the optimizer's 0.04 ms of the synthetic step taken out of the 700.5 ms mean (Megatron's TFLOP/s at that time)
    assert "| ms / iteration without the optimizer" in report and "| 700.5; 227.0 | 875.5; 181.6 |" in report
    assert "GPU idle (gaps over 5 us) by the launch that ended it" in report
    raw = json.loads((out / "step.json").read_text())
    assert raw["runs"][0]["stats"]["iters"] == 4 and raw["runs"][1]["breakdown"]["steps"] == 1
    assert sorted(p.name for p in out.iterdir()) == sorted([
        "step.md", "step.json", "bench_step_tilelang.log", "bench_step_mcore-kernels.log",
        "bench_step_tilelang_profile.log", "bench_step_mcore-kernels_profile.log",
        "bench_step_tilelang_trace.json.gz", "bench_step_mcore-kernels_trace.json.gz"])


def test_host_timers_reach_the_report(fake_runs, tmp_path):
    """``--host-timers``: each timed run loads host_timers through a sitecustomize, its record (iterations past
    --skip) is read back and tabled per variant."""
    assert bs.main([*fake_runs, "--no-profile", "--host-timers"]) == 0
    report = (tmp_path / "out" / "step.md").read_text()
    assert "Host time of Megatron's step phases, `tilelang`" in report
    row = next(line for line in report.splitlines() if line.startswith("| `get_grad_norm_fp32` |"))
    calls, ms_per_iteration = row.split("|")[2:4]
    assert float(calls) == 2.0 and 4.0 <= float(ms_per_iteration) < 50.0  # two 2 ms sleeps per iteration
    record = json.loads((tmp_path / "out" / "bench_step_tilelang_host_timers.jsonl").read_text().splitlines()[0])
    assert record["iterations"] == 4 and len(record["calls"]["train_step"]) == 4
    # Python's collector: the full collection of iteration 5 (and any the interpreter ran itself), the heap at exit
    assert [5, 2] in [c[:2] for c in record["gc"]] and record["heap"]["objects"] > 1000
    assert "Full (generation 2) collections of Python's garbage collector: " in report and "iteration 5: " in report
    assert "| `gc.collect(gen 2)` |" in report and "Objects the collector tracks at exit: " in report


def test_host_timers_patch_megatron_on_import(tmp_path):
    """The import hook wraps a target module's functions (and methods) when it is first imported, before other
    modules bind them by name, so megatron-core's own callers reach the timed versions; every target exists in the
    pinned megatron-core; a sitecustomize the generated one shadows still runs."""
    env, site = bs.host_timers_env({"PYTHONPATH": os.environ.get("PYTHONPATH", "")}, tmp_path / "t.jsonl", 0)
    (tmp_path / "theirs").mkdir()  # a sitecustomize the generated one shadows: it still runs
    (tmp_path / "theirs" / "sitecustomize.py").write_text("import builtins\nbuiltins.GLM5_THEIRS = True\n")
    code = ("import sys, megatron.core.distributed as d, megatron.core.optimizer.optimizer as o\n"
            "f = sys.modules['megatron.core.distributed.finalize_model_grads']\n"
            "print(all(hasattr(x, '__wrapped__') for x in (d.finalize_model_grads, f._update_router_expert_bias,"
            " o.get_grad_norm_fp32, o.ChainedOptimizer.step)), GLM5_THEIRS)\n")
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([env["PYTHONPATH"], str(tmp_path / "theirs")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True True"
    assert "not timed" not in out.stderr
    shutil.rmtree(site)


def test_main_fails_naming_the_variant_and_its_log(fake_runs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BENCH_TEST_FAIL", "1")
    assert bs.main(fake_runs) == 1
    err = capsys.readouterr().err
    log = tmp_path / "out" / "bench_step_mcore-kernels.log"
    assert f"variant mcore-kernels, main run: exit status 1; RuntimeError: CUDA out of memory (log: {log})" in err
    assert f"--- mcore-kernels, main run ({log}):\nTraceback (most recent call last):" in err
    report = (tmp_path / "out" / "step.md").read_text()
    assert "Profile of" not in report  # no profile after a failed timed run
    assert "| `mcore-kernels`: (b) megatron backend + megatron-core's TileLang DSA kernels | FAILED:" in report


def test_dry_run_prints_both_commands_per_variant(capsys):
    assert bs.main(["--dry-run", "--variants", "tilelang", "--extra-args=--moe-grouped-gemm"]) == 0
    out = capsys.readouterr().out
    cmds = [line for line in out.splitlines() if "pretrain_gpt.py" in line and not line.startswith("#")]
    assert len(cmds) == 2 and all(c.endswith("--moe-grouped-gemm") for c in cmds)
    assert "get_glm5_tilelang_spec" in cmds[0] and "--profile-step-start 5" in cmds[1]
    assert "FLOP per iteration, our count: 160.78 T" in out
