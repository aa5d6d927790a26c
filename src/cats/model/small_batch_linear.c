/* Small-batch linear kernels for CPUs with AVX-512: Y[m, n] = sum_k X[m, k] * W[n, k] (+ bias[n]) for a few rows m.
 *
 * Built and loaded by cats/model/small_batch_linear.py (see its docstring for why they exist and how they are used).
 *
 * W is stored blocked, so that one call reads its weights as a single sequential stream:
 *   [ceil(N / 4) blocks][C chunks][4 rows][L values],  C = ceil(K / L),
 * rows past N and values past K zero-padded. bf16: L = 32 values per chunk, accumulated in float32 by vdpbf16ps;
 * float32: L = 16, FMA. Every output is the same sequence of operations, whatever M is and however the rows are
 * tiled or the blocks split over threads: per chunk one vector multiply-accumulate into the output's own accumulator,
 * then one horizontal sum (+ bias, then rounding for bf16). The results are therefore row-invariant: a token's
 * output does not depend on how many other tokens share the call. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define ROWS 4 /* weight rows per block */

static void split(long blocks, int threads, long* begin, long* end) {
  int t = omp_get_thread_num(), count = omp_get_num_threads();
  long per = (blocks + count - 1) / count;
  *begin = t * per;
  *end = *begin + per < blocks ? *begin + per : blocks;
  (void)threads;
}

#if defined(__AVX512F__)
/* ------------------------------------------------------------------------------------------------ float32 */
#define F32_LOAD_X(m) _mm512_maskz_loadu_ps(mask, x + (m) * ldx + c * 16)
#define F32_MAC(m)                                 \
  {                                                \
    __m512 xv = F32_LOAD_X(m);                     \
    a##m##0 = _mm512_fmadd_ps(w0, xv, a##m##0);    \
    a##m##1 = _mm512_fmadd_ps(w1, xv, a##m##1);    \
    a##m##2 = _mm512_fmadd_ps(w2, xv, a##m##2);    \
    a##m##3 = _mm512_fmadd_ps(w3, xv, a##m##3);    \
  }
#define F32_LOAD_W                                          \
  __mmask16 mask = (c == chunks - 1) ? tail : (__mmask16)0xffff; \
  __m512 w0 = _mm512_loadu_ps(w + (c * ROWS + 0) * 16);     \
  __m512 w1 = _mm512_loadu_ps(w + (c * ROWS + 1) * 16);     \
  __m512 w2 = _mm512_loadu_ps(w + (c * ROWS + 2) * 16);     \
  __m512 w3 = _mm512_loadu_ps(w + (c * ROWS + 3) * 16);
