"""Test harness: explicit CPU mode for megatron-core, a single-process gloo fixture, torchrun helper.

The CPU shims come from the library's one documented switch (``megatron_glm5.cpu.enable_cpu_mode``) and are turned
on here for the session, never at import of the library.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # megatron's jit_fuser is torch.compile: slow and useless on CPU
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the tests' sequences are far below split_recompute.MIN_CHUNK_TOKENS: chunk counts by length (the default) would run
# every MLP whole, so the chunked paths are tested at the counts asked for (forced: an exported 1 would make them
# compare whole against whole); test_chunks_by_length turns the rule on
os.environ["MEGATRON_GLM5_MLP_CHUNKS_BY_LENGTH"] = "0"

import pytest
import torch

from megatron_glm5.cpu import disable_cpu_mode, enable_cpu_mode
from megatron_glm5.parallel import destroy_model_parallel
from tests.instrument import count_calls


# tests/gpu needs a CUDA device (it runs on the GPU machine: `pytest tests/gpu`); CI is CPU-only and does not collect it.
collect_ignore_glob = [] if torch.cuda.is_available() else ["gpu/*"]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (run on the H200 machine)")
    config.addinivalue_line("markers", "slow: takes more than ~30 s on 2 CPU cores")


@pytest.fixture(scope="session", autouse=True)
def megatron_cpu_mode():
    """megatron-core's few direct ``torch.cuda.current_device()`` calls answer "cpu" for the whole session."""
    active = enable_cpu_mode()
    yield active
    disable_cpu_mode()


@pytest.fixture(scope="session")
def gloo_world():
    """A single-process gloo world (rank 0 of 1) for the session."""
    from megatron_glm5.parallel import ensure_process_group

    ensure_process_group()
    yield
    # Left initialised until the interpreter exits: destroying and re-creating gloo groups in one process is flaky.


@pytest.fixture
def model_parallel(gloo_world):
    """megatron-core parallel state at TP=PP=EP=1 (factory for other sizes in a 1-process world), torn down after."""
    from megatron.core import parallel_state as ps

    from megatron_glm5.parallel import initialize_model_parallel

    def init(**sizes):
        if ps.model_parallel_is_initialized():
            destroy_model_parallel()
        initialize_model_parallel(**sizes)

    init()
    yield init
    destroy_model_parallel()


@pytest.fixture
def indexer_calls(monkeypatch):
    """Count indexer runs of both backends (test-only instrumentation): ``calls[0]``."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer

    from megatron_glm5.dsa.tilelang_attention import TileLangSparseAttention

    calls = [0]
    count_calls(monkeypatch, calls, DSAIndexer, "forward_before_topk")  # the megatron backend's indexer
    count_calls(monkeypatch, calls, TileLangSparseAttention, "indexer_rows")  # the tilelang backend's indexer
    return calls


@pytest.fixture
def indexer_loss_calls(monkeypatch):
    """Count indexer losses attached to an attention output, either backend, torch or fused path: ``calls[0]``."""
    from megatron_glm5.dsa.attention import DSACoreAttention

    calls = [0]
    count_calls(monkeypatch, calls, DSACoreAttention, "attach_loss", when=lambda output, loss: loss is not None)
    return calls
