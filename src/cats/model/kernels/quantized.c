/* Row-invariant linears on GGUF's own weight blocks: Y[m, n] = sum_k X[m, k] W[n, k] (+ bias[n]) where each row of W
 * is a row of a GGUF tensor exactly as the file stores it (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16,
 * F32), read in place from the memory-mapped file. Built and loaded by cats/model/kernels/quantized.py, which says
 * why they exist and how they are used.
 *
 * The same source is compiled three times: for AVX-512 (BW, VL, VNNI), for AMX (the same plus the tile instructions,
 * -DCATS_AMX: see the section on 16 rows at a time) and for AVX2; quantized.py runs each once in a child process
 * before using it (a CPU may list an instruction set it cannot run).
 *
 * Activations: for the block-quantised types each row of X is first quantised to 8 bits, as llama.cpp does: in
 * blocks of 256 values with one float scale each (the k-quants; plus the sums of every 16 quantised values), or of
 * 32 (the other types; plus d * their sum), scale = max |x| / 127, values rounded to nearest even. The dot products
 * are then exact integer sums within a block (u8 weights x s8 activations: vpmaddubsw into int16, then vpdpwssd /
 * vpmaddwd into int32; vpdpbusd where no scale sits between), scaled per block in float; on AVX-512 the k-quants'
 * integer sums stay per sub-block, in int32 lanes, and are scaled per lane in float (`tokens_lanes`). F16, BF16 and F32 rows
 * multiply the float32 activations with float32 FMAs.
 *
 * Row-invariant: a row of X is quantised alone (block by block: a one-token row's blocks may be shared among the
 * threads), and each output (m, n) is computed by one thread with the same
 * sequence of operations whatever M, the tiling of rows or the split of outputs over threads: its integer block sums
 * are exact, and its float accumulators take the blocks in order, lane by lane, then one fixed reduction. So a token's
 * output does not depend on how many tokens share the call. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512F__)
#define WIDE 1
#if defined(__AVX512VNNI__)
#define LANES_K 1 /* k-quant rows on one vpdpbusd per 64 values: see `tokens_lanes` */
#endif
#endif

/* ggml's type codes (the values GGUF files store) */
enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14,
       BF16 = 30 };

#define TILE 4 /* F32, F16, BF16: tokens that share each load of weights */

static inline float half(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

/* ------------------------------------------------------------------------------- 64 bytes as one or two vectors */
#ifdef WIDE
typedef __m512i v64;
typedef __m512 vf;
static inline v64 load64(const void* p) { return _mm512_loadu_si512(p); }
static inline v64 join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
static inline v64 zero64(void) { return _mm512_setzero_si512(); }
static inline v64 fill8(int c) { return _mm512_set1_epi8((char)c); }
static inline v64 maddubs(v64 u, v64 s) { return _mm512_maddubs_epi16(u, s); }
static inline v64 sub16(v64 a, v64 b) { return _mm512_sub_epi16(a, b); }
static inline v64 dot16(v64 acc, v64 p, v64 scale) { /* acc += pairs of int16 products, into int32 */
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, p, scale);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(p, scale));
#endif
}
static inline v64 dot8(v64 u, v64 s) { /* groups of four u8 x s8 products, into int32 */
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}
static inline v64 abs8(v64 a) { return _mm512_abs_epi8(a); }
static inline v64 sign8(v64 x, v64 w) { /* x where w > 0, -x where w < 0 (0 where w = 0 is not needed: |w| = 0) */
  return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
static inline vf int_to_float(v64 a) { return _mm512_cvtepi32_ps(a); }
static inline vf zerof(void) { return _mm512_setzero_ps(); }
static inline vf fmaddf(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf fill(float a) { return _mm512_set1_ps(a); }
static inline float reduce(vf a) { return _mm512_reduce_add_ps(a); }
#define FLOATS 16
#else
typedef struct { __m256i lo, hi; } v64;
typedef __m256 vf;
static inline v64 load64(const void* p) {
  v64 v = {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)p + 1)};
  return v;
}
static inline v64 join(__m256i lo, __m256i hi) { v64 v = {lo, hi}; return v; }
static inline v64 zero64(void) { return join(_mm256_setzero_si256(), _mm256_setzero_si256()); }
static inline v64 fill8(int c) { return join(_mm256_set1_epi8((char)c), _mm256_set1_epi8((char)c)); }
static inline v64 maddubs(v64 u, v64 s) {
  return join(_mm256_maddubs_epi16(u.lo, s.lo), _mm256_maddubs_epi16(u.hi, s.hi));
}
static inline v64 sub16(v64 a, v64 b) { return join(_mm256_sub_epi16(a.lo, b.lo), _mm256_sub_epi16(a.hi, b.hi)); }
static inline v64 dot16(v64 acc, v64 p, v64 scale) {
  return join(_mm256_add_epi32(acc.lo, _mm256_madd_epi16(p.lo, scale.lo)),
              _mm256_add_epi32(acc.hi, _mm256_madd_epi16(p.hi, scale.hi)));
}
static inline v64 dot8(v64 u, v64 s) {
  __m256i one = _mm256_set1_epi16(1);
  return join(_mm256_madd_epi16(_mm256_maddubs_epi16(u.lo, s.lo), one),
              _mm256_madd_epi16(_mm256_maddubs_epi16(u.hi, s.hi), one));
}
static inline v64 abs8(v64 a) { return join(_mm256_abs_epi8(a.lo), _mm256_abs_epi8(a.hi)); }
static inline v64 sign8(v64 x, v64 w) { return join(_mm256_sign_epi8(x.lo, w.lo), _mm256_sign_epi8(x.hi, w.hi)); }
static inline vf int_to_float(v64 a) { return _mm256_cvtepi32_ps(_mm256_add_epi32(a.lo, a.hi)); }
static inline vf zerof(void) { return _mm256_setzero_ps(); }
static inline vf fmaddf(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf fill(float a) { return _mm256_set1_ps(a); }
static inline float reduce(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#define FLOATS 8
#endif

static inline __m256i nibbles_low(__m256i q) { return _mm256_and_si256(q, _mm256_set1_epi8(0x0f)); }
static inline __m256i nibbles_high(__m256i q) {
  return _mm256_and_si256(_mm256_srli_epi16(q, 4), _mm256_set1_epi8(0x0f));
}
static inline __m256i bits_to_bytes(uint32_t bits, int value) { /* byte j = value where bit j is set, else 0 */
#ifdef WIDE
  return _mm256_maskz_set1_epi8((__mmask32)bits, (char)value);
#else
  __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                       _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                                         0x0101010101010101LL, 0));
  __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
  return _mm256_and_si256(set, _mm256_set1_epi8((char)value));
#endif
}

/* -------------------------------------------------------------------------------------------- activations */
/* One row of X quantised: q (padded with zeros to a multiple of 64 values), per block of `block` values its scale d,
 * d repeated 8 times per block (the lanes of a pair of 32-value blocks), and d times the sum of every 32 and every 16
 * quantised values (the terms of mins and offsets). */
typedef struct {
  int8_t *q, *lanes_q, *lanes6_q; /* blocks of 256 in the orders of `decode_lanes` for Q4_K / Q5_K and for Q6_K
                                    * (NULL unless that is built) */
  float *d, *lanes, *sums32, *sums16;
  float* lanes6_sums; /* with lanes6_q: per block of 256, 32 d times the sum of sub-block 4k + j in lane 4j + k (the
                       * term of Q6_K's offset 32, in the order of its lanes' scales: `lanes_block`) */
} acts;

#ifdef LANES_K
/* A block of 256 quantised values (q, in value order) as `decode_lanes` lays out the weights (blocks of 256 only):
 * unit u, lane 4j + k holds the 4 values of byte m = 16j + 4u of natural unit k. A Q6_K block's natural unit k holds
 * values 64k .. 64k + 63 in order, so that is q's dword 16k + 4j + u (`LANES6_SOURCE`). A Q4_K / Q5_K block's natural
 * units 0 and 1 are the low and high nibbles of its bytes 0-63, units 2 and 3 of bytes 64-127, and byte c holds
 * values 64 (c / 32) + c % 32 (low nibble) and 32 above it (high nibble): with c = 64 (k / 2) + m, q's dword
 * (64 (c / 32) + 32 (k % 2) + c % 32) / 4 (`LANES_SOURCE`). Unit u's source dwords are unit 0's plus u; those of
 * lanes 4j + 2 and 4j + 3 (k = 2, 3) lie in q's second half, the others in its first: two permutes over 32 dwords
 * and a blend a unit (the tables hold unit 0's, mod 32). */
static const int LANES_SOURCE[16] = {0, 8, 0, 8, 4, 12, 4, 12, 16, 24, 16, 24, 20, 28, 20, 28};
static const int LANES6_SOURCE[16] = {0, 16, 0, 16, 4, 20, 4, 20, 8, 24, 8, 24, 12, 28, 12, 28};
static inline void lanes_order(const int8_t* q, int8_t* out, const int* source) {
  __m512i v0 = _mm512_loadu_si512(q), v1 = _mm512_loadu_si512(q + 64);
  __m512i v2 = _mm512_loadu_si512(q + 128), v3 = _mm512_loadu_si512(q + 192);
  __m512i first = _mm512_loadu_si512(source);
  for (int u = 0; u < 4; u++) {
    __m512i at = _mm512_add_epi32(first, _mm512_set1_epi32(u));
    __m512i low = _mm512_permutex2var_epi32(v0, at, v1), high = _mm512_permutex2var_epi32(v2, at, v3);
    _mm512_storeu_si512(out + 64 * u, _mm512_mask_blend_epi32(0xcccc, low, high));
  }
}
#endif

