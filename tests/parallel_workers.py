"""torchrun bodies for the TP / EP / PP parity tests (``tests/test_parallel.py``).

Weights and gradients cross parallel layouts through megatron-core's own ``dist_checkpointing`` (its resharding
logic, gated-MLP factories included), so these tests compare against single-process runs without a hand-written
re-assembly that could share a bug with the code under test.

Two ways through the micro-batches, each followed by the gradient reductions Megatron's DDP +
``finalize_model_grads`` would do (sequence-parallel norms summed over TP, dense grads averaged over DP, expert grads
scaled by 1/DP, and the word embedding, used on the first stage and by MTP on the last, summed over its two pipeline
stages):

* :func:`train_step_grads`, the schedule written out: forward micro-batch by micro-batch through the stages
  (point-to-point sends of the hidden states), then backward in the same order;
* :func:`schedule_step_grads`, megatron-core's own schedule (``get_forward_backward_func()``: 1F1B
  ``forward_backward_pipelining_without_interleaving`` at PP > 1, its shapes, P2P and loss scaling). It allocates one
  tensor on ``device="cuda"`` literally, so on a machine without CUDA it runs under :func:`schedule_on_cpu`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megatron_glm5.parallel import destroy_model_parallel

SEQ = 48


def make_batches(vocab: int, n: int = 2, batch: int = 2, seed: int = 7) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, SEQ), generator=gen) for _ in range(n)]


def tensor_sharded_state_dict(model, values: dict[str, torch.Tensor]):
    """``model.sharded_state_dict()`` with every parameter replaced by ``values[name]`` (same local shape); buffers
    and non-tensor entries are dropped. Saves e.g. gradients in the model's checkpoint layout."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

    by_ptr = {p.data_ptr(): values[n] for n, p in model.named_parameters()}
    assert len(by_ptr) == len(values), "parameters must not share storage"
    sharded = model.sharded_state_dict()

    def swap(x):
        if isinstance(x, (ShardedTensor, ShardedTensorFactory)):
            if x.data.data_ptr() not in by_ptr:
                return None  # a buffer (e.g. the router's expert_bias)
            x.data = by_ptr[x.data.data_ptr()]
            return x
        if isinstance(x, ShardedObject):
            return None
        return x

    dict_list_map_inplace(swap, sharded)
    return _drop_none(sharded)


def _drop_none(d):
    if isinstance(d, dict):
        return {k: _drop_none(v) for k, v in d.items() if v is not None}
    return d


def load_weights(model, ckpt_dir: str) -> None:
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    assert not missing and not unexpected, (missing, unexpected)


def zigzag_rows(seq: int, cp: int, rank: int) -> torch.Tensor:
    """The sequence positions CP rank ``rank`` holds under megatron's load-balanced split (chunks r, 2cp-1-r)."""
    chunk = seq // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def train_step_grads(model, batches, *, vocab: int) -> tuple[float | None, dict[str, torch.Tensor]]:
    """Forward/backward all micro-batches through this rank's pipeline stage (this CP rank's zigzag rows of each
    sequence); returns (mean LM loss over this rank's tokens on the last stage else None, finalised gradients)."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    pp_group = ps.get_pipeline_model_parallel_group()
    prev_rank, next_rank = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
    model.train()
    model.zero_grad(set_to_none=True)
    losses, saved = [], []
    cp = ps.get_context_parallel_world_size()
    rows = zigzag_rows(SEQ, cp, ps.get_context_parallel_rank()) if cp > 1 else torch.arange(SEQ)
    for ids in batches:
        ids = ids[:, rows]
        pos = rows[None].expand(ids.shape[0], rows.numel())
        inp = None
        if not first:  # GLM-5.3-Flash stages exchange its mHC streams, wider than hidden_size
            width = getattr(model.config, "pipeline_hidden_size", model.config.hidden_size)
            inp = torch.empty(rows.numel(), ids.shape[0], width, dtype=torch.float32)
            dist.recv(inp, src=prev_rank, group=pp_group)
            inp.requires_grad_(True)
            model.set_input_tensor(inp)
        out = model(ids, pos, attention_mask=None, labels=ids if last else None)
        if last:
            loss = out.float().mean() / len(batches)
            losses.append(loss)
            saved.append((inp, loss))
        else:
            dist.send(out.detach().contiguous(), dst=next_rank, group=pp_group)
            saved.append((inp, out))
    for inp, out in saved:  # backward in forward order
        if last:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=next_rank, group=pp_group)
            out.backward(grad)
        if not first:
            dist.send(inp.grad.contiguous(), dst=prev_rank, group=pp_group)
    _finalize_grads(model, pp)
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    loss = float(sum(l.item() for l in losses)) if last else None
    return loss, grads


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """Tensor factories called with ``device="cuda"`` allocate on the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _loss_scalers() -> list:
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    return [MTPLossAutoScaler, MoEAuxLossAutoScaler, DSAIndexerLossAutoScaler]


