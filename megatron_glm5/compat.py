"""Every place megatron-glm5 reaches into megatron-core, torch or transformers internals, in one module.

Each hook is a small function or constant here, registered in :data:`HOOKS` with the version it was checked against
and a probe that fails when the internal moves (``tests/test_compat.py`` runs every probe). Callers import the hook
from here, never the internal, so an upgrade is checked and fixed in one file.

This module sits at the bottom of the package (beside :mod:`megatron_glm5.kernels`): it imports nothing of
megatron-glm5, and megatron-core / transformers only inside functions.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

MCORE = "megatron-core 0.19.2"
TORCH = "torch 2.11 (GPU machine) and 2.14 (CPU)"
TRANSFORMERS = "transformers 5.24"


@dataclass(frozen=True, slots=True)
class Hook:
    """One reach into an internal: what, who uses it, the version checked, and a probe (raises if it moved)."""

    name: str
    used_by: str
    checked_against: str
    probe: Callable[[], None]


HOOKS: list[Hook] = []


def _hook(name: str, used_by: str, checked_against: str):
    def register(probe: Callable[[], None]) -> Callable[[], None]:
        HOOKS.append(Hook(name, used_by, checked_against, probe))
        return probe

    return register


# --------------------------------------------------------------------------------------------------------------------
# 1. megatron-core's CheckpointFunction: the running checkpoint's autograd node (core.layer: top-k replay; offload)
# --------------------------------------------------------------------------------------------------------------------


def _checkpoint_frames() -> tuple:
    from megatron.core.tensor_parallel.random import CheckpointFunction

    return CheckpointFunction.forward.__code__, CheckpointFunction.backward.__code__


_frames: tuple | None = None


def checkpoint_node() -> Any:
    """The autograd node (``ctx``) of the innermost megatron-core ``CheckpointFunction`` running on this thread,
    or None. megatron-core hands the checkpointed function no handle on its node, so it is read from the ``ctx``
    local of the ``forward`` / ``backward`` frame (a read-only walk of a few frames)."""
    global _frames
    if _frames is None:
        _frames = _checkpoint_frames()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _frames:
            return frame.f_locals.get("ctx")
        frame = frame.f_back
    return None


@_hook("CheckpointFunction.forward/backward frames hold the node as local 'ctx'", "core/layer.py, offload.py", MCORE)
def _probe_checkpoint_node() -> None:
    for code in _checkpoint_frames():
        assert code.co_varnames and code.co_varnames[0] == "ctx", f"{code.co_name}: first argument is not ctx"


_BLOCK_CHUNK = ("megatron.core.recompute", "checkpointed_forward.<locals>.custom.<locals>.custom_forward")


def checkpoint_last_layer(node: Any) -> Any:
    """The layer a megatron-core ``TransformerBlock`` full-recompute checkpoint ``node`` runs last, or None for any
    other checkpoint (MTP's, a module's own). That chunk function (``recompute.checkpointed_forward``'s
    ``custom_forward``) returns the last layer's output unchanged, and ``CheckpointFunction.backward`` uses the
    recomputed output only as the root of its backward: so the last layer's recomputed output value is never read.
    Read from the chunk function's closure (its block ``self`` and its ``end``)."""
    fn = getattr(node, "run_function", None)
    if fn is None or (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) != _BLOCK_CHUNK:
        return None
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    try:
        return cells["self"].cell_contents.layers[cells["end"].cell_contents - 1]
    except (KeyError, ValueError, IndexError, AttributeError):
        return None


@_hook("recompute.checkpointed_forward's chunk function: custom(start, end).custom_forward, closure self / end, "
       "runs self.layers[start:end] and returns (hidden_states, context); CheckpointFunction keeps it as "
       "run_function and backpropagates from the recomputed outputs", "core/split_recompute.py", MCORE)
def _probe_checkpoint_last_layer() -> None:
    import types

    from megatron.core import recompute
    from megatron.core.tensor_parallel.random import CheckpointFunction

    custom = [c for c in recompute.checkpointed_forward.__code__.co_consts
              if isinstance(c, types.CodeType) and c.co_name == "custom"]
    assert len(custom) == 1, "checkpointed_forward has no nested custom(start, end)"
    inner = [c for c in custom[0].co_consts if isinstance(c, types.CodeType) and c.co_name == "custom_forward"]
    assert len(inner) == 1 and {"self", "end", "start"} <= set(inner[0].co_freevars), "custom_forward's closure"
    assert inner[0].co_qualname == _BLOCK_CHUNK[1], inner[0].co_qualname
    assert "run_function" in CheckpointFunction.forward.__code__.co_names
    assert "backward" in CheckpointFunction.backward.__code__.co_names  # torch.autograd.backward(outputs, args)


# --------------------------------------------------------------------------------------------------------------------
# 2. megatron-core's RouterReplay: the process-wide instance list and the router's replay slot (rl/replay.py, parity)
# --------------------------------------------------------------------------------------------------------------------


def router_replay_instances() -> list:
    """megatron-core's process-wide ``RouterReplay.global_router_replay_instances`` (``RouterReplay.__init__``
    appends to it; ``set_replay_data`` and friends address routers by their position in it)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return RouterReplay.global_router_replay_instances


def replace_router_replay(old: Any, new: Any) -> None:
    """Put ``new`` in ``old``'s slot of the instance list (``new`` was appended by its constructor: dropped)."""
    instances = router_replay_instances()
    while new in instances:
        instances.remove(new)
    for i, inst in enumerate(instances):
        if inst is old:
            instances[i] = new


def forget_router_replay(replay: Any) -> None:
    """Remove a temporary ``RouterReplay`` from the process-wide list."""
    instances = router_replay_instances()
    while replay in instances:
        instances.remove(replay)


@_hook("RouterReplay.global_router_replay_instances, TopKRouter.router_replay, get_replay_topk",
       "rl/replay.py, bridge/parity.py", MCORE)
def _probe_router_replay() -> None:
    import inspect

    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay

    assert isinstance(RouterReplay.global_router_replay_instances, list)
    params = list(inspect.signature(RouterReplay.get_replay_topk).parameters)
    assert params[:3] == ["self", "scores", "topk"] and "default_compute_topk" in params, params
    assert "router_replay" in inspect.getsource(TopKRouter.__init__)


def override_method(obj: Any, name: str, fn: Callable) -> None:
    """Shadow a method of one instance (``obj.name = fn``); :func:`restore_method` falls back to the class's."""
    setattr(obj, name, fn)


def restore_method(obj: Any, name: str) -> None:
    if name in vars(obj):
        delattr(obj, name)


# --------------------------------------------------------------------------------------------------------------------
# 3. torch.nn.Module: class swaps (LoRA mixins, adapter-only checkpoints) and load_state_dict's result type
# --------------------------------------------------------------------------------------------------------------------


def swap_class(module: torch.nn.Module, cls: type) -> None:
    """Give a built module a subclass of its own class (a mixin in front): its state, hooks and parents stay."""
    if not issubclass(cls, type(module)):
        raise TypeError(f"{cls.__name__} is not a subclass of {type(module).__name__}")
    module.__class__ = cls


def incompatible_keys(missing: list[str], unexpected: list[str]) -> Any:
    """What ``Module.load_state_dict`` returns (torch's private ``_IncompatibleKeys`` named tuple)."""
    return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


@_hook("Module.__class__ assignment; torch.nn.modules.module._IncompatibleKeys", "lora.py, lora_checkpoint.py", TORCH)
def _probe_module() -> None:
    class _Sub(torch.nn.Linear):
        pass

    m = torch.nn.Linear(2, 2)
    swap_class(m, _Sub)
    assert type(m) is _Sub and m.weight.shape == (2, 2)
    keys = incompatible_keys([], [])
    assert keys.missing_keys == [] and keys.unexpected_keys == []