static void quantise_row(const float* x, int block, acts a, long b0, long b1) { /* blocks b0 .. b1 - 1 of a row */
  for (long b = b0; b < b1; b++) {
    const float* v = x + b * block;
    int8_t* q = a.q + b * block;
    /* max |v| (a NaN is skipped, as fmaxf skips it), then each value times 127 / max, rounded to nearest even (the
     * rounding mode in force, as lrintf), clamped to +-127; each 16 values' sum */
#ifdef WIDE
    __m512 top = _mm512_setzero_ps();
    for (int i = 0; i < block; i += 16) top = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(v + i)), top);
    float amax = _mm512_reduce_max_ps(top);
#else
    __m256 top = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < block; i += 8) top = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)), top);
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, top);
    for (int i = 0; i < 8; i++) amax = fmaxf(amax, lanes[i]);
#endif
    float inverse = amax > 0.0f ? 127.0f / amax : 0.0f, d = amax / 127.0f;
    int sums16[16];
    for (int g = 0; g < block / 16; g++) {
#ifdef WIDE
      __m512i values = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + 16 * g), _mm512_set1_ps(inverse)));
      values = _mm512_max_epi32(_mm512_min_epi32(values, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
      _mm_storeu_si128((__m128i*)(q + 16 * g), _mm512_cvtepi32_epi8(values));
      sums16[g] = _mm512_reduce_add_epi32(values);
#else
      __m256i sum = _mm256_setzero_si256();
      for (int h = 0; h < 2; h++) {
        __m256i values = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16 * g + 8 * h), _mm256_set1_ps(inverse)));
        values = _mm256_max_epi32(_mm256_min_epi32(values, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
        sum = _mm256_add_epi32(sum, values);
        int32_t wide[8];
        _mm256_storeu_si256((__m256i*)wide, values);
        for (int i = 0; i < 8; i++) q[16 * g + 8 * h + i] = (int8_t)wide[i];
      }
      int32_t parts[8];
      _mm256_storeu_si256((__m256i*)parts, sum);
      sums16[g] = parts[0] + parts[1] + parts[2] + parts[3] + parts[4] + parts[5] + parts[6] + parts[7];
#endif
    }
    a.d[b] = d;
#ifdef LANES_K
    if (a.lanes_q) lanes_order(q, a.lanes_q + b * 256, LANES_SOURCE);
    if (a.lanes6_q) lanes_order(q, a.lanes6_q + b * 256, LANES6_SOURCE);
#endif
    for (int g = 0; g < block / 16; g++) a.sums16[b * (block / 16) + g] = d * (float)sums16[g];
    for (int j = 0; a.lanes6_q && block == 256 && j < 4; j++)
      for (int k = 0; k < 4; k++) a.lanes6_sums[b * 16 + 4 * j + k] = 32.0f * d * (float)sums16[4 * k + j];
    for (int g = 0; g < block / 32; g++) a.sums32[b * (block / 32) + g] = d * (float)(sums16[2 * g] + sums16[2 * g + 1]);
    if (block == 32)
      for (int i = 0; i < 8; i++) a.lanes[b * 8 + i] = d;
  }
}

/* sum_i c[i] * s[i] for i < count, in a fixed order */
static inline float dot_floats(const float* c, const float* s, long count) {
  long whole = count - count % FLOATS;
  vf acc = zerof();
  for (long i = 0; i < whole; i += FLOATS) {
#ifdef WIDE
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(c + i), _mm512_loadu_ps(s + i), acc);
#else
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(c + i), _mm256_loadu_ps(s + i), acc);
#endif
  }
  float total = reduce(acc);
  for (long i = whole; i < count; i++) total += c[i] * s[i];
  return total;
}

#ifndef PREFETCH
#define PREFETCH 4096 /* bytes ahead of the block being decoded that are requested from memory */
#endif
static inline void prefetch_ahead(const uint8_t* p, long bytes) {
  for (long offset = 0; offset < bytes; offset += 64) _mm_prefetch((const char*)(p + PREFETCH + offset), _MM_HINT_T0);
}

/* ---------------------------------------------------------------------------------------------- k-quants */
/* Q4_K, Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of fifth bits), 128 bytes of nibbles.
 * The scales of sub-blocks 0-3 are the low 6 bits of bytes 0-3, their mins of bytes 4-7; sub-blocks 4-7 take
 * the nibbles of bytes 8-11 and the top 2 bits of bytes 0-3 (scales) and 4-7 (mins). The 8 scales to *scales (a
 * byte each), dmin * min to offsets[0 .. 7]; returns d. */
static inline float scales_k(const uint8_t* p, uint64_t* scales, float* offsets) {
  float dmin = half(p + 2);
  uint32_t a, b, c;
  memcpy(&a, p + 4, 4);
  memcpy(&b, p + 8, 4);
  memcpy(&c, p + 12, 4);
  *scales = (a & 0x3f3f3f3fu) | (uint64_t)((c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u)) << 32;
  uint64_t mins = (b & 0x3f3f3f3fu) | (uint64_t)(((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u)) << 32;
  _mm256_storeu_ps(offsets, _mm256_mul_ps(_mm256_set1_ps(dmin),
                                          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mins)))));
  return half(p);
}

/* One block of 256 weights in registers: 4 x 64 values as u8 in value order, and per unit the int16 scale of every
 * pair of products after vpmaddubsw. The coefficients of the sums of X that the block subtracts go to `offsets`:
 * Q4_K / Q5_K per 32 values dmin * min, Q6_K (values stored + 32) per 16 values 32 * d * scale. Returns d. */
static inline float decode_k(int type, const uint8_t* p, v64* w, v64* scale, float* offsets) {
  if (type == Q6_K) { /* ql[128], qh[64], int8 scales[16], d */
    float d = half(p + 208);
    __m128i sc = _mm_loadu_si128((const __m128i*)(p + 192));
#ifdef WIDE
    _mm512_storeu_ps(offsets, _mm512_mul_ps(_mm512_set1_ps(32.0f * d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc))));
    __m256i both = _mm256_broadcastsi128_si256(sc);
    for (int u = 0; u < 4; u++) { /* unit u: groups 4u .. 4u + 3, 8 lanes each */
      __m256i index = _mm256_set_epi64x(0x0101010101010101LL * (4 * u + 3), 0x0101010101010101LL * (4 * u + 2),
                                        0x0101010101010101LL * (4 * u + 1), 0x0101010101010101LL * (4 * u));
      scale[u] = _mm512_cvtepi8_epi16(_mm256_shuffle_epi8(both, index));
    }
#else
    _mm256_storeu_ps(offsets, _mm256_mul_ps(_mm256_set1_ps(32.0f * d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    _mm256_storeu_ps(offsets + 8, _mm256_mul_ps(_mm256_set1_ps(32.0f * d),
                                                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
    const int8_t* s = (const int8_t*)(p + 192);
    for (int u = 0; u < 4; u++)
      scale[u] = join(_mm256_set_m128i(_mm_set1_epi16(s[4 * u + 1]), _mm_set1_epi16(s[4 * u])),
                      _mm256_set_m128i(_mm_set1_epi16(s[4 * u + 3]), _mm_set1_epi16(s[4 * u + 2])));
#endif
#ifdef WIDE
    /* per half of 128 values: ql (64 bytes) and qh (32 bytes, broadcast to both halves of a vector): the low nibbles
     * with qh's bits 0-1 (first 32 values) and 2-3 (next 32), the high nibbles with bits 4-5 and 6-7, each pair of
     * bits shifted to bits 4-5 (16-bit shifts by lane: what crosses into the next byte is masked off) */
    const __m512i low = _mm512_set1_epi8(0x0f), fifth_sixth = _mm512_set1_epi8(0x30);
    const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    for (int h = 0; h < 2; h++) {
      __m512i l = _mm512_loadu_si512(p + 64 * h);
      __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(p + 128 + 32 * h)));
      __m512i even = _mm512_and_si512(_mm512_sllv_epi16(hb, up), fifth_sixth);
      __m512i odd = _mm512_and_si512(_mm512_srlv_epi16(hb, down), fifth_sixth);
      w[2 * h] = _mm512_ternarylogic_epi32(l, even, low, 0xEC); /* (l & low) | even */
      w[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(l, 4), odd, low, 0xEC);
    }
    return d;
#endif
    __m256i three = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
      const uint8_t *ql = p + 64 * h, *qh = p + 128 + 32 * h;
      __m256i l0 = _mm256_loadu_si256((const __m256i*)ql), l1 = _mm256_loadu_si256((const __m256i*)(ql + 32));
      __m256i hb = _mm256_loadu_si256((const __m256i*)qh);
      __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(hb, three), 4);
      __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), three), 4);
      __m256i h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), three), 4);
      __m256i h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), three), 4);
      w[2 * h] = join(_mm256_or_si256(nibbles_low(l0), h0), _mm256_or_si256(nibbles_low(l1), h1));
      w[2 * h + 1] = join(_mm256_or_si256(nibbles_high(l0), h2), _mm256_or_si256(nibbles_high(l1), h3));
    }
    return d;
  }
  /* Q4_K, Q5_K (`scales_k`) */
  uint64_t scales;
  float d = scales_k(p, &scales, offsets);
#ifdef WIDE
  __m256i all = _mm256_set1_epi64x((long long)scales);
  for (int u = 0; u < 4; u++) { /* unit u: sub-blocks 2u and 2u + 1, 16 lanes each */
    __m256i index = _mm256_set_epi64x(0x0101010101010101LL * (2 * u + 1), 0x0101010101010101LL * (2 * u + 1),
                                      0x0101010101010101LL * (2 * u), 0x0101010101010101LL * (2 * u));
    scale[u] = _mm512_cvtepu8_epi16(_mm256_shuffle_epi8(all, index));
  }
#else
  for (int u = 0; u < 4; u++)
    scale[u] = join(_mm256_set1_epi16((short)((scales >> (16 * u)) & 0xff)),
                    _mm256_set1_epi16((short)((scales >> (16 * u + 8)) & 0xff)));
#endif
  const uint8_t* qs = p + (type == Q5_K ? 48 : 16);
