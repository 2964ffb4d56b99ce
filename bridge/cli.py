"""``megatron-glm5``: a thin command line over keyword-only library functions.

    megatron-glm5 demo [--out DIR] [--steps N] [--keep] [--model glm5.2|glm5.3-flash]
    megatron-glm5 convert import    --hf-path DIR --megatron-path DIR [--tp N --pp N --ep N --dtype bf16|fp32]
                                    [--megatron-layout local|te|te-fused-qk]
    megatron-glm5 convert export    --megatron-path DIR --hf-path DIR [--hf-config PATH] [--expert-layout ...]
    megatron-glm5 convert roundtrip --hf-path DIR [--tp N --pp N --ep N] [--megatron-layout ...] [--work-dir DIR --keep]
    megatron-glm5 clean PATH... [--dry-run]
    megatron-glm5 verify --hf-path DIR [--megatron-path DIR] [--num-layers N] [--dtype bf16|fp32] [--device cuda|cpu]
                         [--seq-len N] [--batch-size N] [--seed N] [--tol X]
    megatron-glm5 rollout-parity --hf-path DIR --batch FILE [--backend megatron|tilelang] [--dtype bf16|fp32]
                         [--device cuda|cpu] [--plot FILE] [--max-kl X]
    megatron-glm5 lora export --megatron-path DIR --adapter-path DIR [--hf-config PATH]
    megatron-glm5 lora import --adapter-path DIR --megatron-path DIR --hf-config PATH
    megatron-glm5 lora merge  --hf-path DIR --adapter-path DIR --out DIR

Exit status (README: "Command line: outputs, exit status, errors"): every user or environment error (a bad flag
value, a missing or unreadable path, a file where a directory is expected, an output that may not be replaced, a
TP/PP/EP layout the model cannot take, a malformed checkpoint or config field, a full disk while writing, also in a
spawned rank: a :class:`bridge.errors.BridgeError`, :class:`megatron_glm5.config.GLM5ConfigError` or an ``OSError``
about a path the user gave) prints exactly one ``error:`` line on stderr and exits with 2; a check that ran and failed
(round trip, ``verify``, ``rollout-parity --max-kl``) prints one ``failed:`` line and exits with 1; Ctrl-C and SIGTERM
print one ``error: interrupted; ...`` line and exit with 130 / 143 after the staged output is removed; anything else
is a bug and keeps its traceback. Flags and paths are checked up front (:mod:`bridge.preflight`), before megatron-core
or transformers is imported and before any rank is spawned, so a typo costs a second, not the start-up of the ranks.
``--verbose`` is accepted before or after the subcommand.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import sys
from pathlib import Path
from typing import Sequence

from .errors import BridgeError


class _UsageError(BridgeError):
    """A flag argparse refused (unknown flag, bad choice, missing value)."""


class _Parser(argparse.ArgumentParser):
    """argparse prints the usage and exits from inside ``parse_args``; here its message becomes one ``error:`` line
    like every other user error (``--help`` still prints the usage)."""

    def error(self, message: str):
        raise _UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _size(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}
    t = text.strip().upper()
    num = t.rstrip("KMGTB")
    try:
        value = int(float(num) * units[t[len(num):]])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a size like 5GB or 500MB, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size like 5GB or 500MB, got {text!r}")
    return value


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


_POS, _NONNEG = _int_at_least(1), _int_at_least(0)


def _parallel_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=_POS, default=1, help="tensor-parallel ranks the conversion is sharded over")
    p.add_argument("--pp", type=_POS, default=1, help="pipeline-parallel ranks")
    p.add_argument("--ep", type=_POS, default=1, help="expert-parallel ranks")


VERIFY_EPILOG = """\
A released GLM-5.x on one GPU: --num-layers 4 --dtype bf16 checks the embeddings, the first 4 decoder layers (3
dense + 1 MoE), the final norm and the LM head on both sides (13.0 B parameters: about 26 GB per side in bf16,
52 GB in fp32) at the default sequence length index_topk + 256 = 2304, reading only those layers' tensors.