def register_parameter_hook(fn: Callable) -> Any:
    """torch's process-wide module parameter-registration hook (``WarmupFreeze``); returns its removable handle."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    return register_module_parameter_registration_hook(fn)


@_hook("torch.nn.modules.module.register_module_parameter_registration_hook", "dsa/indexer_training.py", TORCH)
def _probe_parameter_hook() -> None:
    seen = []
    handle = register_parameter_hook(lambda module, name, param: seen.append(name))
    try:
        torch.nn.Linear(1, 1)
    finally:
        handle.remove()
    assert seen == ["weight", "bias"], seen


# --------------------------------------------------------------------------------------------------------------------
# 4. megatron-core's MLA down-projection whitelist and modelopt Linear (dsa/attention.py, providers.py, lora_layers.py)
# --------------------------------------------------------------------------------------------------------------------


def mcore_accepts_down_projection(cls: Any) -> bool:
    """megatron-core's MLA classes whitelist their q/kv down-projection classes by identity (TELinear ->
    duplicated; Linear / TE or local ColumnParallelLinear -> TP-sharded)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.experimental_attention_variant import absorbed_mla as _am

    return cls is not None and cls in (_am.TELinear, _am.Linear, _am.TEColumnParallelLinear, ColumnParallelLinear)


def column_parallel_linear() -> type:
    """The class a replicated down-projection stands in as during megatron-core's MLA constructor."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    return ColumnParallelLinear


@_hook("absorbed_mla.{TELinear, Linear, TEColumnParallelLinear} whitelist", "dsa/attention.py", MCORE)
def _probe_down_projection() -> None:
    import inspect

    from megatron.core.transformer.experimental_attention_variant import absorbed_mla as _am

    for name in ("TELinear", "Linear", "TEColumnParallelLinear"):
        assert hasattr(_am, name), name
    assert mcore_accepts_down_projection(column_parallel_linear())
    assert "linear_q_down_proj" in inspect.getsource(_am.AbsorbedMLASelfAttention.__init__)


def modelopt_linear() -> type:
    """megatron-core's modelopt ``Linear`` (a ``torch.nn.Linear`` taking ``parallel_mode="duplicated"``)."""
    from megatron.core.post_training.modelopt.layers import Linear

    return Linear


@_hook("megatron.core.post_training.modelopt.layers.Linear", "providers.py, lora_layers.py", MCORE)
def _probe_modelopt_linear() -> None:
    assert issubclass(modelopt_linear(), torch.nn.Linear)


def missing_tilelang_dsa_kernel_dependencies() -> list:
    """What megatron-core's fused TileLang DSA kernels lack on this machine (empty: usable)."""
    from megatron.core.utils import _missing_tilelang_dsa_kernel_dependencies

    return list(_missing_tilelang_dsa_kernel_dependencies())


@_hook("megatron.core.utils._missing_tilelang_dsa_kernel_dependencies", "core/policy.py", MCORE)
def _probe_tilelang_dependencies() -> None:
    from megatron.core import utils

    assert callable(utils._missing_tilelang_dsa_kernel_dependencies)


# --------------------------------------------------------------------------------------------------------------------
# 5. torch.distributed.checkpoint / torch.save internals (bridge/megatron_io.py)
# --------------------------------------------------------------------------------------------------------------------


def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """A ``torch.distributed.checkpoint.filesystem._StorageInfo``: the record the filesystem reader expects."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


@contextlib.contextmanager
def torch_save_crc32(enabled: bool) -> Iterator[None]:
    """``torch.save``'s per-record CRC-32 switched for the block (``torch.utils.serialization.config``)."""
    from torch.utils.serialization import config

    previous = config.save.compute_crc32
    config.save.compute_crc32 = enabled
    try:
        yield
    finally:
        config.save.compute_crc32 = previous


@_hook("torch.distributed.checkpoint.filesystem._StorageInfo; serialization config.save.compute_crc32",
       "bridge/megatron_io.py", TORCH)
def _probe_checkpoint_io() -> None:
    info = storage_info("x.distcp", 0, 4)
    assert (info.relative_path, info.offset, info.length) == ("x.distcp", 0, 4)
    with torch_save_crc32(False):
        from torch.utils.serialization import config

        assert config.save.compute_crc32 is False


# --------------------------------------------------------------------------------------------------------------------
# 6. Process-wide attribute patches (cpu.py): installed by name, undone on request and at interpreter exit
# --------------------------------------------------------------------------------------------------------------------

Patch = tuple[Any, str, Any]  # (owner, attribute, replacement)
_originals: dict[tuple[int, str], tuple[Any, str, Any]] = {}  # (id(owner), name) -> (owner, name, original)
_patch_lock = threading.RLock()


_ABSENT = object()  # the original of an attribute a patch added (removing the patch deletes it again)


def install_patches(patches: tuple[Patch, ...]) -> None:
    """Replace (or add) each ``owner.attribute`` (once; the original is remembered until :func:`remove_patches`)."""
    with _patch_lock:
        for owner, name, replacement in patches:
            key = (id(owner), name)
            if key not in _originals:
                _originals[key] = (owner, name, getattr(owner, name, _ABSENT))
                setattr(owner, name, replacement)


def _restore(owner: Any, name: str, original: Any) -> None:
    if original is _ABSENT:
        delattr(owner, name)
    else:
        setattr(owner, name, original)


def remove_patches(patches: tuple[Patch, ...]) -> None:
    with _patch_lock:
        for owner, name, _ in patches:
            entry = _originals.pop((id(owner), name), None)
            if entry is not None:
                _restore(*entry)


def is_patched(owner: Any, name: str) -> bool:
    return (id(owner), name) in _originals


def unpatched(owner: Any, name: str) -> Any:
    """``owner.name`` as it was before any patch of ours (what a probe must look at once a route is installed)."""
    entry = _originals.get((id(owner), name))
    return getattr(owner, name) if entry is None else entry[2]


@atexit.register
def remove_all_patches() -> None:
    """Undo every patch still installed (also at interpreter exit: no patch outlives the code that made it)."""
    with _patch_lock:
        for owner, name, original in _originals.values():
            _restore(owner, name, original)
        _originals.clear()


@_hook("torch.cuda.current_device / random.get_rng_state / synchronize, Tensor.cuda, torch._dynamo.config.disable",
       "cpu.py", f"{TORCH} / {MCORE}")
def _probe_cpu_shims() -> None:
    import torch._dynamo

    for owner, name in ((torch.cuda, "current_device"), (torch.cuda.random, "get_rng_state"),
                        (torch.cuda, "synchronize"), (torch.Tensor, "cuda")):
        assert callable(getattr(owner, name)), name
    assert isinstance(torch._dynamo.config.disable, bool)


# --------------------------------------------------------------------------------------------------------------------
# 7. transformers' GLM-5.3-Flash indexer internals (bridge/parity_reference.py: KPool tie analysis)
# --------------------------------------------------------------------------------------------------------------------

