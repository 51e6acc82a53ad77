"""One line per bench_decode --json record on CUDA (the GPU scripts' summaries): the kernels' own time and
bandwidth beside fp16 SDPA's, and dequantize + SDPA's wall time; a "variant" field (gpu_decode_probe.sh)
leads the line.
    python scripts/gpu_bench_summary.py bench_decode.jsonl
"""

import json
import sys

with open(sys.argv[1]) as f:
    records = [json.loads(line) for line in f]
for r in records:
    lead = f"{r['variant']:>12} " if "variant" in r else ""
    print(f"  {lead}{r['q_heads']}q/{r['kv_heads']}kv/d{r['head_dim']} {r['keys']} {r['bits']}b "
          f"ctx {r['context']}: wall {r['ms']:.3f} ms, gpu {r['gpu_ms']:.4f} ms ({r['gpu_gbps']:.0f} GB/s), "
          f"fp16 SDPA gpu {r['sdpa_half_gpu_ms']:.4f} ms, dequantize+SDPA wall {r['deq_sdpa_ms']:.3f} ms")
