# Sourced by scripts/gpu_check.sh: how a lent GPU machine builds the C++ extension (the op schemas and
# CPU kernels; the GPU kernels are Triton's, compiled when they first run).
export PYTHONUNBUFFERED=1
# The lent H200's image sets CC/CXX to /opt/gcc, and an extension built with them segfaulted while
# formatting any error message (std::ostream code resolved inside _C.so, under torch 2.11); built with
# the system compiler (g++ 13.3 there) errors raise cleanly (2026-12-04). Override with RKV_CC / RKV_CXX.
if [ -x /usr/bin/g++ ]; then export CC=${RKV_CC:-/usr/bin/gcc} CXX=${RKV_CXX:-/usr/bin/g++}; fi
