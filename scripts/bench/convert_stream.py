#!/usr/bin/env python
"""Streaming-conversion benchmark: peak RSS and throughput of ``convert import`` / ``convert export`` on a synthetic
GLM-5.x checkpoint of several GB, next to plain safetensors read+write of the same bytes, in the same run.

    python scripts/bench/convert_stream.py --work-dir /work/bench_convert --size-gb 8 [--check] [--keep]

The synthetic checkpoint is GLM-5.2-shaped (MLA, IndexShare full/shared layers, dense first layer, MoE with
per-expert tensors, one MTP layer) and sized by its number of MoE layers; it is written shard by shard with the
bridge's streaming writer, so generating it needs no more memory than the conversion. Each measured step runs in
its own process; its peak RSS is that process's ``ru_maxrss`` (from ``wait4``), i.e. including Python, torch and
megatron-core themselves. The baseline is ``safetensors.torch.load_file`` + ``save_file`` per shard, with and
without an ``fsync`` of each written file; the converters fsync their data before the rename that publishes the
checkpoint (a rename that can outlive unsynced data would publish a corrupt checkpoint after a crash), so the
fsync baseline is the like-for-like one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

SHARD_BYTES = 2 << 30


def bench_config(size_gb: float) -> dict:
    """GLM-5.2-shaped config whose bf16 weights come to at least ``size_gb`` GB."""
    from megatron_glm5.testing import tiny_glm52_config

    hidden, experts, moe_inter = 2048, 64, 1024
    per_moe_layer = experts * 3 * hidden * moe_inter * 2  # bytes of routed experts per MoE layer (bf16)
    moe_layers = max(2, math.ceil(size_gb * 1e9 / per_moe_layer) - 1)  # the MTP layer is one more MoE layer
    layers = moe_layers + 1  # + one dense first layer
    types = ["full" if i % 2 == 0 else "shared" for i in range(layers)]
    return tiny_glm52_config(
        vocab_size=32768, hidden_size=hidden, intermediate_size=8192, moe_intermediate_size=moe_inter,
        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=512, kv_lora_rank=256,
        qk_nope_head_dim=128, qk_rope_head_dim=64, qk_head_dim=192, v_head_dim=128, head_dim=192,
        n_routed_experts=experts, num_experts_per_tok=4, index_n_heads=16, index_head_dim=128, index_topk=256,
        indexer_types=types, index_topk_freq=2, index_skip_topk_offset=1, dtype="bfloat16",
    )


def write_synthetic(out: Path, raw: dict) -> tuple[int, int]:
    """Write the checkpoint with pseudo-random bf16 values (a random block tiled over each tensor)."""
    import torch

    from bridge import hf_io
    from bridge.mapping import expand
    from megatron_glm5.config import natural_key, parse_hf_config

    out.mkdir(parents=True)
    exp = expand(parse_hf_config(raw))
    shapes = exp.hf_shapes()
    names = sorted(shapes, key=natural_key)
    plan = [hf_io.PlannedTensor(n, shapes[n], torch.float32 if n.endswith("e_score_correction_bias")
                                else torch.bfloat16) for n in names]
    writer = hf_io.HFShardWriter(out, plan, max_shard_bytes=SHARD_BYTES)
    block = (torch.randn(1 << 22) * 0.02).to(torch.bfloat16)
    for i, p in enumerate(plan):
        n = math.prod(p.shape)
        reps = math.ceil(n / block.numel())
        t = block.roll(i).repeat(reps)[:n].reshape(p.shape).to(p.dtype)
        if p.name.endswith("e_score_correction_bias"):
            t = t.float() + 7.0
        writer.write(p.name, t)
    writer.finish()
    hf_io.write_json(out / "config.json", raw)
    hf_io.write_json(out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": [1, 2]})
    return len(plan), writer.total_bytes


_BASELINE = """
import os, sys
from pathlib import Path
from safetensors.torch import load_file, save_file
src, dst, sync = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "fsync"
dst.mkdir()
for shard in sorted(src.glob("*.safetensors")):
    tensors = load_file(shard)
    save_file(tensors, dst / shard.name, metadata={"format": "pt"})
    del tensors
    if sync:
        fd = os.open(dst / shard.name, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
"""

_IMPORT = """
import sys
from bridge.cli import main
sys.exit(main(["convert", "import", "--hf-path", sys.argv[1], "--megatron-path", sys.argv[2], "--no-progress"]))
"""

_EXPORT = """
import sys
from bridge.cli import main
sys.exit(main(["convert", "export", "--megatron-path", sys.argv[1], "--hf-path", sys.argv[2], "--no-progress"]))
"""

_IMPORT_NOSYNC = """
import sys
from megatron_glm5.cpu import enable_cpu_mode
enable_cpu_mode()
import bridge
bridge.convert_hf_to_megatron(hf_path=sys.argv[1], megatron_path=sys.argv[2], progress=False, sync_files=False)
"""

_EXPORT_NOSYNC = """
import sys
from megatron_glm5.cpu import enable_cpu_mode
enable_cpu_mode()
import bridge
bridge.convert_megatron_to_hf(megatron_path=sys.argv[1], hf_path=sys.argv[2], progress=False, sync_files=False)
"""

_CHECK = """
import sys, json
import bridge
r = bridge.compare_hf_checkpoints(sys.argv[1], sys.argv[2])
print(json.dumps({"ok": r["ok"], "tensors": r["tensors"], "bitwise_equal": r["bitwise_equal"]}))
sys.exit(0 if r["ok"] else 1)
"""


_COLD = {"on": False}


def drop_caches() -> bool:
    """Write back dirty pages and drop the page cache (root only), so every step reads its input from disk."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def measured(code: str, *args: str) -> dict:
    """Run ``code`` in a fresh interpreter; wall time and that process's peak RSS. Dirty pages of earlier steps
    are written back first so that no step pays for another's write-back, and with ``--cold`` the page cache is
    dropped so that every step reads its input from disk."""
    if _COLD["on"]:
        drop_caches()
    else:
        os.sync()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHDYNAMO_DISABLE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    out, err = proc.stdout.read(), proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"step failed:\n{out}\n{err}")
    return {"seconds": seconds, "peak_rss_gb": usage.ru_maxrss * 1024 / 1e9, "stdout": out.strip()}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", required=True, type=Path)
    ap.add_argument("--size-gb", type=float, default=8.0)
    ap.add_argument("--check", action="store_true", help="also compare the export with the source bitwise")
    ap.add_argument("--repeat", type=int, default=2, help="runs per step; the best is reported (disk noise)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every step (needs root)")
    args = ap.parse_args()
    if args.cold:
        if not drop_caches():
            raise SystemExit("--cold needs write access to /proc/sys/vm/drop_caches (root)")
        _COLD["on"] = True

    work = args.work_dir
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    try:
        raw = bench_config(args.size_gb)
        t0 = time.perf_counter()
        n_tensors, nbytes = write_synthetic(work / "hf", raw)
        gen_s = time.perf_counter() - t0
        gb = nbytes / 1e9
        print(f"synthetic checkpoint: {n_tensors} tensors, {gb:.2f} GB, {raw['num_hidden_layers']} layers + 1 MTP, "
              f"{raw['n_routed_experts']} experts ({gen_s:.0f} s to write)", flush=True)

        steps = {}
        for rep in range(args.repeat):
            for sync in ("fsync", "nosync"):
                name = f"safetensors load_file+save_file ({sync})"
                steps.setdefault(name, []).append(measured(_BASELINE, str(work / "hf"), str(work / "base"), sync))
                shutil.rmtree(work / "base")
            steps.setdefault("convert import (HF -> torch_dist; fsync, CLI default)", []).append(
                measured(_IMPORT, str(work / "hf"), str(work / "mc")))
            steps.setdefault("convert export (torch_dist -> HF; fsync, CLI default)", []).append(
                measured(_EXPORT, str(work / "mc"), str(work / "hf_out")))
            steps.setdefault("convert import (no fsync)", []).append(
                measured(_IMPORT_NOSYNC, str(work / "hf"), str(work / "mc_nosync")))
            shutil.rmtree(work / "mc_nosync")
            steps.setdefault("convert export (no fsync)", []).append(
                measured(_EXPORT_NOSYNC, str(work / "mc"), str(work / "hf_nosync")))
            shutil.rmtree(work / "hf_nosync")
            if rep + 1 < args.repeat:
                shutil.rmtree(work / "mc")
                shutil.rmtree(work / "hf_out")
        check = measured(_CHECK, str(work / "hf"), str(work / "hf_out")) if args.check else None

        best = {k: min(v, key=lambda s: s["seconds"]) for k, v in steps.items()}
        base_sync = best["safetensors load_file+save_file (fsync)"]["seconds"]
        base_nosync = best["safetensors load_file+save_file (nosync)"]["seconds"]
        print()
        print(f"best of {args.repeat}; {gb:.2f} GB, {n_tensors} tensors; wall time of the whole process (start-up "
              f"and imports included); page cache {'dropped before each step' if args.cold else 'warm'}")
        print()
        print("| step | wall s | GB/s | vs baseline (fsync) | vs baseline (no fsync) | peak RSS GB |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, s in best.items():
            print(f"| {name} | {s['seconds']:.1f} | {gb / s['seconds']:.2f} | {base_sync / s['seconds']:.2f} | "
                  f"{base_nosync / s['seconds']:.2f} | {s['peak_rss_gb']:.2f} |")
        if check is not None:
            print(f"\nbitwise check of the export against the source: {check['stdout']} "
                  f"({check['seconds']:.0f} s, peak RSS {check['peak_rss_gb']:.2f} GB)")
        print(f"\nmegatron checkpoint on disk: {dir_bytes(work / 'mc') / 1e9:.2f} GB")
        print(json.dumps({k: [{kk: round(vv, 3) for kk, vv in s.items() if kk != "stdout"} for s in v]
                          for k, v in steps.items()}))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