Tolerances. fp32 (the precise check): max |logit diff| / max(1, max |HF logit|) <= 1e-4, with HF's DSA top-k and
expert choices replayed into our model when our own choices differ from HF's only at near-ties. bf16: the mean
|logit diff| / mean |HF logit| with HF's choices replayed <= 2e-2 (about 4 bf16 steps; a correct model stays near
1 % after four layers) and >= 95 % of our top-k keys and expert choices equal to HF's on HF's activations. A bf16
value has 8 significant bits and the two sides round in a different order, so choices near a tie flip for some
tokens and move their logits by O(1): a max is no test in bf16. bf16 catches a wrong expert order, router or
indexer; errors of a few percent in one weight need fp32.
"""


def _megatron_layout_flag(p: argparse.ArgumentParser) -> None:
    from .megatron_layout import DEFAULT_LAYOUT, LAYOUTS

    p.add_argument("--megatron-layout", choices=list(LAYOUTS), default=DEFAULT_LAYOUT,
                   help="Megatron tensor names: " + "; ".join(f"{n}: {m.written_by}" for n, m in LAYOUTS.items())
                   + f" (default {DEFAULT_LAYOUT}; export detects the layout)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="megatron-glm5", description="GLM-5.x on Megatron-Core: convert, verify, demo")
    parser.add_argument("--verbose", action="store_true", help="keep third-party warnings and load reports")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="offline end-to-end run on a tiny GLM-5.2: import, train, export, verify")
    demo.add_argument("--out", help="work directory (default: a temporary directory)")
    demo.add_argument("--steps", type=_POS, default=4, help="optimizer steps (default 4)")
    demo.add_argument("--keep", action="store_true", help="keep the work directory")
    demo.add_argument("--model", choices=("glm5.2", "glm5.3-flash"), default="glm5.2",
                      help="which tiny model: glm5.2 (default) or glm5.3-flash (KDA + NoPE DSA in mHC streams)")

    convert = sub.add_parser("convert", help="HF <-> Megatron checkpoint conversion")
    csub = convert.add_subparsers(dest="action", required=True)

    imp = csub.add_parser("import", help="HF safetensors -> megatron-core torch_dist (Megatron-LM --load layout)")
    imp.add_argument("--hf-path", required=True)
    imp.add_argument("--megatron-path", required=True)
    _parallel_flags(imp)
    imp.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                     help="store weights in this dtype (default: the source dtype; FP8 sources become bf16)")
    imp.add_argument("--iteration", type=_NONNEG, default=0, help="iteration of the iter_XXXXXXX directory (default 0)")
    _megatron_layout_flag(imp)
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
    _megatron_layout_flag(rt)
    rt.add_argument("--work-dir", help="where to put the intermediate checkpoints (default: a temporary directory)")
    rt.add_argument("--keep", action="store_true")
    rt.add_argument("--no-progress", action="store_true")

    clean = sub.add_parser("clean", help="remove hidden leftovers of interrupted conversions of an output path")
    clean.add_argument("paths", nargs="+", metavar="PATH", help="an output path given to convert / export_hf")
    clean.add_argument("--dry-run", action="store_true", help="only list what would be removed")

    ver = sub.add_parser("verify", help="logits of our model vs transformers on the same weights (one JSON line)",
                         epilog=VERIFY_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ver.add_argument("--hf-path", required=True)
    ver.add_argument("--megatron-path", help="load our side from this Megatron checkpoint (default: from --hf-path)")
    ver.add_argument("--num-layers", type=_POS, default=None,
                     help="check only the first N decoder layers (+ final norm and LM head, no MTP) on both sides, "
                          "reading only their tensors (default: the whole model)")
    ver.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32",
                     help="compute dtype of both models (default fp32; bf16 for a released checkpoint on one node)")
    ver.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    ver.add_argument("--seq-len", type=_POS, default=None,
                     help="tokens per sequence, > index_topk (default: index_topk + 256 rounded up to 64)")
    ver.add_argument("--batch-size", type=_POS, default=1)
    ver.add_argument("--seed", type=int, default=0)
    ver.add_argument("--tol", type=_positive_float, default=None,
                     help="default: 1e-4 (fp32, on the max relative logit diff), 2e-2 (bf16, on the mean relative "
                          "logit diff with HF's choices replayed)")
    rp = sub.add_parser("rollout-parity", help="our log-probs vs a rollout engine's, replay off and on (one JSON line)",
                        description="Batch file format and metrics: see bridge/rollout_parity.py (README: RL).")
    rp.add_argument("--hf-path", required=True)
    rp.add_argument("--batch", required=True, help="rollout batch (.json or .safetensors)")
    rp.add_argument("--backend", choices=["megatron", "tilelang"], default="megatron")
    rp.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    rp.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    rp.add_argument("--plot", help="write |d logprob| along the tokens and the per-layer top-k overlap (.svg; other "
                                   "formats need matplotlib)")
    rp.add_argument("--max-kl", type=_positive_float, default=None,
                    help="exit 1 when the KL (replay on if the batch has replay data, else off) exceeds this")
    _lora_parser(sub)
    _verbose_everywhere(parser)
    return parser


def _verbose_everywhere(parser: argparse.ArgumentParser) -> None:
    """``--verbose`` before or after the subcommand (``megatron-glm5 convert import ... --verbose``): every leaf
    parser takes it too, without a default of its own, so the top-level value survives when it is not repeated."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                    _verbose_everywhere(sub)
                else:
                    sub.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                                     help="keep third-party warnings and load reports")


