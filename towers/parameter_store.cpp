#include "towers/parameter_store.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/gpu.h"

namespace towers {

LocalParameterStore::LocalParameterStore(float* params, Optimizer& opt, UpdateAccess access,
                                         bool use_locking, bool pin)
    : params_(params), opt_(opt), access_(access), use_locking_(use_locking) {
  if (!pin) return;
  // Page-locked host parameters: every GPU tower's broadcast is a DMA straight from them.
  // Pinning only speeds the copies up; without it they stage through pageable memory.
  std::string why;
  pinned_ = pin_host_memory(params_, sizeof(float) * opt.layout().total(), &why);
  if (!pinned_)
    fmt::print(stderr, "towers: warning: host parameters not page-locked ({}); copies will be "
               "slower\n", why);
}

int64_t InProcessStore::min_clock() const {
  return clocks_.empty() ? 0 : *std::min_element(clocks_.begin(), clocks_.end());
}

int64_t LocalParameterStore::pull(Tower& tower) {
  const int64_t v = version();
  if (access_ == UpdateAccess::Exclusive)
    tower.load_params(params_);
  else
    tower.load_params_shared(params_);
  return v;
}

int64_t LocalParameterStore::push(const float* grads, UpdateRecord& rec, UpdateThreads& on) {
  const float lr = rec.lr;
  const int64_t t = opt_.begin_pieces();
  on.run_update(opt_.end() - opt_.begin(), [&](int64_t lo, int64_t hi) {
    if (access_ == UpdateAccess::Exclusive)
      opt_.apply_piece(params_, grads + lo, lo, hi, lr, t);
    else
      opt_.apply_shared_piece(params_, grads + lo, lo, hi, lr, t, use_locking_);
  });
  return advance();
}

}  // namespace towers
