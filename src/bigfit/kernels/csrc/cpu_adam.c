/* bigfit's host Adam/AdamW step for the offload engine (strategies/cpu_adam.py builds and loads it).
 *
 * Why not torch's fused CPU AdamW: it needs gradients in the parameters' dtype (fp32), so bf16
 * gradients from the device would first be widened in a pass of their own. This kernel reads them as
 * they arrive (2 bytes a parameter instead of 4, on the DMA write and on the step's read) and makes
 * one pass over the fp32 master weights and moments. The step is memory-bound on the offload
 * machines (RESULTS.md), so bytes are its time. It also keeps the moments in compact formats
 * (strategies/statefmt.py; stateref.py holds a plain-torch reference of every one): bf16 (stochastic
 * rounding) and 8-bit codes with one scale per block of a row.
 *
 * Same arithmetic as torch.optim.AdamW / Adam (fp32, non-amsgrad, non-maximize):
 *   g  = grad / grad_scale (+ wd * p for Adam's L2 form)
 *   p *= 1 - lr * wd                         (AdamW's decoupled decay)
 *   m  = m + (g - m) * (1 - beta1)           (torch's lerp)
 *   v  = v * beta2 + (1 - beta2) * g * g
 *   p -= step_size * m / (sqrt(v) / bc2_sqrt + eps)
 * The caller computes every coefficient in double, as torch does (1 - beta2 in float would be off by
 * 5e-5 relative: 0.999f is not 0.999), and passes it rounded to float. Built with -ffp-contract=off,
 * so each operation rounds as torch's do and the reference matches the compact formats bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    int decoupled;  /* AdamW (p *= decay), else Adam (g += l2 * p) */
    float decay, l2, one_minus_b1, beta2, one_minus_b2, eps, step_size, bc2_sqrt, grad_scale;
} Hyper;

static inline float widen_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float gradient(const void *grad, int grad_bf16, int64_t i, const Hyper *h) {
    return (grad_bf16 ? widen_bf16(((const uint16_t *)grad)[i]) : ((const float *)grad)[i]) / h->grad_scale;
}

/* One element's update: the new moments into *m and *v, the new weight returned. */
static inline float adam(float w, float g, float *m, float *v, const Hyper *h) {
    if (h->decoupled) w *= h->decay; else g += h->l2 * w;
    *m = *m + (g - *m) * h->one_minus_b1;
    *v = *v * h->beta2 + h->one_minus_b2 * g * g;
    return w - h->step_size * *m / (sqrtf(*v) / h->bc2_sqrt + h->eps);
}

/* Chunks handed out as threads come free (dynamic), not a fixed share each: the training thread and
 * CUDA's own threads share these cores, and one slowed thread would hold up a static split. */
#define CHUNK 32768
#define CHUNKS(...)                                                                               \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                       \
    for (int64_t start = 0; start < n; start += CHUNK) {                                          \
        const int64_t end = start + CHUNK < n ? start + CHUNK : n;                                \
        _Pragma("omp simd")                                                                       \
        for (int64_t i = start; i < end; i++) { __VA_ARGS__ }                                       \
    }

#define HYPER Hyper h = {decoupled, decay, l2, one_minus_b1, beta2, one_minus_b2, eps, step_size, bc2_sqrt, grad_scale}
#define HYPER_ARGS int decoupled, float decay, float l2, float one_minus_b1, float beta2, float one_minus_b2, \
    float eps, float step_size, float bc2_sqrt, float grad_scale

/* The loops of a kernel over its n elements, once for each gradient dtype (a branch on it inside
 * the loop cost 15% of the fp32 step on the CPU machine's 2 cores). ELEMENT(G) steps element i with
 * its unscaled gradient G. */
#define BOTH_GRADIENTS(ELEMENT)                                                                   \
    if (grad_bf16) {                                                                              \
        const uint16_t *restrict g16 = grad;                                                     \
        CHUNKS(ELEMENT(widen_bf16(g16[i])))                                                       \
    } else {                                                                                      \
        const float *restrict g32 = grad;                                                        \
        CHUNKS(ELEMENT(g32[i]))                                                                   \
    }

#define FP32_ELEMENT(G)                                                                           \
    float mi = m[i], vi = v[i];                                                                   \
    p[i] = adam(p[i], (G) / h.grad_scale, &mi, &vi, &h);                                          \
    m[i] = mi;                                                                                    \
    v[i] = vi;

/* fp32 moments. grad_bf16: the gradients are bf16 (uint16 bits), else fp32. Returns 0. */
int bigfit_adam_step(float *restrict p, const void *restrict grad, int grad_bf16, float *restrict m,
                     float *restrict v, int64_t n, HYPER_ARGS, int threads) {
    HYPER;
    BOTH_GRADIENTS(FP32_ELEMENT)
    return 0;
}

/* -- bf16 moments, stochastically rounded --------------------------------------------------------
 * Round to nearest would freeze the second moment: with beta2 = 0.999 a step changes it by 0.1%,
 * under half of bf16's 0.4-0.8% spacing, so it could never decay. Stochastic rounding keeps it
 * unbiased. The random bits are a hash of (seed, element index), so a step is reproducible. */
static inline uint32_t mix32(uint32_t x) {  /* murmur3's finaliser */
    x ^= x >> 16; x *= 0x85EBCA6Bu; x ^= x >> 13; x *= 0xC2B2AE35u; x ^= x >> 16;
    return x;
}

static inline uint16_t bf16_stochastic(float x, uint32_t r) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (uint16_t)((bits + (r & 0xFFFFu)) >> 16);
}

