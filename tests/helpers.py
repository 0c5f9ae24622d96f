"""Helpers shared by the test modules: the test data path and the GPU kernel checks."""
import math
from pathlib import Path

import torch

from hf_flash import flash_attn_func, ops, reference
from hf_flash.reference import naive_attention

ROOT = Path(__file__).resolve().parent.parent
# The one text file the training, example and pretrained-model tests read; ignored by git (copy
# tinyshakespeare.txt there, e.g. `mkdir -p .data && cp ../shared/data/tinyshakespeare.txt .data/`).
SHAKESPEARE = ROOT / ".data" / "tinyshakespeare.txt"


def poison_allocator():
    """Fill freed blocks of the caching allocator with NaN, so outputs the kernel
    leaves unwritten show up as NaN."""
    for numel in (1 << 24, 1 << 20, 1 << 16, 1 << 12):
        torch.full((numel,), math.nan, device="cuda")
    torch.cuda.synchronize()


def randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def assert_close(out, ref, pt, what="out"):
    assert not out.isnan().any(), f"{what}: NaN in the kernel output"
    err = (out.float() - ref.float()).abs().max().item()
    bound = 2 * (pt.float() - ref.float()).abs().max().item() + 1e-5
    assert err <= bound, f"{what}: max error {err:.3e} > bound {bound:.3e}"


def assert_lse(lse, lse_ref):
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isposinf(lse), torch.isposinf(lse_ref)), "LSE: +inf rows differ"
    assert not lse.isnan().any(), "LSE: NaN"
    torch.testing.assert_close(lse[finite], lse_ref[finite].float(), atol=2e-3, rtol=1e-3)


def check_dense(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None, scale=None):
    assert ops.backend_for(q)[0] == "cuda"
    poison_allocator()
    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
                                  alibi_slopes=alibi, return_attn_probs=True)
    kw = dict(softmax_scale=scale, causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi)
    ref = naive_attention(q.float(), k.float(), v.float(), **kw)
    pt = naive_attention(q, k, v, **kw)
    assert_close(out, ref, pt)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    _, lse_ref = reference.fwd(q.float(), k.float(), v.float(), None, None, q.shape[1], k.shape[1], scale,
                               causal, window[0], window[1], softcap, alibi, 0.0, None)
    assert_lse(lse, lse_ref)
    return out, lse


def cu_seqlens(lengths):
    return torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)


def capture_graph(step):
    """(graph, step's outputs in the graph's memory): step runs once on a side stream (warm-up, outside the
    capture), then is captured; graph.replay() reruns it on whatever its input tensors then hold."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
