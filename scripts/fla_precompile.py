"""Fill Triton's autotune cache for flash-linear-attention's ``chunk_kda`` before tests, benchmarks or training.

fla autotunes every Triton kernel of ``chunk_kda`` once per autotune key (heads, head width, chunk sizes, varlen or
not, batch size for its cumsum kernels, the dtypes of all tensor arguments; not the sequence length, except through
the L2-norm kernels' block count), and each first call compiles every candidate config: about 30 s for the backward
alone at one key on an H200. fla asks Triton to keep the results on disk (``cache_results``, Triton's cache
directory, ``TRITON_CACHE_DIR``, default ``~/.triton/cache``), so once a key is tuned every later process on the
machine starts at once. This script tunes the keys the GPU checks and the Flash examples use, one process per key
set, in parallel (compiling is CPU work; the timing runs share the GPU, which can only make a chosen config less than
the best, never wrong).

    python3 scripts/fla_precompile.py                    # the GPU checks' keys (tests/gpu/test_glm5_next_gpu.py)
    python3 scripts/fla_precompile.py --keys bench       # scripts/bench/bench_kda.py's keys
    python3 scripts/fla_precompile.py --key bf16,bshd,2,8,128,1024   # one key: dtype,layout,batch,heads,dim,tokens

Exit status 0 when every key set ran its forward and backward; prints the seconds each took.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

# dtype, layout (bshd | varlen), batch, heads, head dim, tokens per row
KEY_SETS = {
    "tests": [  # tests/gpu/test_glm5_next_gpu.py and examples/pretrain_glm53_flash_tiny.sh (small_flash_config)
        "fp32,bshd,2,8,128,1024", "bf16,bshd,2,8,128,1024", "fp32,varlen,1,8,128,2048",
        "bf16,varlen,1,8,128,2048", "fp32,bshd,2,4,8,512",
    ],
    "bench": [  # scripts/bench/bench_kda.py: GLM-5.3-Flash's 64 KDA heads at TP=8 and on one GPU
        "bf16,bshd,1,8,128,4096", "bf16,bshd,1,8,128,16384", "bf16,bshd,1,8,128,65536",
        "bf16,bshd,1,64,128,4096", "bf16,bshd,1,64,128,16384",
    ],
    "step": [  # scripts/bench/bench_glm53_step.py: 16 KDA heads, micro-batch 1 x 8192 tokens
        "bf16,bshd,1,16,128,8192",
    ],
}


def run_one(spec: str) -> None:
    """Forward and backward of ``chunk_kda`` once on inputs of this key (inputs as the KDA layer passes them:
    q, k, v and beta in the run's dtype, the gate fp32)."""
    import faulthandler

    import torch
    from fla.ops.kda import chunk_kda

    every = float(os.environ.get("FLA_PRECOMPILE_TRACE_EVERY", "0"))  # diagnosis: where a slow key spends its time
    if every > 0:
        faulthandler.dump_traceback_later(every, repeat=True)
    dtype, layout, b, h, d, t = spec.split(",")
    b, h, d, t = int(b), int(h), int(d), int(t)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    cu = None
    if layout == "varlen":  # four documents, two of them shorter than a chunk
        cu = torch.tensor([0, t // 7, t // 7 + 1, t // 2, t], device="cuda", dtype=torch.int32)
    q, k, v = (torch.randn(b, t, h, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
    g = (-torch.rand(b, t, h, d, device="cuda")).requires_grad_()
    beta = torch.rand(b, t, h, device="cuda", dtype=dt, requires_grad=True)
    o, _ = chunk_kda(q, k, v, g, beta, scale=d**-0.5, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    o.float().square().mean().backward()
    torch.cuda.synchronize()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", default=None, help=f"comma-separated key-set names: {', '.join(KEY_SETS)} (default tests, "
                   "unless --key is given; both add up)")
    p.add_argument("--key", action="append", default=[], help="one key: dtype,layout,batch,heads,dim,tokens")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.keys is None and not args.key:
        args.keys = "tests"
    if args.one:
        run_one(args.one)
        return 0
    names = [n for n in (args.keys or "").split(",") if n]
    unknown = [n for n in names if n not in KEY_SETS]
    if unknown:
        p.error(f"--keys: unknown key sets {unknown} (known: {', '.join(KEY_SETS)})")
    specs = list(dict.fromkeys([s for n in names for s in KEY_SETS[n]] + list(args.key)))
    if not specs:
        p.error("nothing to tune: give --keys and / or --key")
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    def launch(spec: str) -> tuple[str, int, float, str]:
        t0 = time.time()
        print(f"fla precompile {spec}: started", flush=True)
        r = subprocess.run([sys.executable, __file__, "--one", spec], env=env, capture_output=True, text=True)
        return spec, r.returncode, time.time() - t0, (r.stdout + r.stderr)[-4000:]

    t0 = time.time()
    failed = 0
    with ThreadPoolExecutor(max(1, args.workers)) as pool:
        for fut in as_completed([pool.submit(launch, s) for s in specs]):
            spec, rc, secs, tail = fut.result()
            print(f"fla precompile {spec}: {'ok' if rc == 0 else f'FAILED rc={rc}'} in {secs:.1f} s", flush=True)
            if rc:
                failed += 1
                print(tail, flush=True)
    print(f"fla precompile: {len(specs) - failed}/{len(specs)} key sets in {time.time() - t0:.1f} s "
          f"(Triton cache: {os.environ.get('TRITON_CACHE_DIR', '~/.triton/cache')})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