#define BF16_ELEMENT(G)                                                                           \
    float mi = widen_bf16(m[i]), vi = widen_bf16(v[i]);                                           \
    p[i] = adam(p[i], (G) / h.grad_scale, &mi, &vi, &h);                                          \
    const uint32_t r = mix32((uint32_t)(index0 + i) * 0x9E3779B1u ^ seed);                       \
    m[i] = bf16_stochastic(mi, r);                                                                \
    v[i] = bf16_stochastic(vi, r >> 16);

/* index0: the first element's index in its bucket (the hash's input); seed: the step's and bucket's. */
int bigfit_adam_step_bf16(float *restrict p, const void *restrict grad, int grad_bf16, uint16_t *restrict m,
                          uint16_t *restrict v, int64_t n, int64_t index0, uint32_t seed, HYPER_ARGS, int threads) {
    HYPER;
    BOTH_GRADIENTS(BF16_ELEMENT)
    return 0;
}

/* -- 8-bit moments, one scale per block --------------------------------------------------------
 * Each row of a parameter (dim 0: the rows the ranks shard) is cut into blocks of BLOCK; a block's
 * values are stored as codes relative to its largest magnitude, its scale (fp32). The codes are
 * small floats, as 8-bit Adam's dynamic quantisation is, so small values keep their precision:
 * 4 exponent bits (down to 2^-14 of the scale, and evenly spaced below that) and MAN mantissa bits.
 * The first moment: a sign and 3 mantissa bits. The second: its square root (the update divides by
 * it, and the root halves the range: 2^-36 of the block's largest v stays non-zero) with 4.
 * Rounding is to nearest: as in 8-bit Adam a block's values follow its scale, which is exact. */
#define BLOCK 256

static inline uint32_t code8(float x, int man) {  /* x in [0, 1]; both branches computed: vectorisable */
    const uint32_t low = (uint32_t)(x * (float)(1 << (14 + man)) + 0.5f);  /* below 2^-14: evenly spaced */
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits += 1u << (22 - man);  /* half a step: round to nearest, carrying into the exponent */
    const uint32_t normal = ((bits >> 23) - 112) << man | ((bits >> (23 - man)) & ((1u << man) - 1));
    return x < 6.103515625e-05f ? low : normal;
}

static inline float value8(uint32_t code, int man) {
    const uint32_t bits = ((code >> man) + 112) << 23 | (code & ((1u << man) - 1)) << (23 - man);
    float y;
    memcpy(&y, &bits, sizeof y);
    /* below 2^-14 the code is c * 2^-(14+man), which is 2 * (y - 2^-15) exactly: arithmetic, not a
     * select, which kept GCC from vectorising the block's loop (8x slower) */
    const float low = (float)(code < (1u << man));
    return y + (y - 6.103515625e-05f) * low;
}

/* One block: dequantise, step, requantise against the block's new largest values. */
static inline void int8_block(float *restrict p, const void *restrict grad, int grad_bf16, uint8_t *restrict m,
                              uint8_t *restrict v, float *restrict m_scale, float *restrict v_scale, int64_t len,
                              const Hyper *h) {
    float mk[BLOCK], sk[BLOCK], m_max = 0.0f, s_max = 0.0f;
    const float ms = *m_scale, vs = *v_scale;
    #pragma omp simd reduction(max:m_max, s_max)
    for (int64_t k = 0; k < len; k++) {
        const uint32_t mc = m[k];
        const float mag = value8(mc & 0x7F, 3) * ms, si = value8(v[k], 4) * vs;
        float mi = mc & 0x80 ? -mag : mag, vi = si * si;
        p[k] = adam(p[k], gradient(grad, grad_bf16, k, h), &mi, &vi, h);
        mk[k] = mi;
        sk[k] = sqrtf(vi);
        const float a = fabsf(mi);
        m_max = a > m_max ? a : m_max;
        s_max = sk[k] > s_max ? sk[k] : s_max;
    }
    const float m_inv = m_max > 0.0f ? 1.0f / m_max : 0.0f, s_inv = s_max > 0.0f ? 1.0f / s_max : 0.0f;
    #pragma omp simd
    for (int64_t k = 0; k < len; k++) {
        const float x = fabsf(mk[k]) * m_inv, y = sk[k] * s_inv;
        m[k] = (uint8_t)((uint32_t)(mk[k] < 0.0f) << 7 | code8(x < 1.0f ? x : 1.0f, 3));
        v[k] = (uint8_t)code8(y < 1.0f ? y : 1.0f, 4);
    }
    *m_scale = m_max;
    *v_scale = s_max;
}

/* One slot's `rows` x `row_numel` elements (a parameter's rows on this rank); its blocks' scales at
 * m_scale / v_scale, ceil(row_numel / BLOCK) a row. */
int bigfit_adam_step_int8(float *restrict p, const void *restrict grad, int grad_bf16, uint8_t *restrict m,
                          uint8_t *restrict v, float *restrict m_scale, float *restrict v_scale, int64_t rows,
                          int64_t row_numel, HYPER_ARGS, int threads) {
    HYPER;
    const int64_t per_row = (row_numel + BLOCK - 1) / BLOCK, blocks = rows * per_row;
    #pragma omp parallel for schedule(dynamic, 128) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t col = b % per_row * BLOCK, i = b / per_row * row_numel + col;
        const int64_t len = row_numel - col < BLOCK ? row_numel - col : BLOCK;
        const void *gi = grad_bf16 ? (const void *)((const uint16_t *)grad + i)
                                   : (const void *)((const float *)grad + i);
        int8_block(p + i, gi, grad_bf16, m + i, v + i, m_scale + b, v_scale + b, len, &h);
    }
    return 0;
}
