"""LoRA training on the ``tilelang`` backend: loss per step and optimizer-state memory with and without LoRA.

    python tests/gpu/lora_train.py [--steps 20] [--backend tilelang] [--rank 16] [--alpha 32] [--lr 2e-3]
                                   [--distributed-optimizer] [--cpu]

On CUDA: a small GLM-5.2 (``testing.small_glm52_config``: the real MLA latent geometry 512 + 64, so our TileLang
sparse-MLA and indexer kernels run; index_topk 256 < sequence 1024; IndexShare, MTP, dense + shared + routed
experts), bf16, megatron-core's DDP and optimizer (``get_megatron_optimizer``, Adam with fp32 master weights;
``--distributed-optimizer`` for the DistributedOptimizer). It measures, for full fine-tuning and for LoRA, the DDP
gradient buffers and the optimizer state (fp32 master copies + Adam moments, read off the optimizer, and the CUDA
memory the optimizer's first step allocated), then trains the LoRA model for ``--steps`` steps on learnable token
streams and prints the loss of every step. Ends with one JSON line (``RESULT {...}``).

``--cpu`` runs the same code on the tiny fixture in fp32 with torch's AdamW (megatron-core's optimizers need CUDA):
``tests/test_lora_gpu_script.py`` runs it in CI. ``pytest tests/gpu/test_lora_gpu.py -s`` runs the GPU version.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

SEQ_GPU, SEQ_CPU = 1024, 48


def learnable_batches(vocab: int, seq: int, n: int, device, batch: int = 2, seed: int = 100):
    """Token streams a model can learn in a few steps: per sequence a random start and stride modulo the vocab."""
    out = []
    for i in range(n):
        gen = torch.Generator().manual_seed(seed + i)
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        stride = torch.randint(1, 8, (batch, 1), generator=gen)
        out.append(((start + stride * torch.arange(seq)) % vocab).to(device))
    return out


def build(arch, *, cuda: bool, backend: str, lora=None, state=None):
    from megatron_glm5.config import RuntimePolicy
    from megatron_glm5.lora import add_lora
    from megatron_glm5.model import build_model, default_cpu_policy

    if cuda:
        policy = RuntimePolicy(params_dtype=torch.bfloat16, dsa_kernel_backend="tilelang", use_cpu_initialization=True)
    else:
        policy = default_cpu_policy()
    torch.manual_seed(0)
    model = build_model(arch, policy, backend=backend)
    if state is not None:
        model.load_state_dict(state)
    if cuda:
        model = model.cuda()
    if lora is not None:
        add_lora(model, lora)
    return model


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def make_optimizer(model, *, cuda: bool, lr: float, distributed: bool):
    """megatron-core DDP + optimizer on CUDA; torch AdamW on CPU. Returns (wrapped model, optimizer, report)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    report = {"trainable_params": sum(p.numel() for p in trainable),
              "total_params": sum(p.numel() for p in model.parameters())}
    if not cuda:
        opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
        return model, opt, report
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed)
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    report["grad_buffer_bytes"] = sum(_nbytes([b.grad_data]) for b in [*ddp.buffers, *ddp.expert_parallel_buffers])
    before = torch.cuda.memory_allocated()
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, bf16=True, clip_grad=1.0,
                                                 use_distributed_optimizer=distributed), [ddp])
    report["optimizer_construct_bytes"] = torch.cuda.memory_allocated() - before
    report["_mem_before_optimizer"] = before
    return ddp, opt, report


def optimizer_state_bytes(opt) -> dict:
    """fp32 master copies and Adam moments held by a megatron-core (or torch) optimizer."""
    inners = getattr(opt, "chained_optimizers", None) or [opt]
    master = moments = 0
    for o in inners:
        inner = getattr(o, "optimizer", o)
        for state in inner.state.values():
            moments += _nbytes(v for k, v in state.items() if k != "step")
        for name in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups", "shard_fp32_groups"):
            for group in getattr(o, name, None) or []:
                master += _nbytes(group)
    return {"master_bytes": master, "adam_moment_bytes": moments, "optimizer_state_bytes": master + moments}


