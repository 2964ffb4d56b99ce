"""scripts/fla_tuned_configs.py on real Triton autotune records of fla 0.6.0's KDA kernels (tests/data/fla_autotune:
copied out of the H200's Triton cache on 2026-12-02, bf16 and fp32 keys at 8 and 16 heads). The entry hashes were
checked once against fla's own ``KernelConfigFile`` / ``AutotuneKey`` (fla is not a CPU dependency); here: the kernel
names, the best config per key, the default config and the written files."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "fla_autotune"
_spec = importlib.util.spec_from_file_location("fla_tuned_configs", ROOT / "scripts" / "fla_tuned_configs.py")
ftc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ftc)


def test_kernel_names_from_cache_file_names():
    assert ftc.kernel_name("chunk_kda_bwd_kernel_dAv.autotune.json") == "chunk_kda_bwd_kernel_dAv"
    copied = "4J2LLTH6HHXIXMU7J3IEHJ7TCY35XCTMJGG5KUZFYVMX2VP3TSJA_chunk_kda_bwd_kernel_wy_dqkg_fused.autotune.json"
    assert ftc.kernel_name(copied) == "chunk_kda_bwd_kernel_wy_dqkg_fused"
    assert ftc.kernel_name("l2norm_fwd_kernel.autotune.json") == "l2norm_fwd_kernel"  # "l2norm" is no cache hash


def test_best_config_per_key_and_default_from_the_largest_problem(tmp_path):
    files = ftc.build([DATA])
    assert set(files) == {"chunk_gla_fwd_kernel_o", "chunk_kda_bwd_kernel_dAv", "chunk_kda_bwd_kernel_wy_dqkg_fused",
                          "chunk_kda_fwd_kernel_intra_token_parallel", "chunk_local_cumsum_vector_kernel",
                          "recompute_w_u_fwd_kda_kernel"}
    for kernel, content in files.items():
        raw = [json.loads(f.read_text()) for f in DATA.glob(f"*_{kernel}.autotune.json")]
        assert len(content["autotune_entries"]) == len(raw) >= 1
        for rec in raw:
            entry = content["autotune_entries"][ftc.key_hash(rec["key"])]
            times = [ftc._time(t) for _, t in rec["configs_timings"]]
            assert entry["best_ms"] == min(times) and entry["candidates"] == len(times)
            fastest = rec["configs_timings"][times.index(min(times))][0]
            assert entry["config"]["kwargs"] == fastest["kwargs"] and entry["config"]["num_warps"] == fastest["num_warps"]
        slowest = max(content["autotune_entries"].values(), key=lambda e: e["best_ms"])
        assert content["default_config"] == slowest["config"]
    out = tmp_path / "NVIDIA_H200"
    ftc.write(files, out)
    back = json.loads((out / "chunk_kda_bwd_kernel_wy_dqkg_fused.json").read_text())
    assert back["default_config"]["kwargs"] == {"BK": 64, "BV": 64} and len(back["autotune_entries"]) == 2
    assert ftc.main([str(DATA), "--out", str(tmp_path / "cli")]) == 0


def test_key_hash_is_flas_serialisation():
    # fla: md5 of json.dumps(key as lists, separators=(",", ":"), sort_keys=True)
    assert ftc.key_hash((64, 8, False, "torch.bfloat16")) == ftc.key_hash([64, 8, False, "torch.bfloat16"])
    assert ftc.key_hash([1, 2, "torch.int32"]) == hashlib.md5(b'[1,2,"torch.int32"]').hexdigest()  # no spaces


def test_no_records_is_an_error(tmp_path):
    assert ftc.main([str(tmp_path), "--out", str(tmp_path / "o")]) == 1
    with pytest.raises(SystemExit, match="not a directory, a tarball"):
        ftc.build([tmp_path / "x.txt"])