#ifdef WIDE
  /* 32 bytes of nibbles broadcast to both halves of a vector, shifted by 0 (low nibbles: sub-block 2j) and 4 (high:
   * 2j + 1); Q5_K: bits 2j and 2j + 1 of its fifth bits, likewise */
  const __m512i low = _mm512_set1_epi8(0x0f), one = _mm512_set1_epi8(1);
  const __m512i nibble = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  __m512i fifths = type == Q5_K ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(p + 16)))
                                : _mm512_setzero_si512();
  for (int j = 0; j < 4; j++) {
    __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(qs + 32 * j)));
    w[j] = _mm512_and_si512(_mm512_srlv_epi16(q, nibble), low);
    if (type == Q5_K) {
      __m512i bit = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * j)), _mm256_set1_epi16((short)(2 * j + 1)), 1);
      w[j] = _mm512_or_si512(w[j], _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(fifths, bit), one), 4));
    }
  }
  return d;
#else
  __m256i fifth = type == Q5_K ? _mm256_loadu_si256((const __m256i*)(p + 16)) : _mm256_setzero_si256();
  __m256i one = _mm256_set1_epi8(1);
  for (int j = 0; j < 4; j++) {
    __m256i q = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
    __m256i lo = nibbles_low(q), hi = nibbles_high(q);
    if (type == Q5_K) { /* bit s of fifth[i]: value i of sub-block s */
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(fifth, one), 4));
      fifth = _mm256_srli_epi16(fifth, 1);
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(fifth, one), 4));
      fifth = _mm256_srli_epi16(fifth, 1);
    }
    w[j] = join(lo, hi);
  }
  return d;
#endif
}

/* Tokens a[0 .. T-1] against one row of k-quant blocks into out[T], T a constant (1, 2, 4 or 8): each block is
 * decoded once for all of them; every token's operations are those it gets alone (row-invariant). `offsets`: room
 * for the row's. */
#define TOKENS_K(T)                                                                                                \
  static void tokens_k##T(int type, const uint8_t* row, long blocks, const acts* a, float* offsets, float* out) {  \
    long block_bytes = type == Q4_K ? 144 : type == Q5_K ? 176 : 210, per = type == Q6_K ? 16 : 8;                \
    vf acc[T];                                                                                                     \
    for (int t = 0; t < T; t++) acc[t] = zerof();                                                                  \
    v64 w[4], scale[4];                                                                                            \
    for (long b = 0; b < blocks; b++) {                                                                            \
      prefetch_ahead(row + b * block_bytes, block_bytes);                                                          \
      float d = decode_k(type, row + b * block_bytes, w, scale, offsets + b * per);                                \
      _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {                                                        \
        const int8_t* x = a[t].q + b * 256;                                                                        \
        v64 sums = zero64();                                                                                       \
        for (int u = 0; u < 4; u++) sums = dot16(sums, maddubs(w[u], load64(x + 64 * u)), scale[u]);               \
        acc[t] = fmaddf(int_to_float(sums), fill(d * a[t].d[b]), acc[t]);                                          \
      }                                                                                                            \
    }                                                                                                              \
    for (int t = 0; t < T; t++)                                                                                    \
      out[t] = reduce(acc[t]) - dot_floats(offsets, type == Q6_K ? a[t].sums16 : a[t].sums32, blocks * per);      \
  }
TOKENS_K(1)
TOKENS_K(2)
TOKENS_K(4)
TOKENS_K(8)
TOKENS_K(3) TOKENS_K(5) TOKENS_K(6) TOKENS_K(7)

#ifdef LANES_K
/* The k-quants with the sub-block scales applied in float, per int32 lane. A block's 256 values are first split,
 * with in-lane operations only, into four "natural" units of 64 bytes (Q4_K / Q5_K: the low and the high nibbles of
 * bytes 0-63, then of bytes 64-127; Q6_K: values 0-63, 64-127, ... with their top two bits); each 128-bit lane j of
 * natural unit k then holds 16 values of one sub-block (Q6_K) or half sub-block (Q4_K, Q5_K). A 4 x 4 transpose of
 * dwords inside each 128-bit lane (8 unpacks) makes unit u of the block hold in int32 lane 4j + k the dword u of
 * that lane j of natural unit k, so that lane 4j + k of every unit holds values of the same 16; the activations are
 * laid out alike once per token (`lanes_q`, `lanes6_q`). A token's block is then 4 vpdpbusd into one int32 vector
 * (u8 weights x s8 activations, exact: at most 4 x 4 x 63 x 127 per lane), converted to float and multiplied per
 * lane by d_w * d_x * the lane's scale: 4 integer products per 256 values where vpmaddubsw + vpdpwssd take 8, and no
 * operation crosses a 128-bit lane (cross-lane permutes cost more than they seem on AMD's 256-bit pipes). The
 * units, their lanes' float scales (times d) and, for Q4_K and Q5_K, the row's offsets (as `decode_k`; Q6_K takes
 * its offset in the lanes: `lanes_block`) of one block: */
#define LANES_OFFSETS 8 /* row offsets a block keeps on the lanes (Q4_K, Q5_K: dmin * min per 32 values; Q6_K none) */
static inline void transpose_units(__m512i* w) { /* w[u] lane 4j + k = old w[k] lane 4j + u */
  __m512i a = _mm512_unpacklo_epi32(w[0], w[1]), b = _mm512_unpackhi_epi32(w[0], w[1]);
  __m512i c = _mm512_unpacklo_epi32(w[2], w[3]), e = _mm512_unpackhi_epi32(w[2], w[3]);
  w[0] = _mm512_unpacklo_epi64(a, c);
  w[1] = _mm512_unpackhi_epi64(a, c);
  w[2] = _mm512_unpacklo_epi64(b, e);
  w[3] = _mm512_unpackhi_epi64(b, e);
}

/* Bit `first` of each of bytes 0-31 and bit `second` of each of bytes 32-63 (with the bits above them that `mask`
 * keeps) moved to bit 4: each 64 bits rotated left by 4 - s (mod 64) (a shift would lose the top byte's bits) */
static inline __m512i bits_to_four(__m512i bytes, int first, int second, int mask) {
  long low = (68 - first) % 64, high = (68 - second) % 64;
  return _mm512_and_si512(_mm512_rolv_epi64(bytes, _mm512_set_epi64(high, high, high, high, low, low, low, low)),
                          _mm512_set1_epi8((char)mask));
}

static inline void decode_lanes(int type, const uint8_t* p, __m512i* w, __m512* scale, float* offsets) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  if (type == Q6_K) { /* ql[128], qh[64], int8 scales[16], d: value 64k + m (m < 64) is nibble k % 2 of byte
                         64 (k / 2) + m of ql, with bits 2 (m / 32) + 4 (k % 2) .. + 1 of byte 32 (k / 2) + m % 32
                         of qh above it (qh's 32 bytes in both halves of a vector). Lane 4j + k: sub-block 4k + j */
    float d = half(p + 208);
    __m128i sc = _mm_loadu_si128((const __m128i*)(p + 192));
    __m128i lanes = _mm_shuffle_epi8(sc, _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    *scale = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lanes)), _mm512_set1_ps(d));
    for (int h = 0; h < 2; h++) { /* values 128h .. 128h + 127: natural units 2h, 2h + 1 */
      __m512i ql = _mm512_loadu_si512(p + 64 * h);
      __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(p + 128 + 32 * h)));
      w[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low), bits_to_four(qh, 0, 2, 0x30));
      w[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low), bits_to_four(qh, 4, 6, 0x30));
    }
    transpose_units(w);
    return;
  }
  uint64_t scales;
  float d = scales_k(p, &scales, offsets);
  /* lane 4j + k: half sub-block 4 (k / 2) + 2 (j / 2) + k % 2 */
  __m128i lanes = _mm_shuffle_epi8(_mm_cvtsi64_si128((long long)scales),
                                   _mm_setr_epi8(0, 1, 4, 5, 0, 1, 4, 5, 2, 3, 6, 7, 2, 3, 6, 7));
  *scale = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lanes)), _mm512_set1_ps(d));
  const uint8_t* qs = p + (type == Q5_K ? 48 : 16);
  for (int h = 0; h < 2; h++) {
    __m512i q = _mm512_loadu_si512(qs + 64 * h);
    w[2 * h] = _mm512_and_si512(q, low);
    w[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
  }
  if (type == Q5_K) { /* bit s of byte i of the fifth bits: value 32 s + i; natural unit k takes bits (k / 2) * 4 +
                         k % 2 (bytes 0-31 of the unit) and 2 above (bytes 32-63) */
    __m512i fifths = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(p + 16)));
    for (int k = 0; k < 4; k++) {
      int first = 4 * (k / 2) + k % 2;
      w[k] = _mm512_or_si512(w[k], bits_to_four(fifths, first, first + 2, 0x10));
    }
  }
  transpose_units(w);
}

/* One block of a row, decoded (`decode_lanes`: its units w and its lanes' scales), against tokens a[0 .. T-1]
 * (activations from byte `at` of each token's row, in the lanes' order), added to acc[t]; Q6_K (`six`) then takes
 * its offset 32 off in the same lanes: the lanes' scales times the token's `lanes6_sums` (no offsets of the row's
 * own, as the other types keep: 4 operations a block fewer). Then each token's output: its lanes summed (Q4_K,
 * Q5_K: less the row's offsets times the token's sums of 32). */
static inline __attribute__((always_inline)) void lanes_block(const int T, int six, const __m512i* w, __m512 scale,
                                                              const acts* a, long at, long b, __m512* acc) {
  _Pragma("GCC unroll 16") for (int t = 0; t < T; t++) {
    const int8_t* x = a[t].q + at;
    __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_loadu_si512(x));
    for (int u = 1; u < 4; u++) sums = _mm512_dpbusd_epi32(sums, w[u], _mm512_loadu_si512(x + 64 * u));
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(scale, _mm512_set1_ps(a[t].d[b])), acc[t]);
    if (six) acc[t] = _mm512_fnmadd_ps(scale, _mm512_loadu_ps(a[t].lanes6_sums + 16 * b), acc[t]);
  }
}
static inline __attribute__((always_inline)) void lanes_out(const int T, int type, const __m512* acc, const acts* a,
                                                            const float* offsets, long count, float* out) {
  for (int t = 0; t < T; t++)
    out[t] = _mm512_reduce_add_ps(acc[t]) - (type == Q6_K ? 0.0f : dot_floats(offsets, a[t].sums32, count));
}

