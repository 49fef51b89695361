#include "kernels/winograd.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/check.h"
#include "kernels/gemm.h"

namespace towers::kernels::cpu {

namespace {

// The transforms' matrices (scripts/winograd-matrices.py derives and checks them). A is the
// transpose of AT; the adjoints use the transposes.
template <int M, int R>
struct Form;

template <>
struct Form<2, 5> {  // points 0, 1, -1, 2, -1/2, infinity
  static constexpr float AT[2][6] = {{1, 1, 1, 1, 1, 0}, {0, 1, -1, 2, -0.5f, 1}};
  static constexpr float G[6][5] = {
      {1, 0, 0, 0, 0},
      {-1.0f / 3, -1.0f / 3, -1.0f / 3, -1.0f / 3, -1.0f / 3},
      {1.0f / 3, -1.0f / 3, 1.0f / 3, -1.0f / 3, 1.0f / 3},
      {1.0f / 15, 2.0f / 15, 4.0f / 15, 8.0f / 15, 16.0f / 15},
      {-16.0f / 15, 8.0f / 15, -4.0f / 15, 2.0f / 15, -1.0f / 15},
      {0, 0, 0, 0, 1}};
  static constexpr float BT[6][6] = {{1, 1.5f, -2, -1.5f, 1, 0},   {0, -1, -2.5f, -0.5f, 1, 0},
                                     {0, 1, 0.5f, -2.5f, 1, 0},    {0, -0.5f, -1, 0.5f, 1, 0},
                                     {0, 2, -1, -2, 1, 0},         {0, 1, 1.5f, -2, -1.5f, 1}};
};

template <>
struct Form<4, 3> {  // points 0, 1, -1, 1/2, -2, infinity
  static constexpr float AT[4][6] = {{1, 1, 1, 1, 1, 0},
                                     {0, 1, -1, 0.5f, -2, 0},
                                     {0, 1, 1, 0.25f, 4, 0},
                                     {0, 1, -1, 0.125f, -8, 1}};
  static constexpr float G[6][3] = {{1, 0, 0},
                                    {1.0f / 3, 1.0f / 3, 1.0f / 3},
                                    {-1.0f / 3, 1.0f / 3, -1.0f / 3},
                                    {-16.0f / 15, -8.0f / 15, -4.0f / 15},
                                    {1.0f / 15, -2.0f / 15, 4.0f / 15},
                                    {0, 0, 1}};
  static constexpr float BT[6][6] = {{1, -1.5f, -2, 1.5f, 1, 0},   {0, -1, 0.5f, 2.5f, 1, 0},
                                     {0, 1, -2.5f, 0.5f, 1, 0},    {0, -2, -1, 2, 1, 0},
                                     {0, 0.5f, -1, -0.5f, 1, 0},   {0, 1, -1.5f, -2, 1.5f, 1}};
};

// fn(integral_constant<int, 0>), ..., fn(integral_constant<int, N - 1>): loops whose index is a
// constant, so that a matrix entry is known where it is used.
template <int N, class Fn>
inline void unroll(Fn&& fn) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    (fn(std::integral_constant<int, I>{}), ...);
  }(std::make_integer_sequence<int, N>{});
}

// out(i, sum_k Mat[i][k] * in(k)) for i < Rows, k < Cols, in k order, leaving out the zero
// entries (without -ffast-math the compiler must keep 0 * x) and multiplying by none of +-1.
// Transposed: Mat[k][i] instead.
template <int Rows, int Cols, bool Transposed, class Mat, class In, class Out>
inline void product(const Mat& mat, const In& in, const Out& out) {
  unroll<Rows>([&](auto i) {
    float acc = 0.0f;
    unroll<Cols>([&](auto k) {
      constexpr float c = Transposed ? Mat::value[k][i] : Mat::value[i][k];
      (void)mat;
      if constexpr (c == 1.0f) acc += in(k);
      else if constexpr (c == -1.0f) acc -= in(k);
      else if constexpr (c != 0.0f) acc += c * in(k);
    });
    out(i, acc);
  });
}

