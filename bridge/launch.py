"""Running a conversion over several ranks: megatron-core parallel state, local process launch, pipeline split.

A conversion at TP/PP/EP > 1 runs one rank per model shard, as megatron-core itself would save: each rank builds
its shard's skeleton on the meta device and writes exactly the boxes its sharded state dict declares. Under
``torchrun`` the ranks already exist; from a plain process :func:`run_local_ranks` spawns them (gloo on CPU,
NCCL with GPUs) and turns a failing rank's :class:`~bridge.errors.BridgeError` back into the same error here.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from megatron_glm5.core.stages import valid_stage_starts
from megatron_glm5.parallel import destroy_model_parallel, free_port

from . import errors
from .errors import BridgeError


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group, or (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def launched_world_size() -> int:
    """World size of an existing process group, or of a launcher environment (torchrun) about to create one."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_ok(ok: bool, message: str = "") -> None:
    """Raise on every rank if any rank is not ok (keeps ranks from hanging in a later collective)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    msgs = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, None if ok else message)
    bad = [(r, m) for r, m in enumerate(msgs) if m is not None]
    if bad:
        raise BridgeError(bad[0][1] if len(bad) == 1 else "; ".join(f"rank {r}: {m}" for r, m in bad))


def pipeline_split(arch: Any, pp: int) -> dict[str, int]:
    """RuntimePolicy fields for a ``pp``-stage split in which every stage's first DSA layer is an IndexShare "full"
    one (:func:`~megatron_glm5.core.stages.valid_stage_starts`: a GLM-5.x stage starts on a full layer, a
    GLM-5.3-Flash stage may also start on a KDA layer before one). Uniform when that works; for two stages otherwise
    the valid start closest to the middle."""
    n = len(arch.indexer_types)
    if pp == 1:
        return {}
    dsa = set(arch.dsa_layers)
    starts = set(valid_stage_starts(arch.indexer_types, [i in dsa for i in range(n)]))

    def uniform(p: int) -> bool:
        return n % p == 0 and all(s * n // p in starts for s in range(p))

    if uniform(pp):
        return {}
    if pp == 2:
        candidates = [i for i in sorted(starts) if i > 0]
        if candidates:
            first = min(candidates, key=lambda i: (abs(i - n / 2), i))
            return {"num_layers_in_first_pipeline_stage": first, "num_layers_in_last_pipeline_stage": n - first}
    valid = [p for p in range(1, n + 1) if p == 1 or uniform(p) or (p == 2 and len(starts) > 1)]
    raise BridgeError(
        f"--pp {pp}: cannot split {n} layers with IndexShare pattern {list(arch.indexer_types)} into {pp} pipeline "
        f"stages whose first DSA layer is 'full' (valid stage starts: layers {sorted(starts)}); valid --pp: "
        f"{', '.join(map(str, valid[:12]))} (the checkpoint is reshardable, so the conversion layout does not have to "
        "match the training layout)"
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_parallel_layout(arch, tp: int, pp: int, ep: int, *, source: str = "config.json") -> dict[str, int]:
    """Refuse a TP/PP/EP layout that megatron-core would refuse for this architecture, before any rank is started
    and before megatron-core is imported (a spawned rank costs seconds of start-up and reports megatron-core's
    assertion as a nested traceback). Returns :func:`pipeline_split`'s RuntimePolicy fields.

    What megatron-core 0.19.2 requires when it builds a GLM-5.x model (MLA down-projections and the DSA indexer are
    replicated, so they impose nothing): TP divides the attention heads (``TransformerConfig``), the vocabulary
    (``VocabParallelEmbedding`` and the column-parallel LM head split rows), the dense MLP width and - expert tensor
    parallelism defaults to TP - the routed and shared expert widths (column-parallel ``fc1``); EP divides the
    routed experts (MTP layers are MoE layers too); PP gives every stage layers and makes each stage's first DSA
    layer an IndexShare "full" one (MTP always sits on the last stage and adds no constraint)."""
    for flag, v in (("--tp", tp), ("--pp", pp), ("--ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise BridgeError(f"{flag}: expected an integer >= 1, got {v!r}")
    from .families import bridge_family

    bridge_family(arch).check_layout(arch, tp, pp, ep, source=source)
    moe = "sparse" in arch.mlp_layer_types or arch.num_nextn_predict_layers > 0
    by_tp = [("num_attention_heads", arch.num_attention_heads), ("vocab_size", arch.vocab_size)]
    if "dense" in arch.mlp_layer_types:
        by_tp.append(("intermediate_size", arch.intermediate_size))
    if moe:
        by_tp.append(("moe_intermediate_size", arch.moe_intermediate_size))
        if arch.n_shared_experts:
            shared = arch.moe_intermediate_size * arch.n_shared_experts
            by_tp.append(("moe_intermediate_size * n_shared_experts", shared))
    problems = []
    bad_tp = [f"{name} ({value})" for name, value in by_tp if value % tp]
    if bad_tp:
        g = math.gcd(*(value for _, value in by_tp))
        problems.append(f"--tp {tp} must divide {', '.join(bad_tp)}: megatron-core splits attention heads, vocabulary "
                        f"rows and MLP/expert widths evenly over TP ranks; valid --tp: "
                        f"{', '.join(map(str, _divisors(g)[:12]))}")
    if moe and arch.n_routed_experts % ep:
        valid = ", ".join(map(str, _divisors(arch.n_routed_experts)[:12]))
        problems.append(f"--ep {ep} must divide n_routed_experts ({arch.n_routed_experts}): every EP rank holds the "
                        f"same number of experts; valid --ep: {valid}")
    if problems:
        raise BridgeError(f"{source}: " + "; ".join(problems))
    return pipeline_split(arch, pp)


@contextmanager
def model_parallel(tp: int, pp: int, ep: int) -> Iterator[None]:
    """megatron-core parallel state with these sizes for the duration; reuses a matching existing state."""
    from megatron.core import parallel_state as ps

    from megatron_glm5.parallel import initialize_model_parallel

    created = not ps.model_parallel_is_initialized()
    try:
        initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  expert_model_parallel_size=ep)
    except RuntimeError as e:
        raise BridgeError(str(e)) from None
    try:
        yield
    finally:
        if created:
            destroy_model_parallel()


_QUIET_LOGGERS = ("megatron", "torch.utils.cpp_extension")


def _rank_entry(fn: Callable[..., Any], rank: int, nprocs: int, port: int, kwargs: dict, queue, filters: list,
                levels: dict[str, int]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import logging
    import warnings

    warnings.filters[:] = filters  # the parent's warning filters and log levels (the CLI's quiet mode)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    import torch.distributed as dist

    from megatron_glm5.config import GLM5ConfigError
    from megatron_glm5.cpu import enable_cpu_mode

    try:
        enable_cpu_mode()
        dist.init_process_group("gloo")  # conversion ranks move no tensors between them: no GPU needed
        result = fn(**kwargs)
        queue.put((rank, "ok", result))
    except (BridgeError, GLM5ConfigError) as e:
        queue.put((rank, "bridge", (type(e).__name__, str(e))))
    except OSError as e:  # a full disk, a read-only output: the parent reports it like its own
        queue.put((rank, "oserror", (e.errno, e.strerror, e.filename, e.filename2, str(e))))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


@contextmanager
def _ranks_ignore_sigint() -> Iterator[None]:
    """Ranks started meanwhile ignore SIGINT (an ignored signal survives exec): Ctrl-C reaches the whole process
    group, and the ranks, half-way through their imports, would each print a KeyboardInterrupt traceback. The
    parent handles it and stops them (:func:`run_local_ranks`)."""
    import signal

    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_local_ranks(fn: Callable[..., Any], nprocs: int, **kwargs: Any) -> list[Any]:
    """Run ``fn(**kwargs)`` on ``nprocs`` local ranks (a fresh process group); return rank-ordered results."""
    import logging
    import multiprocessing as mp
    import warnings

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    filters = list(warnings.filters)
    levels = {name: logging.getLogger(name).level for name in _QUIET_LOGGERS}
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, nprocs, port, kwargs, queue, filters, levels), daemon=False)
             for r in range(nprocs)]
    with _ranks_ignore_sigint():
        for p in procs:
            p.start()
    results: dict[int, Any] = {}
    failure: tuple[str, Any] | None = None
    interrupted = False
    try:
        while len(results) < nprocs and failure is None:
            while not queue.empty():
                rank, status, payload = queue.get()
                if status == "ok":
                    results[rank] = payload
                else:
                    failure = (status, payload)
                    break
            if failure is None and len(results) < nprocs:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and queue.empty():
                    failure = ("error", f"rank process {procs.index(dead[0])} died with exit code {dead[0].exitcode}")
                time.sleep(0.05)
    except BaseException:  # Ctrl-C, SIGTERM: no rank outlives the command
        interrupted = True
        raise
    finally:
        if failure is not None or interrupted:
            for p in procs:
                if p.is_alive():
                    p.kill()
        for p in procs:
            p.join()
    if failure is not None:
        status, payload = failure
        if status == "oserror":
            code, strerror, filename, filename2, text = payload
            raise OSError(code, strerror, filename, None, filename2) if code is not None else OSError(text)
        if status == "bridge":
            name, message = payload
            if name == "GLM5ConfigError":
                from megatron_glm5.config import GLM5ConfigError

                raise GLM5ConfigError(message)
            cls = getattr(errors, name, BridgeError)
            raise (cls if isinstance(cls, type) and issubclass(cls, BridgeError) else BridgeError)(message)
        raise RuntimeError(f"a conversion rank failed:\n{payload}")
    return [results[r] for r in range(nprocs)]
