// tower_exchange.h — the TowerExchange (layers/layer.h) of N sync towers in one process, for
// --sync-bn: each tower's calls meet the other towers' calls at the same point of the step.
// The k-th sum() of every tower is one round: the last tower to arrive adds the N deposits in
// tower order and wakes the others, who copy the total out before they can deposit for the
// next round (which needs every tower), so one buffer per tower is enough.
//
// A round needs all N towers inside their steps at once: the step driver runs every tower as
// a oneTBB task of an arena with a slot per tower and enough threads for all of them
// (TowerGroup::run). Should a tower never arrive, the others fail after `timeout` instead of
// hanging. A tower that leaves the run (stop, error) abandons the exchange: the towers waiting
// in it, and any that arrive later, throw ExchangeAbandoned, which the driver takes as the end
// of their step.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "layers/layer.h"

namespace towers {

struct ExchangeAbandoned {};

class TowerExchangeGroup {
 public:
  explicit TowerExchangeGroup(int towers, std::chrono::seconds timeout = std::chrono::seconds(300));
  ~TowerExchangeGroup();
  TowerExchange& member(int tower);
  void abandon();  // wakes every waiting tower with ExchangeAbandoned
  void reset();    // a fresh run: no round in progress, not abandoned
  int waiting();   // towers waiting in the current round (for tests)

 private:
  class Member;
  void sum(int tower, double* values, int64_t count);

  const int n_;
  const std::chrono::seconds timeout_;
  std::vector<std::unique_ptr<Member>> members_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::vector<double>> deposit_;
  std::vector<double> total_;
  int arrived_ = 0;
  int64_t round_ = 0;
  bool abandoned_ = false;
};

}  // namespace towers