template <int M, int R>
struct Mats {
  static constexpr int A = M + R - 1;
  struct AT { static constexpr auto& value = Form<M, R>::AT; };
  struct G { static constexpr auto& value = Form<M, R>::G; };
  struct BT { static constexpr auto& value = Form<M, R>::BT; };
};

// The tile transforms run over blocks of kLanes channels, the channel innermost, so that each
// step is a vector operation: the transformed arrays are (T, positions, channels rounded up
// to kLanes, Cp), a tile's positions one contiguous block; position xi's GEMM reads or
// writes the T rows starting at xi * Cp, positions * Cp apart.
constexpr int kLanes = 8;
int64_t lanes_up(int64_t c) { return (c + kLanes - 1) / kLanes * kLanes; }

// product() on blocks of kLanes channels: in(k) and out(i) are pointers to kLanes floats.
template <int Rows, int Cols, bool Transposed, class Mat, class In, class Out>
inline void product_lanes(const In& in, const Out& out) {
  unroll<Rows>([&](auto i) {
    float acc[kLanes] = {};
    unroll<Cols>([&](auto k) {
      constexpr float c = Transposed ? Mat::value[k][i] : Mat::value[i][k];
      const float* __restrict x = in(k);
      if constexpr (c == 1.0f) {
        for (int j = 0; j < kLanes; ++j) acc[j] += x[j];
      } else if constexpr (c == -1.0f) {
        for (int j = 0; j < kLanes; ++j) acc[j] -= x[j];
      } else if constexpr (c != 0.0f) {
        for (int j = 0; j < kLanes; ++j) acc[j] += c * x[j];
      }
    });
    float* __restrict o = out(i);
    for (int j = 0; j < kLanes; ++j) o[j] = acc[j];
  });
}