@contextlib.contextmanager
def schedule_on_cpu():
    """Run megatron-core's schedules here: ``device="cuda"`` factories allocate on the CPU when there is no CUDA, and
    the class-level MTP / MoE aux / indexer loss scales the schedule sets (1 / micro-batches) are put back afterwards,
    so the written-out schedule of later tests in this process keeps megatron-core's default scale."""
    saved = [(cls, cls.main_loss_backward_scale) for cls in _loss_scalers()]
    saved = [(cls, v.clone() if isinstance(v, torch.Tensor) else v) for cls, v in saved]
    mode = contextlib.nullcontext() if torch.cuda.is_available() else _CudaFactoriesOnCpu()
    try:
        with mode:
            yield
    finally:
        for cls, v in saved:
            cls.main_loss_backward_scale = v


def _lm_loss_step(data_iterator, model):
    """megatron-core ``forward_step_func``: this micro-batch's tokens as labels, the mean LM loss."""
    ids = next(data_iterator)
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    out = model(ids, pos, attention_mask=None, labels=ids)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach()}

    return out, loss_func


def schedule_step_grads(model, batches) -> tuple[float | None, dict[str, torch.Tensor]]:
    """:func:`train_step_grads` through megatron-core's own schedule (``get_forward_backward_func()``); the P2P
    tensors' shapes are the schedule's (``get_tensor_shapes``). Returns (mean LM loss on the last stage else None,
    finalised gradients)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.train()
    model.zero_grad(set_to_none=True)
    b, s = batches[0].shape
    with schedule_on_cpu():
        reduced = get_forward_backward_func()(
            forward_step_func=_lm_loss_step, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=s, micro_batch_size=b, forward_only=False,
        )
    _finalize_grads(model, ps.get_pipeline_model_parallel_world_size())
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    last = ps.is_pipeline_last_stage()
    loss = float(sum(r["lm loss"].item() for r in reduced) / len(reduced)) if last else None
    return loss, grads


def _finalize_grads(model, pp: int) -> None:
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    dp_group = ps.get_data_parallel_group(with_context_parallel=True)  # Megatron averages over DP x CP
    dp = ps.get_data_parallel_world_size(with_context_parallel=True)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if getattr(p, "average_gradients_across_tp_domain", False):
            dist.all_reduce(p.grad, group=tp_group)
            p.grad /= ps.get_tensor_model_parallel_world_size()
        elif model.config.sequence_parallel and getattr(p, "sequence_parallel", False):
            dist.all_reduce(p.grad, group=tp_group)
        if getattr(p, "allreduce", True):  # dense: mean over DP
            if dp > 1:
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= dp
        else:  # expert: tokens of every DP rank reach it; Megatron scales by 1/DP
            edp_group = ps.get_expert_data_parallel_group()
            if edp_group.size() > 1:
                dist.all_reduce(p.grad, group=edp_group)
            p.grad /= dp
    if pp > 1:  # word embedding lives on the first stage and (for MTP) on the last
        emb = getattr(getattr(model, "embedding", None), "word_embeddings", None)
        if emb is not None and emb.weight.grad is not None:
            dist.all_reduce(emb.weight.grad, group=ps.get_embedding_group())


def parallel_case(rank: int, world: int, *, raw: dict, weights: str, grads_out: str, tp: int, pp: int, ep: int,
                  vocab: int, backend: str = "megatron", cp: int = 1, moe_grouped_gemm: str = "off",
                  policy_overrides: dict | None = None, mcore_schedule: bool = False,
                  loss_after_attention: bool | None = None) -> dict:
    """Load the reference weights at (TP, PP, EP), run the micro-batches, save gradients as a dist checkpoint.
    ``moe_grouped_gemm="on"``: routed experts are ``TorchGroupedMLP`` (the reference runs ``SequentialMLP``).
    ``policy_overrides``: more ``RuntimePolicy`` fields (e.g. the indexer loss); the logged indexer loss per tracker
    slot comes back as ``indexer_loss`` (reduced over PP, as Megatron-LM's log does). ``mcore_schedule``: through
    megatron-core's schedule (:func:`schedule_step_grads`) instead of the written-out one. ``loss_after_attention``:
    force the ``tilelang`` backend's sparse loss into the backward (``dsa.loss_after_attention``) or the forward."""
    from megatron.core import dist_checkpointing

    from megatron_glm5.architectures import parse_architecture as parse_hf_config  # GLM-5.x and GLM-5.3-Flash
    from megatron_glm5.model import build_model, default_cpu_policy
    from megatron_glm5.parallel import initialize_model_parallel

    logged_after = [0]
    if loss_after_attention is not None:
        from megatron_glm5.dsa.loss_after_attention import LossAfterAttention
        from megatron_glm5.dsa.tilelang_attention import TileLangSparseAttention

        TileLangSparseAttention.loss_after_attention = loss_after_attention
        final_target = LossAfterAttention.final_target

        def counted(self, topk):  # how many losses really ran in the backward
            logged_after[0] += 1
            return final_target(self, topk)

        LossAfterAttention.final_target = counted
    initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              expert_model_parallel_size=ep, context_parallel_size=cp)
    policy = default_cpu_policy(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                expert_model_parallel_size=ep, context_parallel_size=cp,
                                moe_grouped_gemm=moe_grouped_gemm, **(policy_overrides or {}))
    model = build_model(parse_hf_config(raw), policy, backend=backend)
    load_weights(model, weights)
    batches = make_batches(vocab)
    loss, grads = schedule_step_grads(model, batches) if mcore_schedule else train_step_grads(model, batches,
                                                                                             vocab=vocab)
    dist_checkpointing.save(tensor_sharded_state_dict(model, grads), grads_out)
    experts = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith("mlp.experts")})
    return {"loss": loss, "layers": len(model.decoder.layers), "experts": experts, "indexer_loss": _indexer_log(),
            "losses_after_attention": logged_after[0]}


