"""RuntimePolicy's megatron-core kernel choice is spelled ``mcore_dsa_kernels`` (it cannot be confused with the
``tilelang`` attention backend); the old ``dsa_kernel_backend`` keyword and attribute still work, with a
DeprecationWarning, and the megatron-core config field it sets keeps megatron-core's name."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_glm5.core.policy import RuntimeEnvironment, RuntimePolicy, resolve_policy, runtime_kwargs

CPU = RuntimeEnvironment(cuda=False, mcore_tilelang_kernels=False, apex_gradient_accumulation_fusion=False)


def test_new_spelling_reaches_megatron_cores_field():
    policy = RuntimePolicy(mcore_dsa_kernels="none")
    assert runtime_kwargs(policy, CPU)["dsa_kernel_backend"] == "none"
    assert resolve_policy(RuntimePolicy(), CPU).mcore_dsa_kernels == "none"


def test_old_spelling_still_works_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="mcore_dsa_kernels"):
        old = RuntimePolicy(dsa_kernel_backend="cudnn")
    assert old == RuntimePolicy(mcore_dsa_kernels="cudnn")
    with pytest.warns(DeprecationWarning, match="read mcore_dsa_kernels"):
        assert old.dsa_kernel_backend == "cudnn"
    assert dataclasses.replace(old, fusions=False).mcore_dsa_kernels == "cudnn"  # replace passes the new spelling


def test_both_spellings_must_agree():
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="disagree"):
        RuntimePolicy(dsa_kernel_backend="none", mcore_dsa_kernels="tilelang")
