// nccl_reduce.h — sync mode's --reduce nccl: the towers' gradients are summed by an NCCL
// all-reduce among their GPUs (in place, on each tower's compute stream), then one copy from
// the first GPU lands the sum in host memory for the single optimizer apply. With parameters
// mirrored on the GPUs the sum stays there (all_reduce) and each GPU applies it. Each tower's
// gradient is already scaled by 1 / global batch, so the sum is the mean. NCCL needs one
// tower per GPU: a communicator cannot hold the same GPU twice. CUDA builds only.
#pragma once

#include <memory>
#include <vector>

namespace towers {

class Tower;

class NcclReducer {
 public:
  explicit NcclReducer(const std::vector<Tower*>& towers);  // every one a CudaTower
  ~NcclReducer();
  // After every tower's compute_gradients: sum on the GPUs, copy the sum to host_dst.
  void sum_to_host(float* host_dst);
  // The sum in place in every tower's device gradients, queued on each tower's compute stream
  // (a device-mirrored store's average); nothing waits for it.
  void all_reduce();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace towers
