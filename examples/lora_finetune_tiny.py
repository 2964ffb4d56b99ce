"""LoRA fine-tuning of a tiny GLM-5.2 end to end: train adapters on megatron-core, export them as an HF PEFT adapter,
load that into transformers + peft and compare the logits (CPU or GPU, offline, about a minute on CPU).

    python examples/lora_finetune_tiny.py [--out DIR] [--steps 20] [--backend megatron|tilelang] [--merged]

1. writes a random tiny GLM-5.2 checkpoint (IndexShare, MTP, dense + shared + routed experts) with
   ``megatron_glm5.testing`` (or uses ``--hf-path``);
2. ``from_hf_pretrained`` + ``add_lora`` (rank 8; attention incl. kv_b_proj and the routed experts - dense MLP and
   shared experts are left out because HF PEFT cannot represent them for this model; ``--merged`` exports them
   merged instead) and trains the adapters for ``--steps`` AdamW steps on learnable token streams;
3. ``bridge.export_peft_adapter`` -> ``adapter_config.json`` + ``adapter_model.safetensors``;
4. ``peft.PeftModel.from_pretrained`` on transformers' ``GlmMoeDsaForCausalLM`` and a logits comparison (fp32, q/kv
   latent-norm eps matched: ``testing.match_norm_eps``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402


def learnable_batch(vocab: int, seq: int, step: int, batch: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 8, (batch, 1), generator=gen)
    return (start + stride * torch.arange(seq)) % vocab


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="work directory (default: a temporary directory)")
    parser.add_argument("--hf-path", help="an HF GLM-5.x checkpoint (default: write a random tiny GLM-5.2)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq", type=int, default=64, help="sequence length (> index_topk 16: DSA is sparse)")
    parser.add_argument("--backend", default="megatron", choices=["megatron", "tilelang"])
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--merged", action="store_true", help="also adapt the dense MLP / shared experts and export "
                                                              "base + LoRA merged (bridge.export_hf(merge_lora=True))")
    args = parser.parse_args(argv)

    import bridge
    from megatron_glm5 import from_hf_pretrained
    from megatron_glm5.cpu import enable_cpu_mode
    from megatron_glm5.lora import DEFAULT_TARGET_MODULES, LoraConfig, add_lora, lora_parameters
    from megatron_glm5.testing import load_hf_reference_model, match_norm_eps, tiny_glm52_config, write_hf_checkpoint

    enable_cpu_mode()  # a no-op with CUDA
    out = Path(args.out or tempfile.mkdtemp(prefix="glm5-lora-"))
    out.mkdir(parents=True, exist_ok=True)
    hf_path = Path(args.hf_path) if args.hf_path else write_hf_checkpoint(out / "base", tiny_glm52_config(), seed=0)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    model = from_hf_pretrained(hf_path, backend=args.backend, params_dtype=torch.float32)
    # the default targets (attention, routed experts) are what a PEFT adapter holds; merging takes any linear
    merge_only = ("dense_mlp", "shared_experts") if args.merged else ()
    add_lora(model, LoraConfig(r=8, alpha=16, target_modules=(*DEFAULT_TARGET_MODULES, *merge_only)))
    params = [p for _, p in lora_parameters(model)]
    total = sum(p.numel() for p in model.parameters())
    print(f"LoRA: {sum(p.numel() for p in params):,} trainable of {total:,} parameters "
          f"({len(params) // 2} adapters, backend {args.backend}, {device})")
    vocab = model.vocab_size
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(args.steps):
        ids = learnable_batch(vocab, args.seq, step).to(device)
        pos = torch.arange(args.seq, device=device)[None].expand_as(ids)
        opt.zero_grad(set_to_none=True)
        loss = model(ids, pos, None, labels=ids).float().mean()  # LM loss (+ the MTP loss megatron-core attaches)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        print(f"step {step + 1:3d}  loss {losses[-1]:.4f}")
    model.eval()

    import peft

    ids = learnable_batch(vocab, args.seq, 10_000).to(device)
    with torch.no_grad():
        ours = model(ids, torch.arange(args.seq, device=device)[None].expand_as(ids), None).float().cpu()
    result = {"losses": losses, "out": str(out)}
    if args.merged:
        bridge.export_hf(model, out / "merged", merge_lora=True, overwrite=True)
        reference = load_hf_reference_model(out / "merged")
        what = "transformers on the merged checkpoint"
    else:
        report = bridge.export_peft_adapter(model, out / "adapter", overwrite=True)
        print(f"exported PEFT adapter: {report['tensors']} tensors, {report['bytes'] / 1e6:.2f} MB, target_modules "
              f"{report['target_modules']}, target_parameters {report['target_parameters']} -> {out / 'adapter'}")
        with warnings.catch_warnings():  # peft 0.21 wrongly warns that the gate_up_proj rank_pattern was not used
            warnings.simplefilter("ignore")
            reference = peft.PeftModel.from_pretrained(load_hf_reference_model(hf_path), str(out / "adapter"))
        what = "transformers + peft"
    match_norm_eps(reference.get_base_model() if hasattr(reference, "get_base_model") else reference)
    with torch.no_grad():
        theirs = reference(ids.cpu()).logits.float()
    diff = (ours - theirs).abs().max().item()
    result["max_logit_diff"] = diff
    print(f"max |logit diff| megatron-core + LoRA vs {what}: {diff:.2e} (logits up to {theirs.abs().max():.1f})")
    return result


if __name__ == "__main__":
    r = main()
    sys.exit(0 if r["max_logit_diff"] < 1e-4 and r["losses"][-1] < r["losses"][0] else 1)
