"""GRPO + LoRA on a tiny GLM-5.2, a closed loop: transformers + peft roll out, megatron-core trains the adapters, and
every round the adapter goes back to the rollout side (CPU, offline, ~10 s on 2 CPU cores; ``--device cuda`` is
written for one GPU but has not been run yet).

    python examples/rl/grpo_lora_tiny.py [--rounds 3] [--seed 0] [--out DIR] [--device cpu|cuda]

Set-up: a random tiny GLM-5.2 (``megatron_glm5.testing``: IndexShare, MTP, dense + shared + routed experts; vocabulary
cut to 32 tokens so that 64 samples estimate the policy gradient well enough to learn within 3 rounds) is written to
disk; ``from_hf_pretrained`` + ``add_lora`` (r 8, alpha 32; attention and routed experts of the decoder layers, the
adapters HF PEFT can hold for this model) is the policy we train; transformers' ``GlmMoeDsaForCausalLM`` on the same checkpoint, with
``peft``, is the stand-in rollout engine. The reward is verifiable and needs no model: the fraction of completion
tokens in ``TARGET`` (4 ordinary token ids, 1/8 of the vocabulary), so the base policy starts near 0.125.

Each round ``r``:

1. **rollout**: the ``PeftModel`` with the current adapter samples ``--group`` completions of ``--new-tokens`` tokens
   for each of ``--prompts`` random 16-token prompts (``generate``: temperature 1, no top-k / top-p, no EOS, so every
   completion has the same length; ``torch.manual_seed`` fixed per round). As sglang does, it returns the log-prob of
   each sampled token (from ``generate``'s raw logits) and what replay needs: every decoder layer's DSA top-k (the
   ``self_attn`` output; shared layers repeat their source) and routed experts (the ``mlp.gate`` output), recorded by
   forward hooks on the prefill and on every decode step, so they are the choices that produced the sampled tokens
   (``L - 1`` rows per sample, the last sampled token is never run; sequence-relative positions, -1 padded). The
   prompts are as long as ``index_topk`` (16): every completion token is predicted with sparse attention.
2. **reward** and GRPO's group-normalised advantages ``(r - mean_group) / (std_group + 1e-4)``.
3. **ours**: the rollouts packed THD (``input_ids [T]``, ``cu_seqlens``) into
   ``megatron_glm5.rl.compute_logprobs(..., topk_replay=, routing_replay=)``, per-sample arrays
   ``[layers, L - 1, k]`` (:mod:`megatron_glm5.rl.payload`). The first forward of the round runs on the weights the
   rollout used (the adapter just exported), so its gap to the rollout log-probs is the two engines' numerical
   difference only: ``kl`` is the k3 estimator of KL(rollout || train) per completion token, ``mean(exp(d) - 1 - d)``
   with ``d = logp_train - logp_rollout`` (``bridge.rollout_parity.logprob_metrics``), ``max|dlogp|`` the largest
   ``|d|``; a ``ReplayStats`` on that forward gives the overlap of the replayed top-k with the one our indexer computes
   and the fraction of routing choices our router would make differently.
4. **update**: ``--steps`` Adam steps (lr ``--lr``) on the LoRA factors, each a new forward (with replay) and the
   clipped GRPO loss over the completion tokens, ``-mean_t min(ratio_t A, clip(ratio_t, 1 - 0.2, 1 + 0.2) A)``,
   ``ratio_t = exp(logp_train - logp_rollout)`` (token mean, no KL-to-reference term). ``loss`` is the mean over the
   round's steps: the first step's is ~0 by construction (ratio 1, advantages summing to 0 in each group, equal
   lengths), the later ones negative as the steps improve the objective, so the reward is the number to watch.
5. **sync**: ``bridge.export_peft_adapter`` -> ``OUT/round{r}``; the rollout side loads it (``load_adapter`` +
   ``set_adapter``; the previous adapter is deleted), as a LoRA-serving engine would. Round 1 samples with the
   adapter exported before any update (``B = 0``: the base model, through the same path).

After the last round one more rollout, with the last adapter, gives the reward the training reached.

On CPU (fp32, seed 0)::

    round 1: reward=0.1113 kl=3.74e-13 max|dlogp|=2.62e-06 loss=-0.0931 replay: overlap=1.000 mismatch=0.000
    round 2: reward=0.1152 kl=3.61e-13 max|dlogp|=3.34e-06 loss=-0.0887 replay: overlap=1.000 mismatch=0.000
    round 3: reward=0.2188 kl=3.77e-13 max|dlogp|=3.10e-06 loss=-0.0845 replay: overlap=1.000 mismatch=0.000
    after round 3: reward=0.3535 (rollout with adapter round3); 5.4 s

The KL stays at ~4e-13 every round: the exported adapter is exactly what the rollout side runs. transformers' q/kv
latent-norm eps is matched to ``rms_norm_eps`` as sglang / vLLM have it (``testing.match_norm_eps``). Replay: in fp32
on this model both engines make the same top-k and routing choices (overlap 1.000, mismatch 0), so replay does not
change these numbers; it is wired as a bf16 engine needs it (``scripts/bench/RESULTS_rl_gpu.md``: 17.9x lower KL
with both replays). The rollout side does not run the MTP layer, which keeps its own indexer and router here and has
no adapters (it does not change the log-probs; its loss is masked to 0).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

CLIP = 0.2
VOCAB = 32  # few choices per token: 64 samples estimate the policy gradient well enough to learn in 3 rounds
PROMPT_TOKENS = 16  # the fixture's index_topk: every completion token is predicted with sparse attention


@dataclass
class Rollout:
    """``sequences`` int64 ``[n, L]`` (prompt + completion, ``P`` prompt tokens); ``logprobs`` fp32 ``[n, L]``,
    position-indexed like ``compute_logprobs`` (``[:, t]`` = log p(token ``t + 1``), NaN before the completion and
    on the last position); ``indexer_topk`` / ``routed_experts`` int32 ``[n, layers, L - 1, k]``."""

    sequences: torch.Tensor
    prompt_len: int
    logprobs: torch.Tensor
    indexer_topk: torch.Tensor
    routed_experts: torch.Tensor


def target_reward(completions: torch.Tensor, target: range) -> torch.Tensor:
    """The verifiable reward: per sample (``completions`` ``[n, new_tokens]``), the fraction of tokens in ``target``."""
    return ((completions >= target.start) & (completions < target.stop)).float().mean(-1)


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO's advantages: each reward minus its group's mean, over the group's std (``rewards`` ``[n]``, grouped
    consecutively)."""
    r = rewards.view(-1, group)
    return ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-4)).view(-1)


