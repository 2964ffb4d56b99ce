"""Fixtures shared by the GPU tests (collected only where CUDA is available, see tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def parallel():
    """megatron-core parallel state at TP=PP=EP=1 on the GPU (NCCL), one per test module, torn down after it."""
    from megatron.core import parallel_state as ps

    from megatron_glm5.parallel import destroy_model_parallel, initialize_model_parallel

    if ps.model_parallel_is_initialized():
        destroy_model_parallel()
    initialize_model_parallel()
    yield
    destroy_model_parallel()
