"""Tiny KV-cache cases for compute-sanitizer (memcheck / racecheck): the split-KV decode kernel and its
combine (ragged lengths and left padding, empty rows, GQA packing over several row tiles, splits
auto / 1 / 3), and the forward kernel's left-padded path."""
import torch

from hf_flash import flash_attn_with_kvcache

for d in (64, 128, 256):
    for sq, h, h_k in ((1, 8, 2), (5, 8, 1), (16, 4, 4), (17, 4, 2)):
        k, v = (torch.randn(3, h_k, 300, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
        q = torch.randn(3, sq, h, d, device="cuda", dtype=torch.bfloat16)
        ends = torch.tensor([300, 1, 77], dtype=torch.int32, device="cuda")
        leftpad = torch.tensor([3, 1, 0], dtype=torch.int32, device="cuda")
        for splits in (0, 1, 3):
            flash_attn_with_kvcache(q, k, v, cache_seqlens=ends, cache_leftpad=leftpad, causal=True,
                                    num_splits=splits)
        flash_attn_with_kvcache(q, k, v, cache_seqlens=ends, window_size=(20, 0), softcap=10.0)
torch.cuda.synchronize()
print("sanitize cases ran")
