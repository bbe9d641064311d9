/* bigfit's host Adam/AdamW step for the offload engine (strategies/cpu_adam.py builds and loads it).
 *
 * Why not torch's fused CPU AdamW: it needs gradients in the parameters' dtype (fp32), so bf16
 * gradients from the device would first be widened in a pass of their own. This kernel reads them as
 * they arrive (2 bytes a parameter instead of 4, on the DMA write and on the step's read) and makes
 * one pass over the fp32 master weights and moments. The step is memory-bound on the offload
 * machines (RESULTS.md), so bytes are its time.
 *
 * Same arithmetic as torch.optim.AdamW / Adam (fp32, non-amsgrad, non-maximize):
 *   g  = grad / grad_scale (+ wd * p for Adam's L2 form)
 *   p *= 1 - lr * wd                         (AdamW's decoupled decay)
 *   m  = m + (g - m) * (1 - beta1)           (torch's lerp)
 *   v  = v * beta2 + (1 - beta2) * g * g
 *   p -= step_size * m / (sqrt(v) / bc2_sqrt + eps)
 * The caller computes every coefficient in double, as torch does (1 - beta2 in float would be off by
 * 5e-5 relative: 0.999f is not 0.999), and passes it rounded to float.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float widen_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Chunks handed out as threads come free (dynamic), not a fixed share each: the training thread and
 * CUDA's own threads share these cores, and one slowed thread would hold up a static split. */
#define CHUNK 32768
#define ADAM_LOOP(LOAD_GRAD)                                                                      \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                       \
    for (int64_t start = 0; start < n; start += CHUNK) {                                          \
    const int64_t end = start + CHUNK < n ? start + CHUNK : n;                                    \
    _Pragma("omp simd")                                                                           \
    for (int64_t i = start; i < end; i++) {                                                       \
        float g = (LOAD_GRAD) / grad_scale;                                                       \
        float w = p[i];                                                                           \
        if (decoupled) w *= decay; else g += l2 * w;                                              \
        float mi = m[i] + (g - m[i]) * one_minus_b1;                                              \
        float vi = v[i] * beta2 + one_minus_b2 * g * g;                                           \
        m[i] = mi;                                                                                \
        v[i] = vi;                                                                                \
        p[i] = w - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);                                 \
    }                                                                                             \
    }

/* grad_bf16: the gradients are bf16 (uint16 bits), else fp32. decoupled: AdamW (p *= decay), else
 * Adam (g += l2 * p). Returns 0. */
int bigfit_adam_step(float *restrict p, const void *restrict grad, int grad_bf16, float *restrict m,
                     float *restrict v, int64_t n, int decoupled, float decay, float l2, float one_minus_b1,
                     float beta2, float one_minus_b2, float eps, float step_size, float bc2_sqrt,
                     float grad_scale, int threads) {
    if (grad_bf16) {
        const uint16_t *restrict g16 = (const uint16_t *)grad;
        ADAM_LOOP(widen_bf16(g16[i]))
    } else {
        const float *restrict g32 = (const float *)grad;
        ADAM_LOOP(g32[i])
    }
    return 0;
}
