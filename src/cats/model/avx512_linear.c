/* Small-batch linear kernels for CPUs with AVX-512: Y[m, n] = sum_k X[m, k] * W[n, k] (+ bias[n]) for a few rows m.
 *
 * Built and loaded by cats/model/avx512_linear.py (see its docstring for why they exist and how they are used).
 *
 * W is stored in panels of PANEL = 48 output rows, each panel one contiguous stream, so that a call reads the weights
 * as a single sequential stream:
 *   bf16:    [ceil(N / 48) panels][ceil(K / 2) pairs][48 outputs][2 values]   (vdpbf16ps' pair layout)
 *   float32: [ceil(N / 48) panels][K][48 outputs]
 * rows past N and the odd value past K zero-padded. Per step of k, three vectors of weights (48 outputs) are loaded
 * once and multiplied with up to 8 rows of X (each value, or bf16 pair, broadcast), accumulating in float32 in one
 * register lane per output. So every output is the same sequence of operations, whatever M is and however the rows
 * are tiled or the panels split over threads: its lane accumulates k = 0, 1, 2, ... in order, then bias is added
 * (and, for bf16, the sum is rounded to nearest even). The results are row-invariant: a token's output does not
 * depend on how many other tokens share the call. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define PANEL 48 /* outputs per panel: three 16-lane vectors */

