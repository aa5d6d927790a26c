/* Decoding GGUF block-quantised rows (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) into float32 or bfloat16, bit for bit what gguf-py's
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

/* kinds (codes): 0 Q4_0, 1 Q4_1, 2 Q8_0, 3 Q5_0, 4 Q5_1, 5 Q4_K, 6 Q5_K, 7 Q6_K */
static const long BLOCK_BYTES[8] = {18, 20, 34, 22, 24, 144, 176, 210};
static const int BLOCK_VALUES[8] = {32, 32, 32, 32, 32, 256, 256, 256};

static inline uint32_t read_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* the 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block's 12 scale bytes */
static inline void scale_min(const uint8_t *scales, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = scales[j] & 0x3f;
        *min = scales[j + 4] & 0x3f;
    } else {
        *scale = (scales[j + 4] & 0x0f) | ((scales[j - 4] >> 2) & 0x30);
        *min = (scales[j + 4] >> 4) | ((scales[j] >> 2) & 0x30);
    }
}

/* One block into out[BLOCK_VALUES[kind]] (float32), in gguf-py's operations and order. */
static inline void decode_block(int kind, const uint8_t *block, float *out) {
    float d = half_to_float(read_half(block));
    switch (kind) {
    case 0: {
        const uint8_t *qs = block + 2;
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)((int)(qs[j] & 0x0f) - 8);
            out[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
        }
        break;
    }
    case 1: {
        float m = half_to_float(read_half(block + 2));
        const uint8_t *qs = block + 4;
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)(qs[j] & 0x0f) + m;
            out[j + 16] = d * (float)(qs[j] >> 4) + m;
        }
        break;
    }
    case 2: {
        const int8_t *qs = (const int8_t *)(block + 2);
        for (int j = 0; j < 32; j++) out[j] = d * (float)qs[j];
        break;
    }
    case 3: case 4: {
        float m = kind == 4 ? half_to_float(read_half(block + 2)) : 0.0f;
        const uint8_t *rest = block + (kind == 4 ? 4 : 2);
        uint32_t qh = read_u32(rest);
        const uint8_t *qs = rest + 4;
        for (int j = 0; j < 32; j++) {
            int low = j < 16 ? (qs[j] & 0x0f) : (qs[j - 16] >> 4);
            int q = low | (int)(((qh >> j) & 1u) << 4);
            if (kind == 3) out[j] = d * (float)(q - 16);
            else out[j] = d * (float)q + m;
        }
        break;
    }
    case 5: case 6: {
        float dmin = half_to_float(read_half(block + 2));
        const uint8_t *scales = block + 4;
        const uint8_t *qh = kind == 6 ? block + 16 : 0;
        const uint8_t *qs = block + (kind == 6 ? 48 : 16);
        for (int s = 0; s < 8; s++) { /* sub-block s: 32 values, nibble s % 2 of qs[(s / 2) * 32 + i] */
            int scale, min;
            scale_min(scales, s, &scale, &min);
            float ds = d * (float)scale, dm = dmin * (float)min;
            for (int i = 0; i < 32; i++) {
                int q = (qs[(s / 2) * 32 + i] >> (4 * (s % 2))) & 0x0f;
                if (qh) q |= ((qh[i] >> s) & 1) << 4;
                out[s * 32 + i] = ds * (float)q - dm;
            }
        }
        break;
    }
    default: { /* Q6_K: ql[128], qh[64], int8 scales[16], then d */
        const uint8_t *ql = block, *qh = block + 128;
        const int8_t *scales = (const int8_t *)(block + 192);
        d = half_to_float(read_half(block + 208));
        for (int p = 0; p < 256; p++) {
            int half = p / 128, r = p % 128;
            int low = (ql[half * 64 + r % 64] >> (4 * (r / 64))) & 0x0f;
            int high = (qh[half * 32 + r % 32] >> (2 * (r / 32))) & 0x03;
            out[p] = (d * (float)scales[p / 16]) * (float)((low | (high << 4)) - 32);
        }
        break;
    }
    }
}

/* Decode `blocks` consecutive blocks of `kind` from `source` into `target` (BLOCK_VALUES[kind] values a block).
 * to_bf16: write bfloat16 (each float32 value rounded to nearest even), else float32. Returns 0, or -1 for an
 * unknown kind. */
int cats_decode_blocks(int kind, const uint8_t *source, long blocks, void *target, int to_bf16) {
    if (kind < 0 || kind > 7) return -1;
    int count = BLOCK_VALUES[kind];
    float values[256];
    for (long b = 0; b < blocks; b++) {
        const uint8_t *block = source + b * BLOCK_BYTES[kind];
        if (to_bf16) {
            decode_block(kind, block, values);
            uint16_t *out = (uint16_t *)target + b * count;
            for (int j = 0; j < count; j++) out[j] = float_to_bf16(values[j]);
        } else {
            decode_block(kind, block, (float *)target + b * count);
        }
    }
    return 0;
}
