"""The ``pp`` forward's opt-in builds as ``sparse_mla_fwd_interface`` runs them (``MEGATRON_GLM5_PP_OPTIONS`` /
``PP_OPTIONS``): the factory gets exactly the default call's arguments without options (so precompiled kernels still
hit) and ``named_exchange`` / ``ctas`` (the device's SM count) with them. The builds themselves are compared bitwise on
the GPU (``tests/gpu/test_kernels_gpu.py``: ``fwd_pp_options``, ``fwd_pp_persistent``)."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5.kernels import sparse_mla_fwd


@pytest.fixture
def calls(monkeypatch):
    seen = []

    def factory(*args, **kwargs):
        seen.append((args, kwargs))
        return "kernel"

    monkeypatch.setattr(sparse_mla_fwd, "_jit_fwd_pp", lambda: factory)
    monkeypatch.delenv(sparse_mla_fwd.PP_OPTIONS_ENV, raising=False)
    return seen


def test_no_options_call_the_factory_as_before(calls):
    cpu = torch.device("cpu")
    sparse_mla_fwd.pp_kernel(64, 576, 512, 0.0625, 1, cpu)
    sparse_mla_fwd.pp_kernel(16, 576, 512, 0.0625, 4, cpu)
    assert calls == [((64, 576, 512, 0.0625), {}), ((16, 576, 512, 0.0625, 4), {})]


@pytest.mark.parametrize("raw, kwargs", [
    ("named_exchange", {"named_exchange": True}),
    ("persistent", {"ctas": 132}),  # multiprocessor_count's value off the GPU
    (" persistent , named_exchange ", {"named_exchange": True, "ctas": 132}),
    ("", {}),  # empty: the module default (none today)
    ("none", {}),
])
def test_the_switch_chooses_the_build(calls, monkeypatch, raw, kwargs):
    monkeypatch.setenv(sparse_mla_fwd.PP_OPTIONS_ENV, raw)
    sparse_mla_fwd.pp_kernel(64, 576, 512, 0.0625, 1, torch.device("cpu"))
    expected_args = (64, 576, 512, 0.0625, 1) if kwargs else (64, 576, 512, 0.0625)
    assert calls == [(expected_args, kwargs)]


def test_module_default_applies_without_the_switch(calls, monkeypatch):
    monkeypatch.setattr(sparse_mla_fwd, "PP_OPTIONS", ("persistent",))
    sparse_mla_fwd.pp_kernel(16, 512, 512, 0.0625, 4, torch.device("cpu"))
    assert calls == [((16, 512, 512, 0.0625, 4), {"ctas": 132})]


def test_an_empty_switch_keeps_the_module_default_and_none_turns_it_off(calls, monkeypatch):
    monkeypatch.setattr(sparse_mla_fwd, "PP_OPTIONS", ("named_exchange",))
    monkeypatch.setenv(sparse_mla_fwd.PP_OPTIONS_ENV, " ")
    assert sparse_mla_fwd.pp_options() == ("named_exchange",)
    monkeypatch.setenv(sparse_mla_fwd.PP_OPTIONS_ENV, "none")
    assert sparse_mla_fwd.pp_options() == ()


def test_an_unknown_option_is_refused_by_name(calls, monkeypatch):
    monkeypatch.setenv(sparse_mla_fwd.PP_OPTIONS_ENV, "persistant")
    with pytest.raises(ValueError, match="MEGATRON_GLM5_PP_OPTIONS='persistant'.*persistant"):
        sparse_mla_fwd.pp_kernel(64, 576, 512, 0.0625, 1, torch.device("cpu"))
    assert calls == []
