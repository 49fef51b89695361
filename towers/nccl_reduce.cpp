#include "towers/nccl_reduce.h"

#include "core/check.h"

#if TOWERS_HAVE_CUDA
#include <set>

#include <nccl.h>

#include "core/check.h"
#include "core/cuda_check.h"
#include "towers/cuda_tower.h"

#define NCCL_CHECK(call)                                                             \
  do {                                                                               \
    ncclResult_t towers_nr_ = (call);                                                \
    if (towers_nr_ != ncclSuccess)                                                   \
      TOWERS_SYSTEM_FAIL("NCCL call {} failed: {}", #call, ncclGetErrorString(towers_nr_)); \
  } while (0)

namespace towers {

struct NcclReducer::Impl {
  std::vector<CudaTower*> towers;
  std::vector<ncclComm_t> comms;
  int64_t count = 0;
};

NcclReducer::NcclReducer(const std::vector<Tower*>& towers) : impl_(std::make_unique<Impl>()) {
  std::vector<int> devs;
  std::set<int> seen;
  for (Tower* t : towers) {
    auto* ct = dynamic_cast<CudaTower*>(t);
    TOWERS_CHECK(ct != nullptr, "--reduce nccl needs every tower on a GPU");
    TOWERS_REQUIRE(seen.insert(ct->device().ordinal()).second,
                   "--reduce nccl: towers {} share cuda:{}; NCCL needs one tower per GPU (use "
                   "--reduce host, or at most as many towers as GPUs)",
                   impl_->towers.size(), ct->device().ordinal());
    impl_->towers.push_back(ct);
    devs.push_back(ct->device().ordinal());
  }
  impl_->count = towers.front()->graph().layout().total();
  impl_->comms.resize(devs.size());
  NCCL_CHECK(ncclCommInitAll(impl_->comms.data(), static_cast<int>(devs.size()), devs.data()));
  // Only now that the all-reduce exists do the towers stop copying their gradients out.
  for (CudaTower* t : impl_->towers) t->set_grads_to_host(false);
}

NcclReducer::~NcclReducer() {
  for (ncclComm_t c : impl_->comms)
    if (c) ncclCommFinalize(c);
  for (ncclComm_t c : impl_->comms)
    if (c) ncclCommDestroy(c);
}

void NcclReducer::all_reduce() {
  auto& ts = impl_->towers;
  const size_t count = static_cast<size_t>(impl_->count);
  NCCL_CHECK(ncclGroupStart());
  for (size_t i = 0; i < ts.size(); ++i) {
    ts[i]->device().activate();
    NCCL_CHECK(ncclAllReduce(ts[i]->device_grads(), ts[i]->device_grads(), count, ncclFloat,
                             ncclSum, impl_->comms[i], ts[i]->device().compute()));
  }
  NCCL_CHECK(ncclGroupEnd());
}

void NcclReducer::sum_to_host(float* host_dst) {
  auto& ts = impl_->towers;
  const size_t count = static_cast<size_t>(impl_->count);
  all_reduce();
  CudaDevice& d0 = ts[0]->device();
  d0.activate();
  CUDA_CHECK(cudaMemcpyAsync(host_dst, ts[0]->device_grads(), sizeof(float) * count,
                             cudaMemcpyDeviceToHost, d0.compute()));
  for (CudaTower* t : ts) {
    t->device().activate();
    CUDA_CHECK(cudaStreamSynchronize(t->device().compute()));
  }
}

}  // namespace towers

#else  // a build without CUDA has no GPU towers to reduce

namespace towers {
struct NcclReducer::Impl {};
NcclReducer::NcclReducer(const std::vector<Tower*>&) {
  TOWERS_BAD_INPUT("--reduce nccl: this towers was built without CUDA");
}
NcclReducer::~NcclReducer() = default;
void NcclReducer::sum_to_host(float*) {}
void NcclReducer::all_reduce() {}
}  // namespace towers

#endif
