"""Does a raised error reach Python on each device? Each check runs in its own process, so a crash (the lent
H200's image once segfaulted while formatting any error message) is reported rather than taking this
script with it. Exit status 1 when any device crashed or did not raise the expected message.
    python scripts/error_path_check.py [cpu cuda]
"""

import subprocess
import sys

PROBE = """
import torch, torch_rkv
try:
    torch.ops.rkv.quantize(torch.zeros(4, 8, device="{dev}"), 5, 8, 1, False, torch.float16)
except ValueError as e:
    print(str(e).splitlines()[0][:120])
"""


def main(devices):
    bad = 0
    for dev in devices:
        try:
            r = subprocess.run([sys.executable, "-c", PROBE.format(dev=dev)], capture_output=True, text=True,
                               timeout=120)
        except subprocess.TimeoutExpired:
            print(f"error path on {dev}: BROKEN (no answer in 120 s)", flush=True)
            bad += 1
            continue
        said = r.stdout.strip()
        ok = r.returncode == 0 and "must be 2, 3, 4 or 8" in said
        how = f"raised: {said}" if ok else f"exit {r.returncode}: {(r.stdout + r.stderr).strip()[-300:]}"
        print(f"error path on {dev}: {'ok' if ok else 'BROKEN'} ({how})", flush=True)
        bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["cpu", "cuda"]))
