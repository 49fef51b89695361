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

// Rows of an input plane, padded with zeros to the tiles' width (R - 1 + tiles_w * M).
float* zeroed_rows(int64_t floats) {
  thread_local std::vector<float> rows;
  if (static_cast<int64_t>(rows.size()) < floats) rows.resize(floats);
  return rows.data();
}

template <int M, int R>
void input(const WinogradShape& s, int64_t C, int64_t images, const float* x, float* v) {
  using W = Mats<M, R>;
  constexpr int A = W::A, P = (R - 1) / 2;
  const int64_t H = s.height, Wd = s.width, th = s.tiles_h(), tw = s.tiles_w();
  const int64_t T = images * th * tw, Wp = tw * M + R - 1;
  float* rows = zeroed_rows(2 * A * Wp);
  float* rowt = rows + A * Wp;  // B^T applied down the rows: (A, Wp)
  for (int64_t i = 0; i < images; ++i)
    for (int64_t c = 0; c < C; ++c) {
      const float* xc = x + (i * C + c) * H * Wd;
      for (int64_t ti = 0; ti < th; ++ti) {
        for (int r = 0; r < A; ++r) {
          float* row = rows + r * Wp;
          const int64_t y = ti * M - P + r;
          std::fill(row, row + Wp, 0.0f);
          if (y >= 0 && y < H) std::memcpy(row + P, xc + y * Wd, sizeof(float) * Wd);
        }
        for (int64_t w = 0; w < Wp; ++w)
          product<A, A, false>(typename W::BT{}, [&](int k) { return rows[k * Wp + w]; },
                               [&](int a, float val) { rowt[a * Wp + w] = val; });
        const int64_t t0 = (i * th + ti) * tw;
        for (int a = 0; a < A; ++a) {
          float* va = v + (static_cast<int64_t>(a) * A * C + c) * T + t0;  // position (a, 0)
          for (int64_t tj = 0; tj < tw; ++tj) {
            const float* d = rowt + a * Wp + tj * M;
            product<A, A, false>(typename W::BT{}, [&](int k) { return d[k]; },
                                 [&](int b, float val) { va[b * C * T + tj] = val; });
          }
        }
      }
    }
}

template <int M, int R>
void output(const WinogradShape& s, int64_t C, int64_t images, const float* m, const float* bias,
            bool relu, float* y) {
  using W = Mats<M, R>;
  constexpr int A = W::A;
  const int64_t H = s.height, Wd = s.width, th = s.tiles_h(), tw = s.tiles_w();
  const int64_t T = images * th * tw, stride = C * T;  // between positions
  for (int64_t i = 0; i < images; ++i)
    for (int64_t c = 0; c < C; ++c) {
      float* yc = y + (i * C + c) * H * Wd;
      const float b0 = bias != nullptr ? bias[c] : 0.0f;
      for (int64_t ti = 0; ti < th; ++ti)
        for (int64_t tj = 0; tj < tw; ++tj) {
          const float* mt = m + c * T + (i * th + ti) * tw + tj;
          float half[M][A];  // A^T m, down the columns
          for (int b = 0; b < A; ++b)
            product<M, A, false>(typename W::AT{}, [&](int a) { return mt[(a * A + b) * stride]; },
                                 [&](int u, float val) { half[u][b] = val; });
          for (int u = 0; u < M; ++u) {
            const int64_t yy = ti * M + u;
            if (yy >= H) break;
            float out[M];
            product<M, A, false>(typename W::AT{}, [&](int b) { return half[u][b]; },
                                 [&](int vv, float val) { out[vv] = val; });
            for (int vv = 0; vv < M && tj * M + vv < Wd; ++vv) {
              float val = out[vv];
              if (bias != nullptr) val += b0;
              yc[yy * Wd + tj * M + vv] = relu ? std::max(val, 0.0f) : val;
            }
          }
        }
    }
}

template <int M, int R>
void output_adjoint(const WinogradShape& s, int64_t C, int64_t images, const float* dy, float* out) {
  using W = Mats<M, R>;
  constexpr int A = W::A;
  const int64_t H = s.height, Wd = s.width, th = s.tiles_h(), tw = s.tiles_w();
  const int64_t T = images * th * tw, stride = C * T;
  for (int64_t i = 0; i < images; ++i)
    for (int64_t c = 0; c < C; ++c) {
      const float* dc = dy + (i * C + c) * H * Wd;
      for (int64_t ti = 0; ti < th; ++ti)
        for (int64_t tj = 0; tj < tw; ++tj) {
          float g[M][M];  // the tile, zero beyond the plane
          for (int u = 0; u < M; ++u)
            for (int vv = 0; vv < M; ++vv) {
              const int64_t yy = ti * M + u, xx = tj * M + vv;
              g[u][vv] = yy < H && xx < Wd ? dc[yy * Wd + xx] : 0.0f;
            }
          float half[M][A];  // g A^T, along the rows
          for (int u = 0; u < M; ++u)
            product<A, M, true>(typename W::AT{}, [&](int vv) { return g[u][vv]; },
                                [&](int b, float val) { half[u][b] = val; });
          float* ot = out + c * T + (i * th + ti) * tw + tj;
          for (int b = 0; b < A; ++b)
            product<A, M, true>(typename W::AT{}, [&](int u) { return half[u][b]; },
                                [&](int a, float val) { ot[(a * A + b) * stride] = val; });
        }
    }
}

