"""Small kernel cases for compute-sanitizer (GPU machine): ragged tails, empty sequences, windows, GQA.

    compute-sanitizer --tool memcheck python3 tools/sanitize.py [--family sm90,fwd,decode]
    compute-sanitizer --tool racecheck python3 tools/sanitize.py --family sm90

Families:
  sm90    the Hopper forward and backward kernels (default options at d64 / d128 on CC 9.0): dense and varlen,
          lengths off the tiles, seqlen_q != seqlen_k (fully masked causal rows), GQA, bf16 / fp16
  fwd     the mma.sync forward: every other head dim, causal, window + softcap + dropout, empty varlen rows
  decode  the split-KV decode kernel and its combine (ragged and left-padded caches, empty rows, GQA packing
          over several row tiles, splits auto / 1 / 3), and the forward kernel's left-padded path
"""
import argparse

import torch

from hf_flash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache


def cu_seqlens(lens):
    return torch.nn.functional.pad(torch.tensor(lens, device="cuda").cumsum(0), (1, 0)).int()


def sm90():
    for d, dtype, causal, (sq, sk), (h, hk) in [(64, torch.bfloat16, False, (77, 150), (4, 2)),
                                                (128, torch.float16, True, (150, 77), (4, 1)),
                                                (128, torch.bfloat16, True, (200, 200), (2, 2))]:
        q = torch.randn(2, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(2, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        flash_attn_func(q, k, v, causal=causal).backward(torch.randn(2, sq, h, d, device="cuda", dtype=dtype))
    lens = [0, 5, 0, 130, 64]
    cu = cu_seqlens(lens)
    for d in (64, 128):
        q, k, v = (torch.randn(sum(lens), 4, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
        out.backward(torch.randn_like(out))


def fwd():
    for d in (32, 96, 128, 256):
        for dtype in (torch.bfloat16, torch.float16):
            q, k, v = (torch.randn(2, s, 3, d, device="cuda", dtype=dtype) for s in (77, 130, 130))
            flash_attn_func(q, k, v, causal=True)
            flash_attn_func(q, k, v, window_size=(20, 3), softcap=10.0, dropout_p=0.2)
    lens = [0, 5, 129, 1]
    cu = cu_seqlens(lens)
    q = torch.randn(sum(lens), 4, 64, device="cuda", dtype=torch.bfloat16)
    flash_attn_varlen_func(q, q[:, :2], q[:, :2], cu, cu, max(lens), max(lens), causal=True)


def decode():
    for d in (64, 128, 256):
        for sq, h, h_k in ((1, 8, 2), (5, 8, 1), (16, 4, 4), (17, 4, 2)):
            k, v = (torch.randn(3, h_k, 300, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                    for _ in range(2))
            q = torch.randn(3, sq, h, d, device="cuda", dtype=torch.bfloat16)
            ends = torch.tensor([300, 1, 77], dtype=torch.int32, device="cuda")
            leftpad = torch.tensor([3, 1, 0], dtype=torch.int32, device="cuda")
            for splits in (0, 1, 3):
                flash_attn_with_kvcache(q, k, v, cache_seqlens=ends, cache_leftpad=leftpad, causal=True,
                                        num_splits=splits)
            flash_attn_with_kvcache(q, k, v, cache_seqlens=ends, window_size=(20, 0), softcap=10.0)


FAMILIES = {"sm90": sm90, "fwd": fwd, "decode": decode}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default=",".join(FAMILIES), help="comma-separated subset of " + ", ".join(FAMILIES))
    names = parser.parse_args().family.split(",")
    unknown = sorted(set(names) - set(FAMILIES))
    if unknown:
        parser.error(f"--family: unknown {unknown}; choose from {list(FAMILIES)}")
    torch.manual_seed(0)
    for name in names:
        FAMILIES[name]()
    torch.cuda.synchronize()
    print(f"sanitize: {','.join(names)} done")
