"""Build of torch_rkv._C: the op schemas and the CPU kernels, in C++ (the GPU kernels are Triton kernels
in torch_rkv/gpu/, compiled when they first run, so a CUDA machine needs no nvcc).

    pip install --no-build-isolation -e .      (the Makefile's way; compiles against the installed torch)

Environment switches:
  MAX_JOBS                  parallel compile jobs (ninja).
  RKV_SANITIZE=1            AddressSanitizer + UndefinedBehaviorSanitizer build of the C++ kernels
                            (scripts/sanitize.sh sets it, with a copy of the tree).

No flag depends on the build machine's CPU: the CPU kernels that gain from AVX2 are compiled for it in
their own translation units and chosen at run time (torch_rkv/csrc/cpu/capability.h).
"""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

CSRC = os.path.join("torch_rkv", "csrc")

sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp")) + glob.glob(os.path.join(CSRC, "cpu", "*.cpp")))
# -fopenmp: at::parallel_for is an inline template that is only parallel when the extension itself is
# compiled with OpenMP (torch's own libgomp.so.1 is the one loaded at run time).
cxx_flags = ["-O3", "-ffp-contract=off", "-fopenmp", "-fvisibility=hidden"]
link_flags = ["-fopenmp"]
if os.environ.get("RKV_SANITIZE") == "1":
    san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g"]
    cxx_flags = [f for f in cxx_flags if f != "-O3"] + ["-O1"] + san
    link_flags += san

print(f"torch_rkv build: CPU kernels, cxx flags {cxx_flags}")

setup(
    ext_modules=[
        CppExtension(
            "torch_rkv._C",
            sources,
            include_dirs=[os.path.abspath(os.path.join(CSRC, "include")), os.path.abspath(CSRC)],
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