// The weight transforms run over blocks of kernel pairs (o, i), the pair innermost, so that
// each step is a vector operation over the block.
constexpr int64_t kPairs = 64;

template <int M, int R>
void weights(int64_t co, int64_t ci, const float* w, bool flipped, float* u) {
  using W = Mats<M, R>;
  constexpr int A = W::A;
  const int64_t pairs = co * ci;
  for (int64_t q0 = 0; q0 < pairs; q0 += kPairs) {
    const int64_t n = std::min(kPairs, pairs - q0);
    // Pair q is U's column: (o, i) = (q / ci, q % ci), or, flipped, (i, o) = (q / co, q % co)
    // with the kernel turned by 180 degrees.
    float k[R * R][kPairs];
    for (int64_t j = 0; j < n; ++j) {
      const int64_t q = q0 + j;
      const int64_t o = flipped ? q % co : q / ci, i = flipped ? q / co : q % ci;
      const float* src = w + (o * ci + i) * R * R;
      for (int e = 0; e < R * R; ++e) k[e][j] = src[flipped ? R * R - 1 - e : e];
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

WinogradShape winograd_shape(const ConvGeometry& g) {
  WinogradShape s;
  const Window& r = g.rows;
  const Window& c = g.cols;
  const bool same = r.stride == 1 && c.stride == 1 && r.k == c.k && r.out == r.in &&
                    c.out == c.in && r.pad_before == (r.k - 1) / 2 && c.pad_before == (c.k - 1) / 2;
  if (!same || (r.k != 3 && r.k != 5)) return s;
  s.r = static_cast<int>(r.k);
  s.m = s.r == 5 ? 2 : 4;
  s.height = g.height;
  s.width = g.width;
  return s;
}

void winograd_weights(const WinogradShape& s, int64_t co, int64_t ci, const float* w, bool flipped,
                      float* u) {
  with_form(s, [&]<int M, int R>() { weights<M, R>(co, ci, w, flipped, u); });
}

void winograd_weights_adjoint(const WinogradShape& s, int64_t co, int64_t ci, const float* du,
                              float* dw) {
  with_form(s, [&]<int M, int R>() { weights_adjoint<M, R>(co, ci, du, dw); });
}

void winograd_input(const WinogradShape& s, int64_t c, int64_t images, const float* x, float* v) {
  with_form(s, [&]<int M, int R>() { input<M, R>(s, c, images, x, v); });
}

void winograd_output(const WinogradShape& s, int64_t c, int64_t images, const float* m,
                     const float* bias, bool relu, float* y) {
  with_form(s, [&]<int M, int R>() { output<M, R>(s, c, images, m, bias, relu, y); });
}

void winograd_output_adjoint(const WinogradShape& s, int64_t c, int64_t images, const float* dy,
                             float* out) {
  with_form(s, [&]<int M, int R>() { output_adjoint<M, R>(s, c, images, dy, out); });
}

void winograd_forward(const WinogradShape& s, int64_t co, int64_t ci, int64_t images,
                      const float* u, const float* x, const float* bias, bool relu, float* y,
                      float* v, float* m) {
  const int64_t T = s.tiles(images);
  winograd_input(s, ci, images, x, v);
  for (int xi = 0; xi < s.positions(); ++xi)
    gemm(false, false, co, T, ci, 1.0f, u + xi * co * ci, ci, v + xi * ci * T, T, 0.0f,
         m + xi * co * T, T);
  winograd_output(s, co, images, m, bias, relu, y);
}

void winograd_backward(const WinogradShape& s, int64_t co, int64_t ci, int64_t images,
                       const float* ut, const float* x, const float* g, float* dw, float* dx,
                       float* v, float* m, float* du) {
  const int64_t T = s.tiles(images);
  // dU[xi] (co, ci) = Dy[xi] (co, T) * V[xi]^T (T, ci)
  winograd_input(s, ci, images, x, v);
  winograd_output_adjoint(s, co, images, g, m);
  for (int xi = 0; xi < s.positions(); ++xi)
    gemm(false, true, co, ci, T, 1.0f, m + xi * co * T, T, v + xi * ci * T, T, 0.0f,
         du + xi * co * ci, ci);
  winograd_weights_adjoint(s, co, ci, du, dw);
  if (dx == nullptr) return;
  // dx: the forward convolution of g with the flipped kernel, ci outputs from co inputs.
  winograd_input(s, co, images, g, m);
  for (int xi = 0; xi < s.positions(); ++xi)
    gemm(false, false, ci, T, co, 1.0f, ut + xi * ci * co, co, m + xi * co * T, T, 0.0f,
         v + xi * ci * T, T);
  winograd_output(s, ci, images, v, nullptr, false, dx);
}

}  // namespace towers::kernels::cpu
