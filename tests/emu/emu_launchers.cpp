// emu_launchers.cpp — the launchers of the element-wise CUDA kernels, compiled from their .cu
// files as host code for the emulated device: their checks, index widths and per-element code
// are the ones the GPU build runs. Their one launcher, for_each_index (kernels/cuda/launch.cuh),
// becomes a host loop handed to launch_host_loop (emu_kernels.cpp). What in these files is not
// one thread per element is under __CUDACC__, and emu_kernels.cpp has its own version of it.
// Built without FMA contraction, as optimizer.cu and batchnorm.cu are (tests/CMakeLists.txt).
#include "kernels/cuda/activation.cu"
#include "kernels/cuda/augment.cu"
#include "kernels/cuda/batchnorm.cu"
#include "kernels/cuda/bias.cu"
#include "kernels/cuda/conv.cu"
#include "kernels/cuda/dropout.cu"
#include "kernels/cuda/lrn.cu"
#include "kernels/cuda/optimizer.cu"
#include "kernels/cuda/pool.cu"
#include "kernels/cuda/reduce.cu"
#include "kernels/cuda/softmax_xent.cu"
