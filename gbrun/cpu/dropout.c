/* Dropout in one pass over a CPU tensor (gbrun/dropout.py builds and loads
   this file). out[i] = in[i] * m[i], m[i] = scale or 0: forward gives the
   input, backward the output's gradient; with `with_relu`, out[i] =
   max(in[i], 0) * m[i], ReLU then dropout. Element i is kept when a hash of
   (seed, i) falls below the keep threshold, so the mask depends on the seed
   alone (not on the thread count), and dropout's backward regenerates it
   instead of storing it. ReLU then dropout's backward needs no mask: the
   forward's output is above 0 exactly where both let the gradient through. */
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

/* torch's relu: a NaN stays NaN. */
static inline float relu(float v) { return v < 0.0f ? 0.0f : v; }

/* One loop per dtype and variant, over restrict pointers, so that each
   vectorises. */
static void drop_float(const float *restrict in, float *restrict out,
                       int64_t begin, int64_t end, uint32_t k0, uint32_t k1,
                       int32_t keep, float scale, int with_relu) {
    if (with_relu)
        for (int64_t i = begin; i < end; i++)
            out[i] = relu(in[i]) * mask((uint32_t)i, k0, k1, keep, scale);
    else
        for (int64_t i = begin; i < end; i++)
            out[i] = in[i] * mask((uint32_t)i, k0, k1, keep, scale);
}

static void drop_bf16(const bf16 *restrict in, bf16 *restrict out,
                      int64_t begin, int64_t end, uint32_t k0, uint32_t k1,
                      int32_t keep, float scale, int with_relu) {
    if (with_relu)
        for (int64_t i = begin; i < end; i++)
            out[i] = float_to_bf16(relu(bf16_to_float(in[i])) *
                                   mask((uint32_t)i, k0, k1, keep, scale));
    else
        for (int64_t i = begin; i < end; i++)
            out[i] = float_to_bf16(bf16_to_float(in[i]) *
                                   mask((uint32_t)i, k0, k1, keep, scale));
}

/* As torch's threshold_backward after dropout's backward: the gradient
   passes (scaled) where the forward's output is above 0. */
static void relu_drop_back_float(const float *restrict grad,
                                 const float *restrict fwd,
                                 float *restrict out, int64_t begin,
                                 int64_t end, float scale) {
    for (int64_t i = begin; i < end; i++)
        out[i] = fwd[i] > 0.0f ? grad[i] * scale : 0.0f;
}

static void relu_drop_back_bf16(const bf16 *restrict grad,
                                const bf16 *restrict fwd, bf16 *restrict out,
                                int64_t begin, int64_t end, float scale) {
    for (int64_t i = begin; i < end; i++)
        out[i] = bf16_to_float(fwd[i]) > 0.0f
                     ? float_to_bf16(bf16_to_float(grad[i]) * scale) : 0;
}

#define PART (1 << 16) /* elements a thread takes at a time */
#define PARTS(n) (((n) + PART - 1) / PART)
#define BEGIN(part) ((part) * PART)
#define END(part, n) (BEGIN(part) + PART < (n) ? BEGIN(part) + PART : (n))

/* n elements (n <= 2^32) of float32 or bfloat16 from `in` to `out`; keep:
   the keep probability times 2^24; scale: 1 / (1 - p) in the tensor's
   dtype; with_relu: ReLU first; threads: of the OpenMP runtime torch runs on
   (dropout.py links this file against it, so that its threads are torch's
   own). */
void gbrun_dropout(int is_bf16, const void *in, void *out, int64_t n,
                   uint64_t seed, int32_t keep, float scale, int with_relu,
                   int threads) {
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
#pragma omp parallel for num_threads(threads) schedule(static) if (PARTS(n) > 1)
    for (int64_t part = 0; part < PARTS(n); part++) {
        if (is_bf16)
            drop_bf16(in, out, BEGIN(part), END(part, n), k0, k1, keep, scale,
                      with_relu);
        else
            drop_float(in, out, BEGIN(part), END(part, n), k0, k1, keep,
                       scale, with_relu);
    }
}

/* ReLU then dropout's backward: n elements of the output's gradient `grad`
   and of the forward's output `fwd` to the input's gradient `out`. */
void gbrun_relu_dropout_backward(int is_bf16, const void *grad,
                                 const void *fwd, void *out, int64_t n,
                                 float scale, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (PARTS(n) > 1)
    for (int64_t part = 0; part < PARTS(n); part++) {
        if (is_bf16)
            relu_drop_back_bf16(grad, fwd, out, BEGIN(part), END(part, n),
                                scale);
        else
            relu_drop_back_float(grad, fwd, out, BEGIN(part), END(part, n),
                                 scale);
    }
}