def _progress(args) -> bool | None:
    return False if getattr(args, "no_progress", False) else None


def _starting(args) -> None:
    """On a terminal, say at once that a conversion has started: importing torch and megatron-core takes seconds
    before the progress bar (:mod:`bridge.progress`) can appear, and the bar then overwrites this line."""
    if hasattr(args, "no_progress") and not args.no_progress and sys.stderr.isatty():
        sys.stderr.write(f"{_subcommand(args)}: starting\r")
        sys.stderr.flush()


# --------------------------------------------------------------------------------------------------------------------
# Checks before anything heavy
# --------------------------------------------------------------------------------------------------------------------


def _hf_arch(path: str, flag: str = "--hf-path", *, weights: bool = True):
    """The raw config.json and its architecture; ``weights``: ``path`` must be a whole HF checkpoint directory."""
    from . import preflight

    if weights:
        preflight.hf_checkpoint_dir(path, flag=flag)
    raw = preflight.read_hf_config(path, flag=flag)
    return raw, preflight.parse_config(raw, path, flag=flag)


def _preflight(args) -> None:
    """Every check that needs no model: paths exist and have the right kind, outputs can be created, config.json
    parses, the parallel layout fits the architecture, verify's sizes fit the config."""
    from . import preflight
    from .launch import check_parallel_layout

    if args.command == "demo":
        if args.out is not None:
            preflight.work_dir(args.out, flag="--out")
            preflight.demo_outputs(args.out)
        return
    if args.command == "clean":
        return  # it only lists and removes our own leftovers; bridge.output names anything unusable
    if args.command == "lora":
        if args.action == "export":
            preflight.megatron_checkpoint_dir(args.megatron_path, flag="--megatron-path")
            if args.hf_config is not None:
                _hf_arch(args.hf_config, flag="--hf-config", weights=False)
        elif args.action == "merge":
            _hf_arch(args.hf_path)
            preflight.adapter_dir(args.adapter_path, megatron_ok=True)
        else:
            preflight.adapter_dir(args.adapter_path)
            _hf_arch(args.hf_config, flag="--hf-config", weights=False)
        output = getattr(args, _OUTPUT_FLAG[_subcommand(args)])
        preflight.output_dir(output, flag="--" + _OUTPUT_FLAG[_subcommand(args)].replace("_", "-"))
        return
    if args.command == "rollout-parity":
        from .rollout_parity import check_batch_path, check_plot_path

        _hf_arch(args.hf_path)
        check_batch_path(args.batch)
        if args.plot is not None:
            check_plot_path(args.plot)
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise BridgeError("--device cuda: CUDA is not available on this machine; use --device cpu")
        return
    if args.command == "verify":
        raw, arch = _hf_arch(args.hf_path)
        if raw.get("quantization_config"):
            raise BridgeError(f"--hf-path {args.hf_path}: verify needs an unquantised HF checkpoint (this one is FP8); "
                              "export one with `megatron-glm5 convert import` + `convert export` first")
        if args.megatron_path is not None:
            preflight.megatron_checkpoint_dir(args.megatron_path)
        if args.num_layers is not None:
            from .source import check_num_layers

            check_num_layers(args.num_layers, arch, source=f"{args.hf_path}/config.json")
        if args.seq_len is not None and args.seq_len <= arch.index_topk:
            from .parity import default_seq_len

            raise BridgeError(f"--seq-len {args.seq_len} must exceed index_topk ({arch.index_topk}); otherwise DSA "
                              f"keeps every key and the indexer is not exercised (default: {default_seq_len(arch)})")
        if args.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise BridgeError("--device cuda: CUDA is not available on this machine; use --device cpu")
        return
    if args.action in ("import", "roundtrip"):
        from .tables import megatron_layout_for

        _, arch = _hf_arch(args.hf_path)
        check_parallel_layout(arch, args.tp, args.pp, args.ep, source=f"{args.hf_path}/config.json")
        megatron_layout_for(arch, args.megatron_layout, source=f"{args.hf_path}/config.json")
        if args.action == "import":
            preflight.output_dir(args.megatron_path, flag="--megatron-path")
        elif args.work_dir is not None:
            preflight.work_dir(args.work_dir, flag="--work-dir")
        return
    if args.action == "export":
        preflight.megatron_checkpoint_dir(args.megatron_path)
        if args.hf_config is not None:
            _hf_arch(args.hf_config, flag="--hf-config", weights=False)
        preflight.output_dir(args.hf_path, flag="--hf-path")


