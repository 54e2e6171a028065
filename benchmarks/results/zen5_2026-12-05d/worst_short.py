"""The worst short requests of a compare run's interference workload, with the long prompts
sent near them and their inter-token gaps.

    python3 benchmarks/results/zen5_2026-12-05d/worst_short.py /tmp/cmpP2 sloserve vllm
"""
import json, sys
d = sys.argv[1]
for srv in sys.argv[2:] or ['sloserve']:
    s=json.load(open(f'{d}/{srv}-interference-short.json'))
    l=json.load(open(f'{d}/{srv}-interference-long.json'))
    tp=sorted([((lat-tt)/(ol-1)*1000, i) for i,(lat,tt,ol) in enumerate(zip(s['latencies'],s['ttfts'],s['output_lens']))],reverse=True)
    print(srv, 'p99 tpot', round(s['p99_tpot_ms'],1), 'p50', round(s['p50_tpot_ms'],1), 'p99 itl', round(s['p99_itl_ms'],1), 'top', [round(t,1) for t,_ in tp[:5]])
    print('  long ttfts', [round(x*1000) for x in l['ttfts']])
    for t,i in tp[:3]:
        st=s['start_times'][i]
        off=[(round(x-st,2), round(l['ttfts'][j]*1000)) for j,x in enumerate(l['start_times']) if -1.5<x-st<1.5]
        print(f'  short {i} tpot {t:.1f} ttft {s["ttfts"][i]*1000:.0f} longs(offset s, ttft ms) {off} itls', [round(x*1000) for x in s['itls'][i]])
