"""Turn Triton's autotune results for flash-linear-attention's kernels into fla's own config files, so that later
runs (tests, training) pick each kernel's config without autotuning at all.

Why: fla 0.6.0 autotunes every Triton kernel of ``chunk_kda`` per key (heads, widths, varlen, dtypes, ...); on an
H200 a varlen key costs about 125 s for ``chunk_kda_bwd_kernel_wy_dqkg_fused`` alone and the tiny 8-wide probe key
214 s for the whole forward + backward (``scripts/bench/RESULTS_gpu_checks.md``). Every KDA kernel of fla 0.6.0 is
decorated with ``fla.ops.utils.cache.fla_cache_autotune``, which first looks for ``$FLA_CONFIG_DIR/<kernel>.json``
when ``FLA_CACHE_MODE`` is set (read when fla is imported): ``strict`` takes exact key matches only, ``fuzzy`` also
keys that differ only in numbers, ``full`` then falls back to the file's ``default_config``. A config only chooses
tiles, warps and stages, so any config of the kernel's own list is correct for any key; a foreign one may be slower.

Input: Triton's on-disk autotune records (``<TRITON_CACHE_DIR>/<hash>/<kernel>.autotune.json``, written because fla
asks for ``cache_results``), as the cache directory itself, a copy of its files, or a ``.tar.gz`` of them. Output:
one ``<kernel>.json`` per kernel in fla's format: every key's best config (``autotune_entries``, keyed by the md5 of
the key as fla serialises it) and a ``default_config`` (the best config of the key with the longest timing: the
largest problem, closest to training).

    python3 scripts/fla_tuned_configs.py ~/.triton/cache --out scripts/fla_configs/NVIDIA_H200
    FLA_CONFIG_DIR=scripts/fla_configs/NVIDIA_H200 FLA_CACHE_MODE=full python3 -m pytest tests/gpu/test_glm5_next_gpu.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tarfile
from pathlib import Path
from typing import Any, Iterable, Iterator

SUFFIX = ".autotune.json"
CONFIG_FIELDS = ("kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg", "ir_override")


def key_hash(key: Any) -> str:
    """fla's entry hash (``AutotuneKey.key_hash``): md5 of the key as compact, sorted JSON, tuples as lists."""
    return hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def kernel_name(file_name: str) -> str:
    """``<kernel>.autotune.json``, possibly prefixed by ``<cache hash>_`` when copied out of the cache tree."""
    stem = file_name[: -len(SUFFIX)]
    head, sep, tail = stem.partition("_")
    return tail if sep and len(head) >= 32 and head.isalnum() and head.isupper() else stem


def records(sources: Iterable[Path]) -> Iterator[tuple[str, dict]]:
    """(kernel, Triton record) for every ``*.autotune.json`` under the sources (directories, files, tarballs)."""
    for src in sources:
        if src.is_dir():
            for f in sorted(src.rglob("*" + SUFFIX)):
                yield kernel_name(f.name), json.loads(f.read_text())
        elif src.name.endswith((".tar.gz", ".tgz", ".tar")):
            with tarfile.open(src) as tar:
                for m in tar.getmembers():
                    if m.isfile() and m.name.endswith(SUFFIX):
                        yield kernel_name(Path(m.name).name), json.load(tar.extractfile(m))
        elif src.name.endswith(SUFFIX):
            yield kernel_name(src.name), json.loads(src.read_text())
        else:
            raise SystemExit(f"fla_tuned_configs: {src}: not a directory, a tarball or a *{SUFFIX} file")


def _time(timing: Any) -> float:
    return float(timing[0] if isinstance(timing, (list, tuple)) else timing)


def best_entry(record: dict) -> dict:
    """The fastest config of one Triton record, in fla's config form, with its time (ms)."""
    timings = record.get("configs_timings")
    if not timings:
        raise ValueError("record without configs_timings")
    cfg, timing = min(timings, key=lambda ct: _time(ct[1]))
    if cfg.get("pre_hook"):
        raise ValueError("config with a pre-hook (not serialisable)")
    return {"autotune_key": record["key"], "config": {f: cfg.get(f) for f in CONFIG_FIELDS},
            "best_ms": _time(timing), "candidates": len(timings)}


def build(sources: Iterable[Path]) -> dict[str, dict]:
    """kernel -> fla config file content."""
    files: dict[str, dict] = {}
    for kernel, rec in records(sources):
        entry = best_entry(rec)
        f = files.setdefault(kernel, {"kernel_name": kernel, "autotune_entries": {}})
        f["autotune_entries"][key_hash(rec["key"])] = entry
    for f in files.values():
        largest = max(f["autotune_entries"].values(), key=lambda e: e["best_ms"])
        f["default_config"] = dict(largest["config"])
    return files


def write(files: dict[str, dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for kernel, content in sorted(files.items()):
        (out / f"{kernel}.json").write_text(json.dumps(content, indent=1, sort_keys=True) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sources", nargs="+", type=Path, help="Triton cache dir(s), *.autotune.json files or tarballs")
    p.add_argument("--out", type=Path, required=True, help="fla config directory to write (FLA_CONFIG_DIR)")
    args = p.parse_args(argv)
    files = build(args.sources)
    if not files:
        print(f"fla_tuned_configs: no *{SUFFIX} records in {[str(s) for s in args.sources]}", file=sys.stderr)
        return 1
    write(files, args.out)
    for kernel, f in sorted(files.items()):
        print(f"{kernel}: {len(f['autotune_entries'])} keys, default {f['default_config']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
