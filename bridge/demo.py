"""``megatron-glm5 demo``: the whole loop on a tiny random GLM-5.2, offline, in well under a minute on 2 CPU cores.
``--model glm5.3-flash`` runs it on a tiny GLM-5.3-Flash instead (KDA / full DSA / shared DSA / KDA layers in mHC
streams, dense and MoE MLPs, an MTP layer and a tiny vision tower that the conversion carries through), written by
transformers' own ``save_pretrained``.

1. write a tiny GLM-5.2 HF checkpoint (IndexShare ``[full, shared, full, shared]`` + one MTP layer);
2. import it into a megatron-core ``torch_dist`` checkpoint and check that exporting it back is bitwise identical;
3. build the megatron-core GPTModel, load the checkpoint with ``dist_checkpointing.load`` and train a few AdamW
   steps on a fixed random batch (fp32; CPU, or the GPU when there is one);
4. export the trained model to HF and compare its logits with transformers' ``GlmMoeDsaForCausalLM`` on the
   exported files (sequence longer than ``index_topk``, so the sparse attention is really sparse);
5. print a table.

With ``--out DIR`` the four outputs (``DIR/hf``, ``megatron``, ``hf_roundtrip``, ``hf_trained``) follow the output
rules of ``convert`` (:mod:`bridge.output`): a rerun replaces the demo's own earlier outputs, and anything else in
their place is refused before the demo starts; nothing else in ``DIR`` is touched.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch
from megatron_glm5.parallel import destroy_model_parallel

DEMO_SEQ_LEN = 64
MODELS = ("glm5.2", "glm5.3-flash")


def _write_checkpoint(model: str, path: Path) -> tuple[dict, str]:
    """Write the tiny checkpoint of ``model``; returns (its config.json, a one-line description)."""
    import json

    if model == "glm5.2":
        from megatron_glm5.testing import tiny_glm52_config, write_hf_checkpoint

        raw = tiny_glm52_config()
        write_hf_checkpoint(path, raw, seed=0)
        return raw, (f"tiny GLM-5.2 ({raw['num_hidden_layers']} layers, IndexShare {'/'.join(raw['indexer_types'])}, "
                     f"{raw['n_routed_experts']} experts, {raw['num_nextn_predict_layers']} MTP layer)")
    if model == "glm5.3-flash":
        from megatron_glm5.glm5_next.testing import write_transformers_checkpoint

        write_transformers_checkpoint(path, seed=0)
        raw = json.loads((path / "config.json").read_text())
        t = raw["text_config"]
        kinds = "/".join("KDA" if lt == "linear_attention" else f"DSA-{it}"
                         for lt, it in zip(t["layer_types"], t["indexer_types"]))
        return raw, (f"tiny GLM-5.3-Flash ({t['num_hidden_layers']} layers {kinds} in {t['hc_mult']} mHC streams, "
                     f"{t['n_routed_experts']} experts, {t['num_nextn_predict_layers']} MTP layer, vision tower "
                     "carried through)")
    raise ValueError(f"unknown demo model {model!r}; valid: {list(MODELS)}")


def _policy():
    from megatron_glm5.model import default_cpu_policy

    if torch.cuda.is_available():
        return default_cpu_policy(use_cpu_initialization=False)
    return default_cpu_policy()


def run_demo(*, out_dir: str | Path | None = None, steps: int = 4, keep: bool = False, lr: float = 3e-3,
             seq_len: int = DEMO_SEQ_LEN, print_fn=print, model_name: str = "glm5.2") -> dict:
    """Run the demo on ``model_name`` (:data:`MODELS`); returns ``{"ok": bool, "losses": [...], "verify": {...},
    "roundtrip": {...}, ...}``."""
    import bridge
    from .inmemory import load_megatron_checkpoint
    from megatron.core import parallel_state as ps

    from megatron_glm5.architectures import parse_architecture
    from megatron_glm5.parallel import initialize_model_parallel

    from .output import atomic_output_dir
    from .preflight import demo_outputs

    t_start = time.perf_counter()
    if model_name not in MODELS:
        raise ValueError(f"unknown demo model {model_name!r}; valid: {list(MODELS)}")
    if out_dir is not None:  # outputs of an earlier demo are replaced, anything else in the way is refused
        work = demo_outputs(out_dir, flag="out_dir")
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="megatron-glm5-demo-"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        with atomic_output_dir(work / "hf", overwrite=True, kind="hf", source=f"megatron-glm5 demo ({model_name})",
                               sources=[]) as tmp:
            raw, description = _write_checkpoint(model_name, tmp)
        imp = bridge.convert_hf_to_megatron(hf_path=work / "hf", megatron_path=work / "megatron", overwrite=True,
                                            progress=False)
        bridge.convert_megatron_to_hf(megatron_path=work / "megatron", hf_path=work / "hf_roundtrip",
                                      overwrite=True, progress=False)
        rt = bridge.compare_hf_checkpoints(work / "hf", work / "hf_roundtrip")

        created = not ps.model_parallel_is_initialized()
        if created:
            initialize_model_parallel()
        model = load_megatron_checkpoint(work / "megatron", policy=_policy())
        model.to(device).train()
        gen = torch.Generator().manual_seed(0)
        vocab = parse_architecture(raw).vocab_size
        tokens = torch.randint(0, vocab, (2, seq_len + 1), generator=gen).to(device)
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        pos = torch.arange(seq_len, device=device).unsqueeze(0).expand_as(ids)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
        losses = []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = model(ids, pos, None, labels=labels).float().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())

        model.eval()
        t_exp = time.perf_counter()
        exp = bridge.export_hf(model.cpu() if device != "cpu" else model, work / "hf_trained", hf_config=raw,
                               overwrite=True)
        exp_seconds = time.perf_counter() - t_exp
        par = bridge.verify(hf_path=work / "hf_trained", model=model, seq_len=seq_len)
        if created:
            destroy_model_parallel()
    finally:
        if not keep and out_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    total = time.perf_counter() - t_start
    ok = bool(rt["ok"] and par["ok"])
    _print_table(print_fn, description=description, device=device, work=work if (keep or out_dir) else None,
                 losses=losses, imp=imp, rt=rt, exp=exp, exp_seconds=exp_seconds, par=par, total=total, ok=ok)
    return {"ok": ok, "losses": losses, "import": imp, "roundtrip": rt, "export": exp, "verify": par,
            "seconds": total, "work_dir": str(work) if (keep or out_dir) else None}


def _print_table(p, *, description, device, work, losses, imp, rt, exp, exp_seconds, par, total, ok) -> None:
    p(f"megatron-glm5 demo: {description} on {device}, fp32")
    if work is not None:
        p(f"work dir: {work}")
    p("")
    p(" step | train loss")
    p("------+-----------")
    for i, loss in enumerate(losses, 1):
        p(f" {i:4d} | {loss:.4f}")
    p("")
    rows = [
        ("HF -> Megatron import (torch_dist)", f"{imp['hf_tensors']} HF tensors -> {imp['tensors']} megatron "
                                              f"tensors, {imp['bytes'] / 1e6:.1f} MB, {imp['seconds']:.1f} s"),
        ("round trip HF -> Megatron -> HF", ("bitwise identical" if rt["ok"] else "MISMATCH")
         + f" ({rt['bitwise_equal']}/{rt['tensors']} tensors)"),
        ("trained model -> HF export", f"{exp['tensors']} HF tensors, {exp_seconds:.1f} s"),
        (f"logits vs transformers (seq {par['seq_len']} > top-k {par['index_topk']})",
         f"max |diff| {par['max_abs_logit_diff']:.2e}, cosine {par['logit_cosine']:.6f}, top-k overlap "
         f"{min(par['topk_overlap'].values()):.3f}"
         + (f" (differs on {par['topk_rows_differing']} tied rows only; with HF's top-k: max |diff| "
            f"{par['max_abs_logit_diff_with_hf_topk']:.2e})" if par["topk_rows_differing"] else "")
         + (" OK" if par["ok"] else " FAILED")),
        ("total", f"{total:.1f} s -> " + ("OK" if ok else "FAILED")),
    ]
    width = max(len(r[0]) for r in rows)
    p(f" {'check'.ljust(width)} | result")
    p(f"-{'-' * width}-+-{'-' * 40}")
    for name, value in rows:
        p(f" {name.ljust(width)} | {value}")
