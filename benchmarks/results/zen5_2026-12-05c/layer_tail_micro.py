"""The fused layer call (x16_layer_tail) against the separate kernels it replaces, hot, on layers
3 and 4 of the embedded model; asserts bit-identical output. Arg: row counts.

    .venv/bin/python benchmarks/results/zen5_2026-12-05c/layer_tail_micro.py 1,16,64,272,512
"""
import time, torch, sys
from sloserve.engine.llm import LLM
eng = LLM(max_num_batched_tokens=512).engine
fp = eng.runner.fast_path; k = fp.k; c = fp.config
L, N = fp.layers[3], fp.layers[4]
H, Hk, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
def bench(f, n):
    for _ in range(3): f()
    best = 1e9
    for r in range(7):
        t = time.perf_counter()
        for _ in range(n): f()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best
for T in [int(t) for t in sys.argv[1].split(",")]:
    o = torch.randn(T, H * D); h0 = torch.randn(T, c.hidden_size)
    cos, sin = k.rope_tables(torch.arange(T), fp.inv_freq)
    bufs = (torch.empty(T, c.hidden_size), torch.empty(T, c.hidden_size), torch.empty(T, c.intermediate_size))
    def sep():
        h = h0.clone()
        delta = k.qlinear_x16(o, L.o)
        a = k.add_rms_norm(h, delta, L.ln2, fp.eps)
        f = k.qlinear_x16_swiglu(a, L.gate_up[0])
        delta = k.qlinear_x16(f, L.down)
        a = k.add_rms_norm(h, delta, N.ln1, fp.eps)
        qkv = k.qlinear_x16(a, N.qkv[0])
        k.rope(qkv[:, :H*D].view(T, H, D), qkv[:, H*D:(H+Hk)*D].view(T, Hk, D), cos, sin)
        return qkv
    def fus():
        h = h0.clone()
        return k.x16_layer_tail(o, h, L.o, L.ln2, L.gate_up[0], L.down, fp.eps, bufs, (N.ln1, N.qkv[0], N.qkv_bias), (cos, sin, H, Hk, D))
    assert torch.equal(sep(), fus())
    n = max(3, 3000 // T)
    a = [bench(sep, n), bench(fus, n), bench(sep, n), bench(fus, n)]
    print(f"T={T}: separate {min(a[0], a[2]):.1f} us, fused {min(a[1], a[3]):.1f} us, ratio {min(a[1], a[3]) / min(a[0], a[2]):.3f}")
