"""How fast can the sparse-MLA backward's dKV scatter be? fp32 reductions into ``dKV[T_kv, 576]`` at random rows, in
the MMA accumulator's layout, timed per instruction width (issue #22, backward).

The backward adds, per (query, slot), a 576-wide fp32 row into ``dKV[idx]`` straight from the MMA fragments (float2
reductions: each lane holds two adjacent columns of row ``g`` and of row ``g + 8``). The 16-head kernel is bound by
these reductions (ncu: L2 74 % busy). This microbenchmark replays exactly that address pattern from registers, with
no math, so the memory system's rate per instruction width is measured on its own:

* ``f32``: scalar ``red.global.add.f32`` (two per pair);
* ``v2``: ``red.global.add.v2.f32`` per pair (what the kernel does today);
* ``v4``: quad lanes ``2k`` / ``2k + 1`` exchange one pair with one ``shfl.xor 1`` per value: the even lane then holds
  4 consecutive columns of row ``g``, the odd one of row ``g + 8``; one ``red.global.add.v4.f32`` each (half the
  instructions, 16-byte requests);
* ``v4_noshfl``: the ``v4`` addresses without the exchange (its values are wrong; timing only: the shuffles' cost).

Values are multiples of 1/8 small enough that every order of summation is exact, so all correct modes must give
bitwise equal ``dKV`` (checked). Occupancy is set with a dummy shared buffer (the real kernel runs 1-2 CTAs per SM).

    python scripts/bench/bench_dkv_atomics.py [--tokens 4096] [--t-kv 16384] [--out results.md]

No ``from __future__ import annotations``: TileLang evaluates the prim_func's annotations.
"""

import argparse
import datetime
import functools
import subprocess

import torch
from report import emit

MODES = ("f32", "v2", "v4", "v4_noshfl")

SRC = r"""
__device__ __forceinline__ float glm5_bench_val(int r, int col, int blk) {
  return static_cast<float>((r * 5 + col * 3 + blk) & 7) * 0.125f;
}

// One pair of adjacent columns (col, col + 1) of rows r (key k0) and r + 8 (key k1), as one lane holds them.
template <int MODE>
__device__ __forceinline__ void glm5_bench_pair(float* dkv, int d_qk, int k0, int k1, int r, int col, int blk,
                                                int q) {
  float a0 = glm5_bench_val(r, col, blk), a1 = glm5_bench_val(r, col + 1, blk);
  float b0 = glm5_bench_val(r + 8, col, blk), b1 = glm5_bench_val(r + 8, col + 1, blk);
  if (MODE == 0) {
    atomicAdd(dkv + (long)k0 * d_qk + col, a0); atomicAdd(dkv + (long)k0 * d_qk + col + 1, a1);
    atomicAdd(dkv + (long)k1 * d_qk + col, b0); atomicAdd(dkv + (long)k1 * d_qk + col + 1, b1);
  } else if (MODE == 1) {
    atomicAdd(reinterpret_cast<float2*>(dkv + (long)k0 * d_qk + col), make_float2(a0, a1));
    atomicAdd(reinterpret_cast<float2*>(dkv + (long)k1 * d_qk + col), make_float2(b0, b1));
  } else {
    const bool even = (q & 1) == 0;
    float s0 = even ? b0 : a0, s1 = even ? b1 : a1;  // what the partner needs
    float r0 = s0, r1 = s1;
    if (MODE == 2) {
      r0 = __shfl_xor_sync(0xffffffffu, s0, 1);
      r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
    }
    // even lane q = 2j: row r, columns col .. col + 3 (its own pair, then the partner's);
    // odd lane q = 2j + 1: row r + 8, columns col - 2 .. col + 1 (the partner's pair, then its own)
    float4 v = even ? make_float4(a0, a1, r0, r1) : make_float4(r0, r1, b0, b1);
    float* p = even ? dkv + (long)k0 * d_qk + col : dkv + (long)k1 * d_qk + col - 2;
    atomicAdd(reinterpret_cast<float4*>(p), v);
  }
}

template <int MODE>
__device__ __forceinline__ void glm5_bench_scatter(const int* idx, float* dkv, float* smem, int topk, int d_qk) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  if (threadIdx.x == 0) smem[0] = 0.f;  // keeps the occupancy-limiting buffer
  for (int blk = 0; blk < topk / 32; ++blk) {
    int key[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) key[m] = idx[blk * 32 + m * 8 + g];
#pragma unroll
    for (int c = 0; c < 4; ++c) {          // four 128-column chunks: warp w owns 16 columns of each
#pragma unroll
      for (int h = 0; h < 2; ++h) {        // row pairs (g, g + 8) and (g + 16, g + 24)
#pragma unroll
        for (int s = 0; s < 2; ++s) {      // the warp's two 8-column MMA tiles
          int col = c * 128 + w * 16 + s * 8 + q * 2;
          glm5_bench_pair<MODE>(dkv, d_qk, key[2 * h], key[2 * h + 1], h * 16 + g, col, blk, q);
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {          // the 64-column RoPE tail: warp w owns 8 columns
      int col = 512 + w * 8 + q * 2;
      glm5_bench_pair<MODE>(dkv, d_qk, key[2 * h], key[2 * h + 1], h * 16 + g, col, blk, q);
    }
  }
}
"""