/* Tokens a[0 .. T-1] against one row of k-quant blocks into out[T], T a constant; as `tokens_k`, each block decoded
 * once for all of them and each token's operations those it gets alone. */
#define TOKENS_LANES(T)                                                                                            \
  static void tokens_lanes##T(int type, const uint8_t* row, long blocks, const acts* a, float* offsets,           \
                              float* out) {                                                                        \
    long block_bytes = type == Q4_K ? 144 : type == Q5_K ? 176 : 210, per = LANES_OFFSETS;                        \
    __m512 acc[T];                                                                                                 \
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();                                                      \
    long order = (type == Q6_K ? a[0].lanes6_q : a[0].lanes_q) - a[0].q; /* every token's (`quantise_room`) */   \
    __m512i w[4];                                                                                                  \
    __m512 scale;                                                                                                  \
    for (long b = 0; b < blocks; b++) {                                                                            \
      prefetch_ahead(row + b * block_bytes, block_bytes);                                                          \
      decode_lanes(type, row + b * block_bytes, w, &scale, offsets + b * per);                                     \
      lanes_block(T, type == Q6_K, w, scale, a, order + b * 256, b, acc);                                          \
    }                                                                                                              \
    lanes_out(T, type, acc, a, offsets, blocks * per, out);                                                        \
  }
/* A row's blocks decoded once (`decode_lanes`: 4 units, then the lanes' float scales) for the tiles of a prompt,
 * then read back for every tile instead of being decoded again, two rows at a time: each token's activations, loaded
 * once, go into both rows' products (one row at a time, a token's 4 units of 64 bytes are loaded for every row, and
 * 512-bit loads, one a cycle on Zen 4, bounded the tiles). Each row and token gets `lanes_block`'s operations on the
 * same values as `tokens_lanes`, so the same bits. */
#define DECODED_BYTES (5 * 64)    /* a block's units and scales */
#define DECODED_ROWS 16           /* most rows decoded at a time: a chunk of `cats_quantized_team` */
#define DECODED_L2 (192 * 1024)   /* bytes of decoded rows that the tiles then read: well within L2 */
/* Rows of `blocks` k-quant blocks decoded together for a call of M tokens: as many as stay in L2 (at most a chunk),
 * or 0 where the call does not take decoded rows: fewer than 32 tokens, or rows so long that fewer than 8 stay
 * decoded (measured on Qwen2.5-Coder-1.5B, a 700-token prompt: with its K = 8960 rows too, 16 at a time from L2, and
 * pairs of rows against 8-token tiles, 6.92 s against 8.34 s where only K = 1536 rows were decoded, into L1, and
 * taken one at a time; 16-token calls are 14 % slower on decoded rows, whose tiles then pay for decoding without
 * sharing it). */
static long decoded_rows(long M, long blocks) {
  long group = DECODED_L2 / (blocks * DECODED_BYTES);
  group = group > DECODED_ROWS ? DECODED_ROWS : group;
  return M >= 32 && group >= DECODED_ROWS / 2 ? group : 0;
}
static void decode_row_lanes(int type, const uint8_t* row, long blocks, uint8_t* decoded, float* offsets) {
  long block_bytes = type == Q4_K ? 144 : type == Q5_K ? 176 : 210, per = LANES_OFFSETS;
  __m512i w[4];
  __m512 scale;
  for (long b = 0; b < blocks; b++) {
    prefetch_ahead(row + b * block_bytes, block_bytes);
    decode_lanes(type, row + b * block_bytes, w, &scale, offsets + b * per);
    uint8_t* out = decoded + b * DECODED_BYTES;
    for (int u = 0; u < 4; u++) _mm512_store_si512(out + 64 * u, w[u]);
    _mm512_store_ps(out + 256, scale);
  }
}
#define PAIR_TOKENS 8 /* tokens of a pair of decoded rows' tile: 16 accumulators, 8 units and 2 scales in registers */
/* Two decoded rows (row_offsets: their `decode_lanes` offsets) against tokens a[0 .. PAIR_TOKENS - 1] into
 * out[r][t] */
static void decoded_pair(int type, const uint8_t* const* rows, long blocks, const acts* a,
                         const float* const* row_offsets, float out[2][PAIR_TOKENS]) {
  __m512 acc[2][PAIR_TOKENS];
  for (int t = 0; t < PAIR_TOKENS; t++) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
  long order = (type == Q6_K ? a[0].lanes6_q : a[0].lanes_q) - a[0].q;
  for (long b = 0; b < blocks; b++) {
    const uint8_t *in0 = rows[0] + b * DECODED_BYTES, *in1 = rows[1] + b * DECODED_BYTES;
    __m512i w0[4], w1[4];
    for (int u = 0; u < 4; u++) w0[u] = _mm512_load_si512(in0 + 64 * u), w1[u] = _mm512_load_si512(in1 + 64 * u);
    __m512 scale0 = _mm512_load_ps(in0 + 256), scale1 = _mm512_load_ps(in1 + 256);
    _Pragma("GCC unroll 8") for (int t = 0; t < PAIR_TOKENS; t++) { /* the token's loads shared by both rows */
      lanes_block(1, type == Q6_K, w0, scale0, a + t, order + b * 256, b, &acc[0][t]);
      lanes_block(1, type == Q6_K, w1, scale1, a + t, order + b * 256, b, &acc[1][t]);
    }
  }
  for (int r = 0; r < 2; r++) lanes_out(PAIR_TOKENS, type, acc[r], a, row_offsets[r], blocks * LANES_OFFSETS, out[r]);
}
TOKENS_LANES(1)
TOKENS_LANES(2)
TOKENS_LANES(4)
TOKENS_LANES(8)
TOKENS_LANES(16)
TOKENS_LANES(3) TOKENS_LANES(5) TOKENS_LANES(6) TOKENS_LANES(7) TOKENS_LANES(9) TOKENS_LANES(10)
TOKENS_LANES(11) TOKENS_LANES(12) TOKENS_LANES(13) TOKENS_LANES(14) TOKENS_LANES(15)
#endif

/* ------------------------------------------------------------------------ 32-value blocks (Q4_0 ... Q8_0) */
/* One block as 32 bytes in value order (u8; Q8_0: s8), its d, and (to `offset`) the coefficient of d_x * sum(x_q):
 * -8 d (Q4_0), -16 d (Q5_0), m (Q4_1, Q5_1), 0 (Q8_0). */
static inline __m256i decode_32(int type, const uint8_t* p, float* d, float* offset) {
  *d = half(p);
  if (type == Q8_0) {
    *offset = 0.0f;
    return _mm256_loadu_si256((const __m256i*)(p + 2));
  }
  int with_min = type == Q4_1 || type == Q5_1, five = type == Q5_0 || type == Q5_1;
  __m128i q = _mm_loadu_si128((const __m128i*)(p + 2 + 2 * with_min + 4 * five));
  __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0f)),
                               _mm_and_si128(q, _mm_set1_epi8(0x0f)));
  if (five) {
    uint32_t bits;
    memcpy(&bits, p + 2 + 2 * with_min, 4);
    w = _mm256_or_si256(w, bits_to_bytes(bits, 16));
  }
  *offset = with_min ? half(p + 2) : (five ? -16.0f : -8.0f) * *d;
  return w;
}

/* The same for a row of 32-value blocks, taken a pair at a time (the last block alone: zero weights beside it). */
#ifdef WIDE
#define ACCUMULATE_32(t)                                                                                           \
  acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(dw, _mm512_loadu_ps(a[t].lanes + b * 8)), acc[t]);
#else
#define ACCUMULATE_32(t)                                                                                           \
  acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots.lo), _mm256_mul_ps(dw0, _mm256_loadu_ps(a[t].lanes + b * 8)),   \
                           acc[t]);                                                                                \
  acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots.hi), _mm256_mul_ps(dw1, _mm256_loadu_ps(a[t].lanes + b * 8 + 8)), \
                           acc[t]);
#endif
#define TOKENS_32(T)                                                                                                \
  static void tokens_32_##T(int type, const uint8_t* row, long blocks, const acts* a, float* offsets, float* out) { \
    long block_bytes = type == Q4_0 ? 18 : type == Q4_1 ? 20 : type == Q5_0 ? 22 : type == Q5_1 ? 24 : 34;          \
    vf acc[T];                                                                                                      \
    for (int t = 0; t < T; t++) acc[t] = zerof();                                                                   \
    for (long b = 0; b < blocks; b += 2) {                                                                          \
      float da, db = 0.0f;                                                                                          \
      prefetch_ahead(row + b * block_bytes, 2 * block_bytes);                                                       \
      __m256i wa = decode_32(type, row + b * block_bytes, &da, offsets + b);                                        \
      __m256i wb = b + 1 < blocks ? decode_32(type, row + (b + 1) * block_bytes, &db, offsets + b + 1)              \
                                  : _mm256_setzero_si256();                                                         \
      v64 w = join(wa, wb), u = type == Q8_0 ? abs8(w) : w;                                                         \
      PAIR_SCALES                                                                                                   \
      _Pragma("GCC unroll 8") for (int t = 0; t < T; t++) {                                                         \
        v64 x = load64(a[t].q + b * 32);                                                                            \
        if (type == Q8_0) x = sign8(x, w);                                                                          \
        v64 dots = dot8(u, x);                                                                                      \
        ACCUMULATE_32(t)                                                                                            \
      }                                                                                                             \
    }                                                                                                               \
    for (int t = 0; t < T; t++)                                                                                     \
      out[t] = reduce(acc[t]) + (type == Q8_0 ? 0.0f : dot_floats(offsets, a[t].sums32, blocks));                  \
  }