@torch.no_grad()
def hf_rollout(hf, prompts: torch.Tensor, *, group: int, new_tokens: int, seed: int) -> Rollout:
    """Sample ``group`` completions per prompt with transformers ``generate`` and record the rollout engine's
    per-token log-probs, DSA top-k and routed experts (module docstring, step 1)."""
    from transformers import GenerationConfig

    base = hf.get_base_model() if hasattr(hf, "get_base_model") else hf
    cfg = base.config
    layers = cfg.num_hidden_layers
    calls_topk: dict[int, list[torch.Tensor]] = {i: [] for i in range(layers)}
    calls_experts: dict[int, list[torch.Tensor]] = {i: [] for i in range(layers)}
    hooks = []
    for i, layer in enumerate(base.model.layers):
        hooks.append(layer.self_attn.register_forward_hook(
            lambda m, a, out, i=i: calls_topk[i].append(out[2].cpu())))  # [n, s, width] int32
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:  # MoE layers: router_logits, weights, ids [n * s, k]
            hooks.append(gate.register_forward_hook(lambda m, a, out, i=i: calls_experts[i].append(out[2].cpu())))
    ids = prompts.repeat_interleave(group, 0).to(base.device)
    n, p = ids.shape
    gen = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                           pad_token_id=cfg.pad_token_id, return_dict_in_generate=True, output_logits=True)
    torch.manual_seed(seed)
    try:
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    finally:
        for h in hooks:
            h.remove()
    seqs = out.sequences.cpu()
    length = seqs.shape[1]
    if length != p + new_tokens:
        raise RuntimeError(f"generate returned {length - p} new tokens, expected {new_tokens}")
    logits = torch.stack(out.logits, 1).float().cpu()  # [n, new_tokens, V]: step j predicts token p + j
    lp = torch.full((n, length), float("nan"))
    lp[:, p - 1:length - 1] = torch.log_softmax(logits, -1).gather(-1, seqs[:, p:, None])[..., 0]

    k = cfg.index_topk
    topk = torch.full((n, layers, length - 1, k), -1, dtype=torch.int32)
    for i, calls in calls_topk.items():
        row = 0
        for t in calls:  # prefill [n, p, min(k, p)], then one row per decode step
            s, width = t.shape[1], t.shape[2]
            pos = torch.arange(row, row + s)[None, :, None]
            topk[:, i, row:row + s, :width] = torch.where(t <= pos, t, -1)  # prefill rows shorter than k pick
            row += s                                                          # masked (future) keys: drop them
        assert row == length - 1, (row, length)
    experts = torch.full((n, layers, length - 1, cfg.num_experts_per_tok), -1, dtype=torch.int32)
    for i, calls in calls_experts.items():
        if calls:  # dense layers stay -1
            experts[:, i] = torch.cat([t.view(n, -1, t.shape[-1]) for t in calls], 1).to(torch.int32)
    return Rollout(sequences=seqs, prompt_len=p, logprobs=lp, indexer_topk=topk, routed_experts=experts)


