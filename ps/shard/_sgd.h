/* SGD's arithmetic as torch's CPU kernels round it, for ps/shard/_compiled.c. */
#ifndef PSAR_SGD_H
#define PSAR_SGD_H
#include <Python.h>
#include <math.h>

/* One step of torch.optim.SGD's single-tensor loop, as torch's CPU kernels round it:
 * g = g * scale (async_scale="mean"), g = -g (maximize), g = g + wd * p (weight decay: a fused
 * multiply-add, as torch's add with alpha), then with a momentum buffer b (one that exists:
 * the first step, which makes it, is Python's) b = b * mom (rounded), b = b + damp * g, and
 * g = g + mom * b (nesterov) or g = b; then p = p + (-lr) * g. */
#define SGD_BODY(T, FMA)                                                            \
    for (Py_ssize_t i = 0; i < n; i++) {                                            \
        T x = g[i];                                                                 \
        if (a->scaled) x = x * scale;                                               \
        if (a->maximize) x = -x;                                                    \
        if (a->decay) x = FMA(wd, p[i], x);                                         \
        if (buf) {                                                                  \
            T m = buf[i] * mom;                                                     \
            T b = FMA(damp, x, m);                                                  \
            buf[i] = b;                                                             \
            x = a->nesterov ? FMA(mom, b, x) : b;                                   \
        }                                                                           \
        p[i] = FMA(neg_lr, x, p[i]);                                                \
    }

typedef struct {
    double scale, wd, lr, momentum, dampening;
    int scaled, maximize, decay, nesterov;
} Step;

#define SGD_FN(NAME, T, FMA, ATTR)                                                       \
    ATTR static void NAME(T *restrict p, const T *restrict g, T *restrict buf, Py_ssize_t n, \
                          const Step *a) {                                               \
        T scale = (T)a->scale, wd = (T)a->wd, neg_lr = (T)(-a->lr), mom = (T)a->momentum, \
          damp = (T)(1.0 - a->dampening);                                                \
        SGD_BODY(T, FMA)                                                                 \
    }

SGD_FN(sgd_f32_fma, float, __builtin_fmaf, __attribute__((target("avx2,fma"))))
SGD_FN(sgd_f64_fma, double, __builtin_fma, __attribute__((target("avx2,fma"))))
SGD_FN(sgd_f32_any, float, fmaf, )
SGD_FN(sgd_f64_any, double, fma, )

static int have_fma = 0;

/* p, g and buf (NULL: no momentum) of n elements, float64 or float32. */
static void sgd(int f64, void *p, const void *g, void *buf, Py_ssize_t n, const Step *a) {
    if (f64)
        (have_fma ? sgd_f64_fma : sgd_f64_any)((double *)p, (const double *)g, (double *)buf, n, a);
    else
        (have_fma ? sgd_f32_fma : sgd_f32_any)((float *)p, (const float *)g, (float *)buf, n, a);
}

#endif