_PATH_FLAGS = ("hf_path", "megatron_path", "hf_config", "work_dir", "out", "batch", "plot")
_OUTPUT_FLAG = {"convert import": "megatron_path", "convert export": "hf_path", "convert roundtrip": "work_dir",
                "demo": "out", "lora export": "adapter_path", "lora import": "megatron_path", "lora merge": "out",
                "rollout-parity": "plot"}


def _subcommand(args) -> str:
    action = getattr(args, "action", None)
    return f"{args.command} {action}" if action else args.command
_ENVIRONMENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR,
                       errno.EISDIR, errno.ENOENT, errno.EEXIST}


def _belongs_to(f: Path, p: Path) -> bool:
    """``f`` is ``p``, inside it, or inside a hidden sibling ``.<name>.*`` in which outputs are staged."""
    if f == p or p in f.parents:
        return True
    return p.parent in f.parents and f.relative_to(p.parent).parts[0].startswith(f".{p.name}.")


def _os_error_line(e: OSError, args) -> str | None:
    """One line for an ``OSError`` about a path the user gave (or the staging directory of an output), such as an
    output location that is read-only or a full disk; None for anything else, which is a bug and keeps its
    traceback. The up-front checks catch the common cases; this covers what changes while the command runs."""
    if e.errno not in _ENVIRONMENT_ERRNOS:
        return None
    given = {f"--{name.replace('_', '-')}": Path(v).absolute() for name in _PATH_FLAGS
             if isinstance(v := getattr(args, name, None), str)}
    if e.filename is not None:
        f = Path(os.fsdecode(e.filename)).absolute()
        owner = next((f"{flag} {p}" for flag, p in given.items() if _belongs_to(f, p)), None)
        return None if owner is None else f"{owner}: {f}: {e.strerror or e}"
    if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):  # no file named: only a full or read-only disk
        return None
    out = _OUTPUT_FLAG.get(_subcommand(args))
    value = getattr(args, out, None) if out else None
    return (f"--{out.replace('_', '-')} {value}: " if value else "") + f"{e.strerror or e}"


