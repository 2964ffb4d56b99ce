"""GLM-5.3-Flash's clamped SwiGLU on megatron-core 0.19.2: the settings that give it, and checks for the paths that
silently drop the clamp.

transformers (``Glm5NextTextMLP`` / ``Glm5NextTextExperts._apply_gate``)::

    y = down( silu(gate.clamp(max=L)) * up.clamp(-L, L) )        L = swiglu_limit (10.0); gate lower side unclamped

megatron-core computes exactly this in its *unfused* GLU (``linear_fc1`` output chunked ``[gate | up]``, then
``activation_func(gate.clamp(max=L)) * (up.clamp(-L, L) + glu_linear_offset)``) when ``activation_func=F.silu``,
``gated_linear_unit=True``, ``activation_func_clamp_value=L`` and ``glu_linear_offset=0``, despite the field's
docstring, which says the clamp is "only used when activation_func is quick_gelu". Paths below are relative to
``megatron/core/``. That unfused GLU runs in:

* ``MLP.forward`` (``transformer/mlp.py:319-339``): the dense MLP; every ``SequentialMLP`` expert (an ``MLP``; the
  router probabilities multiply the GLU output through ``per_token_scale``, ``mlp.py:336-339``); and
  ``SharedExpertMLP.forward`` (``transformer/moe/shared_experts.py:195-197`` calls ``MLP.forward``);
* ``TEGroupedMLP``'s ``bias_act_func`` (``transformer/moe/experts.py:858-878``): grouped-GEMM routed experts without
  the op fuser; and :class:`~megatron_glm5.moe.grouped_experts.TorchGroupedMLP` (``moe_grouped_gemm`` without TE),
  which runs ``MLP``'s activation code.

Paths that ignore ``activation_func_clamp_value`` for SiLU without any error from megatron-core (config flag ->
where):

* ``bias_activation_fusion=True``: ``bias_swiglu_impl`` / ``weighted_bias_swiglu_impl`` take no clamp
  (``transformer/mlp.py:276-318``, ``transformer/moe/experts.py:827-835``,
  ``transformer/moe/shared_experts.py:271-287``; ``fusions/fused_bias_swiglu.py:209,239``). Only the quick-GEGLU
  fused kernel receives the clamp.
* ``use_te_activation_func=True``: Transformer Engine's ``SwiGLU`` op (``TEActivationOp``,
  ``extensions/transformer_engine.py:590-615``) replaces the GLU in ``transformer/mlp.py:268-275``,
  ``transformer/moe/experts.py:815-826`` and ``transformer/moe/shared_experts.py:267-270``.
* ``use_transformer_engine_op_fuser=True``: grouped experts run ``te.ops.ScaledSwiGLU`` without a limit
  (``transformer/moe/experts.py:286-290,485-494``; only quick-GEGLU gets ``limit=clamp``).
* a block spec built with ``use_te_op_fuser=True`` (``models/gpt/gpt_layer_specs.py:535-539``): the dense MLP becomes
  ``TEFusedMLP`` (TE ``SwiGLU`` op, ``extensions/transformer_engine.py:2814-2819,2857-2895``) or
  ``TEFusedMLPWithGroupedLinear`` (``ScaledSwiGLU``, ``extensions/transformer_engine.py:3144``). The spec choice is
  not visible in the config: use :func:`check_clamped_swiglu_modules` on the built model.
* ``moe_shared_expert_overlap=True``: ``SharedExpertMLP.linear_fc1_forward_and_act`` has its own GLU without the
  clamp (``transformer/moe/shared_experts.py:288-299``, the GLU at 292-295).
* ``use_grouped_gemm_for_shared_expert=True``: ``FusedSharedExpertMLP`` (``models/gpt/moe_module_specs.py:30-33``)
  runs ``te.ops.ScaledSwiGLU`` without a limit (``transformer/moe/shared_experts.py:449-478``).

Not silent, so not checked: ``InferenceGroupedMLP`` (``transformer_impl="inference_optimized"``) raises for SiLU when
it is built (``transformer/moe/experts.py:1027,1047-1052``); ``TransformerConfig`` rejects a non-zero
``glu_linear_offset`` together with ``bias_activation_fusion`` (``transformer/transformer_config.py:2134-2138``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class ClampedSwiGLUError(ValueError):
    """A megatron-core config or module that would not compute the clamped SwiGLU; names the flag to change."""


def clamped_swiglu_kwargs(limit: float) -> dict[str, Any]:
    """``TransformerConfig`` kwargs for ``silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)``: the activation
    itself, plus the fusions that must stay off because they drop the clamp (see the module docstring)."""
    if not limit > 0:
        raise ClampedSwiGLUError(f"swiglu limit: expected a positive float, found {limit}")
    return dict(
        # the activation
        activation_func=F.silu,
        gated_linear_unit=True,
        activation_func_clamp_value=float(limit),
        glu_linear_offset=0.0,
        # fused paths that ignore activation_func_clamp_value for SiLU
        bias_activation_fusion=False,
        use_te_activation_func=False,
        use_transformer_engine_op_fuser=False,
        moe_shared_expert_overlap=False,
        use_grouped_gemm_for_shared_expert=False,
    )


# flag -> (required value, why a different value drops or changes the clamp)
_MUST_BE_OFF: tuple[tuple[str, str], ...] = (
    ("bias_activation_fusion", "the fused bias_swiglu / weighted_bias_swiglu kernels take no clamp"),
    ("use_te_activation_func", "Transformer Engine's SwiGLU op takes no clamp"),
    ("use_transformer_engine_op_fuser", "the op-fuser grouped MLP uses te.ops.ScaledSwiGLU without a limit"),
    ("moe_shared_expert_overlap", "the overlapped shared-expert forward has its own GLU without the clamp"),
    ("use_grouped_gemm_for_shared_expert", "FusedSharedExpertMLP uses te.ops.ScaledSwiGLU without a limit"),
)


def check_clamped_swiglu(config: Any, limit: float) -> None:
    """Raise :class:`ClampedSwiGLUError` unless megatron-core's MLPs built from ``config`` (a ``TransformerConfig``)
    compute the clamped SwiGLU with ``limit``. The message names the flag, the expected and the found value."""
    expected = clamped_swiglu_kwargs(limit)

    def fail(flag: str, want: Any, found: Any, why: str) -> None:
        raise ClampedSwiGLUError(
            f"megatron-core config '{flag}': expected {want!r}, found {found!r} ({why}); set {flag}={want!r}"
        )

    if getattr(config, "activation_func", None) is not F.silu:
        fail("activation_func", F.silu, getattr(config, "activation_func", None), "SwiGLU is silu-gated")
    if not getattr(config, "gated_linear_unit", False):
        fail("gated_linear_unit", True, getattr(config, "gated_linear_unit", None), "SwiGLU is a gated linear unit")
    clamp = getattr(config, "activation_func_clamp_value", None)
    if clamp is None or float(clamp) != float(limit):
        fail("activation_func_clamp_value", float(limit), clamp, "the swiglu_limit of the checkpoint")
    offset = getattr(config, "glu_linear_offset", 0.0)
    if offset != 0.0:
        fail("glu_linear_offset", 0.0, offset, "GLM-5.3-Flash adds nothing to the up projection (GPT-OSS adds 1)")
    for flag, why in _MUST_BE_OFF:
        found = getattr(config, flag, False)
        if found:
            fail(flag, expected[flag], found, f"{why}, so the clamp at {limit} would be silently dropped")


# Module classes whose forward never applies the clamp, by class name (no Transformer Engine import needed).
_CLAMP_DROPPING_MODULES = {
    "TEFusedMLP": "a block spec built with use_te_op_fuser=True; build the dense MLP spec without it",
    "TEFusedMLPWithGroupedLinear": "a block spec built with use_te_op_fuser=True and use_grouped_gemm_for_dense_mlp",
    "FusedSharedExpertMLP": "use_grouped_gemm_for_shared_expert=True",
    "InferenceGroupedMLP": "transformer_impl='inference_optimized'",
}


def check_clamped_swiglu_modules(model: torch.nn.Module, limit: float) -> None:
    """Walk a built megatron-core model and raise :class:`ClampedSwiGLUError` at the first MLP / expert module that
    would not apply the clamp: a TE-fused class (chosen by the block spec, invisible in the config), a
    ``TEGroupedMLP`` on its op-fuser path, or any MLP whose own (possibly deep-copied) config fails
    :func:`check_clamped_swiglu`."""
    for name, module in model.named_modules():
        cls = type(module).__name__
        where = name or "<root>"
        if cls in _CLAMP_DROPPING_MODULES:
            raise ClampedSwiGLUError(
                f"module '{where}' is a {cls}, whose SwiGLU ignores activation_func_clamp_value "
                f"(from {_CLAMP_DROPPING_MODULES[cls]})"
            )
        if getattr(module, "_with_fused_impl", False):
            raise ClampedSwiGLUError(
                f"module '{where}' ({cls}) runs the Transformer Engine op-fuser path (te.ops.ScaledSwiGLU, no clamp); "
                "set use_transformer_engine_op_fuser=False"
            )
        if cls in ("MLP", "SharedExpertMLP", "SequentialMLP", "TorchGroupedMLP", "TEGroupedMLP") \
                and hasattr(module, "config"):
            try:
                check_clamped_swiglu(module.config, limit)
            except ClampedSwiGLUError as e:
                raise ClampedSwiGLUError(f"module '{where}' ({cls}): {e}") from None
