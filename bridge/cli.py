"""``megatron-glm5``: a thin command line over keyword-only library functions.

    megatron-glm5 demo [--out DIR] [--steps N] [--keep]
    megatron-glm5 convert import    --hf-path DIR --megatron-path DIR [--tp N --pp N --ep N --dtype bf16|fp32]
    megatron-glm5 convert export    --megatron-path DIR --hf-path DIR [--hf-config PATH] [--expert-layout ...]
    megatron-glm5 convert roundtrip --hf-path DIR [--tp N --pp N --ep N] [--work-dir DIR --keep]
    megatron-glm5 verify --hf-path DIR [--megatron-path DIR] [--seq-len N] [--batch-size N] [--seed N]
    megatron-glm5 lora export --megatron-path DIR --adapter-path DIR [--hf-config PATH]
    megatron-glm5 lora import --adapter-path DIR --megatron-path DIR --hf-config PATH
    megatron-glm5 lora merge  --hf-path DIR --adapter-path DIR --out DIR

Bad input (a :class:`bridge.errors.BridgeError` or :class:`megatron_glm5.config.GLM5ConfigError`) prints one
``error:`` line and exits with status 2; a failed round trip or parity check exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence


def _size(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}
    t = text.strip().upper()
    num = t.rstrip("KMGTB")
    try:
        return int(float(num) * units[t[len(num):]])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a size like 5GB or 500MB, got {text!r}") from None


def _parallel_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks the conversion is sharded over")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-glm5", description="GLM-5.x on Megatron-Core: convert, verify, demo")
    parser.add_argument("--verbose", action="store_true", help="keep third-party warnings and load reports")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="offline end-to-end run on a tiny GLM-5.2: import, train, export, verify")
    demo.add_argument("--out", help="work directory (default: a temporary directory)")
    demo.add_argument("--steps", type=int, default=4, help="optimizer steps (default 4)")
    demo.add_argument("--keep", action="store_true", help="keep the work directory")

    convert = sub.add_parser("convert", help="HF <-> Megatron checkpoint conversion")
    csub = convert.add_subparsers(dest="action", required=True)

    imp = csub.add_parser("import", help="HF safetensors -> megatron-core torch_dist (Megatron-LM --load layout)")
    imp.add_argument("--hf-path", required=True)
    imp.add_argument("--megatron-path", required=True)
    _parallel_flags(imp)
    imp.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                     help="store weights in this dtype (default: the source dtype; FP8 sources become bf16)")
    imp.add_argument("--iteration", type=int, default=0, help="iteration of the iter_XXXXXXX directory (default 0)")
    imp.add_argument("--overwrite", action="store_true")
    imp.add_argument("--no-progress", action="store_true")

    exp = csub.add_parser("export", help="megatron-core torch_dist -> HF safetensors")
    exp.add_argument("--megatron-path", required=True, help="Megatron-LM save dir or one iter_XXXXXXX dir")
    exp.add_argument("--hf-path", required=True)
    exp.add_argument("--hf-config", help="config.json for checkpoints not written by this bridge")
    exp.add_argument("--expert-layout", choices=["per_expert", "fused"], default=None,
                     help="HF expert tensors (default: the source's layout)")
    exp.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: the stored dtype")
    exp.add_argument("--max-shard-size", type=_size, default="5GB")
    exp.add_argument("--overwrite", action="store_true")
    exp.add_argument("--no-progress", action="store_true")

    rt = csub.add_parser("roundtrip", help="import + export + bitwise comparison with the source")
    rt.add_argument("--hf-path", required=True)
    _parallel_flags(rt)
    rt.add_argument("--work-dir", help="where to put the intermediate checkpoints (default: a temporary directory)")
    rt.add_argument("--keep", action="store_true")
    rt.add_argument("--no-progress", action="store_true")

    ver = sub.add_parser("verify", help="logits of our model vs transformers on the same weights (one JSON line)")
    ver.add_argument("--hf-path", required=True)
    ver.add_argument("--megatron-path", help="load our side from this Megatron checkpoint (default: from --hf-path)")
    ver.add_argument("--seq-len", type=int, default=64)
    ver.add_argument("--batch-size", type=int, default=1)
    ver.add_argument("--seed", type=int, default=0)
    ver.add_argument("--tol", type=float, default=1e-4)
    _lora_parser(sub)
    return parser


def _progress(args) -> bool | None:
    return False if getattr(args, "no_progress", False) else None


def _run(args) -> int:
    import bridge

    if args.command == "demo":
        from .demo import run_demo

        return 0 if run_demo(out_dir=args.out, steps=args.steps, keep=args.keep)["ok"] else 1
    if args.command == "lora":
        return _run_lora(args)
    if args.command == "verify":
        report = bridge.verify(hf_path=args.hf_path, megatron_path=args.megatron_path, seq_len=args.seq_len,
                               batch_size=args.batch_size, seed=args.seed, tol=args.tol)
        print(json.dumps(report), flush=True)
        return 0 if report["ok"] else 1
    if args.action == "import":
        r = bridge.convert_hf_to_megatron(hf_path=args.hf_path, megatron_path=args.megatron_path, tp=args.tp,
                                          pp=args.pp, ep=args.ep, dtype=args.dtype, iteration=args.iteration,
                                          overwrite=args.overwrite, progress=_progress(args))
        print(f"imported {r['hf_tensors']} HF tensors as {r['tensors']} megatron tensors ({r['bytes'] / 1e9:.3f} GB, {r['expert_layout']} experts"
              f"{', ' + str(r['fp8_dequantized']) + ' FP8 weights dequantised' if r['fp8_dequantized'] else ''}) "
              f"into {r['path']} in {r['seconds']:.1f} s ({r['gb_per_s']:.2f} GB/s)")
        return 0
    if args.action == "export":
        r = bridge.convert_megatron_to_hf(megatron_path=args.megatron_path, hf_path=args.hf_path,
                                          hf_config=args.hf_config, expert_layout=args.expert_layout,
                                          dtype=args.dtype, max_shard_bytes=args.max_shard_size,
                                          overwrite=args.overwrite, progress=_progress(args))
        print(f"exported {r['tensors']} HF tensors ({r['bytes'] / 1e9:.3f} GB, {r['expert_layout']} experts) to "
              f"{r['path']} in {r['seconds']:.1f} s ({r['gb_per_s']:.2f} GB/s)")
        return 0
    if args.action == "roundtrip":
        r = bridge.roundtrip(hf_path=args.hf_path, work_dir=args.work_dir, tp=args.tp, pp=args.pp, ep=args.ep,
                             keep=args.keep, progress=_progress(args))
        status = "BITWISE IDENTICAL" if r["ok"] else "MISMATCH"
        print(f"round trip HF -> Megatron (TP={r['tp']} PP={r['pp']} EP={r['ep']}) -> HF: {status}")
        print(f"  tensors compared : {r['tensors']}  (bitwise equal: {r['bitwise_equal']}"
              f"{', FP8 compared with their dequantisation: ' + str(r['fp8_dequantized']) if r['fp8_dequantized'] else ''})")
        print(f"  import / export  : {r['import_seconds']:.1f} s / {r['export_seconds']:.1f} s, {r['bytes'] / 1e9:.3f} GB")
        for name, reason in sorted(r["ignored"].items()):
            print(f"  ignored          : {name} ({reason})")
        for m in r["mismatches"][:20]:
            print(f"  MISMATCH         : {m}")
        if r["work_dir"]:
            print(f"  kept             : {r['work_dir']}")
        return 0 if r["ok"] else 1
    raise AssertionError(args)


# --------------------------------------------------------------------------------------------------------------------
# megatron-glm5 lora (bridge.lora_convert)
# --------------------------------------------------------------------------------------------------------------------


def _lora_parser(sub) -> None:
    lora = sub.add_parser("lora", help="LoRA adapters: Megatron checkpoint <-> HF PEFT, merge into HF weights")
    lsub = lora.add_subparsers(dest="action", required=True)
    exp = lsub.add_parser("export", help="Megatron checkpoint with LoRA adapters (adapter-only or full) -> HF PEFT "
                                         "adapter (adapter_config.json + adapter_model.safetensors)")
    exp.add_argument("--megatron-path", required=True, help="Megatron-LM save dir or one iter_XXXXXXX dir")
    exp.add_argument("--adapter-path", required=True, help="output PEFT adapter directory")
    exp.add_argument("--hf-config", help="the model's config.json, if the checkpoint does not record it")
    exp.add_argument("--overwrite", action="store_true")
    imp = lsub.add_parser("import", help="HF PEFT adapter -> adapter-only Megatron checkpoint (torch_dist, "
                                         "Megatron-LM layout)")
    imp.add_argument("--adapter-path", required=True, help="PEFT adapter directory")
    imp.add_argument("--megatron-path", required=True, help="output Megatron checkpoint directory")
    imp.add_argument("--hf-config", required=True, help="the base model's config.json (or its checkpoint directory)")
    imp.add_argument("--overwrite", action="store_true")
    merge = lsub.add_parser("merge", help="HF checkpoint + adapter (PEFT directory or Megatron checkpoint with "
                                          "adapters) -> merged HF checkpoint, streaming")
    merge.add_argument("--hf-path", required=True, help="base HF checkpoint")
    merge.add_argument("--adapter-path", required=True, help="PEFT adapter directory or Megatron checkpoint")
    merge.add_argument("--out", required=True, help="output HF checkpoint directory")
    merge.add_argument("--max-shard-size", type=_size, default="5GB")
    merge.add_argument("--overwrite", action="store_true")
    merge.add_argument("--no-progress", action="store_true")


def _run_lora(args) -> int:
    from . import lora_convert

    if args.action == "export":
        r = lora_convert.convert_checkpoint_to_peft(args.megatron_path, args.adapter_path, hf_config=args.hf_config,
                                                    overwrite=args.overwrite)
        print(f"exported {r['adapters']} LoRA adapters as {r['tensors']} PEFT tensors ({r['bytes'] / 1e6:.2f} MB; "
              f"target_modules {r['target_modules']}, target_parameters {r['target_parameters']}) to {r['path']}")
        return 0
    if args.action == "import":
        r = lora_convert.convert_peft_to_checkpoint(adapter_path=args.adapter_path, megatron_path=args.megatron_path,
                                                    hf_config=args.hf_config, overwrite=args.overwrite)
        print(f"imported {r['adapters']} LoRA adapters as {r['tensors']} megatron tensors ({r['bytes'] / 1e6:.2f} MB) "
              f"into {r['path']}")
        return 0
    r = lora_convert.merge_adapter_into_hf(hf_path=args.hf_path, adapter_path=args.adapter_path, out_path=args.out,
                                           max_shard_bytes=args.max_shard_size, overwrite=args.overwrite,
                                           progress=_progress(args))
    print(f"merged {r['adapters']} LoRA adapters ({r['adapter_kind']}) into {r['merged_tensors']} of {r['tensors']} "
          f"HF tensors: {r['path']} ({r['bytes'] / 1e9:.3f} GB, {r['seconds']:.1f} s)")
    return 0


def _quiet() -> None:
    """Keep the terminal for results: third-party import-time chatter (missing Apex/TE, deprecations) and
    transformers' load reports are silenced for the CLI process only."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"(megatron|torch|transformers)(\.|$)")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    logging.getLogger("megatron").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not getattr(args, "verbose", False):
        _quiet()
    from bridge.errors import BridgeError

    from megatron_glm5.config import GLM5ConfigError
    from megatron_glm5.cpu import enable_cpu_mode

    enable_cpu_mode()
    try:
        return _run(args)
    except (BridgeError, GLM5ConfigError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
