// A BatchNorm layer's training forward + backward on the CPU, timed (old vs new API).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>
#include "layers/batchnorm.h"
using namespace towers;
int main(int argc, char** argv) {
  const int64_t n = 128;
  struct S {
    int64_t c, h;
  } shapes[] = {{24, 28}, {48, 14}, {96, 7}};
  for (auto sh : shapes) {
    BatchNorm bn("bn", {});
    bn.bind({sh.c, sh.h, sh.h});
    const int64_t count = n * sh.c * sh.h * sh.h;
    std::vector<float> x(count), y(count), dy(count), dx(count), g(sh.c, 1.f), b(sh.c, 0.f),
        m(sh.c, 0.f), v(sh.c, 1.f), dg(sh.c), db(sh.c), dm(sh.c), dv(sh.c);
    for (int64_t i = 0; i < count; ++i) {
      x[i] = (i * 7919 % 1000) / 500.0f - 1.0f;
      dy[i] = (i * 104729 % 1000) / 1000.0f - 0.5f;
    }
#ifdef NEW_API
    std::vector<double> saved((saved_floats(bn, n) + 1) / 2);
#else
    std::vector<double> saved(1);
#endif
    ForwardArgs f;
    f.n = n;
    f.x = x.data();
    f.y = y.data();
    f.params = {g.data(), b.data(), m.data(), v.data()};
    f.saved = reinterpret_cast<float*>(saved.data());
    BackwardArgs a;
    a.n = n;
    a.x = x.data();
    a.y = y.data();
    a.dy = dy.data();
    a.dx = dx.data();
    a.params = f.params;
    a.grads = {dg.data(), db.data(), dm.data(), dv.data()};
    a.saved = f.saved;
    std::vector<double> tf, tb;
    for (int it = 0; it < 30; ++it) {
      auto t0 = std::chrono::steady_clock::now();
      bn.forward(f);
      auto t1 = std::chrono::steady_clock::now();
      bn.backward(a);
      auto t2 = std::chrono::steady_clock::now();
      if (it >= 5) {
        tf.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        tb.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
      }
    }
    std::sort(tf.begin(), tf.end());
    std::sort(tb.begin(), tb.end());
    std::printf("%s 128x%ldx%ldx%ld: forward %.3f ms, backward %.3f ms (medians of 25)\n", argv[1],
                sh.c, sh.h, sh.h, tf[12], tb[12]);
  }
}