def _run(args) -> int:
    import bridge

    if args.command == "demo":
        from .demo import run_demo

        return 0 if run_demo(out_dir=args.out, steps=args.steps, keep=args.keep, model_name=args.model)["ok"] else 1
    if args.command == "clean":
        return _clean(args.paths, dry_run=args.dry_run)
    if args.command == "lora":
        return _run_lora(args)
    if args.command == "verify":
        report = bridge.verify(hf_path=args.hf_path, megatron_path=args.megatron_path, seq_len=args.seq_len,
                               batch_size=args.batch_size, seed=args.seed, tol=args.tol, num_layers=args.num_layers,
                               dtype=args.dtype, device=args.device)
        print(json.dumps(report), flush=True)
        if report["ok"]:
            return 0
        metric = report.get("tol_metric", "max_rel_logit_diff")
        return _failed(f"verify: {metric} {report.get(metric, float('nan')):.3g} > tol {report.get('tol', 0):.3g} "
                       f"(first divergent layer: {report.get('first_divergent_layer')}); the JSON report on stdout "
                       "has the details")
    if args.command == "rollout-parity":
        from .rollout_parity import rollout_parity

        report = rollout_parity(hf_path=args.hf_path, batch=args.batch, backend=args.backend, dtype=args.dtype,
                                device=args.device, plot=args.plot)
        print(json.dumps(report), flush=True)
        side = "replay_on" if "replay_on" in report else "replay_off"
        kl = report[side]["kl"]
        if args.max_kl is None or kl <= args.max_kl:
            return 0
        return _failed(f"rollout-parity: KL ({side.replace('_', ' ')}) {kl:.4g} exceeds --max-kl {args.max_kl:.4g} "
                       f"by {kl - args.max_kl:.4g} ({kl / args.max_kl:.3g}x the limit)")
    if args.action == "import":
        r = bridge.convert_hf_to_megatron(hf_path=args.hf_path, megatron_path=args.megatron_path, tp=args.tp,
                                          pp=args.pp, ep=args.ep, dtype=args.dtype, iteration=args.iteration,
                                          overwrite=args.overwrite, progress=_progress(args),
                                          megatron_layout=args.megatron_layout)
        print(f"imported {r['hf_tensors']} HF tensors as {r['tensors']} megatron tensors ({r['bytes'] / 1e9:.3f} GB, "
              f"{r['expert_layout']} experts, {r['megatron_layout']} Megatron layout"
              f"{', ' + str(r['fp8_dequantized']) + ' FP8 weights dequantised' if r['fp8_dequantized'] else ''}) "
              f"into {r['path']} in {r['seconds']:.1f} s ({r['gb_per_s']:.2f} GB/s)")
        return 0
    if args.action == "export":
        r = bridge.convert_megatron_to_hf(megatron_path=args.megatron_path, hf_path=args.hf_path,
                                          hf_config=args.hf_config, expert_layout=args.expert_layout,
                                          dtype=args.dtype, max_shard_bytes=args.max_shard_size,
                                          overwrite=args.overwrite, progress=_progress(args))
        print(f"exported {r['tensors']} HF tensors ({r['bytes'] / 1e9:.3f} GB, {r['expert_layout']} experts; read as "
              f"the {r['megatron_layout']} Megatron layout, {r['megatron_experts']} expert keys) to {r['path']} in "
              f"{r['seconds']:.1f} s ({r['gb_per_s']:.2f} GB/s)")
        return 0
    if args.action == "roundtrip":
        r = bridge.roundtrip(hf_path=args.hf_path, work_dir=args.work_dir, tp=args.tp, pp=args.pp, ep=args.ep,
                             keep=args.keep, progress=_progress(args), megatron_layout=args.megatron_layout)
        status = "BITWISE IDENTICAL" if r["ok"] else "MISMATCH"
        print(f"round trip HF -> Megatron (TP={r['tp']} PP={r['pp']} EP={r['ep']}) -> HF: {status}")
        print(f"  tensors compared : {r['tensors']}  (bitwise equal: {r['bitwise_equal']}"
              f"{', FP8 compared with their dequantisation: ' + str(r['fp8_dequantized']) if r['fp8_dequantized'] else ''})")
        print(f"  import / export  : {r['import_seconds']:.1f} s / {r['export_seconds']:.1f} s, {r['bytes'] / 1e9:.3f} GB")
        print(f"  megatron layout  : {r['megatron_layout']}")
        for name, reason in sorted(r["ignored"].items()):
            print(f"  ignored          : {name} ({reason})")
        for m in r["mismatches"][:20]:
            print(f"  MISMATCH         : {m}")
        if r["work_dir"]:
            print(f"  kept             : {r['work_dir']}")
        return 0 if r["ok"] else _failed(f"round trip: {len(r['mismatches'])} mismatch(es), first: "
                                         f"{r['mismatches'][0]}")
    raise AssertionError(args)


