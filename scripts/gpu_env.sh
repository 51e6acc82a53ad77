# Sourced by the GPU scripts (gpu_check.sh, gpu_decode_probe.sh): how a lent GPU machine builds the
# extension. CUDA kernels required, compiled for this GPU's arch only.
arch=$(python3 -c "import torch; p = torch.cuda.get_device_capability(); print(f'{p[0]}.{p[1]}')")
export TORCH_CUDA_ARCH_LIST=$arch RKV_BUILD_CUDA=1 PYTHONUNBUFFERED=1
# The lent H200's image sets CC/CXX to /opt/gcc, and an extension built with them segfaulted while
# formatting any error message (std::ostream code resolved inside _C.so, under torch 2.11); built with
# the system compiler (g++ 13.3 there) errors raise cleanly (2026-12-04). Override with RKV_CC / RKV_CXX.
if [ -x /usr/bin/g++ ]; then export CC=${RKV_CC:-/usr/bin/gcc} CXX=${RKV_CXX:-/usr/bin/g++}; fi