def transformers_glm5_next_indexer() -> type:
    """transformers' GLM-5.3-Flash KPool indexer, whose pooling / visibility helpers the tie analysis calls."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    return Glm5NextTextIndexer


@_hook("transformers Glm5NextTextIndexer.get_pooled_states / get_visible_tokens, "
       "glm_moe_dsa.apply_rotary_pos_emb_interleave", "bridge/parity_reference.py", TRANSFORMERS)
def _probe_transformers_indexer() -> None:
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa

    indexer = transformers_glm5_next_indexer()
    for name in ("get_pooled_states", "get_visible_tokens"):
        assert callable(getattr(indexer, name, None)), name
    assert callable(modeling_glm_moe_dsa.apply_rotary_pos_emb_interleave)


# --------------------------------------------------------------------------------------------------------------------
# 8. megatron-core's pipeline P2P shape (glm5_next/spec.py: GLM-5.3-Flash's mHC streams cross stage boundaries)
# --------------------------------------------------------------------------------------------------------------------

_WRAPPED = "_megatron_glm5_wraps"  # attribute of our get_tensor_shapes wrapper: megatron-core's function


def _schedules() -> Any:
    from megatron.core.pipeline_parallel import schedules

    return schedules


def _mcore_get_tensor_shapes() -> Callable:
    fn = _schedules().get_tensor_shapes
    return getattr(fn, _WRAPPED, fn)


def _stage_tensor_shapes(original: Callable) -> Callable:
    def get_tensor_shapes(*, config, **kwargs):
        shapes = original(config=config, **kwargs)
        width = getattr(config, "pipeline_hidden_size", None)
        if width is None or width == config.hidden_size:
            return shapes
        return [(*s[:-1], width) if len(s) == 3 and s[-1] == config.hidden_size else s for s in shapes]

    get_tensor_shapes.__doc__ = original.__doc__
    setattr(get_tensor_shapes, _WRAPPED, original)
    return get_tensor_shapes


def send_pipeline_hidden_size() -> None:
    """Make megatron-core's pipeline schedule send ``[s, b, config.pipeline_hidden_size]`` between stages for a
    config that has that attribute (GLM-5.3-Flash's ``hc_mult`` streams side by side); every other config keeps
    ``[s, b, hidden_size]``. Installed once, process-wide (:func:`install_patches`), when such a model is built.

    megatron-core 0.19.2 derives the P2P buffers of its non-interleaved schedule (1F1B, and forward-only with PP > 1)
    from ``schedules.get_tensor_shapes``, looked up by name at each call; the interleaved (virtual-pipeline) schedule
    computes them inline, so a family whose stage tensors are wider refuses virtual pipeline stages."""
    schedules = _schedules()
    if not is_patched(schedules, "get_tensor_shapes"):
        install_patches(((schedules, "get_tensor_shapes", _stage_tensor_shapes(schedules.get_tensor_shapes)),))


@_hook("pipeline_parallel.schedules.get_tensor_shapes: the 1F1B schedule's P2P shape [s, b, config.hidden_size], "
       "looked up by name", "glm5_next/spec.py", MCORE)
def _probe_pipeline_shapes() -> None:
    import inspect
    from types import SimpleNamespace

    schedules = _schedules()
    original = _mcore_get_tensor_shapes()
    config = inspect.signature(original).parameters.get("config")
    assert config is not None and config.kind is inspect.Parameter.KEYWORD_ONLY, "get_tensor_shapes(*, config)"
    assert "get_tensor_shapes" in schedules.forward_backward_pipelining_without_interleaving.__code__.co_names
    one = SimpleNamespace(size=lambda: 1)
    cfg = SimpleNamespace(variable_seq_lengths=False, sequence_parallel=False, hidden_size=16)
    shapes = original(seq_length=8, micro_batch_size=2, decoder_seq_length=None, config=cfg, tp_group=one,
                      cp_group=one)
    assert [tuple(s) for s in shapes] == [(8, 2, 16)], shapes
    wide = SimpleNamespace(**vars(cfg), pipeline_hidden_size=64)
    assert [tuple(s) for s in _stage_tensor_shapes(original)(
        seq_length=8, micro_batch_size=2, decoder_seq_length=None, config=wide, tp_group=one, cp_group=one)] == \
        [(8, 2, 64)]


# --------------------------------------------------------------------------------------------------------------------
# 9. megatron-core MLP's SwiGLU fusions, looked up by name in megatron.core.transformer.mlp (fusions.py)
# --------------------------------------------------------------------------------------------------------------------

_MLP_SWIGLU = ("bias_swiglu_impl", "weighted_bias_swiglu_impl")


def route_mlp_swiglu(bias_swiglu_impl: Callable, weighted_bias_swiglu_impl: Callable) -> None:
    """Make megatron-core's ``MLP.forward`` call these two (same signatures as megatron-core's
    ``fused_bias_swiglu.bias_swiglu_impl`` / ``weighted_bias_swiglu_impl``) for its fused SwiGLU. ``MLP`` looks both up
    in its module's globals at each call; installed once, process-wide (:func:`install_patches`)."""
    from megatron.core.transformer import mlp

    install_patches(((mlp, "bias_swiglu_impl", bias_swiglu_impl),
                     (mlp, "weighted_bias_swiglu_impl", weighted_bias_swiglu_impl)))


def mlp_swiglu_routed() -> bool:
    from megatron.core.transformer import mlp

    return all(is_patched(mlp, name) for name in _MLP_SWIGLU)


@_hook("transformer.mlp: MLP.forward calls bias_swiglu_impl / weighted_bias_swiglu_impl from its module globals",
       "fusions.py", MCORE)
def _probe_mlp_swiglu() -> None:
    import inspect

    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.transformer import mlp

    names = mlp.MLP.forward.__code__.co_names
    for name in _MLP_SWIGLU:
        assert name in names, f"MLP.forward no longer calls {name}"
        assert callable(getattr(mlp, name)), name
        assert list(inspect.signature(getattr(fused_bias_swiglu, name)).parameters)[:2] in (
            ["input", "bias"],), name


# --------------------------------------------------------------------------------------------------------------------
# 10. megatron-core's MoE token permutation, looked up by name in megatron.core.transformer.moe.token_dispatcher
# --------------------------------------------------------------------------------------------------------------------

_PERMUTE = ("permute", "unpermute")


def route_moe_permute(permute: Callable, unpermute: Callable) -> None:
    """Make megatron-core's token dispatchers call these two (same signatures as ``moe_utils.permute`` /
    ``unpermute``). The dispatchers look both up in their module's globals at each call; installed once,
    process-wide (:func:`install_patches`)."""
    from megatron.core.transformer.moe import token_dispatcher

    install_patches(((token_dispatcher, "permute", permute), (token_dispatcher, "unpermute", unpermute)))


def moe_permute_routed() -> bool:
    from megatron.core.transformer.moe import token_dispatcher

    return all(is_patched(token_dispatcher, name) for name in _PERMUTE)


@_hook("moe.token_dispatcher: the all-gather dispatcher calls permute / unpermute from its module globals; "
       "moe_utils.permute returns (tokens, probs, sorted_indices, pad_offsets, tokens_per_expert)", "fusions.py", MCORE)
def _probe_moe_permute() -> None:
    import inspect

    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    d = token_dispatcher.MoEAllGatherTokenDispatcher
    assert "permute" in unpatched(d, "dispatch_postprocess").__code__.co_names, \
        "dispatch_postprocess no longer calls permute"
    assert "unpermute" in d.combine_preprocess.__code__.co_names, "combine_preprocess no longer calls unpermute"
    assert list(inspect.signature(moe_utils.permute).parameters) == [
        "tokens", "routing_map", "probs", "num_out_tokens", "fused", "drop_and_pad", "tokens_per_expert", "align_size"]
    assert list(inspect.signature(moe_utils.unpermute).parameters) == [
        "permuted_tokens", "sorted_indices", "restore_shape", "probs", "routing_map", "fused", "drop_and_pad",
        "pad_offsets"]
    tokens = torch.arange(6.0).reshape(3, 2)
    out = moe_utils.permute(tokens, torch.tensor([[True, False], [True, True], [False, True]]), num_out_tokens=4)
    assert len(out) == 5 and out[2].tolist() == [0, 1, 1, 2], out[2]