def _indexer_log() -> list[float] | None:
    """megatron-core's indexer-loss tracker after reduction (sum over PP, mean over DP/CP), per slot."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper as helper

    if "values" not in helper.tracker:
        return None
    helper.reduce_loss_in_tracker()
    values = helper.tracker["values"].tolist()
    helper.tracker.clear()
    return values


def reference_run(raw: dict, weights_dir: str, policy_overrides: dict | None = None, *,
                  mcore_schedule: bool = False):
    """Single-process reference (``megatron`` backend): saves the weights as a dist checkpoint; returns (loss,
    grads), and with ``policy_overrides`` (e.g. the indexer loss) also the logged indexer loss per slot.
    ``mcore_schedule``: through megatron-core's schedule (:func:`schedule_step_grads`). Initialises and tears down a
    1-rank model-parallel state."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_glm5.architectures import parse_architecture as parse_hf_config  # GLM-5.x and GLM-5.3-Flash
    from megatron_glm5.model import build_model, default_cpu_policy
    from megatron_glm5.parallel import initialize_model_parallel

    if ps.model_parallel_is_initialized():
        destroy_model_parallel()
    initialize_model_parallel()
    try:
        torch.manual_seed(0)
        model = build_model(parse_hf_config(raw), default_cpu_policy(**(policy_overrides or {})))
        dist_checkpointing.save(model.sharded_state_dict(), weights_dir)
        batches = make_batches(raw["vocab_size"])
        loss, grads = schedule_step_grads(model, batches) if mcore_schedule else \
            train_step_grads(model, batches, vocab=raw["vocab_size"])
        if policy_overrides is None:
            return loss, grads
        return loss, grads, _indexer_log()
    finally:
        destroy_model_parallel()