#define ZERO4(m) __m512 a##m##0 = _mm512_setzero_ps(), a##m##1 = a##m##0, a##m##2 = a##m##0, a##m##3 = a##m##0;
#define SUM4(m)                                  \
  out[(m) * ROWS + 0] = _mm512_reduce_add_ps(a##m##0); \
  out[(m) * ROWS + 1] = _mm512_reduce_add_ps(a##m##1); \
  out[(m) * ROWS + 2] = _mm512_reduce_add_ps(a##m##2); \
  out[(m) * ROWS + 3] = _mm512_reduce_add_ps(a##m##3);

static inline void f32_tile1(const float* w, const float* x, long ldx, long chunks, __mmask16 tail, float* out) {
  ZERO4(0)
  for (long c = 0; c < chunks; c++) {
    F32_LOAD_W
    F32_MAC(0)
  }
  SUM4(0)
}

static inline void f32_tile4(const float* w, const float* x, long ldx, long chunks, __mmask16 tail, float* out) {
  ZERO4(0) ZERO4(1) ZERO4(2) ZERO4(3)
  for (long c = 0; c < chunks; c++) {
    F32_LOAD_W
    F32_MAC(0) F32_MAC(1) F32_MAC(2) F32_MAC(3)
  }
  SUM4(0) SUM4(1) SUM4(2) SUM4(3)
}

static void f32_blocks(const float* W, const float* X, const float* bias, float* Y, long M, long N, long K, long b0,
                       long b1) {
  long chunks = (K + 15) / 16;
  __mmask16 tail = (K % 16) ? (__mmask16)((1u << (K % 16)) - 1u) : (__mmask16)0xffff;
  float out[4 * ROWS];
  for (long b = b0; b < b1; b++) {
    const float* w = W + b * chunks * ROWS * 16;
    for (long m0 = 0; m0 < M;) {
      long tile = M - m0 >= 4 ? 4 : 1;
      if (tile == 4) f32_tile4(w, X + m0 * K, K, chunks, tail, out);
      else f32_tile1(w, X + m0 * K, K, chunks, tail, out);
      for (long m = 0; m < tile; m++)
        for (int i = 0; i < ROWS; i++) {
          long n = b * ROWS + i;
          if (n < N) Y[(m0 + m) * N + n] = out[m * ROWS + i] + (bias ? bias[n] : 0.0f);
        }
      m0 += tile;
    }
  }
}

void cats_linear_f32(const float* W, const float* X, const float* bias, float* Y, long M, long N, long K,
                     int threads) {
  long blocks = (N + ROWS - 1) / ROWS;
  if (threads <= 1 || blocks < 2 * threads) {
    f32_blocks(W, X, bias, Y, M, N, K, 0, blocks);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    long b0, b1;
    split(blocks, threads, &b0, &b1);
    if (b0 < b1) f32_blocks(W, X, bias, Y, M, N, K, b0, b1);
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

#define BF16_LOAD_X(m) (__m512bh) _mm512_maskz_loadu_epi16(mask, x + (m) * ldx + c * 32)
#define BF16_MAC(m)                                  \
  {                                                  \
    __m512bh xv = BF16_LOAD_X(m);                    \
    a##m##0 = _mm512_dpbf16_ps(a##m##0, w0, xv);     \
    a##m##1 = _mm512_dpbf16_ps(a##m##1, w1, xv);     \
    a##m##2 = _mm512_dpbf16_ps(a##m##2, w2, xv);     \
    a##m##3 = _mm512_dpbf16_ps(a##m##3, w3, xv);     \
  }
#define BF16_LOAD_W                                                           \
  __mmask32 mask = (c == chunks - 1) ? tail : (__mmask32)0xffffffffu;         \
  __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + (c * ROWS + 0) * 32);        \
  __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + (c * ROWS + 1) * 32);        \
  __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + (c * ROWS + 2) * 32);        \
  __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + (c * ROWS + 3) * 32);

static inline void bf16_tile1(const uint16_t* w, const uint16_t* x, long ldx, long chunks, __mmask32 tail,
                              float* out) {
  ZERO4(0)
  for (long c = 0; c < chunks; c++) {
    BF16_LOAD_W
    BF16_MAC(0)
  }
  SUM4(0)
}

static inline void bf16_tile4(const uint16_t* w, const uint16_t* x, long ldx, long chunks, __mmask32 tail,
                              float* out) {
  ZERO4(0) ZERO4(1) ZERO4(2) ZERO4(3)
  for (long c = 0; c < chunks; c++) {
    BF16_LOAD_W
    BF16_MAC(0) BF16_MAC(1) BF16_MAC(2) BF16_MAC(3)
  }
  SUM4(0) SUM4(1) SUM4(2) SUM4(3)
}

static void bf16_blocks(const uint16_t* W, const uint16_t* X, const float* bias, uint16_t* Y, long M, long N, long K,
                        long b0, long b1) {
  long chunks = (K + 31) / 32;
  __mmask32 tail = (K % 32) ? (__mmask32)((1u << (K % 32)) - 1u) : (__mmask32)0xffffffffu;
  float out[4 * ROWS];
  for (long b = b0; b < b1; b++) {
    const uint16_t* w = W + b * chunks * ROWS * 32;
    for (long m0 = 0; m0 < M;) {
      long tile = M - m0 >= 4 ? 4 : 1;
      if (tile == 4) bf16_tile4(w, X + m0 * K, K, chunks, tail, out);
      else bf16_tile1(w, X + m0 * K, K, chunks, tail, out);
      for (long m = 0; m < tile; m++)
        for (int i = 0; i < ROWS; i++) {
          long n = b * ROWS + i;
          if (n < N) Y[(m0 + m) * N + n] = to_bf16(out[m * ROWS + i] + (bias ? bias[n] : 0.0f));
        }
      m0 += tile;
    }
  }
}

void cats_linear_bf16(const uint16_t* W, const uint16_t* X, const float* bias, uint16_t* Y, long M, long N, long K,
                      int threads) {
  long blocks = (N + ROWS - 1) / ROWS;
  if (threads <= 1 || blocks < 2 * threads) {
    bf16_blocks(W, X, bias, Y, M, N, K, 0, blocks);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    long b0, b1;
    split(blocks, threads, &b0, &b1);
    if (b0 < b1) bf16_blocks(W, X, bias, Y, M, N, K, b0, b1);
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