# --------------------------------------------------------------------------------------------------------------------
# 11. megatron-core's gradient-norm fallback without apex / TE (optimizer.clip_grads.l2_norm_impl)
# --------------------------------------------------------------------------------------------------------------------


def route_grad_norm(l2_norm: Callable) -> bool:
    """Make megatron-core's ``get_grad_norm_fp32`` call ``l2_norm`` (``amp_C.multi_tensor_l2norm``'s signature) where
    it would call its own fallback, ``utils.local_multi_tensor_l2_norm`` (no apex / TE), which syncs the host once per
    gradient tensor. Leaves apex's or TE's kernel alone. Returns whether the fallback is replaced."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        install_patches(((clip_grads, "l2_norm_impl", l2_norm),))
    return is_patched(clip_grads, "l2_norm_impl")


def route_multi_tensor_scale(scale: Callable) -> bool:
    """Make megatron-core's gradient clip and optimizer (``_multi_tensor_copy_this_to_that``: the main -> model
    parameter copies after each step, with an overflow buffer, i.e. fp16 only; bf16 copies tensor by tensor) call
    ``scale`` (``amp_C.multi_tensor_scale``'s signature) where they would call their own fallback,
    ``utils.local_multi_tensor_scale`` (no apex / TE: a product into a temporary and a copy, two kernels per tensor).
    Leaves apex's or TE's kernel alone. Returns whether a fallback is replaced."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    install_patches(tuple((module, "multi_tensor_scale_impl", scale) for module in (optimizer, clip_grads)
                          if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale))
    return multi_tensor_scale_routed()


def multi_tensor_scale_routed() -> bool:
    from megatron.core.optimizer import clip_grads, optimizer

    return any(is_patched(module, "multi_tensor_scale_impl") for module in (optimizer, clip_grads))


@_hook("optimizer.optimizer: _multi_tensor_copy_this_to_that and optimizer.clip_grads: clip_grad_by_total_norm_fp32 "
       "call multi_tensor_scale_impl (utils.local_multi_tensor_scale without apex / TE) through "
       "multi_tensor_applier(op, noop_flag, [src, dst], scale)", "fusions.py", MCORE)
def _probe_multi_tensor_scale() -> None:
    import inspect

    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    assert "multi_tensor_scale_impl" in optimizer._multi_tensor_copy_this_to_that.__code__.co_names
    assert "multi_tensor_scale_impl" in clip_grads.clip_grad_by_total_norm_fp32.__code__.co_names
    assert list(inspect.signature(utils.local_multi_tensor_scale).parameters) == [
        "chunk_size", "noop_flag", "tensor_lists", "scale"]
    assert hasattr(optimizer, "multi_tensor_scale_impl") and hasattr(clip_grads, "multi_tensor_scale_impl")


def grad_norm_routed() -> bool:
    from megatron.core.optimizer import clip_grads

    return is_patched(clip_grads, "l2_norm_impl")


@_hook("optimizer.clip_grads: get_grad_norm_fp32 calls l2_norm_impl (utils.local_multi_tensor_l2_norm without "
       "apex / TE) through multi_tensor_applier(op, noop_flag, tensor_lists, per_tensor)", "fusions.py", MCORE)
def _probe_grad_norm() -> None:
    import inspect

    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    assert "l2_norm_impl" in unpatched(clip_grads, "get_grad_norm_fp32").__code__.co_names
    assert list(inspect.signature(utils.local_multi_tensor_l2_norm).parameters)[:4] == [
        "chunk_size", "noop_flag", "tensor_lists", "per_tensor"]
    assert hasattr(clip_grads, "l2_norm_impl")


# --------------------------------------------------------------------------------------------------------------------
# 12. megatron-core's gradient-accumulation fusion: the linear layers' apex module (tensor_parallel.layers)
# --------------------------------------------------------------------------------------------------------------------

_WGRAD = ("fused_weight_gradient_mlp_cuda", "_grad_accum_fusion_available")


def route_wgrad_accumulation(module: Any) -> bool:
    """Give megatron-core's linear layers ``module`` (apex's ``wgrad_gemm_accum_fp32`` / ``_fp16``) where apex's
    ``fused_weight_gradient_mlp_cuda`` is not installed, so ``gradient_accumulation_fusion=True`` works without apex.
    Leaves apex's module alone. Only ``tensor_parallel.layers`` sees it (no module of apex's name is created).
    Returns whether the layers now have a fusion (apex's or ``module``)."""
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        install_patches(((layers, _WGRAD[0], module), (layers, _WGRAD[1], True)))
    return bool(layers._grad_accum_fusion_available)


def wgrad_accumulation_routed() -> bool:
    from megatron.core.tensor_parallel import layers

    return is_patched(layers, _WGRAD[0])


@_hook("tensor_parallel.layers: _grad_accum_fusion_available and the module global fused_weight_gradient_mlp_cuda "
       "(wgrad_gemm_accum_fp32 / _fp16(input, grad_output, main_grad)) used by "
       "LinearWithGradAccumulationAndAsyncCommunication.backward", "fusions.py", MCORE)
def _probe_wgrad_accumulation() -> None:
    import inspect

    from megatron.core.tensor_parallel import layers

    assert isinstance(unpatched(layers, "_grad_accum_fusion_available"), bool)
    code = inspect.unwrap(layers.LinearWithGradAccumulationAndAsyncCommunication.backward).__code__  # custom_bwd
    assert "fused_weight_gradient_mlp_cuda" in code.co_names
    assert {"wgrad_gemm_accum_fp32", "wgrad_gemm_accum_fp16", "grad_added_to_main_grad"} <= set(code.co_names)
    assert "_grad_accum_fusion_available" in layers.ColumnParallelLinear.__init__.__code__.co_names


# --------------------------------------------------------------------------------------------------------------------
# 13. megatron-core's optimizer construction (optimizer._get_megatron_optimizer_based_on_param_groups)
# --------------------------------------------------------------------------------------------------------------------