@functools.cache
def _jit():
    import tilelang
    import tilelang.language as T

    @tilelang.jit
    def red_bench(mode: int, smem_floats: int, d_qk: int = 576, threads: int = 256):
        n_tok = T.dynamic("n_tok")
        t_kv = T.dynamic("t_kv")
        topk = T.dynamic("topk")

        @T.prim_func
        def main(Idx: T.Tensor([n_tok, topk], T.int32), dKV: T.Tensor([t_kv, d_qk], T.float32)):
            with T.Kernel(n_tok, threads=threads) as bx:
                buf = T.alloc_shared([smem_floats], T.float32)
                T.import_source(SRC)
                T.call_extern("handle", f"glm5_bench_scatter<{mode}>", T.access_ptr(Idx[bx, 0], "r"),
                              T.access_ptr(dKV[0, 0], "rw"), T.access_ptr(buf[0], "rw"), topk, d_qk)

        return main

    return red_bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096, help="CTAs (queries), each adds topk rows")
    ap.add_argument("--t-kv", type=int, default=16384, help="dKV rows (16384 x 576 fp32 = 37.7 MB: fits in L2)")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--ctas-per-sm", default="1,2,0", help="dummy shared memory for 1 / 2 CTAs per SM; 0: none")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import triton.testing as tt

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    idx = torch.randint(0, args.t_kv, (args.tokens, args.topk), device=dev, dtype=torch.int32, generator=g)
    payload = args.tokens * args.topk * 576 * 4
    per_sm = {1: 200 * 1024 // 4, 2: 100 * 1024 // 4, 0: 32}
    rows = []
    ref = None
    for occ in (int(x) for x in args.ctas_per_sm.split(",")):
        for mode in MODES:
            k = _jit()(MODES.index(mode), per_sm[occ])
            dkv = torch.zeros(args.t_kv, 576, device=dev, dtype=torch.float32)
            k(idx, dkv)
            torch.cuda.synchronize()
            if mode == "v4_noshfl":
                same = "n/a (timing only)"
            elif ref is None:
                ref, same = dkv.clone(), "reference"
            else:
                same = str(bool(torch.equal(dkv, ref)))
            ms = tt.do_bench(lambda: k(idx, dkv), warmup=3, rep=30)
            rows.append((occ or "many", mode, ms, payload / ms / 1e6, same))
            print(rows[-1], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [f"## dKV scatter microbenchmark ({datetime.date.today()}, commit {commit or 'n/a'}, "
             f"{torch.cuda.get_device_name(0)})", "",
             f"{args.tokens} queries x top-{args.topk} random rows of dKV[{args.t_kv}, 576] fp32 "
             f"({payload / 1e9:.1f} GB of fp32 adds), 256 threads per CTA, the MMA fragment's address pattern.", "",
             "| CTAs per SM | mode | ms | GB/s added | dKV equal to f32's |", "|---|---|---|---|---|"]
    lines += [f"| {o} | {m} | {ms:.2f} | {bw:.0f} | {s} |" for o, m, ms, bw, s in rows]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
