/* Row-invariant kernels for the packed CPU forward on AVX-512: the linears, Y[m, n] = sum_k X[m, k] W[n, k] (+ bias[n]),
 * and attention for a few queries (further below). Built and loaded by cats/model/avx512.py (see its docstring for why
 * they exist and how they are used).
 *
 * Linears:
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
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 48 /* outputs per panel: three 16-lane vectors */
#define GROUP_TILES 8 /* row tiles (of up to 8 rows) that share each chunk of a panel */
#define CHUNK 64 /* steps of k per chunk (bf16: pairs): 12 KB of panel, read from memory once, then from L1 by every
                  * tile of the group; a tile's sums wait in memory between chunks (exact: each output still
                  * accumulates k = 0, 1, 2, ... in order in its lane) */

/* The tiles: MT rows of X against one panel; sums into out[MT][PANEL]. */
#define DECLARE(m)                                                                                     \
  __m512 a##m##0 = resume ? _mm512_loadu_ps(out + (m) * PANEL) : _mm512_setzero_ps(),                        \
         a##m##1 = resume ? _mm512_loadu_ps(out + (m) * PANEL + 16) : _mm512_setzero_ps(),                   \
         a##m##2 = resume ? _mm512_loadu_ps(out + (m) * PANEL + 32) : _mm512_setzero_ps();
