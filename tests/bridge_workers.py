"""Helpers for the bridge tests: fixture checkpoints, torchrun bodies (``fn(rank, world_size, **kwargs) -> dict``)
and spawn targets that stall a conversion (so a test can kill it with SIGKILL) or die while replacing an output."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

FIXTURES = {
    # name: (config factory name, expert layout, fp8)
    "glm5": ("tiny_glm5_config", "per_expert", False),
    "glm5_fused": ("tiny_glm5_config", "fused", False),
    "glm52": ("tiny_glm52_config", "per_expert", False),
    "glm52_fused": ("tiny_glm52_config", "fused", False),
    "glm52_fp8": ("tiny_glm52_config", "per_expert", True),
}


def make_fixture(root: Path, name: str, **overrides) -> Path:
    """Write fixture ``name`` under ``root/name`` (once) and return its directory."""
    from megatron_glm5 import testing

    out = Path(root) / name
    if (out / "model.safetensors.index.json").is_file():
        return out
    factory, layout, fp8 = FIXTURES[name]
    cfg = getattr(testing, factory)(**overrides)
    testing.write_hf_checkpoint(out, cfg, seed=0, expert_layout=layout, fp8=fp8, max_shard_bytes=1 << 20)
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}) + "\n")
    return out


# --------------------------------------------------------------------------------------------------------------------
# torchrun bodies
# --------------------------------------------------------------------------------------------------------------------


def import_cases(rank: int, world_size: int, *, cases: list[dict]) -> dict:
    """Run several imports in one 2-process world (each case: hf, out, tp, pp, ep)."""
    from bridge import convert_hf_to_megatron

    for c in cases:
        convert_hf_to_megatron(hf_path=c["hf"], megatron_path=c["out"], tp=c["tp"], pp=c["pp"], ep=c["ep"],
                               progress=False, megatron_layout=c.get("megatron_layout", "local"))
    return {"rank": rank, "done": len(cases)}


def _full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, vocab] on every rank (gathers the vocab-parallel output over TP)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        logits = model(ids, pos, None)
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    return logits


def load_and_run(rank: int, world_size: int, *, ckpts: list[str], tp: int, ep: int, out: str, seq_len: int,
                 seed: int, hf_path: str | None = None, export_to: str | None = None) -> dict:
    """At (TP, EP): load each Megatron checkpoint with megatron-core's dist_checkpointing.load and save the full
    logits; optionally also build from HF with from_hf_pretrained, and export the last model with export_hf."""
    import bridge
    from megatron_glm5.model import default_cpu_policy
    from megatron_glm5.parallel import initialize_model_parallel
    from bridge.pretrained import from_hf_pretrained

    initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    policy = default_cpu_policy(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    results = {}
    model = None
    for i, ckpt in enumerate(ckpts):
        model = bridge.load_megatron_checkpoint(ckpt, policy=policy)
        model.eval()
        vocab = model.glm5_hf_config["vocab_size"]
        ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(seed))
        results[f"ckpt{i}"] = _full_logits(model, ids)
    if hf_path is not None:
        hf_model = from_hf_pretrained(hf_path, policy=policy)
        vocab = hf_model.glm5_hf_config["vocab_size"]
        ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(seed))
        results["from_hf"] = _full_logits(hf_model, ids)
    if export_to is not None:
        bridge.export_hf(model, export_to)
    if rank == 0:
        torch.save(results, out)
    return {"rank": rank}


def save_with_megatron_core(model, root: Path, *, layout: str, singleton: bool, iteration: int = 0) -> Path:
    """``model`` saved by megatron-core's own ``dist_checkpointing.save`` in Megatron-LM's directory layout, its keys
    renamed to ``layout``'s (bridge.megatron_layout) and, with ``singleton``, megatron-core's singleton_local_shards
    form (one key per expert, gated fc1 halves): how another tool's training run would leave it (no bridge
    metadata)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from bridge.megatron_layout import LAYOUTS, to_layout

    ssd = model.sharded_state_dict(metadata={"singleton_local_shards": True} if singleton else None)
    tensors = [v for v in nested_values(ssd) if isinstance(v, ShardedTensor)]
    renamed = to_layout({t.key for t in tensors} | {v.key for v in nested_values(ssd) if hasattr(v, "build_fn")},
                        LAYOUTS[layout])
    for t in tensors:
        t.key = renamed.get(t.key, t.key)
    ckpt = Path(root) / f"iter_{iteration:07d}"
    ckpt.mkdir(parents=True)
    dist_checkpointing.save(ssd, str(ckpt), content_metadata={"singleton_local_shards": singleton})
    (Path(root) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return Path(root)


def te_layout_cases(rank: int, world_size: int, *, imports: list[dict], loads: list[dict], hf_config: str,
                    out: str, seq_len: int, seed: int) -> dict:
    """In one 2-process world: the imports (``import_cases``), then for each load case (tp, pp, ep) every checkpoint
    of ``ckpts`` loaded into our model at that layout; at PP=1 the full logits are saved (rank 0, ``out``), at PP>1
    each rank compares its stage's parameters across the checkpoints."""
    import bridge
    from bridge.launch import model_parallel
    from megatron_glm5.model import default_cpu_policy

    import_cases(rank, world_size, cases=imports)
    logits, same_stage = {}, {}
    for case in loads:
        tp, pp, ep = case["tp"], case["pp"], case["ep"]
        tag = f"tp{tp}_pp{pp}_ep{ep}"
        with model_parallel(tp, pp, ep):
            policy = default_cpu_policy(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                        expert_model_parallel_size=ep)
            states = []
            for i, ckpt in enumerate(case["ckpts"]):
                model = bridge.load_megatron_checkpoint(ckpt, policy=policy, hf_config=hf_config).eval()
                if pp == 1:
                    vocab = model.glm5_hf_config["vocab_size"]
                    ids = torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(seed))
                    logits[f"{tag}_ckpt{i}"] = _full_logits(model, ids)
                else:
                    states.append({k: v for k, v in model.state_dict().items()
                                   if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")})
            if states:
                same_stage[tag] = all(s.keys() == states[0].keys() and all(torch.equal(s[k], states[0][k])
                                                                            for k in s) for s in states[1:])
                same_stage[f"{tag}_tensors"] = len(states[0])
    if rank == 0:
        torch.save(logits, out)
    return {"rank": rank, "same_stage": same_stage}


# --------------------------------------------------------------------------------------------------------------------
# A conversion that stalls, for the kill -9 test (spawn target)
# --------------------------------------------------------------------------------------------------------------------


def stalled_conversion(kind: str, src: str, dst: str, marker: str, after_reads: int) -> None:
    """Run an import (or export) whose reads stop after ``after_reads`` tensors: touch ``marker`` and sleep until
    killed."""
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from megatron_glm5.cpu import enable_cpu_mode

    enable_cpu_mode()
    from bridge import hf_io, megatron_io
    from bridge.convert import convert_hf_to_megatron, convert_megatron_to_hf

    count = {"n": 0}

    def stall():
        count["n"] += 1
        if count["n"] > after_reads:
            Path(marker).touch()
            while True:
                time.sleep(1)

    if kind == "import":
        original = hf_io.HFCheckpointReader.read

        def read(self, *args, **kwargs):
            stall()
            return original(self, *args, **kwargs)

        hf_io.HFCheckpointReader.read = read
        convert_hf_to_megatron(hf_path=src, megatron_path=dst, progress=False)
    else:
        original = megatron_io.DistCheckpoint.read

        def read_box(self, *args, **kwargs):
            stall()
            return original(self, *args, **kwargs)

        megatron_io.DistCheckpoint.read = read_box
        convert_megatron_to_hf(megatron_path=src, hf_path=dst, progress=False)


def killed_while_replacing(src: str, dst: str) -> None:
    """Import ``src`` over the existing output ``dst`` (``overwrite``) and SIGKILL this process right after the new
    checkpoint was swapped in, before the old copy is deleted."""
    import signal

    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    from megatron_glm5.cpu import enable_cpu_mode

    enable_cpu_mode()
    from bridge import output
    from bridge.convert import convert_hf_to_megatron

    def die(path):
        os.kill(os.getpid(), signal.SIGKILL)

    output._remove_tree = die
    convert_hf_to_megatron(hf_path=src, megatron_path=dst, overwrite=True, progress=False)


# --------------------------------------------------------------------------------------------------------------------
# A full disk, injected into a CLI subprocess and every rank it spawns
# --------------------------------------------------------------------------------------------------------------------

_FULL_DISK_SITE = '''\
"""Test-only: every data file of a torch_dist checkpoint (*.distcp) opened for writing fails with ENOSPC on its
first write, as a full disk does. Loaded by every Python process started with this directory on PYTHONPATH."""
import builtins
import errno
import os

_open = builtins.open


class _FullDisk:
    def __init__(self, f):
        self._f = f

    def write(self, data):
        del data  # a real full disk fails inside C, keeping no reference to the caller's buffer
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def open(file, mode="r", *args, **kwargs):
    f = _open(file, mode, *args, **kwargs)
    if ("w" in mode or "a" in mode) and str(file).endswith(".distcp"):
        return _FullDisk(f)
    return f


builtins.open = open
'''


def full_disk_env(root: Path) -> dict[str, str]:
    """Environment for a subprocess whose Megatron-side checkpoint writes hit a full disk (``sitecustomize``)."""
    site = Path(root) / "full_disk_site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_FULL_DISK_SITE)
    repo = Path(__file__).resolve().parent.parent
    return {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{repo}"}


_SLOW_DISK_SITE = '''\
"""Test-only: every write to a torch_dist data file (*.distcp) takes 50 ms, as on a slow disk; the first one creates
the file named by GLM5_TEST_WRITING. Loaded by every Python process started with this directory on PYTHONPATH."""
import builtins
import os
import time

_open = builtins.open
_marker = os.environ.get("GLM5_TEST_WRITING")


class _SlowDisk:
    def __init__(self, f):
        self._f = f

    def write(self, data):
        if _marker and not os.path.exists(_marker):
            _open(_marker, "w").close()
        time.sleep(0.05)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def open(file, mode="r", *args, **kwargs):
    f = _open(file, mode, *args, **kwargs)
    if "w" in mode and str(file).endswith(".distcp"):
        return _SlowDisk(f)
    return f


builtins.open = open
'''


def slow_disk_env(root: Path) -> tuple[dict[str, str], Path]:
    """Environment for a subprocess (and its ranks) whose checkpoint data writes are slow, and the file that appears
    when the first one starts."""
    site = Path(root) / "slow_disk_site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_SLOW_DISK_SITE)
    marker = Path(root) / "WRITING"
    repo = Path(__file__).resolve().parent.parent
    return {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{repo}", "GLM5_TEST_WRITING": str(marker)}, marker
