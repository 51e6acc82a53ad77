"""One vLLM engine for the vLLM tests and bench: `python scripts/vllm_engine.py < job.json`.

A process each, because TORCH_RKV_SCHEME (the plugin's switch) is read when vLLM's processes start. The
job names the model directory, the engine arguments (enforce_eager unless they say otherwise) and a list
of tasks; the result is printed as one line `RESULT <json>` (with vLLM's counters under "metrics" when
the engine keeps statistics: "disable_log_stats": false), and vLLM's own log (its KV cache size among it)
goes to the same output.

in_process (the tests): vLLM's engine core and its one worker run in the engine's own process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, distributed_executor_backend="uni") instead of two more processes,
each of which imports torch and vLLM again: an engine starts in about 9 s instead of 36 on 2 cores, with
the same pages and results. That process is forked from a server that imported vLLM once (the importing
takes 12 s on 2 cores, the engine itself 5); vLLM loads its plugins when an engine starts, so each fork
still reads its own TORCH_RKV_SCHEME. What a server runs (the multiprocess default, where the plugin
loads in every process) is what the bench and `vllm serve` use.

Tasks:
  {"kind": "generate", "prompts": [[ids]...], "max_tokens": n or [n...], "batches": [[i, ...], ...]}
      greedy continuations with the top-2 log-probabilities of every step; `batches` (default: all at
      once) submits the prompts in that order, one generate call per batch (prefix-cache hits)
  {"kind": "timed", "prompts": [[ids]...], "max_tokens": n, "name": key (default "timed")}
      all prompts at once, greedy, no log-probabilities: the wall time, the output tokens and, when the
      engine keeps statistics, each request's first and last token times (engine clock)
  {"kind": "ppl", "ids": [ids]}          perplexity of one sequence from prompt log-probabilities
  {"kind": "forced", "ids": [[ids]...], "starts": [k...], "top": t}
      teacher forcing: the log-probabilities the engine gives, at every position from k on, to its top-t
      tokens and to the sequence's own next token; "ids": "generated" takes the prompts and
      continuations of the job's generate task
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time

ENV = "TORCH_RKV_SCHEME"  # torch_rkv.integrations.vllm.ENV (not imported: this side needs no torch_rkv)
CODEBOOK_ENV = "TORCH_RKV_CODEBOOK"  # (its CODEBOOK_ENV)
ALLOCATION_ENV = "TORCH_RKV_ALLOCATION"  # (its ALLOCATION_ENV)
CHANNELS_ENV = "TORCH_RKV_CHANNELS"  # (its CHANNELS_ENV)
# (its KV_TRANSFER_CONFIG: the plugin's KV connector, which every engine with the plugin takes)
KV_TRANSFER_CONFIG = {"kv_connector": "RKVConnector", "kv_connector_module_path": "torch_rkv.integrations.vllm_connector",
                      "kv_role": "kv_both"}


def run(scheme: str | None, job: dict, kv_gb: str = "2", timeout: int = 900, in_process: bool = False,
        codebook: str | None = None, allocation: str | None = None, channels: str | None = None) -> dict:
    """Run one engine in a new process (scheme None: vLLM's own cache): the task results, with vLLM's
    reported KV cache size ("kv_tokens") and maximum concurrency ("concurrency", at "concurrency_len"
    tokens a request), and its log ("log"). kv_gb: VLLM_CPU_KVCACHE_SPACE, unless the job sets
    kv_cache_memory_bytes (which the variable would override). codebook: the scheme's calibrated levels
    (the plugin's TORCH_RKV_CODEBOOK). allocation: per-layer bits in place of a scheme (TORCH_RKV_ALLOCATION).
    channels: refined key channels, "<m>:<ranking file>" (TORCH_RKV_CHANNELS)."""
    env = {k: v for k, v in os.environ.items()
           if k not in (ENV, CODEBOOK_ENV, ALLOCATION_ENV, CHANNELS_ENV, "VLLM_CPU_KVCACHE_SPACE")}
    env["PYTHONUNBUFFERED"] = "1"
    if "kv_cache_memory_bytes" not in job.get("engine", {}):
        env["VLLM_CPU_KVCACHE_SPACE"] = kv_gb
    if scheme:
        env[ENV] = scheme
    if codebook:
        env[CODEBOOK_ENV] = codebook
    if allocation:
        env[ALLOCATION_ENV] = allocation
    if channels:
        env[CHANNELS_ENV] = channels
    if scheme or allocation:
        job = {**job, "engine": {"kv_transfer_config": KV_TRANSFER_CONFIG, **job.get("engine", {})}}
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        job = {**job, "engine": {"distributed_executor_backend": "uni", **job.get("engine", {})}}
        exit_code, log = _forked(job, env, timeout)
    else:
        # the job on standard input: a 16K-token prompt is past the size of one command-line argument
        proc = subprocess.run([sys.executable, __file__], input=json.dumps(job), env=env, capture_output=True,
                              text=True, check=False, timeout=timeout)
        exit_code, log = proc.returncode, proc.stdout + proc.stderr
    result = [line for line in log.splitlines() if line.startswith("RESULT ")]
    # RESULT is printed once every task is done, so only its absence is a failure: a non-zero exit after it
    # is vLLM's own teardown (seen once in CI: "terminate called without an active exception" as vLLM
    # force-killed its engine process on exit), which changes no result
    if not result:
        raise RuntimeError(f"vLLM engine ({ENV}={scheme}) failed (exit {exit_code}):\n{log[-6000:]}")
    out = json.loads(result[-1][len("RESULT "):])
    out["exit_code"] = exit_code
    out["kv_tokens"], out["concurrency_len"], out["concurrency"] = kv_capacity(log)
    out["log"] = log
    return out


def kv_capacity(log: str) -> tuple[int, int, float]:
    """(tokens, tokens a request, maximum concurrency) of vLLM's "KV cache size" log line."""
    size = re.search(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: "
                     r"([\d.]+)x", log)
    if size is None:
        raise RuntimeError(f"no KV cache size in vLLM's log:\n{log[-3000:]}")
    return int(size.group(1).replace(",", "")), int(size.group(2).replace(",", "")), float(size.group(3))


_forkserver = None  # the multiprocessing context whose server has vLLM imported


def _forked(job: dict, env: dict, timeout: int) -> tuple[int, str]:
    """Run main(job) in a process forked from the server that has vLLM imported, with `env` as its whole
    environment: (exit code, everything it wrote to stdout and stderr)."""
    import multiprocessing
    import tempfile

    global _forkserver
    if _forkserver is None:
        _forkserver = multiprocessing.get_context("forkserver")
        # the server imports these once; this file is importable there (multiprocessing passes sys.path)
        _forkserver.set_forkserver_preload([__spec__.name if __spec__ else "vllm_engine", "vllm.entrypoints.llm"])
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        child = _forkserver.Process(target=_child, args=(job, env, log.name))
        child.start()
        child.join(timeout)
        timed_out = child.exitcode is None
        if timed_out:
            child.kill()
            child.join()
        log.seek(0)
        if timed_out:
            raise subprocess.TimeoutExpired("vLLM engine (forked)", timeout, output=log.read())
        return child.exitcode, log.read()


def _child(job: dict, env: dict, log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)  # vLLM's log handlers write to the streams on these descriptors
    os.dup2(fd, 2)
    os.environ.clear()
    os.environ.update(env)
    code = main(job)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def main(job: dict | None = None) -> int:
    job = json.load(sys.stdin) if job is None else job
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.time()
    engine = {"enforce_eager": True, **job.get("engine", {})}
    if isinstance(engine.get("kv_transfer_config"), dict):
        from vllm.config import KVTransferConfig

        engine["kv_transfer_config"] = KVTransferConfig(**engine["kv_transfer_config"])
    llm = LLM(model=job["model"], **engine)
    out = {"load_s": time.time() - start}
    for task in job["tasks"]:
        kind = task["kind"]
        t0 = time.time()
        if kind == "generate":
            prompts = task["prompts"]
            batches = task.get("batches", [list(range(len(prompts)))])
            counts = task["max_tokens"] if isinstance(task["max_tokens"], list) else [task["max_tokens"]] * len(prompts)
            params = [SamplingParams(max_tokens=n, temperature=0, logprobs=2, ignore_eos=True) for n in counts]
            results = [None] * len(prompts)
            for batch in batches:
                for i, r in zip(batch, llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in batch],
                                                     [params[i] for i in batch], use_tqdm=False)):
                    steps = r.outputs[0].logprobs
                    results[i] = {"tokens": list(r.outputs[0].token_ids), "cached_tokens": r.num_cached_tokens or 0,
                                  "top2": [sorted((lp.logprob for lp in d.values()), reverse=True)[:2] for d in steps]}
            out["generate"] = results
        elif kind == "timed":
            params = SamplingParams(max_tokens=task["max_tokens"], temperature=0, ignore_eos=True)
            t1 = time.perf_counter()
            results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in task["prompts"]], params, use_tqdm=False)
            timed = {"wall_s": time.perf_counter() - t1, "requests": len(results),
                     "output_tokens": sum(len(r.outputs[0].token_ids) for r in results)}
            if all(r.metrics is not None for r in results):
                timed["first_token_ts"] = [r.metrics.first_token_ts for r in results]
                timed["last_token_ts"] = [r.metrics.last_token_ts for r in results]
                timed["generated"] = [r.metrics.num_generation_tokens for r in results]
            out[task.get("name", "timed")] = timed
        elif kind == "ppl":
            ids = task["ids"]
            r = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                             SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)[0]
            nll = -sum(d[ids[i]].logprob for i, d in enumerate(r.prompt_logprobs) if d is not None)
            out["ppl"] = math.exp(nll / (len(ids) - 1))
        elif kind == "forced":
            seqs, starts = task["ids"], task["starts"]
            if seqs == "generated":
                gen = job["tasks"][0]
                seqs = [p + g["tokens"] for p, g in zip(gen["prompts"], out["generate"])]
                starts = [len(p) for p in gen["prompts"]]
            rows = []
            for r, k in zip(llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in seqs],
                                         SamplingParams(max_tokens=1, prompt_logprobs=task.get("top", 2),
                                                        temperature=0), use_tqdm=False), starts):
                rows.append([{str(tok): lp.logprob for tok, lp in d.items()} for d in r.prompt_logprobs[k:]])
            out["forced"] = {"ids": seqs, "starts": starts, "logprobs": rows}
        else:
            raise ValueError(f"unknown task {kind!r}")
        out[f"{kind}_s"] = time.time() - t0
    if not job.get("engine", {}).get("disable_log_stats", True):
        out["metrics"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if hasattr(m, "value")}
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