def grpo_loss(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    """Clipped policy-gradient loss, token mean over ``mask`` (all ``[n, L]``; ``advantages`` ``[n, 1]``)."""
    ratio = torch.exp(logprobs - torch.where(mask, rollout_logprobs, logprobs.detach()))
    per_token = -torch.minimum(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages)
    return per_token[mask].mean()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="seeds the checkpoint, the LoRA init, the prompts and "
                                                              "the sampling")
    parser.add_argument("--out", help="keep the checkpoint and the adapters here (OUT/base, OUT/round{r}; default: a "
                                      "temporary directory, removed at the end)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (the GRPO group)")
    parser.add_argument("--new-tokens", type=int, default=8, help="completion length")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per round (on the round's rollouts)")
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.group < 2:
        parser.error("--steps must be >= 1 and --group >= 2 (a group's advantages need two samples)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    if args.device == "cpu" and torch.cuda.is_available():
        raise SystemExit("--device cpu: megatron-glm5 builds the model on CUDA when it is there; hide the GPUs "
                         "(CUDA_VISIBLE_DEVICES=)")

    import peft
    from megatron.core import parallel_state as ps
    from transformers.utils import logging as hf_logging

    import bridge
    from bridge.rollout_parity import logprob_metrics
    from megatron_glm5 import from_hf_pretrained
    from megatron_glm5.cpu import enable_cpu_mode
    from megatron_glm5.lora import LoraConfig, add_lora, lora_parameters
    from megatron_glm5.parallel import destroy_model_parallel
    from megatron_glm5.rl import ReplayStats, compute_logprobs
    from megatron_glm5.testing import load_hf_reference_model, match_norm_eps, tiny_glm52_config, write_hf_checkpoint

    t0 = time.time()
    enable_cpu_mode()  # a no-op with CUDA
    own_parallel_state = not ps.model_parallel_is_initialized()  # else the caller's (a test fixture) to tear down
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="glm5-grpo-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        raw = tiny_glm52_config(vocab_size=VOCAB)
        hf_path = write_hf_checkpoint(out / "base", raw, seed=args.seed)
        model = from_hf_pretrained(hf_path, params_dtype=torch.float32)  # parallel state: TP = PP = EP = 1
        # the default targets (attention, routed experts: what HF PEFT holds); MTP excluded: neither the rollout
        # engine nor the log-prob objective runs it
        lora = LoraConfig(r=8, alpha=32, exclude_modules=("mtp",), seed=args.seed)
        add_lora(model, lora)
        params = [p for _, p in lora_parameters(model)]
        opt = torch.optim.Adam(params, lr=args.lr)
        device = next(model.parameters()).device
        target = range(3, 3 + VOCAB // 8)  # TARGET: 4 ordinary ids (0-2: bos / pad / eos), 1/8 of the vocabulary

        adapter = out / "round0"
        bridge.export_peft_adapter(model, adapter, overwrite=True)  # B = 0: the base model, through the real path
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # transformers lists the MTP tensors it does not load, one line each
        hf_logging.disable_progress_bar()
        try:
            base = load_hf_reference_model(hf_path).to(device)
        finally:
            hf_logging.set_verbosity(verbosity)
            hf_logging.enable_progress_bar()
        match_norm_eps(base)
        base.generation_config.eos_token_id = None  # no EOS (generate would fill it in from generation_config.json)
        with warnings.catch_warnings():  # peft 0.21 wrongly warns that the gate_up_proj rank_pattern was not used
            warnings.simplefilter("ignore")
            hf = peft.PeftModel.from_pretrained(base, str(adapter), adapter_name=adapter.name)
        hf.eval()
        gen = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(3, VOCAB, (args.prompts, PROMPT_TOKENS), generator=gen)

        def rollout(r: int) -> Rollout:
            return hf_rollout(hf, prompts, group=args.group, new_tokens=args.new_tokens, seed=args.seed * 1000 + r)

        rows = []
        for r in range(1, args.rounds + 1):
            ro = rollout(r)
            n, length = ro.sequences.shape
            rewards = target_reward(ro.sequences[:, ro.prompt_len:], target)
            adv = group_advantages(rewards, args.group).to(device)[:, None]
            ids = ro.sequences.reshape(-1)  # THD: the n sequences back to back
            cu = [i * length for i in range(n + 1)]
            replay = dict(topk_replay=list(ro.indexer_topk), routing_replay=list(ro.routed_experts))
            roll = ro.logprobs.to(device)
            mask = torch.isfinite(roll)  # the positions that predict a completion token
            stats = ReplayStats()
            model.train()
            losses = []
            for step in range(args.steps):
                lp = compute_logprobs(model, ids, cu, replay_stats=stats if step == 0 else None, **replay)
                lp = lp.view(n, length)
                if step == 0:  # the weights the rollout used: the gap is the engines' difference only
                    gap = logprob_metrics(lp.detach()[mask], roll[mask])
                    summary = stats.summary()
                loss = grpo_loss(lp, roll, adv, mask)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            model.eval()
            row = {"round": r, "reward": rewards.mean().item(), "kl": gap["kl"], "kl_k1": gap["kl_k1"],
                   "max_abs_dlogp": gap["abs_diff_max"], "loss": sum(losses) / len(losses), "losses": losses,
                   "topk_overlap": min(v["mean"] for v in summary["indexer_overlap"].values()),
                   "routing_mismatch": max(v["fraction"] for v in summary["routing_mismatch"].values())}
            rows.append(row)
            print(f"round {r}: reward={row['reward']:.4f} kl={row['kl']:.2e} max|dlogp|={row['max_abs_dlogp']:.2e} "
                  f"loss={row['loss']:+.4f} replay: overlap={row['topk_overlap']:.3f} "
                  f"mismatch={row['routing_mismatch']:.3f}", flush=True)

            prev, adapter = adapter, out / f"round{r}"
            bridge.export_peft_adapter(model, adapter, overwrite=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hf.load_adapter(str(adapter), adapter_name=adapter.name)
            hf.set_adapter(adapter.name)
            hf.delete_adapter(prev.name)

        last = rollout(args.rounds + 1)
        final = target_reward(last.sequences[:, last.prompt_len:], target).mean().item()
        seconds = time.time() - t0
        print(f"after round {args.rounds}: reward={final:.4f} (rollout with adapter {adapter.name}); {seconds:.1f} s")
        return {"rounds": rows, "final_reward": final, "seconds": seconds,
                "adapter": str(adapter) if args.out else None, "base": str(hf_path) if args.out else None}
    finally:
        if own_parallel_state:
            destroy_model_parallel()
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