// Per-thread buffers of a chunk's transforms, grown to the largest request and reused.
struct Scratch {
  std::vector<float> planes, v, m, du;
  static float* get(std::vector<float>& b, int64_t floats) {
    if (static_cast<int64_t>(b.size()) < floats) b.resize(static_cast<size_t>(floats));
    return b.data();
  }
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// x (images, C, H, W) channels-last in this thread's scratch: (images, Hp, Wp, lanes_up(C)),
// each plane at (off, off), zeros around it and in the lanes past C. Only the border and the
// lanes past C are cleared; the plane's pixels are written once, kLanes channels of a pixel
// side by side (one vector store, from kLanes rows of x).
const float* channels_last(const float* x, int64_t images, int64_t C, int64_t H, int64_t Wd,
                           int64_t Hp, int64_t Wp, int64_t off) {
  const int64_t Cp = lanes_up(C), floats = images * Hp * Wp * Cp, full = C / kLanes * kLanes;
  float* out = Scratch::get(scratch().planes, floats);
  for (int64_t i = 0; i < images; ++i)
    for (int64_t yp = 0; yp < Hp; ++yp) {
      float* row = out + (i * Hp + yp) * Wp * Cp;
      const int64_t y = yp - off;
      if (y < 0 || y >= H) {
        std::fill(row, row + Wp * Cp, 0.0f);
        continue;
      }
      std::fill(row, row + off * Cp, 0.0f);
      std::fill(row + (off + Wd) * Cp, row + Wp * Cp, 0.0f);
      float* dst = row + off * Cp;
      const float* src = x + (i * C * H + y) * Wd;  // channel c's row at src + c * H * Wd
      for (int64_t cb = 0; cb < full; cb += kLanes)
        for (int64_t xx = 0; xx < Wd; ++xx)
          for (int j = 0; j < kLanes; ++j) dst[xx * Cp + cb + j] = src[(cb + j) * H * Wd + xx];
      for (int64_t xx = 0; xx < Wd; ++xx)
        for (int64_t c = full; c < Cp; ++c) dst[xx * Cp + c] = c < C ? src[c * H * Wd + xx] : 0.0f;
    }
  return out;
}

// x (images, C, H, W) channels-last with the padding of the tiles' patches, in this thread's
// scratch: (images, tiles_h * M + R - 1, tiles_w * M + R - 1, lanes_up(C)), each plane at
// ((R - 1) / 2, (R - 1) / 2).
template <int M, int R>
const float* planes(const WinogradShape& s, int64_t C, int64_t images, const float* x) {
  constexpr int P = (R - 1) / 2;
  return channels_last(x, images, C, s.height, s.width, s.tiles_h() * M + R - 1,
                       s.tiles_w() * M + R - 1, P);
}

// f(i, ti, tj, t, cb) for every tile (ti, tj) of every image i, t its index among the
// images * tiles_h * tiles_w tiles, and every block of kLanes channels cb of lanes_up(C).
template <class F>
void for_each_tile(const WinogradShape& s, int64_t C, int64_t images, F f) {
  const int64_t th = s.tiles_h(), tw = s.tiles_w(), Cp = lanes_up(C);
  for (int64_t i = 0; i < images; ++i)
    for (int64_t ti = 0; ti < th; ++ti)
      for (int64_t tj = 0; tj < tw; ++tj)
        for (int64_t cb = 0; cb < Cp; cb += kLanes) f(i, ti, tj, (i * th + ti) * tw + tj, cb);
}

// planes() of an input -> v (T, positions, lanes_up(C)).
template <int M, int R>
void input(const WinogradShape& s, int64_t C, int64_t images, const float* pad, float* v) {
  using W = Mats<M, R>;
  constexpr int A = W::A;
  const int64_t th = s.tiles_h(), tw = s.tiles_w();
  const int64_t Cp = lanes_up(C);
  const int64_t Hp = th * M + R - 1, Wp = tw * M + R - 1;
  for_each_tile(s, C, images, [&](int64_t i, int64_t ti, int64_t tj, int64_t t, int64_t cb) {
    const float* base = pad + ((i * Hp + ti * M) * Wp + tj * M) * Cp;
    float rows[A][A][kLanes];  // (a, k): B^T down the patch's columns
    for (int k = 0; k < A; ++k)
      product_lanes<A, A, false, typename W::BT>(
          [&](int r) { return base + (r * Wp + k) * Cp + cb; },
          [&](int a) { return rows[a][k]; });
    for (int a = 0; a < A; ++a)
      product_lanes<A, A, false, typename W::BT>(
          [&](int k) { return rows[a][k]; },
          [&](int b) { return v + ((t * A + a) * A + b) * Cp + cb; });
  });
}

// m (T, positions, lanes_up(C)) -> y (images, C, H, W), plus bias[c] (unless null), ReLU.
template <int M, int R>
void output(const WinogradShape& s, int64_t C, int64_t images, const float* m, const float* bias,
            bool relu, float* y) {
  using W = Mats<M, R>;
  constexpr int A = W::A;
  const int64_t H = s.height, Wd = s.width;
  const int64_t Cp = lanes_up(C);
  for_each_tile(s, C, images, [&](int64_t i, int64_t ti, int64_t tj, int64_t t, int64_t cb) {
    float half[M][A][kLanes];  // A^T m, down the columns
    for (int b = 0; b < A; ++b)
      product_lanes<M, A, false, typename W::AT>(
          [&](int a) { return m + ((t * A + a) * A + b) * Cp + cb; },
          [&](int u) { return half[u][b]; });
    float out[M][M][kLanes];
    for (int u = 0; u < M; ++u)
      product_lanes<M, A, false, typename W::AT>([&](int b) { return half[u][b]; },
                                                 [&](int vv) { return out[u][vv]; });
    const int64_t lanes = std::min<int64_t>(kLanes, C - cb);
    for (int64_t j = 0; j < lanes; ++j) {
      const float b0 = bias != nullptr ? bias[cb + j] : 0.0f;
      float* yc = y + (i * C + cb + j) * H * Wd;
      for (int u = 0; u < M && ti * M + u < H; ++u)
        for (int vv = 0; vv < M && tj * M + vv < Wd; ++vv) {
          float val = out[u][vv][j];
          if (bias != nullptr) val += b0;
          yc[(ti * M + u) * Wd + tj * M + vv] = relu ? std::max(val, 0.0f) : val;
        }
    }
  });
}

// planes() of dy -> out (T, positions, lanes_up(C)) = A dy_tile A^T per tile.
template <int M, int R>
void output_adjoint(const WinogradShape& s, int64_t C, int64_t images, const float* pad, float* out) {
  using W = Mats<M, R>;
  constexpr int A = W::A, P = (R - 1) / 2;
  const int64_t th = s.tiles_h(), tw = s.tiles_w();
  const int64_t Cp = lanes_up(C);
  const int64_t Hp = th * M + R - 1, Wp = tw * M + R - 1;
  for_each_tile(s, C, images, [&](int64_t i, int64_t ti, int64_t tj, int64_t t, int64_t cb) {
    const float* base = pad + ((i * Hp + ti * M + P) * Wp + tj * M + P) * Cp;
    float half[M][A][kLanes];  // dy A^T, along the rows
    for (int u = 0; u < M; ++u)
      product_lanes<A, M, true, typename W::AT>(
          [&](int vv) { return base + (u * Wp + vv) * Cp + cb; },
          [&](int b) { return half[u][b]; });
    for (int b = 0; b < A; ++b)
      product_lanes<A, M, true, typename W::AT>(
          [&](int u) { return half[u][b]; },
          [&](int a) { return out + ((t * A + a) * A + b) * Cp + cb; });
  });
}

// The weight transforms run over blocks of kernel pairs (o, i), the pair innermost, so that
// each step is a vector operation over the block.
constexpr int64_t kPairs = 64;

template <int M, int R>
void weights(int64_t co, int64_t ci, const float* w, bool for_dx, float* u) {
  using W = Mats<M, R>;
  constexpr int A = W::A;
  const int64_t pairs = co * ci;
  for (int64_t q0 = 0; q0 < pairs; q0 += kPairs) {
    const int64_t n = std::min(kPairs, pairs - q0);
    // Pair q is U's column: (i, o) = (q / co, q % co); for dx (o, i) = (q / ci, q % ci), with
    // the kernel turned by 180 degrees.
    float k[R * R][kPairs];
    for (int64_t j = 0; j < n; ++j) {
      const int64_t q = q0 + j;
      const int64_t o = for_dx ? q / ci : q % co, i = for_dx ? q % ci : q / co;
      const float* src = w + (o * ci + i) * R * R;
      for (int e = 0; e < R * R; ++e) k[e][j] = src[for_dx ? R * R - 1 - e : e];
    }
    float half[A * R][kPairs];  // G w, down the columns: (a, l)
    for (int l = 0; l < R; ++l)
      for (int64_t j = 0; j < n; ++j)
        product<A, R, false>(typename W::G{}, [&](int kk) { return k[kk * R + l][j]; },
                             [&](int a, float val) { half[a * R + l][j] = val; });
    for (int a = 0; a < A; ++a)
      for (int64_t j = 0; j < n; ++j)
        product<A, R, false>(typename W::G{}, [&](int l) { return half[a * R + l][j]; },
                             [&](int b, float val) { u[(a * A + b) * pairs + q0 + j] = val; });
  }
}

template <int M, int R>
void weights_adjoint(int64_t co, int64_t ci, const float* du, float* dw) {
  using W = Mats<M, R>;
  constexpr int A = W::A;
  const int64_t pairs = co * ci;
  for (int64_t p0 = 0; p0 < pairs; p0 += kPairs) {
    const int64_t n = std::min(kPairs, pairs - p0);
    float half[R * A][kPairs];  // G^T dU, down the columns: (k, b)
    for (int b = 0; b < A; ++b)
      for (int64_t j = 0; j < n; ++j)
        product<R, A, true>(typename W::G{}, [&](int a) { return du[(a * A + b) * pairs + p0 + j]; },
                            [&](int kk, float val) { half[kk * A + b][j] = val; });
    float k[R * R][kPairs];
    for (int kk = 0; kk < R; ++kk)
      for (int64_t j = 0; j < n; ++j)
        product<R, A, true>(typename W::G{}, [&](int b) { return half[kk * A + b][j]; },
                            [&](int l, float val) { k[kk * R + l][j] = val; });
    for (int64_t j = 0; j < n; ++j)
      for (int e = 0; e < R * R; ++e) dw[(p0 + j) * R * R + e] = k[e][j];
  }
}

// Calls f.template operator()<M, R>() for the shape's form.
template <class Fn>
void with_form(const WinogradShape& s, Fn&& fn) {
  if (s.m == 2 && s.r == 5) return fn.template operator()<2, 5>();
  if (s.m == 4 && s.r == 3) return fn.template operator()<4, 3>();
  TOWERS_CHECK(false, "winograd: no F({}x{}, {}x{}) form", s.m, s.m, s.r, s.r);
}

}  // namespace

