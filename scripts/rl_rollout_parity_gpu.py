"""Train-vs-rollout log-prob parity in bf16 with indexer top-k and routing replay off and on (the H200 check).

    source .gpu/install.sh && python3 scripts/rl_rollout_parity_gpu.py [--steps 300] [--eval-tokens 8192] [--out R.json]

1. A GPU-sized GLM-5.2 toy (``small_glm52_config``: 4 layers [full, shared, full, shared], the real 576/512 MLA latent,
   index_topk 256, 8 experts top-2, MTP) is trained briefly from random weights on a synthetic corpus (noisy
   repetitions of random "phrases": a long-range copy task, so attention and the top-k matter), fp32, with our own
   ``compute_logprobs`` as the SFT objective. Random weights would make the comparison meaningless: they put routing
   and top-k boundaries everywhere near ties and magnify bf16 noise.
2. The trained model is exported to an HF checkpoint (bf16).
3. Rollout stand-in: transformers' ``GlmMoeDsaForCausalLM`` in bf16 on held-out sequences (``--eval-tokens`` tokens in
   sequences of ``--eval-seq`` tokens), q/kv latent norm eps matched to ``rms_norm_eps`` as sglang / vLLM have it;
   its per-token log-probs, DSA top-k (per full layer; shared layers repeat it) and routed experts are captured in
   sglang's payload format (base64, token-major, without each sequence's last token).
4. Ours: the ``tilelang`` backend in bf16, ``compute_logprobs`` with replay off and on; KL (k3) and |d logprob|
   against the rollout's, per-layer top-k overlap and routing mismatch.

The JSON report is printed (and written to ``--out``); the check passes when replay cuts the KL at least 2x.
``--device cpu --tiny`` rehearses the whole flow on the CPU fixture (minutes, fp32 torch paths).
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def corpus(n: int, length: int, vocab: int, seed: int, *, table_seed: int = 0, phrase: int = 48,
           noise: float = 0.1) -> list[torch.Tensor]:
    """``n`` sequences of ``length`` tokens from a sparse Markov chain (each token has 4 likely successors, fixed by
    ``table_seed``: learnable in a few hundred steps, so the model's distributions become peaked like a real LM's),
    with ``noise`` of the tokens uniform; in every other sequence the second half repeats a phrase of ``phrase``
    tokens (a long-range copy: attention and the DSA top-k matter there)."""
    succ = torch.randint(2, vocab, (vocab, 4), generator=torch.Generator().manual_seed(table_seed))
    probs = torch.tensor([0.7, 0.1, 0.1, 0.1])
    gen = torch.Generator().manual_seed(seed)
    seqs = torch.empty(n, length, dtype=torch.int64)
    seqs[:, 0] = torch.randint(2, vocab, (n,), generator=gen)
    choice = torch.multinomial(probs, n * length, replacement=True, generator=gen).view(n, length)
    for t in range(1, length):
        seqs[:, t] = succ[seqs[:, t - 1], choice[:, t]]
    noisy = torch.rand(n, length, generator=gen) < noise
    seqs[noisy] = torch.randint(2, vocab, (int(noisy.sum()),), generator=gen)
    half = length // 2
    for i in range(1, n, 2):
        p = seqs[i, half:half + phrase].clone()
        seqs[i, half:] = p.repeat(-(-(length - half) // phrase))[: length - half]
    return list(seqs)


def _cu(seqs) -> list[int]:
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + s.numel())
    return cu


def train(path: Path, out_dir: Path, *, steps: int, seq: int, batch: int, lr: float, device: str, log) -> dict:
    """SFT with compute_logprobs as the objective (``tilelang`` backend: bf16 on its kernels on CUDA, fp32 torch paths
    on CPU), then export to ``out_dir`` in bf16."""
    from bridge import export_hf, from_hf_pretrained
    from megatron_glm5.config import RuntimePolicy
    from megatron_glm5.rl import compute_logprobs

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    policy = RuntimePolicy(params_dtype=dtype, fusions=False, use_cpu_initialization=device == "cpu",
                           perform_initialization=False)
    model = from_hf_pretrained(path, policy=policy, backend="tilelang")
    model.train()
    vocab = model.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    losses = []
    t0 = time.time()
    for step in range(steps):
        seqs = corpus(batch, seq, vocab, seed=1000 + step)
        ids, cu = torch.cat(seqs), _cu(seqs)
        lp = compute_logprobs(model, ids, cu)
        mask = torch.ones_like(lp, dtype=torch.bool)
        mask[torch.tensor(cu[1:]) - 1] = False
        loss = -lp[mask].mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            log(f"train step {step}: loss {losses[-1]:.3f} ({time.time() - t0:.0f} s)")
    export_hf(model, out_dir, dtype=torch.bfloat16, overwrite=True)
    del model, opt
    return {"steps": steps, "loss_first": losses[0], "loss_last": sum(losses[-10:]) / len(losses[-10:]),
            "train_seconds": time.time() - t0}


@torch.no_grad()
def hf_rollout(hf_dir: Path, seqs, *, device: str, dtype) -> dict:
    """transformers as the rollout engine: token-indexed log-probs (NaN on first tokens), per-sample sglang payloads
    of its DSA top-k (every decoder layer, shared layers repeating their source) and routed experts."""
    from megatron_glm5.testing import load_hf_reference_model, match_norm_eps

    hf = load_hf_reference_model(hf_dir, dtype=dtype).to(device)
    match_norm_eps(hf)
    cfg = hf.config
    layers = cfg.num_hidden_layers
    lps, topk_payloads, expert_payloads = [], [], []
    for s in seqs:
        got_topk, got_experts = {}, {}
        hooks = []
        for i, layer in enumerate(hf.model.layers):
            hooks.append(layer.self_attn.register_forward_hook(
                lambda m, a, out, i=i: got_topk.__setitem__(i, out[2][0].clone())))
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                hooks.append(gate.register_forward_hook(
                    lambda m, a, out, i=i: got_experts.__setitem__(i, out[2].clone())))
        logits = hf(s[None].to(device)).logits[0].float()
        for h in hooks:
            h.remove()
        logp = torch.log_softmax(logits, -1)
        lp = torch.full((s.numel(),), math.nan)
        lp[1:] = logp[:-1].gather(1, s[1:, None].to(device))[:, 0].cpu()
        lps.append(lp)
        n = s.numel()
        pos = torch.arange(n, device=device)[:, None]
        k = cfg.index_topk
        topk = torch.full((n, layers, k), -1, dtype=torch.int32)
        for i, t in got_topk.items():
            t = t.long()
            t = torch.where(t <= pos, t, -1)  # transformers' masked picks past a short row's causal range
            width = min(k, t.shape[-1])
            topk[:, i, :width] = t[:, :width].to(torch.int32).cpu()
        experts = torch.full((n, layers, cfg.num_experts_per_tok), -1, dtype=torch.int32)
        for i, e in got_experts.items():
            experts[:, i] = e.view(n, -1).to(torch.int32).cpu()
        enc = lambda x: base64.b64encode(x[:-1].contiguous().numpy().tobytes()).decode()  # noqa: E731
        topk_payloads.append(enc(topk))
        expert_payloads.append(enc(experts))
    del hf
    return {"rollout_logprobs": torch.cat(lps), "indexer_topk": topk_payloads, "routed_experts": expert_payloads}


def run(*, steps: int, train_seq: int, train_batch: int, eval_tokens: int, eval_seq: int, lr: float, device: str,
        tiny: bool, work: Path, log=print) -> dict:
    from bridge.rollout_parity import RolloutBatch, rollout_parity
    from megatron_glm5.testing import small_glm52_config, tiny_glm52_config, write_hf_checkpoint

    raw = tiny_glm52_config() if tiny else small_glm52_config(dtype="float32")
    init = write_hf_checkpoint(work / "init", raw, seed=0, max_shard_bytes=256 << 20)
    trained = work / "trained"
    t0 = time.time()
    report = {"config": "tiny_glm52_config" if tiny else "small_glm52_config", "device": device}
    report["train"] = train(init, trained, steps=steps, seq=train_seq, batch=train_batch, lr=lr, device=device,
                            log=log)
    seqs = corpus(eval_tokens // eval_seq, eval_seq, raw["vocab_size"], seed=7)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rollout = hf_rollout(trained, seqs, device=device, dtype=dtype)
    batch = RolloutBatch(input_ids=torch.cat(seqs), cu_seqlens=_cu(seqs), rollout_logprobs=rollout["rollout_logprobs"],
                         indexer_topk=rollout["indexer_topk"], routed_experts=rollout["routed_experts"])
    backend = "tilelang"
    parity = rollout_parity(hf_path=trained, batch=batch, backend=backend,
                            dtype="bf16" if device == "cuda" else "fp32", plot=work / "rollout_parity.svg")
    report.update(parity)
    for name, kw in (("topk_replay_only", dict(routed_experts=None)), ("routing_replay_only", dict(indexer_topk=None))):
        one = RolloutBatch(**{**batch.__dict__, **kw})
        report[name] = rollout_parity(hf_path=trained, batch=one, backend=backend,
                                      dtype="bf16" if device == "cuda" else "fp32")["replay_on"]
    report["seconds"] = time.time() - t0
    report["ok"] = report["replay_on"]["kl"] * 2 <= report["replay_off"]["kl"]
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--train-seq", type=int, default=1024)
    p.add_argument("--train-batch", type=int, default=4)
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--eval-seq", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="the CPU fixture (rehearsal)")
    p.add_argument("--out", help="write the JSON report here (and the SVG plot next to it)")
    args = p.parse_args(argv)
    from megatron_glm5.cpu import enable_cpu_mode

    enable_cpu_mode()
    with tempfile.TemporaryDirectory() as tmp:
        report = run(steps=args.steps, train_seq=args.train_seq, train_batch=args.train_batch,
                     eval_tokens=args.eval_tokens, eval_seq=args.eval_seq, lr=args.lr, device=args.device,
                     tiny=args.tiny, work=Path(tmp))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
            svg = Path(tmp) / "rollout_parity.svg"
            if svg.is_file():
                Path(args.out).with_suffix(".svg").write_text(svg.read_text())
    print(json.dumps(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
