"""Deterministic mode end to end: what makes two runs of the same training step bitwise equal.

Three sources of run-to-run differences in a GLM-5.x step, and what removes each:

* **DSA top-k ties.** Our indexer top-k (TileLang kernel and torch reference) breaks ties towards the lower key
  index, always; replaying the rollout's top-k (:mod:`megatron_glm5.rl.replay`) removes the selection altogether.
  (megatron-core's own fused indexer, used by the ``megatron`` backend with ``mcore_dsa_kernels="tilelang"``, is
  not covered: use the ``tilelang`` backend.)
* **Sparse-MLA backward.** The TileLang backward accumulates ``dKV`` with float atomics unless
  ``RuntimePolicy(deterministic_mode=True)`` (megatron-core's ``deterministic_mode``), which switches it to a
  partial-buffer reduction in a fixed order.
* **Everything else on CUDA** (MoE permutation ``scatter_add_`` / ``index_add_``, cuBLAS split-K, NCCL reductions):
  :func:`enable_deterministic_algorithms` below, process-wide, called from a program's ``main`` before CUDA or NCCL
  start.

On CPU every path is deterministic already (two runs are bitwise equal; ``tests/test_rl_replay.py``).
"""

from __future__ import annotations

import os
import warnings

import torch


def enable_deterministic_algorithms() -> None:
    """Process-wide switches for bitwise reproducible steps on CUDA (the library never calls this):

    * ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS reads it when it initialises: set before the first GEMM);
    * ``NCCL_ALGO=Ring`` unless set (NCCL reads it when a communicator is created);
    * ``torch.use_deterministic_algorithms(True)`` (deterministic ``scatter_add_`` / ``index_add_`` kernels, errors on
      ops that have none) and cuDNN's deterministic mode.

    Pair it with ``RuntimePolicy(deterministic_mode=True)`` and the ``tilelang`` backend."""
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            warnings.warn("enable_deterministic_algorithms: CUDA is already initialised; CUBLAS_WORKSPACE_CONFIG may "
                          "come too late for cuBLAS (set it in the environment of the process)", stacklevel=2)
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    os.environ.setdefault("NCCL_ALGO", "Ring")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