/* The tiles: MT rows of X against one panel; sums into out[MT][PANEL]. */
#define DECLARE(m) __m512 a##m##0 = _mm512_setzero_ps(), a##m##1 = a##m##0, a##m##2 = a##m##0;
#define KEEP(m)                                    \
  _mm512_storeu_ps(out + (m) * PANEL, a##m##0);      \
  _mm512_storeu_ps(out + (m) * PANEL + 16, a##m##1); \
  _mm512_storeu_ps(out + (m) * PANEL + 32, a##m##2);
#define ROWS1(S) S(0)
#define ROWS2(S) S(0) S(1)
#define ROWS4(S) S(0) S(1) S(2) S(3)
#define ROWS8(S) S(0) S(1) S(2) S(3) S(4) S(5) S(6) S(7)

static void split(long panels, long* begin, long* end) {
  int t = omp_get_thread_num(), count = omp_get_num_threads();
  long per = (panels + count - 1) / count;
  *begin = t * per;
  *end = *begin + per < panels ? *begin + per : panels;
}

#if defined(__AVX512F__)
/* ------------------------------------------------------------------------------------------------ float32 */
#define F32_STEP(m)                                           \
  {                                                           \
    __m512 xv = _mm512_set1_ps(x[(m) * ldx + k]);             \
    a##m##0 = _mm512_fmadd_ps(w0, xv, a##m##0);               \
    a##m##1 = _mm512_fmadd_ps(w1, xv, a##m##1);               \
    a##m##2 = _mm512_fmadd_ps(w2, xv, a##m##2);               \
  }
#define F32_TILE(MT)                                                                                    \
  static void f32_tile##MT(const float* w, const float* x, long ldx, long K, float* out) {             \
    ROWS##MT(DECLARE)                                                                                   \
    for (long k = 0; k < K; k++) {                                                                      \
      __m512 w0 = _mm512_loadu_ps(w + k * PANEL), w1 = _mm512_loadu_ps(w + k * PANEL + 16),             \
             w2 = _mm512_loadu_ps(w + k * PANEL + 32);                                                  \
      ROWS##MT(F32_STEP)                                                                                \
    }                                                                                                   \
    ROWS##MT(KEEP)                                                                                      \
  }
F32_TILE(1)
F32_TILE(2)
F32_TILE(4)
F32_TILE(8)

static void f32_panels(const float* W, const float* X, const float* bias, float* Y, long M, long N, long K, long p0,
                       long p1) {
  float out[8 * PANEL];
  for (long p = p0; p < p1; p++) {
    const float* w = W + p * K * PANEL;
    long n0 = p * PANEL, count = N - n0 < PANEL ? N - n0 : PANEL;
    for (long m0 = 0; m0 < M;) {
      long tile = M - m0 >= 8 ? 8 : M - m0 >= 4 ? 4 : M - m0 >= 2 ? 2 : 1;
      const float* x = X + m0 * K;
      if (tile == 8) f32_tile8(w, x, K, K, out);
      else if (tile == 4) f32_tile4(w, x, K, K, out);
      else if (tile == 2) f32_tile2(w, x, K, K, out);
      else f32_tile1(w, x, K, K, out);
      for (long m = 0; m < tile; m++)
        for (long i = 0; i < count; i++) Y[(m0 + m) * N + n0 + i] = out[m * PANEL + i] + (bias ? bias[n0 + i] : 0.0f);
      m0 += tile;
    }
  }
}

void cats_linear_f32(const float* W, const float* X, const float* bias, float* Y, long M, long N, long K,
                     int threads) {
  long panels = (N + PANEL - 1) / PANEL;
  if (threads <= 1 || panels < 2 * threads) {
    f32_panels(W, X, bias, Y, M, N, K, 0, panels);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    long p0, p1;
    split(panels, &p0, &p1);
    if (p0 < p1) f32_panels(W, X, bias, Y, M, N, K, p0, p1);
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* ------------------------------------------------------------------------------------------------ bfloat16 */
static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch does; NaN stays NaN */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static inline __m512bh bf16_pair(const uint16_t* x, long k, long K) { /* x[k], x[k + 1] (0 past K), broadcast */
  int32_t pair;
  if (k + 1 < K) memcpy(&pair, x + k, 4);
  else pair = x[k];
  return (__m512bh)_mm512_set1_epi32(pair);
}

#define BF16_STEP(m)                                       \
  {                                                        \
    __m512bh xv = bf16_pair(x + (m) * ldx, 2 * k, K);      \
    a##m##0 = _mm512_dpbf16_ps(a##m##0, w0, xv);           \
    a##m##1 = _mm512_dpbf16_ps(a##m##1, w1, xv);           \
    a##m##2 = _mm512_dpbf16_ps(a##m##2, w2, xv);           \
  }
#define BF16_TILE(MT)                                                                                    \
  static void bf16_tile##MT(const uint16_t* w, const uint16_t* x, long ldx, long K, float* out) {       \
    ROWS##MT(DECLARE)                                                                                    \
    for (long k = 0; k < (K + 1) / 2; k++) {                                                             \
      const uint16_t* row = w + k * 2 * PANEL;                                                           \
      __m512bh w0 = (__m512bh)_mm512_loadu_si512(row), w1 = (__m512bh)_mm512_loadu_si512(row + 32),     \
               w2 = (__m512bh)_mm512_loadu_si512(row + 64);                                              \
      ROWS##MT(BF16_STEP)                                                                                \
    }                                                                                                    \
    ROWS##MT(KEEP)                                                                                       \
  }
BF16_TILE(1)
BF16_TILE(2)
BF16_TILE(4)
BF16_TILE(8)

static void bf16_panels(const uint16_t* W, const uint16_t* X, const float* bias, uint16_t* Y, long M, long N, long K,
                        long p0, long p1) {
  long pairs = (K + 1) / 2;
  float out[8 * PANEL];
  for (long p = p0; p < p1; p++) {
    const uint16_t* w = W + p * pairs * 2 * PANEL;
    long n0 = p * PANEL, count = N - n0 < PANEL ? N - n0 : PANEL;
    for (long m0 = 0; m0 < M;) {
      long tile = M - m0 >= 8 ? 8 : M - m0 >= 4 ? 4 : M - m0 >= 2 ? 2 : 1;
      const uint16_t* x = X + m0 * K;
      if (tile == 8) bf16_tile8(w, x, K, K, out);
      else if (tile == 4) bf16_tile4(w, x, K, K, out);
      else if (tile == 2) bf16_tile2(w, x, K, K, out);
      else bf16_tile1(w, x, K, K, out);
      for (long m = 0; m < tile; m++)
        for (long i = 0; i < count; i++)
          Y[(m0 + m) * N + n0 + i] = to_bf16(out[m * PANEL + i] + (bias ? bias[n0 + i] : 0.0f));
      m0 += tile;
    }
  }
}

void cats_linear_bf16(const uint16_t* W, const uint16_t* X, const float* bias, uint16_t* Y, long M, long N, long K,
                      int threads) {
  long panels = (N + PANEL - 1) / PANEL;
  if (threads <= 1 || panels < 2 * threads) {
    bf16_panels(W, X, bias, Y, M, N, K, 0, panels);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    long p0, p1;
    split(panels, &p0, &p1);
    if (p0 < p1) bf16_panels(W, X, bias, Y, M, N, K, p0, p1);
  }
}
#endif

/* which kernels this build has: 1 = bfloat16, 2 = float32 */
int cats_linear_kernels(void) {
  int kinds = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  kinds |= 1;
#endif
#if defined(__AVX512F__)
  kinds |= 2;
#endif
  return kinds;
}