def load_sharded_grads(raw: dict, grads_dir: str) -> dict[str, torch.Tensor]:
    """Re-assemble a (TP/EP/PP-sharded) gradient checkpoint into single-process tensors by parameter name."""
    from megatron.core import dist_checkpointing

    from megatron_glm5.architectures import parse_architecture as parse_hf_config  # GLM-5.x and GLM-5.3-Flash
    from megatron_glm5.model import build_model, default_cpu_policy
    from megatron_glm5.parallel import initialize_model_parallel

    initialize_model_parallel()
    try:
        model = build_model(parse_hf_config(raw), default_cpu_policy())
        params = dict(model.named_parameters())
        sharded = tensor_sharded_state_dict(model, {n: torch.empty_like(p) for n, p in params.items()})
        state = dist_checkpointing.load(sharded, grads_dir)
        return {n: state[n] for n in params}
    finally:
        destroy_model_parallel()


def grad_errors(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """max |diff| / max |ref| per parameter."""
    assert set(grads) == set(ref), set(grads) ^ set(ref)
    return {n: ((grads[n] - r).abs().max() / r.abs().max().clamp_min(1e-12)).item() for n, r in ref.items()}


def pretrain_pipeline_steps(rank: int, world: int, *, hf_dir: str, flags: list[str], steps: int = 3) -> dict:
    """``python -m megatron_glm5.pretrain``'s own pieces at PP = ``world`` without Megatron-LM's training loop (it
    needs CUDA): its argument handling (``--hf-config`` applied, validated with Megatron-LM's ``validate_args``), its
    model provider for this rank's stage and its ``forward_step`` / loss through megatron-core's schedule, ``steps``
    Adam steps on one repeated mock batch. Returns the last stage's losses (None elsewhere) and the stage's layers."""
    import sys

    from megatron.core import parallel_state as ps
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables, unset_global_variables

    from megatron_glm5.config import load_hf_config
    from megatron_glm5.families import parse_architecture
    from megatron_glm5.parallel import initialize_model_parallel
    from megatron_glm5.pretrain import (
        add_glm5_args,
        apply_architecture,
        disable_unavailable_fusions,
        forward_step,
        model_provider,
    )

    argv = ["--hf-config", hf_dir, *flags]
    saved_argv, sys.argv = sys.argv, ["pretrain", *argv]
    try:
        args = parse_args(extra_args_provider=add_glm5_args)
    finally:
        sys.argv = saved_argv
    arch = parse_architecture(load_hf_config(hf_dir))
    apply_architecture(args, arch, argv)
    disable_unavailable_fusions(args)
    validate_args(args, {})
    set_global_variables(args)
    try:
        initialize_model_parallel(pipeline_model_parallel_size=args.pipeline_model_parallel_size)
        model = model_provider(arch, "megatron", pre_process=ps.is_pipeline_first_stage(),
                               post_process=ps.is_pipeline_last_stage())
        gen = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, arch.vocab_size, (args.micro_batch_size, args.seq_length), generator=gen)
        batch = {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": torch.ones(tokens.shape),
                 "position_ids": torch.arange(args.seq_length)[None].expand_as(tokens)}
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        losses = []
        from megatron.core.pipeline_parallel import get_forward_backward_func

        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            with schedule_on_cpu():
                reduced = get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=iter([batch]), model=[model], num_microbatches=1,
                    seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=False)
            _finalize_grads(model, ps.get_pipeline_model_parallel_world_size())
            optimizer.step()
            if ps.is_pipeline_last_stage():
                total, count = reduced[0]["lm loss"].tolist()
                losses.append(total / count)
        return {"losses": losses if ps.is_pipeline_last_stage() else None,
                "layers": [la.layer_number - 1 for la in model.decoder.layers], "mtp": bool(model.mtp_process)}
    finally:
        unset_global_variables()
        destroy_model_parallel()