#ifdef WIDE
#define PAIR_SCALES __m512 dw = _mm512_insertf32x8(_mm512_set1_ps(da), _mm256_set1_ps(db), 1);
#else
#define PAIR_SCALES __m256 dw0 = _mm256_set1_ps(da), dw1 = _mm256_set1_ps(db);
#endif
TOKENS_32(1)
TOKENS_32(2)
TOKENS_32(4)
TOKENS_32(8)
TOKENS_32(3) TOKENS_32(5) TOKENS_32(6) TOKENS_32(7)


/* Which order of `decode_lanes` a type's rows read their activations in (a bit of `quantise_room`), 0: none */
static int lanes_layout(int type) {
#ifdef LANES_K
  if (type == Q6_K) return 2;
#ifndef CATS_AMX /* (the AMX build takes Q4_K and Q5_K on `rows16`) */
  if (type == Q4_K || type == Q5_K) return 1;
#endif
#endif
  (void)type;
  return 0;
}

/* A tile of T tokens against rows n0 .. n1 - 1, into Y: one function of its own for each tile kernel and each T,
 * out of line, with its loop over the rows. Where the tiles were inlined into one caller, the compiler stopped
 * inlining some of them there (measured on Qwen2.5-Coder-1.5B: a 4-token forward took longer than a 5-token one;
 * one token's Q8_0 lm_head ~12 % slower). Each row is read once for the tile. */
typedef void rows_fn(int type, const uint8_t* W, long row_bytes, long n0, long n1, const acts* X, long blocks,
                     const float* bias, float* Y, long N, float* offsets);
#define ROWS_OF(fn, T)                                                                                            \
  __attribute__((noinline)) static void rows_##fn(int type, const uint8_t* W, long row_bytes, long n0, long n1,   \
                                                  const acts* X, long blocks, const float* bias, float* Y, long N, \
                                                  float* offsets) {                                               \
    float out[16];                                                                                                \
    for (long n = n0; n < n1; n++) {                                                                              \
      fn(type, W + n * row_bytes, blocks, X, offsets, out);                                                       \
      for (long t = 0; t < T; t++) Y[t * N + n] = bias ? out[t] + bias[n] : out[t];                               \
    }                                                                                                             \
  }
#define ROWS_1_TO_8(kernel)                                                                                       \
  ROWS_OF(kernel##1, 1) ROWS_OF(kernel##2, 2) ROWS_OF(kernel##3, 3) ROWS_OF(kernel##4, 4) ROWS_OF(kernel##5, 5)   \
  ROWS_OF(kernel##6, 6) ROWS_OF(kernel##7, 7) ROWS_OF(kernel##8, 8)
ROWS_1_TO_8(tokens_k)
ROWS_1_TO_8(tokens_32_)
static rows_fn* const rows_k[9] = {NULL, rows_tokens_k1, rows_tokens_k2, rows_tokens_k3, rows_tokens_k4,
                                   rows_tokens_k5, rows_tokens_k6, rows_tokens_k7, rows_tokens_k8};
static rows_fn* const rows_32[9] = {NULL, rows_tokens_32_1, rows_tokens_32_2, rows_tokens_32_3, rows_tokens_32_4,
                                    rows_tokens_32_5, rows_tokens_32_6, rows_tokens_32_7, rows_tokens_32_8};
#ifdef LANES_K
ROWS_1_TO_8(tokens_lanes)
ROWS_OF(tokens_lanes9, 9) ROWS_OF(tokens_lanes10, 10) ROWS_OF(tokens_lanes11, 11) ROWS_OF(tokens_lanes12, 12)
ROWS_OF(tokens_lanes13, 13) ROWS_OF(tokens_lanes14, 14) ROWS_OF(tokens_lanes15, 15) ROWS_OF(tokens_lanes16, 16)
static rows_fn* const rows_lanes[17] = {
    NULL, rows_tokens_lanes1, rows_tokens_lanes2, rows_tokens_lanes3, rows_tokens_lanes4, rows_tokens_lanes5,
    rows_tokens_lanes6, rows_tokens_lanes7, rows_tokens_lanes8, rows_tokens_lanes9, rows_tokens_lanes10,
    rows_tokens_lanes11, rows_tokens_lanes12, rows_tokens_lanes13, rows_tokens_lanes14, rows_tokens_lanes15,
    rows_tokens_lanes16};
#endif

/* Rows n0 .. n1 - 1 against every token: a tile of tokens at a time (its quantised rows stay in L1), against each
 * of the rows in turn (the chunk's rows stay in L1 or L2 from one tile to the next). */
static void rows_blocks(int type, int block, const uint8_t* W, long row_bytes, long n0, long n1, const acts* X,
                        long M, long K, const float* bias, float* Y, long N, float* offsets, uint8_t* decoded) {
  long blocks = K / block;
  int lanes = lanes_layout(type) != 0; /* the k-quants, where `tokens_lanes` is built (and their order filled) */
  long most = lanes ? 16 : 8;          /* the largest tile */
  long m0 = 0;
#ifdef LANES_K
  long group = lanes && decoded && n1 - n0 <= DECODED_ROWS ? decoded_rows(M, blocks) : 0;
  if (group) { /* a prompt: each row decoded once for all its full tiles */
    long whole = M / PAIR_TOKENS * PAIR_TOKENS;
    long row_decoded = blocks * DECODED_BYTES, row_offsets = blocks * LANES_OFFSETS; /* each row's room in them */
    float* offsets_room = (float*)(decoded + DECODED_ROWS * row_decoded);
    for (long g0 = n0; g0 < n1; g0 += group) {
      long g1 = g0 + group < n1 ? g0 + group : n1;
      for (long n = g0; n < g1; n++)
        decode_row_lanes(type, W + n * row_bytes, blocks, decoded + (n - g0) * row_decoded,
                         offsets_room + (n - g0) * row_offsets);
      for (long t0 = 0; t0 < whole; t0 += PAIR_TOKENS)
        for (long n = g0; n < g1; n += 2) { /* a pair of rows (the last one twice where the group is odd) */
          long second = n + 1 < g1 ? n + 1 : n;
          const uint8_t* rows[2] = {decoded + (n - g0) * row_decoded, decoded + (second - g0) * row_decoded};
          const float* offsets_of[2] = {offsets_room + (n - g0) * row_offsets,
                                        offsets_room + (second - g0) * row_offsets};
          float out[2][PAIR_TOKENS];
          decoded_pair(type, rows, blocks, X + t0, offsets_of, out);
          for (long r = 0; r <= second - n; r++)
            for (long t = 0; t < PAIR_TOKENS; t++)
              Y[(t0 + t) * N + n + r] = bias ? out[r][t] + bias[n + r] : out[r][t];
        }
    }
    m0 = whole;
  }
#else
  (void)decoded;
#endif
  while (m0 < M) { /* tiles of the largest size, then one of what is left */
    long T = M - m0 < most ? M - m0 : most;
    rows_fn* rows = block == 256 ? rows_k[T] : rows_32[T];
#ifdef LANES_K
    if (lanes) rows = rows_lanes[T];
#endif
    rows(type, W, row_bytes, n0, n1, X + m0, blocks, bias, Y + m0 * N, N, offsets);
    m0 += T;
  }
}

#ifdef CATS_AMX
/* ------------------------------------------------------------------------------- k-quants, 16 rows at a time */
/* The AMX build (``-DCATS_AMX``) takes k-quant rows 16 at a time, and each block's share of an output as one exact
 * integer (weights x activations x sub-block scales) scaled in float: out = sum over blocks, in order, of
 * fma(sum_b, d_b * d_x, .), minus the offsets' terms. Few tokens run on the vectors (each row's int32 lanes summed
 * across the 16 rows at once); 8 or more on the tiles: a weight tile is 16 rows x 64 values, each
 * value times the low 3 bits of its sub-block's scale (l) in one tile and times the high 3 (h) in another (both
 * fit a byte: q <= 31, l, h <= 7), against up to 16 tokens' activations, so sum = C_l + 8 C_h. The integer sums
 * are exact and the float steps the same on both, so a token's output does not depend on which ran it. Only Q4_K
 * and Q5_K rows come here: Q6_K's signed 8-bit scales do not split so, and its rows stay on `rows_blocks`. */
#include <sys/syscall.h>
#include <unistd.h>

#define TILE_TOKENS 8 /* fewest tokens worth the tiles (below, the vectors) */

/* Linux lends the tile registers to a process that asks (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); until it
 * has, a tile instruction traps. 1 once granted, -1 if refused (the vectors then take every row). */
static int tiles_granted(void) {
  static volatile int state = 0;
  if (state == 0) state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
  return state > 0;
}

static void tiles_on(void) { /* 8 tiles of 16 rows x 64 bytes, this thread's */
  struct {
    uint8_t palette, start, reserved[14];
    uint16_t bytes[16];
    uint8_t rows[16];
  } config;
  memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int i = 0; i < 8; i++) config.bytes[i] = 64, config.rows[i] = 16;
  _tile_loadconfig(&config);
}

static inline int split_scales(int type) { return type == Q4_K || type == Q5_K; } /* the rows `rows16` takes */
static inline int tiled(int type, long M) { return split_scales(type) && M >= TILE_TOKENS; }

/* lanes r = the sum of the 16 int32 lanes of v[r], for r < 16 */
static inline __m512i sum_each(const __m512i* v) {
  __m512i pairs[8], quads[4];
  for (int i = 0; i < 8; i++)
    pairs[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; i++)
    quads[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(pairs[2 * i], pairs[2 * i + 1]),
                                _mm512_unpackhi_epi64(pairs[2 * i], pairs[2 * i + 1]));
  __m512i a = _mm512_add_epi32(_mm512_shuffle_i32x4(quads[0], quads[1], 0x88),
                               _mm512_shuffle_i32x4(quads[0], quads[1], 0xdd));
  __m512i b = _mm512_add_epi32(_mm512_shuffle_i32x4(quads[2], quads[3], 0x88),
                               _mm512_shuffle_i32x4(quads[2], quads[3], 0xdd));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xdd));
}