#define KEEP(m)                                    \
  _mm512_storeu_ps(out + (m) * PANEL, a##m##0);      \
  _mm512_storeu_ps(out + (m) * PANEL + 16, a##m##1); \
  _mm512_storeu_ps(out + (m) * PANEL + 32, a##m##2);
#define ROWS1(S) S(0)
#define ROWS2(S) S(0) S(1)
#define ROWS4(S) S(0) S(1) S(2) S(3)
#define ROWS8(S) S(0) S(1) S(2) S(3) S(4) S(5) S(6) S(7)

static __attribute__((unused)) void split(long panels, long* begin, long* end) {
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
  static void f32_tile##MT(const float* w, const float* x, long ldx, long k0, long k1, int resume,      \
                           float* out) {                                                                \
    ROWS##MT(DECLARE)                                                                                   \
    for (long k = k0; k < k1; k++) {                                                                    \
      _mm_prefetch((const char*)(w + (k + CHUNK) * PANEL), _MM_HINT_T0);                                \
      _mm_prefetch((const char*)(w + (k + CHUNK) * PANEL + 16), _MM_HINT_T0);                           \
      _mm_prefetch((const char*)(w + (k + CHUNK) * PANEL + 32), _MM_HINT_T0);                           \
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
  float out[GROUP_TILES + 2][8 * PANEL]; /* a group's tiles: at most GROUP_TILES + 2 (63 rows = 7 x 8 + 4 + 2 + 1) */
  for (long p = p0; p < p1; p++) {
    const float* w = W + p * K * PANEL;
    long n0 = p * PANEL, count = N - n0 < PANEL ? N - n0 : PANEL;
    for (long g0 = 0; g0 < M; g0 += GROUP_TILES * 8) {
      long g1 = M - g0 < GROUP_TILES * 8 ? M : g0 + GROUP_TILES * 8;
      long step = g1 - g0 > 8 ? CHUNK : K; /* several tiles: chunks of k, each read once from memory */
      for (long k0 = 0; k0 < K; k0 += step) {
        long k1 = K - k0 < step ? K : k0 + step;
        for (long m0 = g0, t = 0; m0 < g1; t++) {
          long tile = g1 - m0 >= 8 ? 8 : g1 - m0 >= 4 ? 4 : g1 - m0 >= 2 ? 2 : 1;
          const float* x = X + m0 * K;
          if (tile == 8) f32_tile8(w, x, K, k0, k1, k0 > 0, out[t]);
          else if (tile == 4) f32_tile4(w, x, K, k0, k1, k0 > 0, out[t]);
          else if (tile == 2) f32_tile2(w, x, K, k0, k1, k0 > 0, out[t]);
          else f32_tile1(w, x, K, k0, k1, k0 > 0, out[t]);
          m0 += tile;
        }
      }
      for (long m0 = g0, t = 0; m0 < g1; t++) {
        long tile = g1 - m0 >= 8 ? 8 : g1 - m0 >= 4 ? 4 : g1 - m0 >= 2 ? 2 : 1;
        for (long m = 0; m < tile; m++)
          for (long i = 0; i < count; i++)
            Y[(m0 + m) * N + n0 + i] = out[t][m * PANEL + i] + (bias ? bias[n0 + i] : 0.0f);
        m0 += tile;
      }
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
  static void bf16_tile##MT(const uint16_t* w, const uint16_t* x, long ldx, long K, long k0, long k1,   \
                            int resume, float* out) {                                                    \
    ROWS##MT(DECLARE)                                                                                    \
    for (long k = k0; k < k1; k++) {                                                                     \
      const uint16_t* row = w + k * 2 * PANEL;                                                           \
      _mm_prefetch((const char*)(row + CHUNK * 2 * PANEL), _MM_HINT_T0);                                 \
      _mm_prefetch((const char*)(row + CHUNK * 2 * PANEL + 32), _MM_HINT_T0);                            \
      _mm_prefetch((const char*)(row + CHUNK * 2 * PANEL + 64), _MM_HINT_T0);                            \
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
  float out[GROUP_TILES + 2][8 * PANEL]; /* a group's tiles: at most GROUP_TILES + 2 (63 rows = 7 x 8 + 4 + 2 + 1) */
  for (long p = p0; p < p1; p++) {
    const uint16_t* w = W + p * pairs * 2 * PANEL;
    long n0 = p * PANEL, count = N - n0 < PANEL ? N - n0 : PANEL;
    for (long g0 = 0; g0 < M; g0 += GROUP_TILES * 8) {
      long g1 = M - g0 < GROUP_TILES * 8 ? M : g0 + GROUP_TILES * 8;
      long step = g1 - g0 > 8 ? CHUNK : pairs; /* several tiles: chunks of k pairs, each read once from memory */
      for (long k0 = 0; k0 < pairs; k0 += step) {
        long k1 = pairs - k0 < step ? pairs : k0 + step;
        for (long m0 = g0, t = 0; m0 < g1; t++) {
          long tile = g1 - m0 >= 8 ? 8 : g1 - m0 >= 4 ? 4 : g1 - m0 >= 2 ? 2 : 1;
          const uint16_t* x = X + m0 * K;
          if (tile == 8) bf16_tile8(w, x, K, K, k0, k1, k0 > 0, out[t]);
          else if (tile == 4) bf16_tile4(w, x, K, K, k0, k1, k0 > 0, out[t]);
          else if (tile == 2) bf16_tile2(w, x, K, K, k0, k1, k0 > 0, out[t]);
          else bf16_tile1(w, x, K, K, k0, k1, k0 > 0, out[t]);
          m0 += tile;
        }
      }
      for (long m0 = g0, t = 0; m0 < g1; t++) {
        long tile = g1 - m0 >= 8 ? 8 : g1 - m0 >= 4 ? 4 : g1 - m0 >= 2 ? 2 : 1;
        for (long m = 0; m < tile; m++)
          for (long i = 0; i < count; i++)
            Y[(m0 + m) * N + n0 + i] = to_bf16(out[t][m * PANEL + i] + (bias ? bias[n0 + i] : 0.0f));
        m0 += tile;
      }
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

/* ================================================================================================ attention
 * out[t, h * D + d] = sum_s p[h, t, s] v[g, s, d],  p = softmax_s(scale * q[h, t] . k[g, s] + mask[t, s]),  g = h / (Hq / Hk)
 * for a few queries t over S cached keys (grouped-query attention; mask additive float32 [T, S] or NULL = all visible).
 *
 * Row-invariant, like the linears: each (head, query) is computed alone, by the same sequence of operations whatever
 * T is, and a key it does not see (mask below -1e30) contributes nothing: no score, and exactly nothing to either sum,
 * so a query gets the same bits whether other queries' keys sit between its own or not. Scores: per key, the dot
 * product over D accumulates in one vector, then 16 keys' vectors are summed across lanes together, each by the same
 * tree of additions; then scale, mask, and softmax in float32 with an exp accurate to ~1 ulp. float32 (f32_attend_heads):
 * the weighted sum of V and the normaliser accumulate key by key, in slot order, hidden keys skipped. bf16
 * (bf16_attend_group): over the list of the keys the query sees, see there. (Compiled with -ffp-contract=off: no
 * fused multiply-add appears that the source does not spell out.) */
#if defined(__AVX512F__)
static inline __m512 exp_le0(__m512 x) { /* exp(x) for x <= 0 (Cephes' expf); 0 below -104 and for -inf */
  const __m512 low = _mm512_set1_ps(-104.0f);
  __mmask16 keep = _mm512_cmp_ps_mask(x, low, _CMP_GE_OQ);
  x = _mm512_max_ps(x, low);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_scalef_ps(keep, y, n);
}

#define HIDDEN (-1e30f) /* mask values below this hide the key */
#define INLINE static inline __attribute__((always_inline))

/* The lane sums of 16 vectors, as one vector (lane i = the sum of x_i's lanes, every x_i by the same tree). */

#define HALVES(a, b) _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE))
#define QUARTERS(a, b) _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD))
#define PAIRS(a, b) _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE))
#define SINGLES(a, b) _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD))
INLINE __m512 lane_sums16(__m512 x0, __m512 x1, __m512 x2, __m512 x3, __m512 x4, __m512 x5, __m512 x6, __m512 x7,
                          __m512 x8, __m512 x9, __m512 x10, __m512 x11, __m512 x12, __m512 x13, __m512 x14,
                          __m512 x15, __m512i order) {
  __m512 b0 = HALVES(x0, x8), b1 = HALVES(x1, x9), b2 = HALVES(x2, x10), b3 = HALVES(x3, x11);
  __m512 b4 = HALVES(x4, x12), b5 = HALVES(x5, x13), b6 = HALVES(x6, x14), b7 = HALVES(x7, x15);
  __m512 c0 = QUARTERS(b0, b4), c1 = QUARTERS(b1, b5), c2 = QUARTERS(b2, b6), c3 = QUARTERS(b3, b7);
  __m512 d0 = PAIRS(c0, c2), d1 = PAIRS(c1, c3);
  return _mm512_permutexvar_ps(order, SINGLES(d0, d1)); /* back to key order */
}

/* scores[s] -> exp(scores[s] - top) in place (hidden keys are -inf: exp gives 0) */
static void softmax_numerators(float* scores, long S, float top) {
  __m512 shift = _mm512_set1_ps(top);
  long s = 0;
  for (; s + 16 <= S; s += 16) _mm512_storeu_ps(scores + s, exp_le0(_mm512_sub_ps(_mm512_loadu_ps(scores + s), shift)));
  if (s < S) {
    __mmask16 rest = (__mmask16)((1u << (S - s)) - 1u);
    _mm512_mask_storeu_ps(scores + s, rest, exp_le0(_mm512_sub_ps(_mm512_maskz_loadu_ps(rest, scores + s), shift)));
  }
}

static __m512i lane_order(void) { /* where lane_sums16 puts key i; its inverse restores key order */
  float probe[16], where[16];
  __m512 x[16];
  for (int i = 0; i < 16; i++) {
    for (int j = 0; j < 16; j++) probe[j] = j == 0 ? (float)i : 0.0f;
    x[i] = _mm512_loadu_ps(probe);
  }
  _mm512_storeu_ps(where, lane_sums16(x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], x[8], x[9], x[10], x[11],
                                      x[12], x[13], x[14], x[15], _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                                                   6, 5, 4, 3, 2, 1, 0)));
  int32_t order[16];
  for (int lane = 0; lane < 16; lane++) order[(int)where[lane]] = lane;
  return _mm512_loadu_si512(order);
}


INLINE __m512 f32_dot(const float* q, const float* k, const long D) {
  __m512 acc = _mm512_setzero_ps();
  for (long d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc);
  return acc;
}

/* float32 attention of P query heads of one query that read the same KV head (head h's query at qp + h q_head, its
 * result to out + h D): result[j] (D / 16 vectors) = sum_s p[s] V[s, :] / sum_s p[s]. Each head's operations are
 * those it gets alone (so the result does not depend on P, nor on which heads share a call): scores 16 keys at a
 * time, each key's dot product over D in one vector (d = 0, 16, ... in order), the 16 keys' vectors summed across
 * lanes by `lane_sums16` (hidden keys get -inf); the weighted sum and the normaliser key by key in slot order, hidden
 * keys skipped, then one division. The heads share each load of K and V: the 16 keys' K rows (in L1) serve
 * SCORE_HEADS heads at a time whose queries sit in registers, and each V row serves every head, D in chunks of
 * `value_vectors` vectors so that the sums stay in registers. So K and V are read once per query for the group of
 * heads instead of once per head (Qwen2.5-1.5B: 6 heads per KV head). scores: room for P (S + 16) floats. */
#define SCORE_HEADS(D) ((D) <= 64 ? 4 : (D) <= 128 ? 2 : 1)
#define MOST_HEADS 8 /* heads per call */
static inline long value_vectors(int P, long D) { /* chunk of D / 16 whose P sums fit in 24 registers */
  long n = D / 16, c = P <= 2 ? 8 : P <= 6 ? 4 : 2;
  while (c > n || n % c) c /= 2;
  return c;
}

/* The dot products of n heads' queries (q + h q_head, in registers: n D / 16 vectors) with the 16 keys from s0 (K
 * rows kv_row apart, each loaded once for the n heads; hidden ones 0), into x[(h 16 + i) 16 ..]: each a vector
 * accumulated over d = 0, 16, ... in order. */
#define SCORE_PASS(n, V)                                                                                           \
  INLINE void score_pass_##n##_##V(const float* q, long q_head, const float* kp, long kv_row, long s0,           \
                                   __mmask16 shown, float* x) {                                                  \
    __m512 qv[n][V];                                                                                              \
    _Pragma("GCC unroll 4") for (int h = 0; h < n; h++)                                                           \
      _Pragma("GCC unroll 8") for (int d = 0; d < V; d++) qv[h][d] = _mm512_loadu_ps(q + h * q_head + 16 * d);   \
    for (int i = 0; i < 16; i++) {                                                                                \
      const float* kr = kp + (s0 + i) * kv_row;                                                                   \
      __m512 acc[n];                                                                                              \
      _Pragma("GCC unroll 4") for (int h = 0; h < n; h++) acc[h] = _mm512_setzero_ps();                          \
      if ((shown >> i) & 1) {                                                                                     \
        _Pragma("GCC unroll 8") for (int d = 0; d < V; d++) {                                                     \
          __m512 k = _mm512_loadu_ps(kr + 16 * d);                                                                \
          _Pragma("GCC unroll 4") for (int h = 0; h < n; h++) acc[h] = _mm512_fmadd_ps(qv[h][d], k, acc[h]);     \
        }                                                                                                         \
      }                                                                                                           \
      _Pragma("GCC unroll 4") for (int h = 0; h < n; h++) _mm512_store_ps(x + (h * 16 + i) * 16, acc[h]);       \
    }                                                                                                             \
  }
SCORE_PASS(1, 4)
SCORE_PASS(2, 4)
SCORE_PASS(3, 4)
SCORE_PASS(4, 4)
SCORE_PASS(1, 8)
SCORE_PASS(2, 8)
INLINE void score_pass_any(const float* q, const long D, const float* kp, long kv_row, long s0, __mmask16 shown,
                           float* x) {
  for (int i = 0; i < 16; i++)
    _mm512_store_ps(x + i * 16, (shown >> i) & 1 ? f32_dot(q, kp + (s0 + i) * kv_row, D) : _mm512_setzero_ps());
}

/* The weighted sums of V of P heads, vectors c0 .. c0 + C - 1 of D / 16: acc[h] = sum over the keys shown, in slot
 * order, of p_h[s] V[s] (p_h at scores + h stride), into out + h D + 16 c0; with c0 = 0 also each head's normaliser
 * (total[h] += p_h[s], in the same order). Each row's C vectors are loaded once for the P heads. */
#define VALUE_PASS(P, C)                                                                                           \
  INLINE void value_pass_##P##_##C(const float* scores, long stride, const float* vp, long kv_row,                \
                                   const float* mask, long S, long c0, float* total, float* out, long D) {      \
    __m512 acc[P][C];                                                                                             \
    _Pragma("GCC unroll 8") for (int h = 0; h < P; h++)                                                           \
      _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[h][c] = _mm512_setzero_ps();                       \
    for (long s = 0; s < S; s++) {                                                                                \
      if (mask && mask[s] < HIDDEN) continue;                                                                     \
      __m512 row[C];                                                                                              \
      _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) row[c] = _mm512_loadu_ps(vp + s * kv_row + 16 * (c0 + c)); \
      _Pragma("GCC unroll 8") for (int h = 0; h < P; h++) {                                                       \
        float p = scores[h * stride + s];                                                                         \
        if (c0 == 0) total[h] += p;                                                                               \
        __m512 weight = _mm512_set1_ps(p);                                                                        \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[h][c] = _mm512_fmadd_ps(weight, row[c], acc[h][c]); \
      }                                                                                                           \
    }                                                                                                             \
    _Pragma("GCC unroll 8") for (int h = 0; h < P; h++)                                                           \
      _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) _mm512_storeu_ps(out + h * D + 16 * (c0 + c), acc[h][c]); \
  }
/* the (P, C) that `value_vectors` gives */
VALUE_PASS(1, 8) VALUE_PASS(2, 8) VALUE_PASS(1, 4) VALUE_PASS(2, 4) VALUE_PASS(3, 4) VALUE_PASS(4, 4)
VALUE_PASS(5, 4) VALUE_PASS(6, 4) VALUE_PASS(1, 2) VALUE_PASS(2, 2) VALUE_PASS(3, 2) VALUE_PASS(4, 2)
VALUE_PASS(5, 2) VALUE_PASS(6, 2) VALUE_PASS(7, 2) VALUE_PASS(8, 2) VALUE_PASS(1, 1) VALUE_PASS(2, 1)
VALUE_PASS(3, 1) VALUE_PASS(4, 1) VALUE_PASS(5, 1) VALUE_PASS(6, 1) VALUE_PASS(7, 1) VALUE_PASS(8, 1)
#define VALUE_PASSES(P, C)                                                                                         \
  switch ((P) * 16 + (C)) {                                                                                        \
    case 24: value_pass_1_8(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 40: value_pass_2_8(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 20: value_pass_1_4(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 36: value_pass_2_4(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 52: value_pass_3_4(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 68: value_pass_4_4(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 84: value_pass_5_4(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 100: value_pass_6_4(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 18: value_pass_1_2(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 34: value_pass_2_2(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 50: value_pass_3_2(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 66: value_pass_4_2(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 82: value_pass_5_2(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 98: value_pass_6_2(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 114: value_pass_7_2(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 130: value_pass_8_2(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 17: value_pass_1_1(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 33: value_pass_2_1(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 49: value_pass_3_1(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 65: value_pass_4_1(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 81: value_pass_5_1(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 97: value_pass_6_1(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 113: value_pass_7_1(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
    case 129: value_pass_8_1(scores, stride, vp, kv_row, mask, S, c0, total, out, D); break; \
  }

INLINE void f32_attend_heads(const int P, const float* qp, long q_head, const float* kp, const float* vp, long kv_row,
                             const float* mask, long S, const long D, float scale, float* scores, float* out,
                             __m512i order) {
  const long stride = S + 16, V = D / 16, HS = SCORE_HEADS(D);
  float top[MOST_HEADS];
  for (int h = 0; h < P; h++) top[h] = -INFINITY;
  __m512 scaled = _mm512_set1_ps(scale);
  float xs[MOST_HEADS * 16 * 16] __attribute__((aligned(64))); /* per head, the 16 keys' dot-product vectors */
  for (long s0 = 0; s0 < S; s0 += 16) {
    __mmask16 shown = 0;
    for (int i = 0; i < 16 && s0 + i < S; i++)
      if (!(mask && mask[s0 + i] < HIDDEN)) shown |= (__mmask16)(1u << i);
    for (int h0 = 0; h0 < P; h0 += HS) {
      const int n = P - h0 < HS ? P - h0 : HS;
      const float* qh = qp + h0 * q_head;
      float* xh = xs + h0 * 256;
      if (D == 128 && n == 2) score_pass_2_8(qh, q_head, kp, kv_row, s0, shown, xh);
      else if (D == 64 && n == 4) score_pass_4_4(qh, q_head, kp, kv_row, s0, shown, xh);
      else if (D == 64 && n == 3) score_pass_3_4(qh, q_head, kp, kv_row, s0, shown, xh);
      else if (D == 64 && n == 2) score_pass_2_4(qh, q_head, kp, kv_row, s0, shown, xh);
      else if (D == 128) score_pass_1_8(qh, q_head, kp, kv_row, s0, shown, xh);
      else if (D == 64) score_pass_1_4(qh, q_head, kp, kv_row, s0, shown, xh);
      else
        for (int h = 0; h < n; h++) score_pass_any(qh + h * q_head, D, kp, kv_row, s0, shown, xh + h * 256);
    }
    long count = S - s0 < 16 ? S - s0 : 16;
    __m512 masked = mask ? _mm512_maskz_loadu_ps(shown, mask + s0) : _mm512_setzero_ps();
    for (int h = 0; h < P; h++) {
      const float* x = xs + h * 256;
#define X(i) _mm512_load_ps(x + 16 * (i))
      __m512 sums = lane_sums16(X(0), X(1), X(2), X(3), X(4), X(5), X(6), X(7), X(8), X(9), X(10), X(11), X(12),
                                X(13), X(14), X(15), order);
#undef X
      __m512 values = _mm512_mask_blend_ps(shown, _mm512_set1_ps(-INFINITY),
                                           _mm512_add_ps(_mm512_mul_ps(sums, scaled), masked));
      top[h] = fmaxf(top[h], _mm512_mask_reduce_max_ps(shown, values));
      _mm512_mask_storeu_ps(scores + h * stride + s0, (__mmask16)((1u << count) - 1u), values);
    }
  }
  for (int h = 0; h < P; h++) softmax_numerators(scores + h * stride, S, top[h]);
  float total[MOST_HEADS];
  for (int h = 0; h < P; h++) total[h] = 0.0f;
  const long C = value_vectors(P, D);
  for (long c0 = 0; c0 < V; c0 += C)
    VALUE_PASSES(P, C)
  for (int h = 0; h < P; h++) {
    __m512 norm = _mm512_set1_ps(total[h]);
    for (long j = 0; j < V; j++)
      _mm512_storeu_ps(out + h * D + 16 * j, _mm512_div_ps(_mm512_loadu_ps(out + h * D + 16 * j), norm));
  }
}

/* How the float32 attention of T queries is shared out: an item is (KV head g, query t, part), and part p of g's
 * `groups` query heads is heads [p P, (p + 1) P) of it (P = ceil(groups / parts), the last part what is left). One part
 * per KV head and query unless that leaves the team unevenly loaded (fewer items than 4 per thread, not a multiple of
 * them): then one head per item. A head's result is the same either way (`f32_attend_heads`). */
static long f32_parts(long groups, long Hk, long T, int threads) {
  long whole = (groups + MOST_HEADS - 1) / MOST_HEADS, items = Hk * T * whole;
  return items % threads == 0 || items >= 4 * threads ? whole : groups;
}

/* work item `item` (see `f32_parts`) of float32 attention: heads of query t into out[t, h D ..]; scores: room for
 * MOST_HEADS (S + 16) floats */
INLINE void f32_attention_item(long item, long T, long groups, long parts, const float* q, long q_head, long q_row,
                               const float* k, const float* v, long kv_head, long kv_row, const float* mask,
                               long mask_row, float* out, long out_row, long S, long D, float scale, float* scores,
                               __m512i order) {
  long part = item % parts, t = item / parts % T, g = item / parts / T;
  long size = (groups + parts - 1) / parts, h0 = g * groups + part * size;
  long h1 = h0 + size < (g + 1) * groups ? h0 + size : (g + 1) * groups;
  const float* qp = q + h0 * q_head + t * q_row;
  const float* m = mask ? mask + t * mask_row : NULL;
  const float *kp = k + g * kv_head, *vp = v + g * kv_head;
  float* row = out + t * out_row + h0 * D;
  switch (h1 - h0) {
#define HEADS(P)                                                                                                     \
  case P:                                                                                                            \
    if (D == 64) f32_attend_heads(P, qp, q_head, kp, vp, kv_row, m, S, 64, scale, scores, row, order);               \
    else if (D == 128) f32_attend_heads(P, qp, q_head, kp, vp, kv_row, m, S, 128, scale, scores, row, order);        \
    else f32_attend_heads(P, qp, q_head, kp, vp, kv_row, m, S, D, scale, scores, row, order);                        \
    break;
    HEADS(1) HEADS(2) HEADS(3) HEADS(4) HEADS(5) HEADS(6) HEADS(7) HEADS(8)
#undef HEADS
  }
}

void cats_attention_f32(const float* q, long q_head, long q_row, const float* k, const float* v, long kv_head,
                        long kv_row, const float* mask, long mask_row, float* out, long Hq, long Hk, long T, long S,
                        long D, float scale, int threads) {
  long groups = Hq / Hk, parts = f32_parts(groups, Hk, T, threads), items = Hk * T * parts;
  __m512i order = lane_order();
#pragma omp parallel num_threads(threads > items ? (int)items : threads)
  {
    float* scores = (float*)malloc(sizeof(float) * MOST_HEADS * (S + 16));
#pragma omp for schedule(static)
    for (long item = 0; item < items; item++)
      f32_attention_item(item, T, groups, parts, q, q_head, q_row, k, v, kv_head, kv_row, mask, mask_row, out, Hq * D,
                         S, D, scale, scores, order);
    free(scores);
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
INLINE __m512 bf16_dot(const __m512bh* query, const uint16_t* k, const long D) {
  __m512 acc = _mm512_setzero_ps();
  for (long c = 0; c < D / 32; c++) acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(k + c * 32), query[c]);
  return acc;
}
/* bf16 attention, the query heads of one KV head together: the keys a query sees are listed first (in slot order),
 * and everything after runs over that list, so hidden keys take no part at all. Scores as in f32_attend_heads, per head;
 * softmax in float32 (the normaliser a vector sum over the list, lanes by list position); the weighted sum of V runs
 * over consecutive pairs of listed keys by vdpbf16ps (V rows interleaved pairwise, the probabilities rounded to
 * bf16 by vcvtneps2bf16, as flash attention rounds them), for up to GROUP_HEADS heads per pass sharing each pair's load. */
#define GROUP_HEADS 4
static const uint16_t zero_row[256];

INLINE void bf16_attend_group(const uint16_t* const* queries, uint16_t* const* outs, int heads, const uint16_t* kp,
                              const uint16_t* vp, long kv_row, const float* mask, long S, const long D, float scale,
                              int32_t* listed, float* scores, uint16_t* probabilities, __m512i order) {
  long n = 0; /* the visible keys, in slot order */
  if (mask) {
    const __m512i step = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (long s0 = 0; s0 < S; s0 += 16) {
      __mmask16 in = S - s0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (S - s0)) - 1u);
      __mmask16 shown = _mm512_mask_cmp_ps_mask(in, _mm512_maskz_loadu_ps(in, mask + s0), _mm512_set1_ps(HIDDEN),
                                                _CMP_GE_OQ);
      _mm512_mask_compressstoreu_epi32(listed + n, shown, _mm512_add_epi32(step, _mm512_set1_epi32((int)s0)));
      n += __builtin_popcount(shown);
    }
  } else {
    for (long s = 0; s < S; s++) listed[s] = (int32_t)s;
    n = S;
  }
  long stride = n + 32;
  float totals[GROUP_HEADS];
  for (int head = 0; head < heads; head++) {
    float* sc = scores + head * stride;
    __m512bh query[8];
    for (long c = 0; c < D / 32; c++) query[c] = (__m512bh)_mm512_loadu_si512(queries[head] + c * 32);
    __m512 scaled = _mm512_set1_ps(scale), top = _mm512_set1_ps(-INFINITY);
    for (long j0 = 0; j0 < n; j0 += 16) {
      long count = n - j0 < 16 ? n - j0 : 16;
      __mmask16 in = (__mmask16)((1u << count) - 1u);
      __m512 x[16];
      _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++) x[i] =
          i < count ? bf16_dot(query, kp + (long)listed[j0 + i] * kv_row, D) : _mm512_setzero_ps();
      __m512 sums = lane_sums16(x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], x[8], x[9], x[10], x[11], x[12],
                                x[13], x[14], x[15], order);
      __m512 added = mask ? _mm512_mask_i32gather_ps(_mm512_setzero_ps(), in,
                                                     _mm512_maskz_loadu_epi32(in, listed + j0), mask, 4)
                          : _mm512_setzero_ps();
      __m512 values = _mm512_add_ps(_mm512_mul_ps(sums, scaled), added);
      top = _mm512_mask_max_ps(top, in, top, values);
      _mm512_mask_storeu_ps(sc + j0, in, values);
    }
    softmax_numerators(sc, n, _mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (long j0 = 0; j0 < n; j0 += 16) {
      __mmask16 in = n - j0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j0)) - 1u);
      total = _mm512_add_ps(total, _mm512_maskz_loadu_ps(in, sc + j0));
    }
    totals[head] = _mm512_reduce_add_ps(total);
    uint16_t* pb = probabilities + head * stride; /* bf16 (round to nearest even), pairs read as one 32-bit value */
    for (long j0 = 0; j0 < n; j0 += 16) {
      __mmask16 in = n - j0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j0)) - 1u);
      _mm256_mask_storeu_epi16(pb + j0, in, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(in, sc + j0)));
    }
    pb[n] = 0; /* the odd last key's partner */
  }
  __m512 acc[GROUP_HEADS][16];
  for (int head = 0; head < heads; head++)
    for (long j = 0; j < D / 16; j++) acc[head][j] = _mm512_setzero_ps();
  for (long j = 0; j < n; j += 2) {
    const uint16_t* a = vp + (long)listed[j] * kv_row;
    const uint16_t* b = j + 1 < n ? vp + (long)listed[j + 1] * kv_row : zero_row;
    __m512bh pairs[16]; /* chunk c of 32 values: pairs[2c] = d in 8L..8L+3, pairs[2c+1] = 8L+4..8L+7, per 128-bit L */
    for (long c = 0; c < D / 32; c++) {
      __m512i va = _mm512_loadu_si512(a + c * 32), vb = _mm512_loadu_si512(b + c * 32);
      pairs[2 * c] = (__m512bh)_mm512_unpacklo_epi16(va, vb);
      pairs[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(va, vb);
    }
    for (int head = 0; head < heads; head++) {
      int32_t pair;
      memcpy(&pair, probabilities + head * stride + j, 4);
      __m512bh weight = (__m512bh)_mm512_set1_epi32(pair);
      for (long k = 0; k < D / 16; k++) acc[head][k] = _mm512_dpbf16_ps(acc[head][k], pairs[k], weight);
    }
  }
  for (int head = 0; head < heads; head++) {
    float lanes[256];
    for (long k = 0; k < D / 16; k++) _mm512_storeu_ps(lanes + k * 16, acc[head][k]);
    for (long k = 0; k < D / 16; k++)
      for (int e = 0; e < 16; e++) { /* lane e of pairs[k]: d = 32 (k / 2) + 8 (e / 4) + 4 (k % 2) + e % 4 */
        long d = 32 * (k / 2) + 8 * (e / 4) + 4 * (k % 2) + e % 4;
        outs[head][d] = to_bf16(lanes[k * 16 + e] / totals[head]);
      }
  }
}

/* per-thread buffers of bf16 attention over S keys */
struct bf16_buffers {
  int32_t* listed;
  float* scores;
  uint16_t* probabilities;
};
static struct bf16_buffers bf16_buffers_new(long S) {
  struct bf16_buffers b = {(int32_t*)malloc(sizeof(int32_t) * (S + 16)),
                           (float*)malloc(sizeof(float) * GROUP_HEADS * (S + 32)),
                           (uint16_t*)malloc(sizeof(uint16_t) * GROUP_HEADS * (S + 32))};
  return b;
}
static void bf16_buffers_free(struct bf16_buffers b) {
  free(b.probabilities);
  free(b.scores);
  free(b.listed);
}

/* work item ``item`` of bf16 attention (= (g T + t) passes + pass): query t of up to GROUP_HEADS query heads of KV
 * head g, into out[t, h D ..] */
INLINE void bf16_attention_item(long item, long T, long groups, long passes, const uint16_t* q, long q_head, long q_row,
                                const uint16_t* k, const uint16_t* v, long kv_head, long kv_row, const float* mask,
                                long mask_row, uint16_t* out, long out_row, long S, long D, float scale,
                                struct bf16_buffers b, __m512i order) {
  long g = item / (T * passes), t = (item / passes) % T, pass = item % passes;
  long first = g * groups + pass * GROUP_HEADS;
  int heads = (int)(groups - pass * GROUP_HEADS < GROUP_HEADS ? groups - pass * GROUP_HEADS : GROUP_HEADS);
  const uint16_t* queries[GROUP_HEADS];
  uint16_t* outs[GROUP_HEADS];
  for (int i = 0; i < heads; i++) {
    queries[i] = q + (first + i) * q_head + t * q_row;
    outs[i] = out + t * out_row + (first + i) * D;
  }
  const float* m = mask ? mask + t * mask_row : NULL;
  if (D == 64)
    bf16_attend_group(queries, outs, heads, k + g * kv_head, v + g * kv_head, kv_row, m, S, 64, scale, b.listed,
                      b.scores, b.probabilities, order);
  else
    bf16_attend_group(queries, outs, heads, k + g * kv_head, v + g * kv_head, kv_row, m, S, D, scale, b.listed,
                      b.scores, b.probabilities, order);
}

void cats_attention_bf16(const uint16_t* q, long q_head, long q_row, const uint16_t* k, const uint16_t* v,
                         long kv_head, long kv_row, const float* mask, long mask_row, uint16_t* out, long Hq, long Hk,
                         long T, long S, long D, float scale, int threads) {
  long groups = Hq / Hk, passes = (groups + GROUP_HEADS - 1) / GROUP_HEADS, items = Hk * T * passes;
  __m512i order = lane_order();
#pragma omp parallel num_threads(threads > items ? (int)items : threads)
  {
    struct bf16_buffers buffers = bf16_buffers_new(S);
#pragma omp for schedule(static)
    for (long item = 0; item < items; item++)
      bf16_attention_item(item, T, groups, passes, q, q_head, q_row, k, v, kv_head, kv_row, mask, mask_row, out,
                          Hq * D, S, D, scale, buffers, order);
    bf16_buffers_free(buffers);
  }
}
#endif

/* ================================================================================================ one decoder layer
 * A Llama-style decoder layer (Llama, Mistral, Qwen2: RMSNorm, q/k/v with optional biases, rotary over the whole head,
 * grouped-query attention, o, RMSNorm, SiLU-gated MLP) for a few tokens, in one call and one OpenMP region: what the
 * lean forward does with ~40 torch ops and five kernel calls per layer. The linears and attention are the kernels
 * above (so the same bits as there); the elementwise steps round to bf16 after every op exactly where torch's bf16
 * ops round (norm: float32 inside, then `weight * x.to(bf16)`; rotary: each product, then the sum; residual adds;
 * `silu(gate)` then `* up`), so the layer is row-invariant too: every token's results are computed by the same
 * operations whatever T is. (The RMSNorm's sum of squares and SiLU's exp are this file's own, so the last bits can
 * differ from torch's here and there.) ``hidden`` [T, H] is updated in place; the new tokens' K and V are written to
 * slots past .. past + T - 1 of the cache buffers ([Hk][capacity][D] per layer); scratch holds the intermediates. */
#if defined(__AVX512F__)
struct cats_layer {
  int bf16; /* element type: 1 = bfloat16, 0 = float32 */
  long H, Hq, Hk, D, inter;
  float eps1, eps2, scale;
  const void *ln1, *ln2;                  /* [H] */
  const void* qkv; const float* qkv_bias;  /* panels of [q; k; v] ([Hq D + 2 Hk D, H]), float32 bias or NULL */
  const void* o; const float* o_bias;      /* [H, Hq D] */
  const void* gate_up; const float* gate_up_bias; /* [gate; up] ([2 inter, H]) */
  const void* down; const float* down_bias; /* [H, inter] */
  /* NULL: the four linears above are packed panels. Else they are GGUF block linears (float32 only): qkv, o, gate_up
   * and down each point to a group of linears that this function multiplies, called by every thread of the team
   * (`cats_quantized_team` in quantized.c; the biases are the groups' own, the *_bias fields unused). */
  int (*blocks)(const void* group, const float* X, float* Y, long M);
  /* blocks only, NULL where q and k are stored in the model's order: column j of [q; k] in the model's order is
   * column qk_order[j] of the block linears' output (llama.cpp's converter reorders Llama's q and k rows) */
  const long* qk_order;
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAS_BF16 1
INLINE float bf16_value(uint16_t x) {
  uint32_t u = (uint32_t)x << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
#else
#define HAS_BF16 0
INLINE float bf16_value(uint16_t x) { (void)x; return 0.0f; }
static inline uint16_t to_bf16(float f) { (void)f; return 0; }
#endif

INLINE float load_at(const void* p, long i, int bf16) {
  return bf16 ? bf16_value(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}
INLINE void store_at(void* p, long i, float v, int bf16) {
  if (bf16) ((uint16_t*)p)[i] = to_bf16(v);
  else ((float*)p)[i] = v;
}
INLINE float rounded(float v, int bf16) { return bf16 ? bf16_value(to_bf16(v)) : v; }

/* RMSNorm of one row: out = w * (x * rsqrt(mean(x^2) + eps)), the product rounded as torch rounds it */
static void norm_row(const void* x, const void* w, void* out, long H, float eps, int bf16) {
  __m512 acc = _mm512_setzero_ps();
  float row[H];
  for (long i = 0; i < H; i++) row[i] = load_at(x, i, bf16);
  long i = 0;
  for (; i + 16 <= H; i += 16) {
    __m512 v = _mm512_loadu_ps(row + i);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  float sum = _mm512_reduce_add_ps(acc);
  for (; i < H; i++) sum += row[i] * row[i];
  float scale = 1.0f / sqrtf(sum / (float)H + eps);
  long j = 0;
  if (!bf16) /* float32: the same products, 16 at a time */
    for (; j + 16 <= H; j += 16)
      _mm512_storeu_ps((float*)out + j, _mm512_mul_ps(_mm512_loadu_ps((const float*)w + j),
                                                      _mm512_mul_ps(_mm512_loadu_ps(row + j), _mm512_set1_ps(scale))));
  for (; j < H; j++) store_at(out, j, load_at(w, j, bf16) * rounded(row[j] * scale, bf16), bf16);
}

/* the residual add of one row, row += update, rounded as torch's bf16 add rounds */
static void add_row(void* row, const void* update, long H, int bf16) {
  long j = 0;
  if (!bf16) /* float32: the same sums, 16 at a time */
    for (; j + 16 <= H; j += 16)
      _mm512_storeu_ps((float*)row + j, _mm512_add_ps(_mm512_loadu_ps((const float*)row + j),
                                                      _mm512_loadu_ps((const float*)update + j)));
  for (; j < H; j++) store_at(row, j, load_at(row, j, bf16) + load_at(update, j, bf16), bf16);
}

/* the linear y = x W^T (+ bias) of M rows, this thread's share of the panels (caller: barrier after) */
static void shared_linear(const void* W, const void* X, const float* bias, void* Y, long M, long N, long K, int bf16) {
  long p0, p1;
  split((N + PANEL - 1) / PANEL, &p0, &p1);
  if (p0 >= p1) return;
#if HAS_BF16
  if (bf16) {
    bf16_panels((const uint16_t*)W, (const uint16_t*)X, bias, (uint16_t*)Y, M, N, K, p0, p1);
    return;
  }
#endif
  f32_panels((const float*)W, (const float*)X, bias, (float*)Y, M, N, K, p0, p1);
}

/* one linear of the layer, y = x W^T (+ bias) for the T rows, by the whole team (every thread calls it; the rows of y
 * are complete for all when it returns); `failed` collects the block linears' errors */
#define LAYER_LINEAR(W, bias, X, Y, N, K)                                                        \
  if (L->blocks) {                                                                              \
    int done = L->blocks(W, (const float*)(X), (float*)(Y), T);                                 \
    if (done) {                                                                                 \
      _Pragma("omp atomic write") failed = done;                                                \
    }                                                                                           \
  } else {                                                                                      \
    shared_linear(W, X, bias, Y, T, N, K, bf16);                                                \
    _Pragma("omp barrier")                                                                      \
  }

#define SILU_PIECE 512 /* values of a token's gate that one thread takes at a time (a multiple of 16) */

/* Returns 0, or what a block linear returned (-1: a type it does not take, -2: out of memory). */
int cats_layer(const struct cats_layer* L, void* hidden, long T, const void* cos, const void* sin, void* kbuf,
               void* vbuf, long kv_head, long past, const float* mask, long mask_row, void* scratch, int threads) {
  const int bf16 = L->bf16;
  const long H = L->H, D = L->D, Hq = L->Hq, Hk = L->Hk, I = L->inter, S = past + T, half = D / 2;
  const long qw = Hq * D, kw = Hk * D, width = qw + 2 * kw, size = bf16 ? 2 : 4;
  char* at = (char*)scratch;
  void* normed = at; at += T * H * size;
  void* qkv = at; at += T * width * size;
  void* query = at; at += T * qw * size;
  void* attended = at; at += T * qw * size;
  void* projected = at; at += T * H * size;
  void* gate_up = at; at += T * 2 * I * size;
  void* activated = at;
  long groups = Hq / Hk, passes = (groups + GROUP_HEADS - 1) / GROUP_HEADS;
  long parts = f32_parts(groups, Hk, T, threads), items = bf16 ? Hk * T * passes : Hk * T * parts;
  __m512i order = lane_order();
  const long* qk_order = L->blocks ? L->qk_order : NULL;
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (long t = 0; t < T; t++)
      norm_row((char*)hidden + t * H * size, L->ln1, (char*)normed + t * H * size, H, L->eps1, bf16);
    LAYER_LINEAR(L->qkv, L->qkv_bias, normed, qkv, width, H)
    /* rotary on q and k (x cos + rotate_half(x) sin, each product rounded, then the sum), K and V into the cache */
#pragma omp for schedule(static)
    for (long item = 0; item < T * (Hq + Hk); item++) {
      long t = item / (Hq + Hk), head = item % (Hq + Hk);
      const char* row = (const char*)qkv + t * width * size; /* column j of [q; k]: at(j) */
#define at(j) (qk_order ? qk_order[j] : (j))
      void* target = head < Hq ? (void*)((char*)query + (t * qw + head * D) * size)
                               : (void*)((char*)kbuf + ((head - Hq) * kv_head + (past + t) * D) * size);
      for (long d = 0, j = head * D; d < D; d++, j++) {
        float x = load_at(row, at(j), bf16);
        float turned = d < half ? -load_at(row, at(j + half), bf16) : load_at(row, at(j - half), bf16);
        float c = load_at(cos, t * D + d, bf16), s = load_at(sin, t * D + d, bf16);
        store_at(target, d, rounded(x * c, bf16) + rounded(turned * s, bf16), bf16);
      }
      if (head >= Hq) /* its V */
        memcpy((char*)vbuf + ((head - Hq) * kv_head + (past + t) * D) * size,
               (const char*)qkv + (t * width + qw + kw + (head - Hq) * D) * size, D * size);
    }
#undef at
    if (bf16) {
#if HAS_BF16
      struct bf16_buffers buffers = bf16_buffers_new(S);
#pragma omp for schedule(static)
      for (long item = 0; item < items; item++)
        bf16_attention_item(item, T, groups, passes, (const uint16_t*)query, D, qw, (const uint16_t*)kbuf,
                            (const uint16_t*)vbuf, kv_head, D, mask, mask_row, (uint16_t*)attended, qw, S, D, L->scale,
                            buffers, order);
      bf16_buffers_free(buffers);
#endif
    } else {
      float* scores = (float*)malloc(sizeof(float) * MOST_HEADS * (S + 16));
#pragma omp for schedule(static)
      for (long item = 0; item < items; item++)
        f32_attention_item(item, T, groups, parts, (const float*)query, D, qw, (const float*)kbuf, (const float*)vbuf,
                           kv_head, D, mask, mask_row, (float*)attended, qw, S, D, L->scale, scores, order);
      free(scores);
    }
    LAYER_LINEAR(L->o, L->o_bias, attended, projected, H, qw)
#pragma omp for schedule(static)
    for (long t = 0; t < T; t++) {
      add_row((char*)hidden + t * H * size, (const char*)projected + t * H * size, H, bf16);
      norm_row((char*)hidden + t * H * size, L->ln2, (char*)normed + t * H * size, H, L->eps2, bf16);
    }
    LAYER_LINEAR(L->gate_up, L->gate_up_bias, normed, gate_up, 2 * I, H)
    /* silu(gate) = gate / (1 + exp(-gate)) (gate >= 0) or gate e / (1 + e), e = exp(gate) (gate < 0), rounded; then
     * times up, rounded */
    long pieces = (I + SILU_PIECE - 1) / SILU_PIECE; /* per token: the team shares its pieces (one token: all) */
#pragma omp for schedule(static)
    for (long item = 0; item < T * pieces; item++) {
      long t = item / pieces, first = item % pieces * SILU_PIECE, last = first + SILU_PIECE < I ? first + SILU_PIECE : I;
      const char* row = (const char*)gate_up + t * 2 * I * size;
      float gates[16], ups[16], values[16];
      for (long j0 = first; j0 < last; j0 += 16) {
        long count = last - j0 < 16 ? last - j0 : 16;
        __mmask16 some = (__mmask16)((1u << count) - 1);
        __m512 g, up, one = _mm512_set1_ps(1.0f);
        if (bf16) {
          for (long j = 0; j < count; j++) {
            gates[j] = load_at(row, j0 + j, bf16);
            ups[j] = load_at(row, I + j0 + j, bf16);
          }
          for (long j = count; j < 16; j++) gates[j] = ups[j] = 0.0f;
          g = _mm512_loadu_ps(gates);
          up = _mm512_loadu_ps(ups);
        } else { /* float32: the same values, loaded as vectors */
          g = _mm512_maskz_loadu_ps(some, (const float*)row + j0);
          up = _mm512_maskz_loadu_ps(some, (const float*)row + I + j0);
        }
        __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
        __m512 e = exp_le0(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
        __m512 numerator = _mm512_mask_mul_ps(g, negative, g, e);
        __m512 silu = _mm512_div_ps(numerator, _mm512_add_ps(one, e));
        if (!bf16) { /* (rounding to float32 is none: the product as the scalar path takes it) */
          _mm512_mask_storeu_ps((float*)activated + t * I + j0, some, _mm512_mul_ps(silu, up));
          continue;
        }
        _mm512_storeu_ps(values, silu);
        for (long j = 0; j < count; j++)
          store_at((char*)activated + t * I * size, j0 + j, rounded(values[j], bf16) * ups[j], bf16);
      }
    }
    LAYER_LINEAR(L->down, L->down_bias, activated, projected, H, I)
#pragma omp for schedule(static)
    for (long t = 0; t < T; t++) add_row((char*)hidden + t * H * size, (const char*)projected + t * H * size, H, bf16);
  }
  return failed;
}

/* Layers one after another on the same T tokens, in one call: what a forward's layers cost without a return to Python
 * between them (the interpreter's work between two layers' kernels, whose 28 MB of weights have just streamed
 * through the caches, took several times its warm time: docs/performance.md). Layer i is cats_layer(L[i], ...) with
 * its own rotary tables cos[i] / sin[i], cache buffers kbuf[i] / vbuf[i] (kv_head[i] slots apart between heads), past[i]
 * slots before the new tokens and mask[i] (rows mask_row[i] apart, or NULL); scratch: the most any of them needs.
 * Returns 0, or what cats_layer returned for the first layer that failed (its index in *failed; the layers before
 * it ran, it and those after did not). */
int cats_layers(long count, const struct cats_layer* const* L, void* hidden, long T, const void* const* cos,
                const void* const* sin, void* const* kbuf, void* const* vbuf, const long* kv_head, const long* past,
                const float* const* mask, const long* mask_row, void* scratch, int threads, long* failed) {
  for (long i = 0; i < count; i++) {
    int done = cats_layer(L[i], hidden, T, cos[i], sin[i], kbuf[i], vbuf[i], kv_head[i], past[i], mask[i], mask_row[i],
                          scratch, threads);
    if (done) {
      *failed = i;
      return done;
    }
  }
  return 0;
}

/* bytes of scratch cats_layer needs for T tokens */
long cats_layer_scratch(const struct cats_layer* L, long T) {
  long qw = L->Hq * L->D, width = qw + 2 * L->Hk * L->D;
  return T * (2 * L->H + width + 2 * qw + 3 * L->inter) * (L->bf16 ? 2 : 4);
}
#endif

/* which kernels this build has: 1 = bfloat16 (linear and attention), 2 = float32 (both) */
int cats_kernels(void) {
  int kinds = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  kinds |= 1;
#endif
#if defined(__AVX512F__)
  kinds |= 2;
#endif
  return kinds;
}