WinogradShape winograd_shape(int64_t kernel, int64_t stride, Padding padding, int64_t height,
                             int64_t width) {
  WinogradShape s;
  if (!winograd_fits(kernel, stride, padding)) return s;
  s.r = static_cast<int>(kernel);
  s.m = s.r == 5 ? 2 : 4;
  s.height = height;
  s.width = width;
  return s;
}

void winograd_weights(const WinogradShape& s, int64_t co, int64_t ci, const float* w, bool for_dx,
                      float* u) {
  with_form(s, [&]<int M, int R>() { weights<M, R>(co, ci, w, for_dx, u); });
}

void winograd_forward(const WinogradShape& s, int64_t co, int64_t ci, int64_t images,
                      const float* u, const float* x, const float* bias, bool relu, float* y) {
  const int64_t T = s.tiles(images), cpi = lanes_up(ci), cpo = lanes_up(co), pos = s.positions();
  Scratch& sc = scratch();
  float* v = Scratch::get(sc.v, pos * T * cpi);
  float* m = Scratch::get(sc.m, pos * T * cpo);
  if (cpo != co) std::fill(m, m + pos * T * cpo, 0.0f);  // the lanes past co, never written
  with_form(s, [&]<int M, int R>() { input<M, R>(s, ci, images, planes<M, R>(s, ci, images, x), v); });
  // M[xi] (T, co) = V[xi] (T, ci) * U[xi] (ci, co); V[xi]'s rows are pos * cpi apart
  for (int xi = 0; xi < pos; ++xi)
    gemm(false, false, T, co, ci, 1.0f, v + xi * cpi, pos * cpi, u + xi * ci * co, co, 0.0f,
         m + xi * cpo, pos * cpo);
  with_form(s, [&]<int M, int R>() { output<M, R>(s, co, images, m, bias, relu, y); });
}

