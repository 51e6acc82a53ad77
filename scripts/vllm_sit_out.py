"""A vLLM scheduler whose running requests miss steps, for the vLLM tests (engine argument
scheduler_cls="vllm_sit_out.SittingOutScheduler", with scripts/ on sys.path, as scripts/vllm_engine.py
runs it).

vLLM's own scheduler skips a running request while the step is below its next_decode_eligible_step (what
pipeline parallelism with asynchronous scheduling sets). This one sets it for the second request it
sees: counting from the step its prompt is computed by, that request misses steps 2 and 3, then steps 8
to 8 + LONG - 1, and decodes on. Each step it sits out is printed as `sit-out: <request> <step>`.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler

LONG = 24


class SittingOutScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.arrival: dict[str, int] = {}
        self.decoding_since: dict[str, int] = {}  # request -> the step its prompt was computed by

    def sits_out(self, request, step: int) -> bool:
        j = self.arrival.setdefault(request.request_id, len(self.arrival))
        if request.num_computed_tokens < request.num_prompt_tokens or j != 1:
            return False
        since = step - self.decoding_since.setdefault(request.request_id, step)
        return since in (2, 3) or 8 <= since < 8 + LONG

    def schedule(self, *args, **kwargs):
        step = self.current_step + 1  # (the step vLLM's schedule is about to number)
        for request in self.running:
            if self.sits_out(request, step):
                request.next_decode_eligible_step = step + 1
                print(f"sit-out: {request.request_id} {step}", flush=True)
        return super().schedule(*args, **kwargs)
