/* Dropout in one pass over a CPU tensor (gbrun/dropout.py builds and loads
   this file). out[i] = in[i] * m[i], m[i] = scale or 0: forward gives the
   input, backward the output's gradient. Element i is kept when a hash of
   (seed, i) falls below the keep threshold, so the mask depends on the seed
   alone (not on the thread count), and backward regenerates it instead of
   storing it. */
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float bf16_to_float(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch does; a NaN stays a (quiet) NaN. */
static inline bf16 float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (bf16)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u
                                                  : rounded);
}

/* Chris Wellons' triple32: a bijection of 32-bit integers whose output
   bits each flip with probability 1/2 (to within 2e-5) when any input bit
   flips. */
static inline uint32_t triple32(uint32_t x) {
    x ^= x >> 17; x *= 0xed5ad4bbu;
    x ^= x >> 11; x *= 0xac4c1b51u;
    x ^= x >> 15; x *= 0x31848babu;
    x ^= x >> 14;
    return x;
}

/* scale if element i is kept (its top 24 hash bits below `keep`), else 0. */
static inline float mask(uint32_t i, uint32_t k0, uint32_t k1, int32_t keep,
                         float scale) {
    uint32_t h = triple32(i * 0x9e3779b9u + k0) ^ k1;
    return (int32_t)(h >> 8) < keep ? scale : 0.0f;
}

/* One loop per dtype, over restrict pointers, so that each vectorises. */
static void drop_float(const float *restrict in, float *restrict out,
                       int64_t begin, int64_t end, uint32_t k0, uint32_t k1,
                       int32_t keep, float scale) {
    for (int64_t i = begin; i < end; i++)
        out[i] = in[i] * mask((uint32_t)i, k0, k1, keep, scale);
}

static void drop_bf16(const bf16 *restrict in, bf16 *restrict out,
                      int64_t begin, int64_t end, uint32_t k0, uint32_t k1,
                      int32_t keep, float scale) {
    for (int64_t i = begin; i < end; i++)
        out[i] = float_to_bf16(bf16_to_float(in[i]) *
                               mask((uint32_t)i, k0, k1, keep, scale));
}

#define PART (1 << 16) /* elements a thread takes at a time */

/* n elements (n <= 2^32) of float32 or bfloat16 from `in` to `out`; keep:
   the keep probability times 2^24; scale: 1 / (1 - p) in the tensor's
   dtype; threads: of the OpenMP runtime torch runs on (dropout.py links
   this file against it, so that its threads are torch's own). */
void gbrun_dropout(int is_bf16, const void *in, void *out, int64_t n,
                   uint64_t seed, int32_t keep, float scale, int threads) {
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    int64_t parts = (n + PART - 1) / PART;
#pragma omp parallel for num_threads(threads) schedule(static) if (parts > 1)
    for (int64_t part = 0; part < parts; part++) {
        int64_t begin = part * PART, end = begin + PART < n ? begin + PART : n;
        if (is_bf16)
            drop_bf16(in, out, begin, end, k0, k1, keep, scale);
        else
            drop_float(in, out, begin, end, k0, k1, keep, scale);
    }
}
