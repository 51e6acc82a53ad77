"""Build of torch_rkv._C: the CPU kernels always, the CUDA kernels wherever torch and nvcc allow.

Environment switches:
  RKV_BUILD_CUDA=auto|0|1   auto (default): build the CUDA kernels when torch is a CUDA build and nvcc
                            is found; 0: CPU only (fast local iteration); 1: fail if CUDA is missing.
  TORCH_CUDA_ARCH_LIST      GPU archs to compile for; default "8.0;9.0" (no GPU is needed to compile).
  RKV_CPU_ISA=native|generic  native (default): AVX2+FMA+F16C when the build CPU has them; generic:
                            baseline x86-64 / aarch64 code for a portable build.
  CUDA_HOME                 the CUDA toolkit; found from `nvcc` on PATH (even a wrapper script) if unset.
  MAX_JOBS                  parallel compile jobs (ninja).
  RKV_SANITIZE=1            AddressSanitizer + UndefinedBehaviorSanitizer build of the C++ kernels
                            (scripts/sanitize.sh sets it, with a CPU-only build in a copy of the tree).
"""

import glob
import os
import platform
import re
import shutil
import subprocess

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
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


def cpu_isa_flags():
    if os.environ.get("RKV_CPU_ISA", "native") == "generic" or platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(re.search(r"^flags\s*:(.*)$", f.read(), re.M).group(1).split())
    except (OSError, AttributeError):
        return []
    return ["-mavx2", "-mfma", "-mf16c"] if {"avx2", "fma", "f16c"} <= flags else []


cuda_home = find_cuda_home()
if cuda_home:
    os.environ["CUDA_HOME"] = cuda_home  # before torch.utils.cpp_extension reads it
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

mode = os.environ.get("RKV_BUILD_CUDA", "auto")
can_cuda = torch.version.cuda is not None and cuda_home is not None
if mode == "1" and not can_cuda:
    raise RuntimeError(f"RKV_BUILD_CUDA=1 but torch.version.cuda={torch.version.cuda} and CUDA_HOME={cuda_home}")
with_cuda = can_cuda and mode != "0"

sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp")) + glob.glob(os.path.join(CSRC, "cpu", "*.cpp")))
# -fopenmp: at::parallel_for is an inline template that is only parallel when the extension itself is
# compiled with OpenMP (torch's own libgomp.so.1 is the one loaded at run time).
cxx_flags = ["-O3", "-ffp-contract=off", "-fopenmp", "-fvisibility=hidden"] + cpu_isa_flags()
link_flags = ["-fopenmp"]
if os.environ.get("RKV_SANITIZE") == "1":
    san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g"]
    cxx_flags = [f for f in cxx_flags if f != "-O3"] + ["-O1"] + san
    link_flags += san
extra = {"cxx": cxx_flags}
if with_cuda:
    sources += sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu")))
    extra["cxx"] = extra["cxx"] + ["-DRKV_WITH_CUDA"]
    extra["nvcc"] = ["-O3", "-lineinfo", "--expt-relaxed-constexpr", "-DRKV_WITH_CUDA",
                     "-Xcompiler", "-ffp-contract=off"]
Extension = CUDAExtension if with_cuda else CppExtension

with open(os.path.join(ROOT, "torch_rkv", "_build_config.py"), "w") as f:  # read by tests/test_build.py
    f.write(f"# written by setup.py\nTORCH = {torch.__version__!r}\nCUDA_MODE = {mode!r}\nCUDA_KERNELS = {with_cuda!r}\n")

print(f"torch_rkv build: torch {torch.__version__}, CUDA kernels {'on' if with_cuda else 'off'}"
      f" (CUDA_HOME={cuda_home}, archs {os.environ['TORCH_CUDA_ARCH_LIST']}), cpu flags {cxx_flags}")

setup(
    packages=find_packages(include=["torch_rkv", "torch_rkv.*"]),
    ext_modules=[
        Extension(
            "torch_rkv._C",
            sources,
            include_dirs=[os.path.join(ROOT, CSRC, "include"), os.path.join(ROOT, CSRC)],
            extra_compile_args=extra,
            extra_link_args=link_flags,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
