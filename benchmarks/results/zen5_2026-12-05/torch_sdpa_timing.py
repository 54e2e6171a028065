"""torch's CPU flash attention (SDPA) in bf16 and float32 for the embedded model's heads: a causal
512-token chunk and one after 1,536 cached tokens (the two calls cpu-paged made without AMX).

    .venv/bin/python benchmarks/results/zen5_2026-12-05/torch_sdpa_timing.py
"""
import torch, time, torch.nn.functional as F
def bench(f, n=5):
    f(); ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return min(ts)*1e3
for dt in (torch.bfloat16, torch.float32):
    for n, P in ((512,0),(512,1536)):
        q=torch.randn(1,9,n,64,dtype=dt); k=torch.randn(1,3,n,64,dtype=dt); v=torch.randn(1,3,n,64,dtype=dt)
        t1=bench(lambda: F.scaled_dot_product_attention(q,k,v,is_causal=True,enable_gqa=True))
        if P:
            qq=q.reshape(1,3,3*n,64); pk=torch.randn(1,3,P,64,dtype=dt); pv=torch.randn(1,3,P,64,dtype=dt)
            t2=bench(lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qq,pk,pv,0.0,False))
        else: t2=0
        print(dt, n, P, f"causal {t1:.2f} ms, past {t2:.2f} ms, x30 layers {30*(t1+t2):.0f} ms")
