#include "towers/tower_exchange.h"

#include "core/check.h"

namespace towers {

class TowerExchangeGroup::Member final : public TowerExchange {
 public:
  Member(TowerExchangeGroup& g, int tower) : g_(g), tower_(tower) {}
  void sum(double* values, int64_t count) override { g_.sum(tower_, values, count); }

 private:
  TowerExchangeGroup& g_;
  int tower_;
};

TowerExchangeGroup::TowerExchangeGroup(int towers, std::chrono::seconds timeout)
    : n_(towers), timeout_(timeout), deposit_(towers) {
  TOWERS_CHECK(towers >= 1, "a tower exchange needs at least one tower, got {}", towers);
  for (int i = 0; i < n_; ++i) members_.push_back(std::make_unique<Member>(*this, i));
}

TowerExchangeGroup::~TowerExchangeGroup() = default;

TowerExchange& TowerExchangeGroup::member(int tower) { return *members_[tower]; }

void TowerExchangeGroup::abandon() {
  std::lock_guard<std::mutex> l(mu_);
  abandoned_ = true;
  cv_.notify_all();
}

int TowerExchangeGroup::waiting() {
  std::lock_guard<std::mutex> l(mu_);
  return arrived_;
}

void TowerExchangeGroup::reset() {
  std::lock_guard<std::mutex> l(mu_);
  abandoned_ = false;
  arrived_ = 0;
}

void TowerExchangeGroup::sum(int tower, double* values, int64_t count) {
  std::unique_lock<std::mutex> l(mu_);
  if (abandoned_) throw ExchangeAbandoned{};
  deposit_[tower].assign(values, values + count);
  if (++arrived_ == n_) {
    total_.assign(count, 0.0);
    for (int i = 0; i < n_; ++i) {
      TOWERS_CHECK(static_cast<int64_t>(deposit_[i].size()) == count,
                   "tower exchange round {}: tower {} gave {} values, tower {} gave {}", round_,
                   i, deposit_[i].size(), tower, count);
      for (int64_t k = 0; k < count; ++k) total_[k] += deposit_[i][k];
    }
    arrived_ = 0;
    ++round_;
    cv_.notify_all();
  } else {
    const int64_t round = round_;
    if (!cv_.wait_for(l, timeout_, [&] { return round_ != round || abandoned_; }))
      TOWERS_BAD_INPUT("--sync-bn: tower {} waited {} s for the other towers at a batch-statistics "
                       "exchange (round {}); {} of {} arrived, and the towers of a step must run "
                       "at once",
                       tower, timeout_.count(), round, arrived_, n_);
    if (round_ == round) throw ExchangeAbandoned{};
  }
  std::copy(total_.begin(), total_.end(), values);
}

}  // namespace towers