/* Each thread's room for `rows16`: the 16 rows' offsets, float sums, int32 lanes and weight / result tiles */
typedef struct {
  float *offsets, *acc, *d; /* d: per block, the 16 rows' d */
  __m512i* lanes;           /* per block, token and row: the int32 lanes of its sum */
  uint8_t* weights; /* 8 tiles: l then h, per 64 values of a block */
  int32_t* results; /* 2 tiles: C_l, C_h */
} room16;

/* The activations as tiles, for every 16 tokens g, block b and 64 values u: row i holds values 4i .. 4i + 3 of each
 * token side by side (the layout the tile product takes), zero past the last token; scales[g][b][t] = d_x. */
typedef struct {
  int8_t* tiles;
  float* scales;
  long groups;
} tokens16;

/* Room for the tiles of M tokens' rows of K values: 1 if allocated */
static int tokens_as_tiles(long M, long K, tokens16* out) {
  long blocks = K / 256, groups = (M + 15) / 16;
  out->groups = groups;
  out->tiles = aligned_alloc(64, (size_t)(groups * blocks * 4 * 1024));
  out->scales = calloc((size_t)(groups * blocks * 16), sizeof(float));
  return out->tiles && out->scales;
}

static void fill_tokens(const acts* X, long M, long K, const tokens16* out, long g, long b) {
  long blocks = K / 256;
  for (int u = 0; u < 4; u++) {
    int8_t* tile = out->tiles + ((g * blocks + b) * 4 + u) * 1024;
    memset(tile, 0, 1024);
    for (long t = 0; t < 16 && g * 16 + t < M; t++)
      for (int i = 0; i < 16; i++) memcpy(tile + 64 * i + 4 * t, X[g * 16 + t].q + b * 256 + 64 * u + 4 * i, 4);
  }
  for (long t = 0; t < 16 && g * 16 + t < M; t++) out->scales[(g * blocks + b) * 16 + t] = X[g * 16 + t].d[b];
}

/* Rows n0 .. n1 - 1 (at most 16) of a Q4_K or Q5_K tensor against every token, into Y (see the section's comment) */
static void rows16(int type, const uint8_t* W, long row_bytes, long n0, long n1, const acts* X, long M, long K,
                   const float* bias, float* Y, long N, const room16* room, const tokens16* tokens) {
  long blocks = K / 256, per = 8, rows = n1 - n0; /* per: offsets per block (one per 32 values) */
  long block_bytes = type == Q4_K ? 144 : 176;
  float d[16] __attribute__((aligned(64)));
  v64 w[4], scale[4];
  if (rows == 16 && tiled(type, M) && tokens && tokens->tiles) {
    memset(room->acc, 0, sizeof(float) * 16 * (size_t)(tokens->groups * 16));
    for (long b = 0; b < blocks; b++) {
      for (long r = 0; r < 16; r++) {
        const uint8_t* p = W + (n0 + r) * row_bytes + b * block_bytes;
        prefetch_ahead(p, block_bytes);
        d[r] = decode_k(type, p, w, scale, room->offsets + r * blocks * per + b * per);
        for (int u = 0; u < 4; u++) {
          __m512i low = _mm512_and_si512(scale[u], _mm512_set1_epi16(7)), high = _mm512_srli_epi16(scale[u], 3);
          _mm512_store_si512(room->weights + u * 1024 + r * 64, _mm512_mullo_epi16(w[u], low));
          _mm512_store_si512(room->weights + (4 + u) * 1024 + r * 64, _mm512_mullo_epi16(w[u], high));
        }
      }
      for (long g = 0; g < tokens->groups; g++) {
        const int8_t* B = tokens->tiles + (g * blocks + b) * 4 * 1024;
        _tile_zero(0);
        _tile_zero(1);
        for (int u = 0; u < 4; u++) {
          _tile_loadd(2, room->weights + u * 1024, 64);
          _tile_loadd(3, room->weights + (4 + u) * 1024, 64);
          _tile_loadd(4, B + u * 1024, 64);
          _tile_dpbusd(0, 2, 4);
          _tile_dpbusd(1, 3, 4);
        }
        _tile_stored(0, room->results, 64);
        _tile_stored(1, room->results + 256, 64);
        __m512 dx = _mm512_loadu_ps(tokens->scales + (g * blocks + b) * 16);
        for (long r = 0; r < 16; r++) { /* lanes: tokens g * 16 .. */
          __m512i sum = _mm512_add_epi32(_mm512_load_si512(room->results + 16 * r),
                                         _mm512_slli_epi32(_mm512_load_si512(room->results + 256 + 16 * r), 3));
          float* acc = room->acc + (r * tokens->groups + g) * 16;
          _mm512_store_ps(acc, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(_mm512_set1_ps(d[r]), dx),
                                               _mm512_load_ps(acc)));
        }
      }
    }
    for (long r = 0; r < 16; r++)
      for (long m = 0; m < M; m++) {
        float out = room->acc[r * tokens->groups * 16 + m] -
                    dot_floats(room->offsets + r * blocks * per, X[m].sums32, blocks * per);
        Y[m * N + n0 + r] = bias ? out + bias[n0 + r] : out;
      }
    return;
  }
  for (long m0 = 0; m0 < M;) { /* the vectors: T tokens at a time, row by row; then each block's 16 rows' sums */
    long T = M - m0 >= 4 ? 4 : M - m0;
    for (long r = 0; r < 16; r++) {
      if (r >= rows) {
        for (long i = 0; i < blocks * T; i++) room->lanes[i * 16 + r] = _mm512_setzero_si512();
        for (long b = 0; b < blocks; b++) room->d[b * 16 + r] = 0.0f;
        continue;
      }
      const uint8_t* row = W + (n0 + r) * row_bytes;
      for (long b = 0; b < blocks; b++) {
        prefetch_ahead(row + b * block_bytes, block_bytes);
        room->d[b * 16 + r] =
            decode_k(type, row + b * block_bytes, w, scale, room->offsets + r * blocks * per + b * per);
        for (long t = 0; t < T; t++) {
          const int8_t* x = X[m0 + t].q + b * 256;
          v64 sums = zero64();
          for (int u = 0; u < 4; u++) sums = dot16(sums, maddubs(w[u], load64(x + 64 * u)), scale[u]);
          room->lanes[(b * T + t) * 16 + r] = sums;
        }
      }
    }
    __m512 acc[4];
    for (long t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
      __m512 dw = _mm512_load_ps(room->d + b * 16);
      for (long t = 0; t < T; t++)
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_each(room->lanes + (b * T + t) * 16)),
                                 _mm512_mul_ps(dw, _mm512_set1_ps(X[m0 + t].d[b])), acc[t]);
    }
    for (long t = 0; t < T; t++) {
      float sums[16];
      _mm512_storeu_ps(sums, acc[t]);
      for (long r = 0; r < rows; r++) {
        float out = sums[r] - dot_floats(room->offsets + r * blocks * per, X[m0 + t].sums32, blocks * per);
        Y[(m0 + t) * N + n0 + r] = bias ? out + bias[n0 + r] : out;
      }
    }
    m0 += T;
  }
}
#endif

/* --------------------------------------------------------------------------------------- F32, F16, BF16 */
static inline vf load_floats(int type, const uint8_t* row, long k) {
#ifdef WIDE
  if (type == F32) return _mm512_loadu_ps((const float*)row + k);
  __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)row + k));
  if (type == F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
  if (type == F32) return _mm256_loadu_ps((const float*)row + k);
  __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)row + k));
  if (type == F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#endif
}