def flash_pipeline_case(rank: int, world: int, *, parity: dict, pretrain: dict) -> dict:
    """The GLM-5.3-Flash PP=2 checks of one torchrun: :func:`parallel_case` through megatron-core's schedule, then
    :func:`pretrain_pipeline_steps`."""
    result = parallel_case(rank, world, **parity)
    destroy_model_parallel()
    result["pretrain"] = pretrain_pipeline_steps(rank, world, **pretrain)
    return result


def loss_after_box_tp(rank: int, world: int) -> dict:
    """The indexer loss after the attention under TP: each rank's attention backward leaves the head sum of its own
    heads in the box; the token's backward all-reduces and normalises it. Returns the max relative gradient error
    against the loss on the full normalised target (fp64, the same inputs on every rank)."""
    from megatron_glm5.dsa import indexer_loss as il
    from megatron_glm5.dsa.loss_after_attention import LossAfterAttention

    g = torch.Generator().manual_seed(0)  # the same draws on every rank
    t_len, k, hi, di = 10, 4, 2, 8
    qi, ki, w = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((t_len, hi, di), (t_len, di),
                                                                                       (t_len, hi)))
    topk = torch.stack([torch.cat([torch.randperm(t + 1, generator=g)[: min(k, t + 1)],
                                   torch.full((max(0, k - t - 1),), -1)]) for t in range(t_len)]).int()
    valid = topk >= 0
    partial = [torch.rand(t_len, k, generator=g, dtype=torch.float64) * valid for _ in range(world)]
    full = sum(partial)
    full = full / full.sum(-1, keepdim=True).clamp_min(il.TARGET_EPS)
    rw = torch.full((t_len,), 1.0 / t_len, dtype=torch.float64)

    class Attention(torch.autograd.Function):  # stand-in: leaves this rank's partial head sum in the box
        @staticmethod
        def forward(ctx, x, box):
            ctx.box = box
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            ctx.box.target = partial[rank].clone()
            return grad, None

    logged = []
    plan = LossAfterAttention(loss_fn=il.sparse_indexer_loss, scale_fn=lambda device: torch.ones((), dtype=torch.float64),
                              log_fn=logged.append, tp_group=dist.group.WORLD)
    leaves = [t.clone().requires_grad_(True) for t in (qi, ki, w)]
    x = torch.randn(t_len, 3, generator=g, dtype=torch.float64, requires_grad=True)
    Attention.apply(plan.after(x, plan.token(*leaves, topk, rw)), plan.box).sum().backward()
    ref_leaves = [t.clone().requires_grad_(True) for t in (qi, ki, w)]
    ref = il.sparse_indexer_loss(*ref_leaves, topk, full, rw)
    ref.backward()
    err = max(float((a.grad - b.grad).abs().max() / b.grad.abs().max()) for a, b in zip(leaves, ref_leaves))
    return {"grad_err": err, "loss_err": abs(float(logged[0]) - float(ref)) / abs(float(ref)),
            "single_rank_err": float((partial[rank] / partial[rank].sum(-1, keepdim=True).clamp_min(1e-10)
                                      - full).abs().max())}