def train_step(model, opt, ids, *, cuda: bool) -> float:
    pos = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)
    if cuda:
        from megatron.core.distributed import finalize_model_grads

        model.zero_grad_buffer()
        opt.zero_grad()
        loss = model(ids, pos, None, labels=ids).float().mean()
        loss.backward()
        finalize_model_grads([model])
        opt.step()
    else:
        opt.zero_grad(set_to_none=True)
        loss = model(ids, pos, None, labels=ids).float().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
    return loss.item()


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--backend", default="tilelang", choices=["tilelang", "megatron"])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="tiny fixture, fp32, torch AdamW (what CI runs)")
    args = parser.parse_args(argv)

    from megatron.core import parallel_state as ps

    from megatron_glm5.config import parse_hf_config
    from megatron_glm5.cpu import enable_cpu_mode
    from megatron_glm5.lora import LoraConfig, lora_parameters
    from megatron_glm5.parallel import initialize_model_parallel
    from megatron_glm5.testing import small_glm52_config, tiny_glm52_config

    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda:
        enable_cpu_mode()
    if not ps.model_parallel_is_initialized():
        initialize_model_parallel()
    arch = parse_hf_config(small_glm52_config() if cuda else tiny_glm52_config())
    seq = SEQ_GPU if cuda else SEQ_CPU
    device = "cuda" if cuda else "cpu"
    batches = learnable_batches(arch.vocab_size, seq, args.steps, device)
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "backend": args.backend,
                    "seq": seq, "index_topk": arch.index_topk, "rank": args.rank, "alpha": args.alpha,
                    "distributed_optimizer": args.distributed_optimizer}

    def measured(model, name):
        wrapped, opt, rep = make_optimizer(model, cuda=cuda, lr=args.lr, distributed=args.distributed_optimizer)
        loss = train_step(wrapped, opt, batches[0], cuda=cuda)  # Adam state exists after the first step
        rep.update(optimizer_state_bytes(opt))
        if cuda:
            rep["cuda_bytes_after_first_step_minus_model"] = torch.cuda.memory_allocated() - rep.pop(
                "_mem_before_optimizer")
        rep["first_loss"] = loss
        result[name] = rep
        print(f"[{name}] trainable {rep['trainable_params']:,} of {rep['total_params']:,} parameters; optimizer state "
              f"{rep['optimizer_state_bytes'] / 2**20:.2f} MiB (master {rep['master_bytes'] / 2**20:.2f} MiB, Adam "
              f"moments {rep['adam_moment_bytes'] / 2**20:.2f} MiB)"
              + (f"; DDP grad buffers {rep['grad_buffer_bytes'] / 2**20:.2f} MiB" if cuda else ""), flush=True)
        return wrapped, opt

    full = build(arch, cuda=cuda, backend=args.backend)
    state = {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in full.state_dict().items()}
    wrapped, opt = measured(full, "full_finetune")
    del wrapped, opt, full
    if cuda:
        torch.cuda.empty_cache()

    lora = LoraConfig(args.rank, args.alpha)
    model = build(arch, cuda=cuda, backend=args.backend, lora=lora, state=state)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    wrapped, opt = measured(model, "lora")
    losses = [result["lora"]["first_loss"]]
    t0 = time.perf_counter()
    print(f"step  1 loss {losses[0]:.4f}", flush=True)
    for step in range(1, args.steps):
        losses.append(train_step(wrapped, opt, batches[step], cuda=cuda))
        print(f"step {step + 1:2d} loss {losses[-1]:.4f}", flush=True)
    if cuda:
        torch.cuda.synchronize()
    result["lora_losses"] = losses
    result["seconds_per_step"] = (time.perf_counter() - t0) / max(1, args.steps - 1)
    result["base_unchanged"] = all(torch.equal(p, base[n]) for n, p in model.named_parameters() if "lora_" not in n)
    result["adapters_finite"] = all(torch.isfinite(p).all().item() for _, p in lora_parameters(model))
    result["kv_up_lora_B_trained"] = any((p.detach().float().abs().sum() > 0).item()
                                         for n, p in lora_parameters(model) if "linear_kv_up_proj.lora_B" in n)
    f, lo = result["full_finetune"], result["lora"]
    result["optimizer_state_ratio"] = lo["optimizer_state_bytes"] / max(1, f["optimizer_state_bytes"])
    print(f"LoRA optimizer state / full fine-tuning: {result['optimizer_state_ratio']:.4f} "
          f"({lo['optimizer_state_bytes'] / 2**20:.2f} MiB vs {f['optimizer_state_bytes'] / 2**20:.2f} MiB)")
    print("RESULT " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if run()["base_unchanged"] else 1)