void winograd_backward(const WinogradShape& s, int64_t co, int64_t ci, int64_t images,
                       const float* ut, const float* x, const float* g, float* dw, float* dx) {
  const int64_t T = s.tiles(images), cpi = lanes_up(ci), cpo = lanes_up(co), pos = s.positions();
  const int64_t big = std::max(cpi, cpo);
  Scratch& sc = scratch();
  float* v = Scratch::get(sc.v, pos * T * big);
  float* m = Scratch::get(sc.m, pos * T * big);
  float* du = Scratch::get(sc.du, pos * co * ci);
  with_form(s, [&]<int M, int R>() {
    // dU[xi] (co, ci) = Dy[xi]^T (co, T) * V[xi] (T, ci)
    input<M, R>(s, ci, images, planes<M, R>(s, ci, images, x), v);
    // g's planes serve both Dy here and, for dx, its input transform below.
    const float* gp = planes<M, R>(s, co, images, g);
    output_adjoint<M, R>(s, co, images, gp, m);
    for (int xi = 0; xi < pos; ++xi)
      gemm(true, false, co, ci, T, 1.0f, m + xi * cpo, pos * cpo, v + xi * cpi, pos * cpi, 0.0f,
           du + xi * co * ci, ci);
    weights_adjoint<M, R>(co, ci, du, dw);
    if (dx == nullptr) return;
    // dx: the forward convolution of g with the flipped kernel, ci outputs from co inputs:
    // Mdx[xi] (T, ci) = Vg[xi] (T, co) * Ut[xi] (co, ci)
    input<M, R>(s, co, images, gp, m);
    if (cpi != ci) std::fill(v, v + pos * T * cpi, 0.0f);
    for (int xi = 0; xi < pos; ++xi)
      gemm(false, false, T, ci, co, 1.0f, m + xi * cpo, pos * cpo, ut + xi * co * ci, ci, 0.0f,
           v + xi * cpi, pos * cpi);
    output<M, R>(s, ci, images, v, nullptr, false, dx);
  });
}

}  // namespace towers::kernels::cpu