def _clean(paths: Sequence[str], *, dry_run: bool) -> int:
    """Remove the stale ``.<name>.partial-*`` / ``.export-*`` / ``.old-*`` directories of each output path (their
    writers ran on this host and have exited); list the others with the reason they are kept."""
    from .output import find_partials, format_bytes, remove_stale_partials

    verb = "would remove" if dry_run else "removed"
    for path in paths:
        items = find_partials(path)
        removed = {r.path for r in remove_stale_partials(path, dry_run=dry_run)}
        for item in items:
            if item.path in removed:
                print(f"{verb} {item.path} ({format_bytes(item.nbytes)}; {item.reason})")
            else:
                print(f"kept {item.path} ({format_bytes(item.nbytes)}; {item.reason})")
        if not items:
            print(f"{path}: no leftovers of interrupted runs")
    return 0


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


def _error(message: str, code: int = 2) -> int:
    if "bridge.progress" in sys.modules:
        sys.modules["bridge.progress"].end_bars()  # a progress bar on screen ends its line first
    if sys.stderr.isatty():
        sys.stderr.write("\r\x1b[K")  # over a "starting" status line
    print("error: " + " ".join(str(message).split()), file=sys.stderr, flush=True)  # one line, whatever the message
    return code


def _failed(message: str) -> int:
    """A check that ran and failed: one ``failed:`` line on stderr (the report is on stdout), exit status 1."""
    print("failed: " + " ".join(str(message).split()), file=sys.stderr, flush=True)
    return 1


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread like ``KeyboardInterrupt`` so that every cleanup runs."""


def _raise_terminated(signum, frame):
    raise _Terminated()


def _output_of(args) -> str | None:
    flag = _OUTPUT_FLAG.get(_subcommand(args))
    value = getattr(args, flag, None) if flag else None
    return value if isinstance(value, str) else None


def _snapshot(path: str | None):
    """Enough of an output path's state to tell whether a run changed it: markers and entries one level down."""
    from .output import read_marker

    if path is None:
        return None
    p = Path(path)
    try:
        if not (p.exists() or p.is_symlink()):
            return "absent"
        if not p.is_dir():
            st = p.stat()
            return st.st_size, st.st_mtime_ns
        return read_marker(p), sorted((e.name, read_marker(e.path) if e.is_dir() else e.stat().st_mtime_ns)
                                      for e in os.scandir(p))
    except OSError:
        return None


def _interrupted(args, before, code: int) -> int:
    """One line for Ctrl-C (130) and SIGTERM (143). The staged outputs were removed on the way out; whether the
    output path itself changed is checked, not assumed (the signal may come after an output was committed)."""
    out = _output_of(args)
    if out is None:
        return _error("interrupted; nothing was written", code)
    if before is not None and _snapshot(out) == before:
        return _error(f"interrupted; nothing was written at {out}", code)
    return _error(f"interrupted after writing to {out}: it holds only complete outputs (staged ones were removed)",
                  code)


def main(argv: Sequence[str] | None = None) -> int:
    args, before, previous = None, None, None
    try:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread: SIGTERM keeps its handler
        pass
    try:
        try:
            args = build_parser().parse_args(argv)
        except _UsageError as e:
            return _error(str(e))
        before = _snapshot(_output_of(args))
        return _main(args)
    except KeyboardInterrupt:
        return _interrupted(args, before, 128 + signal.SIGINT) if args is not None else 128 + signal.SIGINT
    except _Terminated:
        return _interrupted(args, before, 128 + signal.SIGTERM) if args is not None else 128 + signal.SIGTERM
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main(args) -> int:
    _starting(args)
    if getattr(args, "device", None) == "cpu":
        # megatron-core puts some buffers on the current CUDA device whenever one is visible: hide the GPUs before
        # anything initialises CUDA (bridge.parity.resolve_device refuses cpu while they are visible).
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from megatron_glm5.config import GLM5ConfigError

    try:
        _preflight(args)
        if not getattr(args, "verbose", False):
            _quiet()
        from megatron_glm5.cpu import enable_cpu_mode

        enable_cpu_mode()
        return _run(args)
    except (BridgeError, GLM5ConfigError) as e:
        return _error(str(e))
    except OSError as e:
        line = _os_error_line(e, args)
        if line is None:
            raise
        return _error(line)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
