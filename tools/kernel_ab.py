"""Timings of the build on PYTHONPATH next to SDPA cuDNN (GQA through enable_gqa, as transformers calls it),
backward (default) or forward, in one process; prints CSV lines TAG,case,backend,ms,tflops (tools/kernel_ab.sh
compares builds; PASS=fwd there times the forward). AB_DET=1 also times the backward with deterministic=True
(backend "det"); AB_CASES picks cases by name. AB_SUSTAIN=SECONDS times each call back to back for that long, the
first half untimed, as `bench kernels --sustain` does (timing.SustainedTimer): at the clock the board's power
limit leaves, as in training, instead of a burst at up to the boost clock.

    python tools/kernel_ab.py TAG [bwd|fwd]
"""
import os
import sys

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from hf_flash import ops
from hf_flash.bench.kernels import MAX_CALLS, REL_BIAS_RADIUS, TARGET_MS, VARLEN_DOCS, doc_offsets
from hf_flash.bench.timing import SustainedTimer

loaded, detail = ops.extension_status()  # builds or loads the kernels (import alone does neither)
if not loaded:
    sys.exit(f"kernel_ab: {detail}")

# (name, batch, seqlen, heads, kv heads, head dim, causal): the e2e benchmark's Llama layer, the paper grid, S = 512
# (issue 16's short-sequence cells), then T5's shapes with and without its relative position bias ("bias": a
# float32 (H, 2R + 1) table, R = REL_BIAS_RADIUS as in the kernel benchmark's rel_bias rows), then grids of few
# tiles: the e2e benchmark's small model and single-prompt Llama prefills; d256 (Gemma 2 / 3) last. "packed": the
# kernel benchmark's packed batch (its documents' lengths, GQA 32/8, d128, causal), whose cuDNN column (SDPA has no
# packed form) is its longest document alone, a clock reference for ÷cuDNN.
CASES = [("llama 2x4096", 2, 4096, 16, 8, 128, True), ("llama 1x16384", 1, 16384, 16, 8, 128, True),
         ("llama 8x1024", 8, 1024, 16, 8, 128, True), ("packed 8 docs", 1, max(VARLEN_DOCS), 32, 8, 128, True),
         ("packed 8 docs d64", 1, max(VARLEN_DOCS), 32, 8, 64, True),
         ("d128 causal 1k", 16, 1024, 16, 16, 128, True), ("d128 full 1k", 16, 1024, 16, 16, 128, False),
         ("d128 causal 2k", 8, 2048, 16, 16, 128, True), ("d128 causal 16k", 1, 16384, 16, 16, 128, True),
         ("d128 full 2k", 8, 2048, 16, 16, 128, False), ("d128 full 16k", 1, 16384, 16, 16, 128, False),
         ("d64 causal 1k", 16, 1024, 32, 32, 64, True), ("d64 full 1k", 16, 1024, 32, 32, 64, False),
         ("d64 full 2k", 8, 2048, 32, 32, 64, False),
         ("d64 causal 2k", 8, 2048, 32, 32, 64, True), ("d64 causal 16k", 1, 16384, 32, 32, 64, True),
         ("d64 full 16k", 1, 16384, 32, 32, 64, False),
         *((f"d{d} {mask} {s // 1024}k", 16384 // s, s, 2048 // d, 2048 // d, d, mask == "causal")
           for d in (128, 64) for s in (4096, 8192) for mask in ("causal", "full")),
         ("d128 causal 512", 32, 512, 16, 16, 128, True), ("d128 full 512", 32, 512, 16, 16, 128, False),
         ("d64 causal 512", 32, 512, 32, 32, 64, True), ("d64 full 512", 32, 512, 32, 32, 64, False),
         ("t5 enc 32x512", 32, 512, 12, 12, 64, False), ("t5 enc 32x512 bias", 32, 512, 12, 12, 64, False),
         ("t5 dec 32x512", 32, 512, 12, 12, 64, True), ("t5 dec 32x512 bias", 32, 512, 12, 12, 64, True),
         ("t5 enc 4x4096", 4, 4096, 12, 12, 64, False), ("t5 enc 4x4096 bias", 4, 4096, 12, 12, 64, False),
         ("d128 dec 2x4096", 2, 4096, 32, 32, 128, True), ("d128 dec 2x4096 bias", 2, 4096, 32, 32, 128, True),
         ("smol 8x1024", 8, 1024, 9, 3, 64, True), ("smol 16x512", 16, 512, 9, 3, 64, True),
         ("llama 1x1024", 1, 1024, 32, 8, 128, True), ("llama 1x2048", 1, 2048, 32, 8, 128, True),
         ("llama 2x2048", 2, 2048, 32, 8, 128, True),
         ("d256 full 4k", 4, 4096, 8, 8, 256, False), ("d256 causal 4k", 4, 4096, 8, 8, 256, True),
         ("d256 causal 16k", 1, 16384, 8, 8, 256, True), ("d256 gemma2-9b 4x2k", 4, 2048, 16, 8, 256, True)]

tag, mode = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "bwd"
# AB_CASES="d64,llama 8x1024": only the cases whose name contains one of these (a short call for a narrow change).
if os.environ.get("AB_CASES"):
    CASES = [c for c in CASES if any(x.strip() in c[0] for x in os.environ["AB_CASES"].split(","))]


SUSTAIN = float(os.environ.get("AB_SUSTAIN") or 0)
sustained = SustainedTimer(SUSTAIN) if SUSTAIN else None


def time_ms(fn, inputs):
    """GPU ms per call: the median of triton's burst timing, or sustained (AB_SUSTAIN)."""
    if sustained is None:
        return triton.testing.do_bench(fn, warmup=100, rep=300, grad_to_none=inputs, return_mode="median")
    calls, host_guess = sustained.warm_up(fn, TARGET_MS, MAX_CALLS)
    return sustained(fn, calls, host_guess)[0]


def case(b, s, h, hk, d, causal, bias, docs=()):
    """({backend: callable}, the inputs whose grads do_bench resets) for one case of the chosen pass; `docs`: hf_flash
    runs these packed documents (cuDNN the dense b x s)."""
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    table = torch.randn(h, 2 * REL_BIAS_RADIUS + 1, device="cuda", requires_grad=True) if bias else None
    opts = (d**-0.5, causal, -1, 0 if causal else -1, 0.0, None, 0.0, None)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    hq, hk_, hv, cu, sh = q, k, v, None, s  # hf_flash's inputs (packed: its own tensors, cuDNN keeps q, k, v)
    if docs:
        cu = doc_offsets(docs)
        hq, hk_, hv = (torch.randn(sum(docs), x.shape[2], d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for x in (q, k, v))
        sh = max(docs)
    inputs = [q, k, v] + ([hq, hk_, hv] if docs else [])
    if mode == "fwd":
        def cudnn():
            with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=h != hk)

        return {"hf_flash": lambda: torch.ops.hf_flash.fwd(hq, hk_, hv, cu, cu, sh, sh, *opts, False, None, table),
                "cudnn": cudnn}, inputs
    dout = torch.randn_like(hq)
    out, lse = torch.ops.hf_flash.fwd(hq, hk_, hv, cu, cu, sh, sh, *opts, False, None, table)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=h != hk)

    def bwd(det):
        return lambda: torch.ops.hf_flash.bwd(dout, hq, hk_, hv, out, lse, cu, cu, sh, sh, *opts, det, None, table)

    # autograd.grad: new gradients each call, none accumulated into .grad (an extra pass do_bench resets away)
    do_t = torch.randn_like(o)
    fns = {"hf_flash": bwd(False),
           "cudnn": lambda: torch.autograd.grad(o, (q, k, v), do_t, retain_graph=True)}
    if os.environ.get("AB_DET") == "1":
        fns["det"] = bwd(True)
    return fns, inputs


for name, b, s, h, hk, d, causal in CASES:
    docs = VARLEN_DOCS if name.startswith("packed") else ()
    flops = (2.5 if mode == "bwd" else 1.0) * 4 * sum(n * n for n in docs or [s] * b) * h * d / (2 if causal else 1)
    fns, inputs = case(b, s, h, hk, d, causal, name.endswith(" bias"), docs)
    for backend, fn in fns.items():
        ms = time_ms(fn, inputs)
        print(f"{tag},{name},{backend},{ms:.4f},{flops / ms * 1e-9:.1f}", flush=True)
    del fns, inputs  # the case's tensors
    torch.cuda.empty_cache()