def route_fused_adam(adjust: Callable[[torch.optim.Optimizer], bool]) -> bool:
    """Call ``adjust`` on the torch optimizer inside every optimizer megatron-core builds, when megatron-core fell back
    to torch's optimizers (no TE / apex ``FusedAdam``). Returns whether the route is installed."""
    from megatron.core import optimizer as mcore_optimizer

    if not mcore_optimizer.USING_PYTORCH_OPTIMIZER:
        return False
    original = mcore_optimizer._get_megatron_optimizer_based_on_param_groups

    def build(*args, **kwargs):
        result = original(*args, **kwargs)
        inner = result[0] if isinstance(result, tuple) else getattr(result, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            adjust(inner)
        return result

    install_patches(((mcore_optimizer, "_get_megatron_optimizer_based_on_param_groups", build),))
    return True


def fused_adam_routed() -> bool:
    from megatron.core import optimizer as mcore_optimizer

    return is_patched(mcore_optimizer, "_get_megatron_optimizer_based_on_param_groups")


@_hook("optimizer: get_megatron_optimizer builds through the module global "
       "_get_megatron_optimizer_based_on_param_groups (a MegatronOptimizer with .optimizer, or (optimizer, init_fn)); "
       "USING_PYTORCH_OPTIMIZER", "fusions.py", MCORE)
def _probe_fused_adam() -> None:
    from megatron.core import optimizer as mcore_optimizer
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    assert isinstance(mcore_optimizer.USING_PYTORCH_OPTIMIZER, bool)
    assert "_get_megatron_optimizer_based_on_param_groups" in mcore_optimizer.get_megatron_optimizer.__code__.co_names
    assert "optimizer" in MegatronOptimizer.__init__.__code__.co_varnames


# --------------------------------------------------------------------------------------------------------------------
# 14. megatron-core's all-gather token dispatcher: MoEAllGatherTokenDispatcher.dispatch_postprocess (moe_dispatch.py)
# --------------------------------------------------------------------------------------------------------------------

_DISPATCH_STATE = ("hidden_shape_before_permute", "local_map", "local_probs",
                   "reversed_local_input_permutation_mapping")


def route_dispatch_postprocess(fn: Callable) -> None:
    """Make ``MoEAllGatherTokenDispatcher.dispatch_postprocess(self, hidden_states, probs)`` call
    ``fn(self, hidden_states, probs, original)`` (``original``: megatron-core's method, for what ``fn`` does not
    take). Installed once, process-wide (:func:`install_patches`)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    if is_patched(MoEAllGatherTokenDispatcher, "dispatch_postprocess"):
        return
    original = MoEAllGatherTokenDispatcher.dispatch_postprocess

    def dispatch_postprocess(self, hidden_states, probs):
        return fn(self, hidden_states, probs, original)

    install_patches(((MoEAllGatherTokenDispatcher, "dispatch_postprocess", dispatch_postprocess),))


def dispatch_postprocess_routed() -> bool:
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    return is_patched(MoEAllGatherTokenDispatcher, "dispatch_postprocess")


@_hook("moe.token_dispatcher: MoEAllGatherTokenDispatcher.dispatch_postprocess(hidden_states, probs) -> (permuted, "
       "tokens_per_expert, local_probs), leaving hidden_shape_before_permute / local_map / local_probs / "
       "reversed_local_input_permutation_mapping for combine_preprocess", "moe_dispatch.py", MCORE)
def _probe_dispatch_postprocess() -> None:
    import inspect

    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher as D

    method = unpatched(D, "dispatch_postprocess")
    assert list(inspect.signature(method).parameters) == ["self", "hidden_states", "probs"]
    sets = set(method.__code__.co_names)
    assert set(_DISPATCH_STATE) <= sets and "routing_map" in sets, sets
    uses = set(D.combine_preprocess.__code__.co_names)
    assert {"reversed_local_input_permutation_mapping", "hidden_shape_before_permute", "local_map"} <= uses, uses
    assert {"tp_size", "ep_size"} <= set(D.token_dispatch.__code__.co_names)


# --------------------------------------------------------------------------------------------------------------------
# 15. megatron-core's TransformerLayer MLP half (core/mlp_chunks.py: the MLP in chunks inside a layer's recompute)
# --------------------------------------------------------------------------------------------------------------------


_MLP_HALF = {  # method: its parameters after self, as core/mlp_chunks.py and DSADecoderLayer._forward_mlp call them
    "_forward_mlp": ["hidden_states", "inference_context", "padding_mask", "packed_seq_params"],
    "_forward_pre_mlp_layernorm": ["hidden_states"],
    "_maybe_unflatten_for_moe": ["hidden_states", "padding_mask", "packed_seq_params"],
    "_maybe_reflatten_from_moe": ["output", "packed_seq_params", "mbs"],
    "_forward_post_mlp": ["mlp_output_with_bias", "residual"],
}


@_hook("transformer_layer.TransformerLayer: forward calls _forward_mlp, whose steps are _forward_pre_mlp_layernorm, "
       "_maybe_unflatten_for_moe, the MLP, _maybe_reflatten_from_moe, _forward_post_mlp; mlp_chunks_for_training",
       "core/mlp_chunks.py, core/layer.py", MCORE)
def _probe_mlp_half() -> None:
    import inspect

    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer as L

    for name, params in _MLP_HALF.items():
        got = list(inspect.signature(getattr(L, name)).parameters)[1:]
        assert got == params, f"TransformerLayer.{name}{tuple(got)}, expected {tuple(params)}"
    assert "_forward_mlp" in L.forward.__code__.co_names
    steps = set(L._forward_mlp.__code__.co_names)
    assert set(_MLP_HALF) - {"_forward_mlp"} <= steps, steps
    assert "mlp_chunks_for_training" in TransformerConfig.__dataclass_fields__


# --------------------------------------------------------------------------------------------------------------------
# 16. megatron-core's token dispatchers: per-call tensors kept on the dispatcher (core/layer.py)
# --------------------------------------------------------------------------------------------------------------------


def release_dispatcher_graph(moe_layer: Any) -> int:
    """Detach the tensors megatron-core's token dispatcher keeps on itself from the call under way (the all-gather
    dispatcher's ``local_probs``, the all-to-all's ``probs``; the flex dispatcher keeps its own one level down, not
    reached): they are read again only for their dtype in that call's combine, but as they are they hold its
    autograd graph until the next call replaces them. In a layer's recompute that graph's leaves are the checkpoint's
    detached input (with its gradient) or, with MLP chunks, a chunk of the norm output, so each MoE layer's input and
    gradient outlived its backward: 2.4 GB after a 32K-token step of the GLM-5 slice (``RESULTS_step.md``, round 5).
    Returns how many were detached."""
    dispatcher = getattr(moe_layer, "token_dispatcher", None)
    if dispatcher is None:
        return 0
    held = [(k, v) for k, v in vars(dispatcher).items() if isinstance(v, torch.Tensor) and v.grad_fn is not None]
    for k, v in held:
        setattr(dispatcher, k, v.detach())
    return len(held)


def release_dispatcher_graph_after_experts(moe_layer: Any) -> bool:
    """Call :func:`release_dispatcher_graph` on ``moe_layer`` each time its experts' forward ends (a forward hook on
    ``moe_layer.experts``, run also when that forward raises). The experts' call, not the MoE layer's, is where a
    selective ``recompute_modules=["moe"]`` recompute passes too (it reruns the layer's inner function, not its
    ``__call__``). Returns whether a hook was installed (not for a layer without dispatcher or experts)."""
    experts = getattr(moe_layer, "experts", None)
    if getattr(moe_layer, "token_dispatcher", None) is None or not isinstance(experts, torch.nn.Module):
        return False
    owner = weakref.ref(moe_layer)  # the hook lives on a child of the layer: no reference cycle

    def release(module, args, output) -> None:
        layer = owner()
        if layer is not None:
            release_dispatcher_graph(layer)

    experts.register_forward_hook(release, always_call=True)
    return True


@_hook("moe.moe_layer.MoELayer: token_dispatcher, a plain object whose dispatch of one call keeps tensors on self "
       "(MoEAllGatherTokenDispatcher.local_probs, MoEAlltoAllTokenDispatcher.probs), read within that call; "
       "routed_experts_compute calls self.experts (its forward hooks run, also in the moe recompute)",
       "core/layer.py", MCORE)
def _probe_dispatcher_state() -> None:
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import (MoEAllGatherTokenDispatcher,
                                                                MoEAlltoAllTokenDispatcher, MoETokenDispatcher)

    assert {"token_dispatcher", "experts"} <= set(MoELayer.__init__.__code__.co_names)
    assert "experts" in MoELayer.routed_experts_compute.__code__.co_names
    assert not issubclass(MoETokenDispatcher, torch.nn.Module)
    assert "local_probs" in unpatched(MoEAllGatherTokenDispatcher, "dispatch_postprocess").__code__.co_names
    assert "probs" in MoEAlltoAllTokenDispatcher.dispatch_preprocess.__code__.co_names


# --------------------------------------------------------------------------------------------------------------------
# 17. megatron-core's per-step module walks in finalize_model_grads (finalize_walks.py); torch's global registration
#     hooks
# --------------------------------------------------------------------------------------------------------------------

_WALKS = ("_update_router_expert_bias", "reset_model_temporary_tensors")
_registration_hooks: list = []


def route_finalize_walks(update_router_expert_bias: Callable, reset_model_temporary_tensors: Callable,
                         model_changed: Callable[..., None]) -> bool:
    """Make megatron-core's ``finalize_model_grads`` call ``update_router_expert_bias(original, model, config, ...)``
    and ``reset_model_temporary_tensors(original, config, model)`` (``original``: megatron-core's function), and call
    ``model_changed(module, name, value)`` whenever any module, buffer or parameter is registered or assigned again
    (torch's global registration hooks, installed once for the process; they return None: the value is kept).
    Returns whether the route is installed."""
    fmg = _finalize_module()
    if not any(is_patched(fmg, name) for name in _WALKS):
        original_update, original_reset = (getattr(fmg, name) for name in _WALKS)

        def update(model, config, *args, **kwargs):
            return update_router_expert_bias(original_update, model, config, *args, **kwargs)

        def reset(config, model):
            return reset_model_temporary_tensors(original_reset, config, model)

        from torch.nn.modules import module as torch_module

        with _patch_lock:
            if not _registration_hooks:
                for register in (torch_module.register_module_module_registration_hook,
                                 torch_module.register_module_buffer_registration_hook,
                                 torch_module.register_module_parameter_registration_hook):
                    _registration_hooks.append(register(model_changed))
        install_patches(((fmg, _WALKS[0], update), (fmg, _WALKS[1], reset)))
    return finalize_walks_routed()


def _finalize_module() -> Any:
    import importlib

    # the package re-exports the function of the module's name: the module itself by its full name
    return importlib.import_module("megatron.core.distributed.finalize_model_grads")


def finalize_walks_routed() -> bool:
    fmg = _finalize_module()
    return all(is_patched(fmg, name) for name in _WALKS)


@_hook("distributed.finalize_model_grads: finalize_model_grads calls the module globals _update_router_expert_bias"
       "(model, config, tp_dp_cp_group) and reset_model_temporary_tensors(config, model), each walking "
       "get_attr_wrapped_model(chunk, 'modules')() for expert_bias / reset_global_aux_loss_tracker / qb_beta_accum; "
       "torch.nn.modules.module's global module / buffer / parameter registration hooks", "finalize_walks.py",
       f"{MCORE} / {TORCH}")
def _probe_finalize_walks() -> None:
    import inspect

    from torch.nn.modules import module as torch_module

    fmg = _finalize_module()
    assert set(_WALKS) <= set(fmg.finalize_model_grads.__code__.co_names)
    update, reset = (unpatched(fmg, name) for name in _WALKS)
    assert list(inspect.signature(update).parameters)[:2] == ["model", "config"]
    assert list(inspect.signature(reset).parameters) == ["config", "model"]
    for fn in (update, reset):  # the stand-in chunk answers get_attr_wrapped_model(chunk, "modules")
        assert "get_attr_wrapped_model" in fn.__code__.co_names
    # every name the walks test a module for is known (a new one would be missed by the stand-in's list)
    for fn, names in ((update, {"expert_bias", "frozen_expert_bias", "modules"}),
                      (reset, {"expert_bias", "global_aux_loss", "modules", "qb_beta_accum",
                               "reset_global_aux_loss_tracker"})):
        consts = {c for c in fn.__code__.co_consts if isinstance(c, str)} - {fn.__doc__}
        assert consts == names, consts
    for name in ("register_module_module_registration_hook", "register_module_buffer_registration_hook",
                 "register_module_parameter_registration_hook"):
        assert callable(getattr(torch_module, name))


# --------------------------------------------------------------------------------------------------------------------
# 18. megatron-core's gradient clip without apex / TE with the norm left on the device
#     (optimizer.clip_grads.get_grad_norm_fp32 and multi_tensor_scale_tensor_impl, optimizer.optimizer's
#     get_grad_norm_fp32 bound by name)
# --------------------------------------------------------------------------------------------------------------------


def route_device_grad_clip(grad_norm: Callable, scale_tensor: Callable) -> bool:
    """Where megatron-core has no tensor-scale kernel (no apex / TE): its optimizers' gradient norm becomes
    ``grad_norm(original, grads_for_norm, norm_type, grad_stats_parallel_group)`` (a device tensor, no host read) and
    its clip, given that tensor, scales with ``scale_tensor`` (``multi_tensor_scale_tensor``'s signature). Returns
    whether the route is installed. megatron-core's layer-wise optimizer is affected too: its ``get_grad_norm``
    calls the ``get_grad_norm_fp32`` bound in ``layer_wise_optimizer.py`` (not patched here), which, seeing
    ``multi_tensor_scale_tensor_impl`` set, returns megatron-core's own tensor branch (an fp32 device root, not
    ``grad_norm``'s), and ``ChainedOptimizer.step``'s clip then scales with ``scale_tensor``."""
    from megatron.core.optimizer import clip_grads, optimizer

    if clip_grads.multi_tensor_scale_tensor_impl is None and not is_patched(optimizer, "get_grad_norm_fp32"):
        original = clip_grads.get_grad_norm_fp32

        def get_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
            return grad_norm(original, grads_for_norm, norm_type, grad_stats_parallel_group)

        install_patches(((clip_grads, "multi_tensor_scale_tensor_impl", scale_tensor),
                         (clip_grads, "get_grad_norm_fp32", get_grad_norm_fp32),
                         (optimizer, "get_grad_norm_fp32", get_grad_norm_fp32)))
    return device_grad_clip_routed()


def device_grad_clip_routed() -> bool:
    from megatron.core.optimizer import clip_grads, optimizer

    return is_patched(optimizer, "get_grad_norm_fp32") and is_patched(clip_grads, "multi_tensor_scale_tensor_impl")


@_hook("optimizer.clip_grads: get_grad_norm_fp32(grads_for_norm, norm_type, grad_stats_parallel_group) and the "
       "module globals it reads (multi_tensor_applier, l2_norm_impl, the DTensor helpers); "
       "clip_grad_by_total_norm_fp32 scales by a tensor coefficient, clamped to 1, through "
       "multi_tensor_scale_tensor_impl (None without apex / TE); optimizer.optimizer: "
       "MegatronOptimizer.get_grad_norm / clip_grad_norm and ChainedOptimizer.get_grad_norm call the module global "
       "get_grad_norm_fp32", "fusions.py, optim_fusions.py", MCORE)
def _probe_device_grad_clip() -> None:
    import inspect

    from megatron.core.optimizer import clip_grads, optimizer

    assert hasattr(clip_grads, "multi_tensor_scale_tensor_impl")
    norm = unpatched(clip_grads, "get_grad_norm_fp32")
    assert list(inspect.signature(norm).parameters) == ["grads_for_norm", "norm_type", "grad_stats_parallel_group"]
    for name in ("multi_tensor_applier", "l2_norm_impl", "get_data_parallel_group_if_dtensor", "to_local_if_dtensor"):
        assert name in norm.__code__.co_names and hasattr(clip_grads, name), name
    clip = inspect.getsource(unpatched(clip_grads, "clip_grad_by_total_norm_fp32"))
    assert "clip_coeff.clamp_max_(1.0)" in clip
    assert "multi_tensor_scale_tensor_impl, dummy_overflow_buf, [grads, grads]" in clip
    for fn in (optimizer.MegatronOptimizer.get_grad_norm, optimizer.MegatronOptimizer.clip_grad_norm,
               optimizer.ChainedOptimizer.get_grad_norm):
        assert "get_grad_norm_fp32" in inspect.unwrap(fn).__code__.co_names


# --------------------------------------------------------------------------------------------------------------------
# 19. megatron-core's DDP gradient checks decided before the optimizer step (distributed.param_and_grad_buffer's
#     _ParamAndGradBucketGroup.check_grads; torch.optim's global step pre-hooks)
# --------------------------------------------------------------------------------------------------------------------

_optimizer_pre_hook: Any = None
# ids of the megatron-core OptimizerCudaGraphWrapper instances made since the route was installed (tests clear it)
_optimizer_graphs_built: list[int] = []


def route_deferred_grad_checks(check_grads: Callable, before_optimizer_step: Callable) -> bool:
    """megatron-core's DDP bucket groups check their gradients through ``check_grads(original, group,
    check_for_nan_or_inf, check_for_large)``, and ``before_optimizer_step(optimizer, args, kwargs)`` runs before every
    torch optimizer's ``step`` (torch's global step pre-hook, registered once per process: it must stay a no-op when
    nothing is pending). Also notes each ``OptimizerCudaGraphWrapper`` made (its ``__init__``), for
    :func:`optimizer_cuda_graph_used`. Returns whether the route is installed."""
    global _optimizer_pre_hook
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.optimizer import optimizer_cuda_graph as ocg

    owner = pgb._ParamAndGradBucketGroup
    if not is_patched(owner, "check_grads"):
        original = owner.check_grads

        def routed_check_grads(self, check_for_nan_or_inf, check_for_large):
            return check_grads(original, self, check_for_nan_or_inf, check_for_large)

        with _patch_lock:
            if _optimizer_pre_hook is None:
                from torch.optim.optimizer import register_optimizer_step_pre_hook

                _optimizer_pre_hook = register_optimizer_step_pre_hook(before_optimizer_step)
        install_patches(((owner, "check_grads", routed_check_grads),))
    wrapper = ocg.OptimizerCudaGraphWrapper
    if not is_patched(wrapper, "__init__"):
        wrapper_init = wrapper.__init__

        def noting_init(self, *args, **kwargs):
            _optimizer_graphs_built.append(id(self))
            wrapper_init(self, *args, **kwargs)

        install_patches(((wrapper, "__init__", noting_init),))
    return deferred_grad_checks_routed()


def deferred_grad_checks_routed() -> bool:
    from megatron.core.distributed import param_and_grad_buffer as pgb

    return is_patched(pgb._ParamAndGradBucketGroup, "check_grads") and _optimizer_pre_hook is not None


def optimizer_cuda_graph_used() -> bool:
    """Whether megatron-core's optimizer CUDA graph wrapper (``--optimizer-cuda-graph``) is in use in this process:
    one was made since :func:`route_deferred_grad_checks` (Megatron-LM wraps ``optimizer.step`` before its first
    iteration), or it has stepped. Its captured step runs no torch optimizer pre-hook that could decide (the capture
    runs the pre-hook under capture, where it cannot read the host), and with ``--cuda-graph-warmup-steps 0`` the very
    first step is the capture."""
    if _optimizer_graphs_built:
        return True
    module = sys.modules.get("megatron.core.optimizer.optimizer_cuda_graph")
    if module is None:  # never imported: never used
        return False
    wrapper = module.OptimizerCudaGraphWrapper
    return wrapper.curr_iteration > 0 or wrapper.cuda_graph is not None


@_hook("distributed.param_and_grad_buffer: _ParamAndGradBucketGroup.check_grads(check_for_nan_or_inf, "
       "check_for_large) reads only its buckets' grad_data.norm(p=2) and calls the rerun state machine; "
       "start_grad_sync calls it before the collective; rerun_state_machine.RerunMode.DISABLED; "
       "optimizer.optimizer_cuda_graph.OptimizerCudaGraphWrapper's class counters and __init__(optimizer_step_func, "
       "...); torch.optim's "
       "register_optimizer_step_pre_hook", "deferred_grad_checks.py", f"{MCORE} / {TORCH}")
def _probe_deferred_grad_checks() -> None:
    import inspect

    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megatron.core.rerun_state_machine import RerunMode

    check = unpatched(pgb._ParamAndGradBucketGroup, "check_grads")
    assert list(inspect.signature(check).parameters) == ["self", "check_for_nan_or_inf", "check_for_large"]
    # the replay hands check_grads a stand-in with only .buckets[i].grad_data.norm(p=2): nothing else may be read
    assert set(check.__code__.co_names) <= {"get_rerun_state_machine", "range", "len", "buckets", "grad_data", "norm",
                                            "validate_result", "torch", "isnan", "isinf", "partial",
                                            "is_unexpectedly_large"}, check.__code__.co_names
    assert "self.check_grads(" in inspect.getsource(pgb._ParamAndGradBucketGroup.start_grad_sync)
    assert RerunMode.DISABLED.value == "disabled"
    from megatron.core.optimizer import optimizer_cuda_graph as ocg

    wrapper = ocg.OptimizerCudaGraphWrapper
    assert isinstance(wrapper.curr_iteration, int) and hasattr(wrapper, "cuda_graph")  # class-level counters
    assert list(inspect.signature(unpatched(wrapper, "__init__")).parameters)[:2] == ["self", "optimizer_step_func"]
    assert "OptimizerCudaGraphWrapper.curr_iteration += 1" in inspect.getsource(wrapper.__call__)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    assert callable(register_optimizer_step_pre_hook)


# --------------------------------------------------------------------------------------------------------------------
# 20. megatron-core's rerun state machine: the forward loss checks decided at the optimizer step
#     (rerun_state_machine.RerunStateMachine.validate_result; the step pre-hook of hook 19)
# --------------------------------------------------------------------------------------------------------------------


def route_deferred_loss_checks(validate_result: Callable) -> bool:
    """Every ``RerunStateMachine.validate_result(result, rejection_func, message, comparison_func, tolerance,
    fatal)`` goes through ``validate_result(original, machine, ...)``. Decided at the optimizer step pre-hook of
    :func:`route_deferred_grad_checks`, so it is installed only with that route (returns False without it)."""
    if not deferred_grad_checks_routed():
        return False
    from megatron.core.rerun_state_machine import RerunStateMachine

    if not is_patched(RerunStateMachine, "validate_result"):
        original = RerunStateMachine.validate_result

        def routed_validate_result(self, result, rejection_func, message, comparison_func=None, tolerance=0.0,
                                   fatal=True):
            return validate_result(original, self, result, rejection_func, message, comparison_func, tolerance,
                                   fatal)

        install_patches(((RerunStateMachine, "validate_result", routed_validate_result),))
    return deferred_loss_checks_routed()


def deferred_loss_checks_routed() -> bool:
    """Whether :func:`route_deferred_loss_checks` is installed (and so the step pre-hook that decides)."""
    from megatron.core.rerun_state_machine import RerunStateMachine

    return is_patched(RerunStateMachine, "validate_result") and deferred_grad_checks_routed()


@_hook("rerun_state_machine: RerunStateMachine.validate_result(result, rejection_func, message, comparison_func, "
       "tolerance, fatal) in mode DISABLED calls rejection_func(result) and raises with current_iteration + 1; "
       "should_run_forward_backward counts current_iteration once per iteration in that mode",
       "deferred_grad_checks.py", MCORE)
def _probe_deferred_loss_checks() -> None:
    import inspect

    from megatron.core.rerun_state_machine import RerunStateMachine

    check = unpatched(RerunStateMachine, "validate_result")
    assert list(inspect.signature(check).parameters) == ["self", "result", "rejection_func", "message",
                                                         "comparison_func", "tolerance", "fatal"]
    source = inspect.getsource(check)
    disabled = source[source.index("if self.mode == RerunMode.DISABLED:"):source.index("if comparison_func is None")]
    for piece in ("rejection_func(result)", "self.current_iteration + 1", "raise RuntimeError(full_message)",
                  "self._log_validation_error_to_file("):
        assert piece in disabled, piece
    run = inspect.getsource(unpatched(RerunStateMachine, "should_run_forward_backward"))
    assert "self.current_iteration += 1" in run and "RerunMode.DISABLED" in run


# --------------------------------------------------------------------------------------------------------------------
# 21. megatron-core's mixed-precision optimizer step (optimizer.Float16OptimizerWithFloat16Params.step_with_ready_grads)
#     and torch's optimizer step hooks (Optimizer.profile_hook_step) around a step of our own (adam_model_copy.py)
# --------------------------------------------------------------------------------------------------------------------


def route_adam_model_copy(step_with_ready_grads: Callable) -> bool:
    """``Float16OptimizerWithFloat16Params.step_with_ready_grads(self)`` goes through
    ``step_with_ready_grads(original, self)``. Returns whether the route is installed."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params as owner

    if not is_patched(owner, "step_with_ready_grads"):
        original = owner.step_with_ready_grads

        def routed(self):
            return step_with_ready_grads(original, self)

        install_patches(((owner, "step_with_ready_grads", routed),))
    return adam_model_copy_routed()


def adam_model_copy_routed() -> bool:
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params as owner

    return is_patched(owner, "step_with_ready_grads")


def run_optimizer_step(optimizer: torch.optim.Optimizer, step: Callable[[torch.optim.Optimizer], None]) -> None:
    """``step(optimizer)`` in place of ``optimizer.step()``, inside torch's own step wrapper: the global and the
    optimizer's step pre-hooks before it, its post-hooks after, the profiler's record, as for ``step()``."""
    torch.optim.Optimizer.profile_hook_step(step)(optimizer)


def unhooked_step(optimizer: torch.optim.Optimizer) -> Any:
    """The optimizer class's own ``step`` without torch's hook wrapper (``_patch_step_function`` marks the wrapped
    one ``hooked``), for a step already inside the hooks."""
    step = type(optimizer).step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    return step(optimizer)


def fused_adamw_arithmetic_known() -> bool:
    """Whether this torch's fused CUDA AdamW computes the moments as ``fma`` (torch >= 2.8, the form
    ``kernels/fused_adamw.py`` reproduces; read in torch 2.14's header and sm_90 code), on CUDA rather than ROCm (the
    route also checks each configuration against torch's kernel on the device before its first step)."""
    if torch.version.hip:
        return False
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 8)


