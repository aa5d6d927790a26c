/* Decoding GGUF block-quantised rows (Q4_0, Q4_1, Q8_0) into float32 or bfloat16, bit for bit what gguf-py's
 * numpy dequantisation gives (and, for bfloat16, torch's round-to-nearest-even conversion of it): each value is
 * computed in float32 with the same operations in the same order (compiled with -ffp-contract=off: no fused
 * multiply-add). Plain C; no threads (the layer reader calls it from its own thread). */
#include <stdint.h>
#include <string.h>

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exponent = 127 - 15 + 1;
            while (!(mantissa & 0x400u)) { mantissa <<= 1; exponent--; }
            bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
        }
    } else if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch (finite values) */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7f800000u) == 0x7f800000u) return (uint16_t)((bits >> 16) | ((bits & 0xffffu) ? 0x40u : 0));
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline uint16_t read_half(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* One block of 32 values into out[32] (float32). kind: 0 = Q4_0 (18 bytes), 1 = Q4_1 (20), 2 = Q8_0 (34). */
static inline void decode_block(int kind, const uint8_t *block, float *out) {
    float d = half_to_float(read_half(block));
    if (kind == 0) {
        const uint8_t *qs = block + 2;
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)((int)(qs[j] & 0x0f) - 8);
            out[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
        }
    } else if (kind == 1) {
        float m = half_to_float(read_half(block + 2));
        const uint8_t *qs = block + 4;
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)(qs[j] & 0x0f) + m;
            out[j + 16] = d * (float)(qs[j] >> 4) + m;
        }
    } else {
        const int8_t *qs = (const int8_t *)(block + 2);
        for (int j = 0; j < 32; j++) out[j] = d * (float)qs[j];
    }
}

static const long BLOCK_BYTES[3] = {18, 20, 34};

/* Decode `blocks` consecutive blocks of `kind` from `source` into `target` (32 values a block). to_bf16: write
 * bfloat16 (each float32 value rounded to nearest even), else float32. Returns 0, or -1 for an unknown kind. */
int cats_decode_blocks(int kind, const uint8_t *source, long blocks, void *target, int to_bf16) {
    if (kind < 0 || kind > 2) return -1;
    float values[32];
    for (long b = 0; b < blocks; b++) {
        const uint8_t *block = source + b * BLOCK_BYTES[kind];
        if (to_bf16) {
            decode_block(kind, block, values);
            uint16_t *out = (uint16_t *)target + b * 32;
            for (int j = 0; j < 32; j++) out[j] = float_to_bf16(values[j]);
        } else {
            decode_block(kind, block, (float *)target + b * 32);
        }
    }
    return 0;
}