static inline float scalar_float(int type, const uint8_t* row, long k) {
  if (type == F32) return ((const float*)row)[k];
  uint16_t h = ((const uint16_t*)row)[k];
  if (type == F16) return _cvtsh_ss(h);
  uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static void rows_float(int type, const uint8_t* W, long row_bytes, long n0, long n1, const float* X, long M, long K,
                       const float* bias, float* Y, long N) {
  long whole = K - K % FLOATS;
  for (long n = n0; n < n1; n++) {
    const uint8_t* row = W + n * row_bytes;
    for (long m0 = 0; m0 < M; m0 += TILE) {
      long tile = M - m0 < TILE ? M - m0 : TILE;
      vf acc[TILE];
      for (long t = 0; t < tile; t++) acc[t] = zerof();
      for (long k = 0; k < whole; k += FLOATS) {
        vf w = load_floats(type, row, k);
        for (long t = 0; t < tile; t++) {
#ifdef WIDE
          vf x = _mm512_loadu_ps(X + (m0 + t) * K + k);
#else
          vf x = _mm256_loadu_ps(X + (m0 + t) * K + k);
#endif
          acc[t] = fmaddf(w, x, acc[t]);
        }
      }
      for (long t = 0; t < tile; t++) {
        float value = reduce(acc[t]);
        for (long k = whole; k < K; k++) value += scalar_float(type, row, k) * X[(m0 + t) * K + k];
        Y[(m0 + t) * N + n] = bias ? value + bias[n] : value;
      }
    }
  }
}

/* ------------------------------------------------------------------------------------------------ entry */
static int block_values(int type) {
  switch (type) {
  case Q4_K: case Q5_K: case Q6_K: return 256;
  case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: return 32;
  case F32: case F16: case BF16: return 1;
  default: return 0;
  }
}

/* Bytes of one block of `type` (of `block_values` values). */
static long block_bytes_of(int type) {
  switch (type) {
  case Q4_0: return 18;
  case Q4_1: return 20;
  case Q5_0: return 22;
  case Q5_1: return 24;
  case Q8_0: return 34;
  case Q4_K: return 144;
  case Q5_K: return 176;
  case Q6_K: return 210;
  case F16: case BF16: return 2;
  default: return 4;
  }
}

/* Room for M rows of K values quantised (by `quantise_row`, for blocks of 256 or 32 values; `lanes`: with their
 * values also in the orders of `decode_lanes`, bit 0 for Q4_K / Q5_K and bit 1 for Q6_K): the row records point
 * into *q and *floats (which the caller frees with the returned array). NULL if out of memory. */
static acts* quantise_room(long M, long K, int lanes, int8_t** q, float** floats) {
  long padded = (K + 63) / 64 * 64, per = padded / 32 + 2; /* 32-value blocks per row, with room for a pair */
  long stride = per * 8 + per * 2 + per * 2 + per + per * 2; /* lanes, sums16, sums32 (or per-block d), d, lanes6_sums */
  acts* rows = malloc(sizeof(acts) * M);
  long copies = 1 + (lanes & 1) + (lanes >> 1 & 1); /* the values, then (lanes) in the orders of `decode_lanes` */
  *q = calloc((size_t)(copies * M * padded), 1);
  *floats = calloc((size_t)(M * stride), sizeof(float));
  if (!rows || !*q || !*floats) {
    free(rows); free(*q); free(*floats);
    *q = NULL; *floats = NULL;
    return NULL;
  }
  for (long m = 0; m < M; m++) {
    float* f = *floats + m * stride;
    int8_t* lanes_q = lanes & 1 ? *q + (M + m) * padded : NULL;
    int8_t* lanes6_q = lanes & 2 ? *q + ((lanes & 1 ? 2 : 1) * M + m) * padded : NULL;
    acts a = {*q + m * padded, lanes_q, lanes6_q, f, f + per, f + per + per * 8, f + per + per * 8 + per * 2,
              f + per + per * 8 + per * 4};
    rows[m] = a;
  }
  return rows;
}

/* The team's shares of a call's chunks of rows: thread t first takes chunks lo_t, lo_t + 1, ... of its own range
 * [lo_t, hi_t) (a contiguous stream of rows, as a static split), then, its range done, takes the last chunk left in
 * the range with the most left (hi - 1), until none is left. Each range is (lo, hi) in one 64-bit word, on a cache
 * line of its own, taken from either end by compare-and-swap. Which thread computes a chunk does not change its
 * results (the kernels are the same on every thread). Measured on Qwen2.5-Coder-1.5B, one token per step (2
 * threads, 113 calls a step): with a static split the two threads of a call finished ~65 us apart on average (by
 * turns, one streams its share more slowly), 7.3 ms of waiting a step in all; with these shares 0.8 ms. The step
 * itself gained less (0.979-0.987x in three interleaved runs): while one thread waited, the other had the memory to
 * itself. (Interleaved chunks for all, `schedule(dynamic, 4)`, were 1.10-1.16x slower: see docs/performance.md.) */
typedef struct { _Alignas(64) uint64_t range; } share;

static uint64_t range_of(long lo, long hi) { return (uint64_t)lo | (uint64_t)hi << 32; }

/* shares[0 .. team - 1] for `chunks` chunks (contiguous ranges, as `omp for schedule(static)` would split them);
 * NULL if out of memory */
static share* shares_new(long chunks, int team) {
  share* shares = aligned_alloc(64, sizeof(share) * (size_t)team);
  for (int t = 0; shares && t < team; t++) shares[t].range = range_of(chunks * t / team, chunks * (t + 1) / team);
  return shares;
}

/* The next chunk for thread `me` (see `share`), or -1 when none is left */
static long next_chunk(share* shares, int me, int team) {
  for (;;) {
    uint64_t own = __atomic_load_n(&shares[me].range, __ATOMIC_RELAXED);
    long lo = (long)(own & 0xffffffffu), hi = (long)(own >> 32);
    if (lo < hi) {
      if (__atomic_compare_exchange_n(&shares[me].range, &own, range_of(lo + 1, hi), 0, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED))
        return lo;
      continue;
    }
    int victim = -1;
    long most = 0;
    uint64_t seen = 0; /* the victim's range as read (taken only if it is still that) */
    for (int t = 0; t < team; t++) {
      uint64_t other = __atomic_load_n(&shares[t].range, __ATOMIC_RELAXED);
      long left = (long)(other >> 32) - (long)(other & 0xffffffffu);
      if (left > most) most = left, victim = t, seen = other;
    }
    if (victim < 0) return -1;
    long last = (long)(seen >> 32);
    if (__atomic_compare_exchange_n(&shares[victim].range, &seen, range_of((long)(seen & 0xffffffffu), last - 1), 0,
                                    __ATOMIC_RELAXED, __ATOMIC_RELAXED))
      return last - 1;
  }
}

/* Several linears that read the same input, as `cats_quantized_team` takes them: linear i has N[i] rows of
 * row_bytes[i] bytes of GGUF type types[i] at W[i], and float32 bias biases[i] (NULL: none); every row holds K
 * values. */
struct cats_group {
  int count;
  const int* types;
  const uint8_t* const* W;
  const long* row_bytes;
  const long* N;
  const float* const* biases;
  long K;
};

/* Y[M, sum N] = the group's linears on X[M, K] side by side (linear i in columns offset_i .. offset_i + N_i - 1):
 * Y[m, offset_i + n] = X[m] . W_i[n] (+ bias_i[n]). X is quantised once per block size. Called by every thread of
 * an OpenMP team with the same arguments (or outside a parallel region: a team of one); the team quantises X's rows
 * and then shares the rows of W, in chunks of 16 (`share`); Y is complete for every thread when it returns. Returns 0, -1 for a type or a K these
 * kernels do not take (K a multiple of each type's block), -2 if out of memory (this thread's share is then
 * missing: callers combine every thread's result). */
int cats_quantized_team(const struct cats_group* g, const float* X, float* Y, long M) {
  long total = 0, chunks = 0, chunk = 16, K = g->K;
  int families = 0; /* bit 0: 32-value blocks, bit 1: 256 */
  int layouts = 0; /* the orders of `decode_lanes` the group's types take (bits of `quantise_room`) */
  for (int i = 0; i < g->count; i++) {
    int block = block_values(g->types[i]);
    if (block == 0 || K % block) return -1;
    families |= block == 32 ? 1 : block == 256 ? 2 : 0;
    layouts |= lanes_layout(g->types[i]);
    total += g->N[i];
    chunks += (g->N[i] + chunk - 1) / chunk;
  }
  if (M <= 0 || total <= 0) return 0;
  acts *rows32 = NULL, *rows256 = NULL;
  int8_t *q32 = NULL, *q256 = NULL;
  float *f32 = NULL, *f256 = NULL;
  share* shares = NULL;
  int failed = 0, me = omp_get_thread_num(), team = omp_get_num_threads();
#pragma omp single copyprivate(rows32, rows256, q32, q256, f32, f256, shares, failed)
  {
    if (families & 1) failed |= !(rows32 = quantise_room(M, K, 0, &q32, &f32));
    if (families & 2) failed |= !(rows256 = quantise_room(M, K, layouts, &q256, &f256));
    failed |= !(shares = shares_new(chunks, team));
  }
  if (!failed) {
    /* fewer rows than threads (decoding): each row's blocks are shared out too */
    long parts = M < team ? team : 1;
#pragma omp for schedule(static)
    for (long item = 0; item < M * parts; item++) {
      long m = item / parts, part = item % parts;
      if (rows32) quantise_row(X + m * K, 32, rows32[m], K / 32 * part / parts, K / 32 * (part + 1) / parts);
      if (rows256) quantise_row(X + m * K, 256, rows256[m], K / 256 * part / parts, K / 256 * (part + 1) / parts);
    }
    long padded = (K + 63) / 64 * 64;
    float* scratch = malloc(sizeof(float) * (size_t)(padded / 16 + 16)); /* a row's offsets */
    uint8_t* decoded = NULL; /* a prompt's k-quant rows, decoded once for all its tiles (`rows_blocks`) */
#ifdef LANES_K
    if (layouts && decoded_rows(M, K / 256))
      decoded = aligned_alloc(64, (size_t)(DECODED_ROWS * (K / 256) * (DECODED_BYTES + LANES_OFFSETS * sizeof(float))));
#endif
#ifdef CATS_AMX
    int split = 0, tiles = 0; /* whether some linear here takes `rows16`, and the tiles (every thread: the same) */
    for (int i = 0; i < g->count; i++) split |= split_scales(g->types[i]), tiles |= tiled(g->types[i], M);
    tiles = tiles && rows256 && tiles_granted();
    tokens16 tokens = {NULL, NULL, 0};
    if (tiles) {
      int ready = 1;
#pragma omp single copyprivate(tokens, ready)
      ready = tokens_as_tiles(M, K, &tokens);
      if (ready) {
#pragma omp for schedule(static)
        for (long gb = 0; gb < tokens.groups * (K / 256); gb++)
          fill_tokens(rows256, M, K, &tokens, gb / (K / 256), gb % (K / 256));
        tiles_on();
      } else {
        tiles = 0; /* out of memory for the tiles: the vectors take every row (the same sums) */
      }
    }
    long groups = (M + 15) / 16;
    room16 room = {NULL, NULL, NULL, NULL, NULL, NULL};
    if (split)
      room = (room16){malloc(sizeof(float) * (size_t)(16 * (K / 256 + 1) * 8)),
                      aligned_alloc(64, sizeof(float) * (size_t)(16 * groups * 16)),
                      aligned_alloc(64, sizeof(float) * (size_t)(16 * (K / 256 + 1))),
                      aligned_alloc(64, 64 * (size_t)(16 * 4 * (K / 256 + 1))), aligned_alloc(64, 8 * 1024),
                      aligned_alloc(64, 2 * 1024)};
    if (split && (!room.offsets || !room.acc || !room.d || !room.lanes || !room.weights || !room.results)) {
      free(scratch);
      scratch = NULL;
    }
#endif
    for (long c = next_chunk(shares, me, team); c >= 0; c = next_chunk(shares, me, team)) {
      long first = c, offset = 0; /* chunk c: linear i, rows n0 .. n1 - 1 */
      int i = 0;
      while (first >= (g->N[i] + chunk - 1) / chunk) {
        first -= (g->N[i] + chunk - 1) / chunk;
        offset += g->N[i];
        i++;
      }
      long n0 = first * chunk, n1 = n0 + chunk < g->N[i] ? n0 + chunk : g->N[i];
      int block = block_values(g->types[i]);
      if (!scratch) continue;
      if (block == 1)
        rows_float(g->types[i], g->W[i], g->row_bytes[i], n0, n1, X, M, K, g->biases[i], Y + offset, total);
#ifdef CATS_AMX
      else if (split_scales(g->types[i]))
        rows16(g->types[i], g->W[i], g->row_bytes[i], n0, n1, rows256, M, K, g->biases[i], Y + offset, total, &room,
               tiles ? &tokens : NULL);
#endif
      else
        rows_blocks(g->types[i], block, g->W[i], g->row_bytes[i], n0, n1, block == 32 ? rows32 : rows256, M, K,
                    g->biases[i], Y + offset, total, scratch, decoded);
    }
#pragma omp barrier
    failed |= !scratch;
    free(scratch);
    free(decoded);
#ifdef CATS_AMX
    if (tiles) _tile_release();
    free(room.offsets); free(room.acc); free(room.d); free(room.lanes); free(room.weights); free(room.results);
#pragma omp single nowait /* (after the chunks' barrier: no thread reads the tokens' tiles any more) */
    {
      free(tokens.tiles);
      free(tokens.scales);
    }
#endif
  } /* (the loop over chunks ends with the team's barrier: every row of Y is written, the quantised rows unused) */
#pragma omp single nowait
  {
    free(rows32); free(q32); free(f32);
    free(rows256); free(q256); free(f256);
    free(shares);
  }
  return failed ? -2 : 0;
}

/* `cats_quantized_team` on `threads` threads of a team of its own: several linears on the same input in one call
 * (W_i, row_bytes_i, N_i, biases_i, types_i as in `struct cats_group`). */
int cats_quantized_linears(int count, const int* types, const uint8_t* const* W, const long* row_bytes,
                           const long* N, const float* const* biases, const float* X, float* Y, long M, long K,
                           int threads) {
  struct cats_group g = {count, types, W, row_bytes, N, biases, K};
  long rows = 0;
  for (int i = 0; i < count; i++) rows += N[i];
  int done = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && rows > 16)
  {
    int mine = cats_quantized_team(&g, X, Y, M);
    if (mine) {
#pragma omp atomic write
      done = mine;
    }
  }
  return done;
}

