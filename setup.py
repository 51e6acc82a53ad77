"""Build of torch_rkv._C: the CPU kernels always, the CUDA kernels wherever torch and nvcc allow.

    pip install --no-build-isolation -e .      (the Makefile's way; compiles against the installed torch)

Environment switches:
  RKV_BUILD_CUDA=auto|0|1   auto (default): build the CUDA kernels when torch is a CUDA build and nvcc
                            is found; 0: CPU only (fast local iteration); 1: fail if CUDA is missing.
  TORCH_CUDA_ARCH_LIST      GPU archs to compile for; default "8.0;9.0" (no GPU is needed to compile).
  CUDA_HOME                 the CUDA toolkit; found from `nvcc` on PATH (even a wrapper script) if unset.
  MAX_JOBS                  parallel compile jobs (ninja).
  RKV_SANITIZE=1            AddressSanitizer + UndefinedBehaviorSanitizer build of the C++ kernels
                            (scripts/sanitize.sh sets it, with a CPU-only build in a copy of the tree).

No flag depends on the build machine's CPU: the CPU kernels that gain from AVX2 are compiled for it in
their own translation units and chosen at run time (torch_rkv/csrc/cpu/capability.h).
"""

import glob
import os
import re
import shutil
import subprocess

from setuptools import setup

CSRC = os.path.join("torch_rkv", "csrc")


def find_cuda_home():
    """The toolkit folder behind `nvcc`, which may be a wrapper script rather than a symlink."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        probe = subprocess.run([nvcc, "-v", "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                               capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"_HERE_=(\S+)", probe.stdout + probe.stderr)
    return os.path.dirname(os.path.realpath(match.group(1))) if match else None


cuda_home = find_cuda_home()
if cuda_home:
    os.environ["CUDA_HOME"] = cuda_home  # before torch.utils.cpp_extension reads it
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

mode = os.environ.get("RKV_BUILD_CUDA", "auto")
if mode not in ("auto", "0", "1"):
    raise ValueError(f"RKV_BUILD_CUDA must be auto, 0 or 1 (got {mode!r})")
can_cuda = torch.version.cuda is not None and cuda_home is not None
if mode == "1" and not can_cuda:
    raise RuntimeError(f"RKV_BUILD_CUDA=1 but torch.version.cuda={torch.version.cuda} and CUDA_HOME={cuda_home}")
with_cuda = can_cuda and mode != "0"

sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp")) + glob.glob(os.path.join(CSRC, "cpu", "*.cpp")))
# the build's own settings, readable at run time as torch_rkv._C.build (no generated source files)
defines = [f"-DRKV_CUDA_REQUEST={ {'0': 0, '1': 1, 'auto': 2}[mode] }"]
# -fopenmp: at::parallel_for is an inline template that is only parallel when the extension itself is
# compiled with OpenMP (torch's own libgomp.so.1 is the one loaded at run time).
cxx_flags = ["-O3", "-ffp-contract=off", "-fopenmp", "-fvisibility=hidden"] + defines
link_flags = ["-fopenmp"]
if os.environ.get("RKV_SANITIZE") == "1":
    san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g"]
    cxx_flags = [f for f in cxx_flags if f != "-O3"] + ["-O1"] + san
    link_flags += san
extra = {"cxx": cxx_flags}
if with_cuda:
    sources += sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu")))
    extra["cxx"] = extra["cxx"] + ["-DRKV_WITH_CUDA"]
    extra["nvcc"] = ["-O3", "-lineinfo", "--expt-relaxed-constexpr", "-DRKV_WITH_CUDA", *defines,
                     "-Xcompiler", "-ffp-contract=off"]
Extension = CUDAExtension if with_cuda else CppExtension

print(f"torch_rkv build: torch {torch.__version__}, CUDA kernels {'on' if with_cuda else 'off'}"
      f" (CUDA_HOME={cuda_home}, archs {os.environ['TORCH_CUDA_ARCH_LIST']}), cxx flags {extra['cxx']}")

setup(
    ext_modules=[
        Extension(
            "torch_rkv._C",
            sources,
            include_dirs=[os.path.abspath(os.path.join(CSRC, "include")), os.path.abspath(CSRC)],
            extra_compile_args=extra,
            extra_link_args=link_flags,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
