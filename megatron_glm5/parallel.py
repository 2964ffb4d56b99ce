"""Process-group set-up shared by the library entry points (``from_hf_pretrained``, ``demo``, the bridge)."""

from __future__ import annotations

import os
import socket
from contextlib import closing

import torch
import torch.distributed as dist


def free_port() -> int:
    """A free local TCP port (for a single-process rendezvous or locally spawned ranks)."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_process_group() -> None:
    """Initialise ``torch.distributed`` if needed: NCCL when CUDA is present, else gloo. Under a launcher (``RANK``
    set) the launcher's environment is used; a plain process becomes rank 0 of a world of 1 on a free local port,
    without writing anything into ``os.environ`` (child processes must not inherit a rendezvous that is in use)."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def seed_model_parallel(seed: int) -> None:
    """megatron-core's ``model_parallel_cuda_manual_seed``. Without CUDA it uses the inference RNG tracker, whose
    ``fork()`` is a no-op context (TransformerBlock forks it under sequence parallelism); TP-forked dropout RNG is
    then shared, which only matters with dropout > 0 (GLM-5.x trains with dropout 0)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(seed)
    else:
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


def initialize_model_parallel(
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    expert_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    seed: int = 1234,
) -> None:
    """Initialise megatron-core's parallel state unless it already is (then the sizes must agree)."""
    from megatron.core import parallel_state as ps

    ensure_process_group()
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size())
        want = (tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size)
        if have != want:
            raise RuntimeError(
                f"megatron-core parallel state is already initialised with (TP, PP, EP) = {have}, but {want} was "
                "requested; call megatron_glm5.parallel.destroy_model_parallel() first"
            )
        return
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        context_parallel_size=context_parallel_size,
    )
    seed_model_parallel(seed)


def destroy_model_parallel() -> None:
    """megatron-core's ``destroy_model_parallel`` plus the process groups it created: megatron-core only forgets them,
    and each gloo group keeps its I/O threads alive, so a process that builds models repeatedly (tests, conversions,
    a launcher re-sharding) would accumulate thousands of threads."""
    from megatron.core import parallel_state as ps

    if dist.is_initialized():
        seen: set[int] = set()
        for value in vars(ps).values():
            for group in value if isinstance(value, (list, tuple)) else (value,):
                if (isinstance(group, dist.ProcessGroup) and group is not dist.GroupMember.WORLD
                        and id(group) not in seen):
                    seen.add(id(group))
                    dist.destroy_process_group(group)
    ps.destroy_model_parallel()