/* One linear: Y[M, N] = X[M, K] W^T (+ bias), W: N rows of row_bytes bytes of GGUF type `type` (see
 * cats_quantized_linears). */
int cats_quantized_linear(int type, const uint8_t* W, long row_bytes, const float* X, const float* bias, float* Y,
                          long M, long N, long K, int threads) {
  return cats_quantized_linears(1, &type, &W, &row_bytes, &N, &bias, X, Y, M, K, threads);
}

/* ------------------------------------------------------------------------------------- rows as float32 */
/* One block of `type` at p as float32 values, those gguf-py's dequantisation gives: each value's product and sum in
 * its order and float32 rounding (the function is compiled without contraction into FMAs, which would round once
 * where gguf-py rounds twice). */
__attribute__((optimize("fp-contract=off"))) static void block_floats(int type, const uint8_t* p, float* out) {
  switch (type) {
    case Q4_0: case Q4_1: {
      float d = half(p), m = type == Q4_1 ? half(p + 2) : 0.0f;
      const uint8_t* q = p + (type == Q4_1 ? 4 : 2);
      for (int i = 0; i < 32; i++) {
        int v = i < 16 ? q[i] & 15 : q[i - 16] >> 4;
        out[i] = type == Q4_1 ? d * (float)v + m : d * (float)(v - 8);
      }
      return;
    }
    case Q5_0: case Q5_1: {
      float d = half(p), m = type == Q5_1 ? half(p + 2) : 0.0f;
      const uint8_t* h = p + (type == Q5_1 ? 4 : 2);
      uint32_t high;
      memcpy(&high, h, 4);
      for (int i = 0; i < 32; i++) {
        int v = (i < 16 ? h[4 + i] & 15 : h[4 + i - 16] >> 4) | (int)((high >> i) & 1) << 4;
        out[i] = type == Q5_1 ? d * (float)v + m : d * (float)(v - 16);
      }
      return;
    }
    case Q8_0: {
      float d = half(p);
      for (int i = 0; i < 32; i++) out[i] = (float)(int8_t)p[2 + i] * d;
      return;
    }
    case Q4_K: case Q5_K: {
      float d = half(p), dmin = half(p + 2);
      const uint8_t* s = p + 4;
      const uint8_t* qh = p + 16;
      const uint8_t* ql = p + (type == Q5_K ? 48 : 16);
      for (int j = 0; j < 8; j++) {
        int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 2) & 0x30);
        int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
        float scale = d * (float)sc, offset = dmin * (float)mn;
        for (int i = 0; i < 32; i++) {
          int v = (ql[32 * (j / 2) + i] >> (4 * (j % 2))) & 15;
          if (type == Q5_K) v |= ((qh[i] >> j) & 1) << 4;
          out[32 * j + i] = scale * (float)v - offset;
        }
      }
      return;
    }
    case Q6_K: {
      const uint8_t* ql = p;
      const uint8_t* qh = p + 128;
      const int8_t* sc = (const int8_t*)(p + 192);
      float d = half(p + 208);
      for (int v = 0; v < 256; v++) {
        int h = v / 128, r = v % 128;
        int low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 15;
        int high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
        out[v] = (d * (float)sc[v / 16]) * (float)((low | high << 4) - 32);
      }
      return;
    }
  }
}

/* Rows of a GGUF tensor as float32: out[i, :] = row rows[i] of W (N rows; rows NULL: row i), `columns` values
 * each, as gguf-py dequantises them (an embedding's looked-up rows: a few microseconds where gguf-py's numpy code
 * takes 0.1-0.5 ms a call). Returns -1 for a type it does not take, -2 for a row number outside [0, N). */
int cats_quantized_rows(int type, const uint8_t* W, long row_bytes, long N, const int64_t* rows, long n, long columns,
                        float* out) {
  int block = block_values(type);
  if (block == 0 || columns % block) return -1;
  for (long i = 0; i < n; i++)
    if (rows ? rows[i] < 0 || rows[i] >= N : i >= N) return -2;
  for (long i = 0; i < n; i++) {
    const uint8_t* row = W + (rows ? rows[i] : i) * row_bytes;
    float* values = out + i * columns;
    if (type == F32) {
      memcpy(values, row, columns * sizeof(float));
    } else if (type == F16 || type == BF16) {
      for (long k = 0; k < columns; k++) {
        uint16_t bits;
        memcpy(&bits, row + 2 * k, 2);
        if (type == F16) {
          values[k] = _cvtsh_ss(bits);
        } else {
          uint32_t wide = (uint32_t)bits << 16;
          memcpy(values + k, &wide, 4);
        }
      }
    } else {
      long bytes = block_bytes_of(type);
      for (long b = 0; b < columns / block; b++) block_floats(type, row + b * bytes, values + b * block);
    }
  }
  return 0;
}

/* A small call of every type: the child process that checks this build runs it (an instruction the CPU cannot
 * run kills the child, not the caller). Returns 0 when every result is finite. */
int cats_quantized_probe(void) {
  static uint8_t weights[2 * 210 * 2];
  static float x[2 * 256], y[2 * 2];
  for (int i = 0; i < (int)sizeof(weights); i++) weights[i] = (uint8_t)(i * 7 + 1) & 0x3b;
  for (int i = 0; i < 512; i++) x[i] = (float)((i % 13) - 6) * 0.25f;
  int types[] = {Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16};
  for (int i = 0; i < (int)(sizeof(types) / sizeof(types[0])); i++) {
    int block = block_values(types[i]);
    long K = block == 256 ? 256 : 64;
    if (cats_quantized_linear(types[i], weights, 420, x, NULL, y, 2, 2, K, 1)) return -1;
  }
#ifdef CATS_AMX
  /* the tiles: granted, and each token's outputs those the vectors give it alone */
  if (!tiles_granted()) return -2;
  static uint8_t rows[16 * 144];
  static float many[TILE_TOKENS * 256], together[TILE_TOKENS * 16], alone[16];
  for (int i = 0; i < (int)sizeof(rows); i++) rows[i] = (uint8_t)(i * 13 + 5);
  for (int i = 0; i < 16; i++) rows[144 * i] = 0x00, rows[144 * i + 1] = 0x20, rows[144 * i + 3] = 0x10;
  for (int i = 0; i < TILE_TOKENS * 256; i++) many[i] = (float)((i * 7) % 23 - 11) * 0.125f;
  if (cats_quantized_linear(Q4_K, rows, 144, many, NULL, together, TILE_TOKENS, 16, 256, 1)) return -1;
  for (int m = 0; m < TILE_TOKENS; m++) {
    if (cats_quantized_linear(Q4_K, rows, 144, many + 256 * m, NULL, alone, 1, 16, 256, 1)) return -1;
    if (memcmp(alone, together + 16 * m, sizeof alone)) return -3;
  }
#endif
  return 0;
}

#ifdef CATS_AMX
int cats_quantized_isa(void) { return 1024; }
#elif defined(WIDE)
int cats_quantized_isa(void) { return 512; }
#else
int cats_quantized_isa(void) { return 256; }
#endif
