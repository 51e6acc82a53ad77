"""`python -m torch_rkv plan`'s command line: add_arguments, its options, and main, which reads them into a
PlanRequest, runs it and prints what it found."""

from __future__ import annotations

import argparse

from .report import print_plan
from .request import plan_request
from .run import run_plan
from .shape import MODELS

# the schemes a plan counts unless --schemes names others
DEFAULT_SCHEMES = ("per-token-8", "per-token-4", "quarot-4", "kvquant-3", "kivi-2", "rkv-4", "rkv-3", "rkv-mixed-2", "rkv-2")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """plan's options, on its subcommand's parser."""
    p.add_argument("--model", default="llama-3-70b", help=f"a preset ({', '.join(MODELS)}) or use --config")
    p.add_argument("--config", help="config.json of any transformers model")
    p.add_argument("--params", type=float, help="number of weights (with --config; default: counted by "
                   "transformers on the meta device, else estimated for a dense decoder)")
    p.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory in GB (1e9 bytes)")
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--weight-bits", type=float, help="bits per weight (default: with --config, the bytes of the "
                         "checkpoint beside it, as loaded; else 4)")
    weights.add_argument("--weight-gb", type=float, help="weight memory in GB instead of --weight-bits")
    p.add_argument("--reserve-gb", type=float, default=4.0, help="activations, workspace, fragmentation (GB)")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES), help="presets like rkv-3 or kivi-2, each "
                   "optionally +<m>: m key channels per KV head refined (with --channels)")
    p.add_argument("--channels", help="the model's key-channel ranking (torch_rkv.eval.channels) that a scheme "
                   "named <preset>+<m> refines its channels from")
    p.add_argument("--budget-gb", type=float, help="KV-cache memory in GB (instead of GPU - weights - reserve); "
                   "with --sensitivity, also the per-layer bit allocation that fits it")
    p.add_argument("--sensitivity", help="a per-layer sensitivity profile of this model (JSON, written by "
                   "python -m torch_rkv calibrate)")
    p.add_argument("--split", action="store_true", help="with --sensitivity: an allocation whose layers all keep the "
                   "same key + value bits (pages of one size; by default each layer keeps the bits that pay most)")
    p.add_argument("--out", help="with --sensitivity: write the allocation to this file (docs/format.md)")
    p.add_argument("--vllm", action="store_true", help="plan a vLLM engine with the plugin (docs/serving.md): per "
                   "scheme, the KV memory to give vLLM once the side pool for --batch requests at once is set aside, "
                   "and the tokens and concurrency vLLM reports for requests of --context tokens; with --sensitivity, "
                   "the allocation whose pages and side pool fit (serve it with TORCH_RKV_ALLOCATION)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="the model dtype: a float32 checkpoint's weights are held in it; with --vllm, vLLM's own "
                   "cache and the plugin's full-precision rows too")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="with --vllm: where vLLM runs (its "
                   "default block size: 16 tokens on CUDA, 128 on CPU)")
    p.add_argument("--block-size", type=int, help="with --vllm: vLLM's block size in tokens (default: the one vLLM "
                   "picks, the device's default or the smallest the scheme takes: a multiple of its block, 128 "
                   "for the rkv presets)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="with --vllm: the engine's max_num_seqs (it bounds the "
                   "side pool and the requests run at once; vLLM 0.32's default depends on the device and entry "
                   "point, 1024 on GPUs of 70 GiB or more: pass the engine's)")
    p.add_argument("--max-num-batched-tokens", type=int, help="with --vllm: the engine's max_num_batched_tokens, "
                   "what a sliding layer holds beyond its window (default: vllm serve's, 2048 on CPU; on CUDA 8192 "
                   "on GPUs of 70 GiB or more by --gpu-gb, 16384 from 160 GiB, 2048 below and on A100s)")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true", help="with --vllm: the engine runs "
                   "with this vLLM flag (sliding layers then keep every block, like full ones)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="with --vllm: GPUs the engine shards the "
                   "model over; --gpu-gb, --reserve-gb and --budget-gb are then one GPU's, which holds 1/N of the "
                   "weights and of the KV heads")
    p.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false", help="with --vllm: the "
                   "engine runs with this vLLM flag (a hybrid model's recurrent states then take 1 block a request, "
                   "not 2, or 3 for a Mamba 2 mixer)")
    p.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="with --vllm: vLLM's flag, the dtype of a hybrid's recurrent states (auto: the model dtype, "
                   "Nemotron-H's float32; on a CPU with AVX-512 BF16 vLLM keeps float32)")
    p.add_argument("--num-speculative-tokens", type=int, default=0, help="with --vllm: ngram speculative decoding's "
                   "drafts a step (each side slot's ring holds that many more rows, and vLLM then schedules without "
                   "async scheduling)")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    """Plan what the parsed options (add_arguments) ask, and print it; a refusal ends the command with its
    message."""
    request = plan_request(args)
    result = run_plan(request)
    print_plan(request, result)
    return 0