@_hook("optimizer.optimizer: Float16OptimizerWithFloat16Params.step_with_ready_grads(self) steps self.optimizer "
       "then _copy_main_params_to_model_params (float16_groups / fp32_from_float16_groups, pairwise), timers "
       "optimizer-inner-step and optimizer-copy-main-to-model-params; torch.optim.Optimizer.profile_hook_step(func) "
       "runs the global and per-optimizer step pre- and post-hooks around func(self)", "adam_model_copy.py",
       f"{MCORE} / {TORCH}")
def _probe_adam_model_copy() -> None:
    import inspect

    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params as owner
    from torch.optim import optimizer as torch_optimizer

    source = inspect.getsource(unpatched(owner, "step_with_ready_grads"))
    for piece in ("self.optimizer.step()", "self._copy_main_params_to_model_params()", "is_stub_optimizer",
                  "'optimizer-inner-step'", "'optimizer-copy-main-to-model-params'",
                  "reuse_grad_buf_for_mxfp8_param_ag"):
        assert piece in source, piece
    pairs = inspect.getsource(owner._get_model_and_main_params_data_float16)
    assert "self.float16_groups" in pairs and "self.fp32_from_float16_groups" in pairs
    wrapper = inspect.getsource(torch_optimizer.Optimizer.profile_hook_step)
    for piece in ("_global_optimizer_pre_hooks", "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                  "_global_optimizer_post_hooks", "functools.wraps(func)"):
        assert piece in wrapper, piece
    assert "step.hooked = True" in inspect.getsource(torch_optimizer.Optimizer._patch_step_function)


# --------------------------------------------------------------------------------------------------------------------
# 22. megatron-core's rerun state machine: the re-run decision after the forward-backward
#     (rerun_state_machine.RerunStateMachine.should_run_forward_backward; deferred_grad_checks.py)
# --------------------------------------------------------------------------------------------------------------------


def route_rerun_decision(should_run: Callable) -> bool:
    """``RerunStateMachine.should_run_forward_backward(data_iterator)`` goes through ``should_run(original, machine,
    data_iterator)``. Installed only with :func:`route_deferred_loss_checks` (whose routed ``validate_result`` queues
    what this decides); returns whether it is installed."""
    if not deferred_loss_checks_routed():
        return False
    from megatron.core.rerun_state_machine import RerunStateMachine

    if not is_patched(RerunStateMachine, "should_run_forward_backward"):
        original = RerunStateMachine.should_run_forward_backward

        def routed(self, data_iterator):
            return should_run(original, self, data_iterator)

        install_patches(((RerunStateMachine, "should_run_forward_backward", routed),))
    return rerun_decision_routed()


def rerun_decision_routed() -> bool:
    from megatron.core.rerun_state_machine import RerunStateMachine

    return is_patched(RerunStateMachine, "should_run_forward_backward") and deferred_loss_checks_routed()


@_hook("rerun_state_machine: should_run_forward_backward(data_iterator) resets validation_counts first and, in an "
       "initial run under validate_results, reduces rerun_requested over the ranks; validate_result's call identity "
       "is (message, rank, per-message sequence) from _get_validation_call_info, not the caller's stack; "
       "RerunMode.VALIDATE_RESULTS, RerunState.INITIAL_RUN, first_iteration_complete", "deferred_grad_checks.py",
       MCORE)
def _probe_rerun_decision() -> None:
    import inspect

    from megatron.core.rerun_state_machine import RerunMode, RerunState, RerunStateMachine

    run = inspect.getsource(unpatched(RerunStateMachine, "should_run_forward_backward"))
    body = run[run.index('"""', run.index('"""') + 3) + 3:]
    first = next(line.strip() for line in body.splitlines() if line.strip() and not line.strip().startswith("#"))
    assert first == "self.validation_counts = defaultdict(int)", first
    assert "self._reduce_any(self.rerun_requested)" in run
    call = inspect.getsource(RerunStateMachine._get_validation_call_info)
    assert "Caller(message=message, rank=rank)" in call and "inspect" not in call and "stack" not in call
    check = inspect.getsource(unpatched(RerunStateMachine, "validate_result"))
    for piece in ("self._get_validation_call_info(message)", "self.state == RerunState.INITIAL_RUN and not "
                  "self.rerun_requested", "if not self.first_iteration_complete:", "self.initial_result = result"):
        assert piece in check, piece
    assert RerunMode.VALIDATE_RESULTS.value == "validate_results" and RerunState.INITIAL_RUN is not None


def check_all() -> list[str]:
    """Run every probe; the names of those that fail (an empty list: every internal is where it was)."""
    failed = []
    for hook in HOOKS:
        try:
            hook.probe()
        except Exception as e:  # noqa: BLE001 - a probe's failure of any kind means the internal moved
            failed.append(f"{hook.name} ({hook.checked_against}): {type(e).__name__}: {e}")
    return failed
