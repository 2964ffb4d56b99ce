"""The DSA indexer warm-up on a tiny GLM-5.2, end to end (CPU or GPU, offline; about 20-30 s on 2 CPU cores):

    python examples/indexer_warmup_tiny.py [--out DIR] [--steps 150] [--backend megatron|tilelang] [--hf-path DIR]

1. writes a random tiny GLM-5.2 checkpoint (IndexShare, MTP) whose attention is made peaked (the q / kv latent norms
   scaled by 3, so a few keys hold most of each row's attention, as in a trained model), or uses ``--hf-path``;
2. ``from_hf_pretrained`` with ``RuntimePolicy(dsa_indexer_warmup=True)``: dense main attention, every parameter
   frozen except the indexers', which are then re-initialised (as when a model without an indexer gains one);
3. Adam on ``megatron_glm5.dsa.indexer_parameters(model)``; each step prints the indexer KL loss (megatron-core's
   tracker) and the recall: the share of the dense attention mass the indexer's top-k keys capture, next to the most
   any as many keys could capture;
4. ``bridge.export_hf`` writes the warmed-up model back to HF and the script checks that only indexer tensors
   changed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402


def peaked_checkpoint(out: Path, sharpen: float = 3.0) -> Path:
    """A random tiny GLM-5.2 checkpoint whose attention logits are ``sharpen ** 2`` times larger than the fixture's."""
    from megatron_glm5.testing import make_hf_state_dict, tiny_glm52_config, write_hf_checkpoint

    raw = tiny_glm52_config()
    sd = make_hf_state_dict(raw, seed=0)
    for name in sd:
        if name.endswith(("q_a_layernorm.weight", "kv_a_layernorm.weight")):
            sd[name] = sd[name] * sharpen
    return write_hf_checkpoint(out, raw, state_dict=sd)


def reinit_indexers(model, seed: int = 123, std: float = 0.02) -> None:
    """Fresh indexer weights: normal(0, std) linears, LayerNorm ``k_norm`` at weight 1 / bias 0."""
    from megatron_glm5.dsa import indexer_parameters

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in indexer_parameters(model):
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif p.ndim == 1:  # k_norm weight / bias: LayerNorm's own initialisation
                p.fill_(1.0 if p.abs().mean() > 0.5 else 0.0)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="work directory (default: a temporary directory)")
    parser.add_argument("--hf-path", help="an HF GLM-5.x checkpoint (default: write a peaked tiny GLM-5.2)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seq", type=int, default=64, help="sequence length (> index_topk 16: DSA is sparse)")
    parser.add_argument("--backend", default="megatron", choices=["megatron", "tilelang"])
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args(argv)

    import bridge
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper
    from megatron_glm5 import from_hf_pretrained
    from megatron_glm5.config import RuntimePolicy
    from megatron_glm5.cpu import enable_cpu_mode
    from megatron_glm5.dsa import indexer_parameters
    from megatron_glm5.dsa.indexer_training import RECALL, mean_recall

    enable_cpu_mode()  # a no-op with CUDA
    out = Path(args.out or tempfile.mkdtemp(prefix="glm5-warmup-"))
    out.mkdir(parents=True, exist_ok=True)
    hf_path = Path(args.hf_path) if args.hf_path else peaked_checkpoint(out / "base")
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    policy = RuntimePolicy(params_dtype=torch.bfloat16 if cuda else torch.float32, use_cpu_initialization=not cuda,
                           dsa_indexer_warmup=True)
    model = from_hf_pretrained(hf_path, backend=args.backend, policy=policy)
    reinit_indexers(model)
    params = list(indexer_parameters(model))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    print(f"warm-up: {sum(p.numel() for p in params):,} indexer parameters train ({len(trainable)} tensors), "
          f"{sum(p.numel() for p in model.parameters()):,} in the model; backend {args.backend}, {device}")
    opt = torch.optim.Adam(params, lr=args.lr)
    vocab = model.vocab_size
    model.train()
    RECALL.take()
    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
    recalls, losses = [], []
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, vocab, (2, args.seq), generator=gen).to(device)
        pos = torch.arange(args.seq, device=device)[None].expand_as(ids)
        opt.zero_grad(set_to_none=True)
        model(ids, pos, None, labels=ids).float().mean().backward()  # the LM loss carries the indexer losses
        opt.step()
        values = DSAIndexerLossLoggingHelper.tracker["values"]
        losses.append(float(values.mean()))  # mean over the loss-computing layers (full layers + MTP)
        DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
        captured, best = mean_recall(RECALL.take())
        recalls.append(captured)
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step + 1:4d}  indexer loss {losses[-1]:.4f}  recall {captured:.3f} (best possible {best:.3f})",
                  flush=True)
    model.eval()
    report = bridge.export_hf(model, out / "warmed_up", overwrite=True)
    changed = _changed_tensors(hf_path, out / "warmed_up")
    print(f"exported {out / 'warmed_up'}: {len(changed)} tensors changed, all indexer weights: "
          f"{all('.indexer.' in n for n in changed)}")
    return {"recalls": recalls, "losses": losses, "changed": changed, "out": str(out), "export": report}


def _changed_tensors(a: Path, b: Path) -> list[str]:
    from safetensors import safe_open

    def tensors(d: Path) -> dict[str, torch.Tensor]:
        result = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                result.update({k: h.get_tensor(k) for k in h.keys()})
        return result

    ta, tb = tensors(a), tensors(b)
    assert set(ta) == set(tb), sorted(set(ta) ^ set(tb))
    return sorted(n for n in ta if not torch.equal(ta[n].float(), tb[n].float()))


if __name__ == "__main__":
    r = main()
    rise = sum(r["recalls"][-10:]) / 10 - sum(r["recalls"][:10]) / 10
    print(f"recall rose by {rise:.3f} (mean of the last 10 steps vs the first 10)")
    sys.exit(0 if rise > 0.05 and all(".indexer." in n for n in r["changed"]) and r["changed"] else 1)
