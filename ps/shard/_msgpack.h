/* The msgpack a push+pull's header and its reply's are written in: the forms
 * ps/shard/_compiled.c reads (any a packer may choose) and writes (msgpack-python's Packer's). */
#ifndef PSAR_MSGPACK_H
#define PSAR_MSGPACK_H
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* ---------------------------------------------------------------- msgpack, read */

typedef struct {
    const uint8_t *p, *end;
} Reader;

static int rd_byte(Reader *r, uint8_t *out) {
    if (r->p >= r->end) return 0;
    *out = *r->p++;
    return 1;
}

static int rd_be(Reader *r, int n, uint64_t *out) {
    if (r->end - r->p < n) return 0;
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | r->p[i];
    r->p += n;
    *out = v;
    return 1;
}

/* A non-negative int below limit, in any of msgpack's int forms. 0: not one (or a bool,
 * float, nil, negative...). */
static int rd_uint(Reader *r, uint64_t limit, uint64_t *out) {
    uint8_t b;
    uint64_t v;
    if (!rd_byte(r, &b)) return 0;
    if (b <= 0x7f) {
        v = b;
    } else if (b >= 0xcc && b <= 0xcf) {
        if (!rd_be(r, 1 << (b - 0xcc), &v)) return 0;
    } else if (b >= 0xd0 && b <= 0xd3) {
        int n = 1 << (b - 0xd0);
        if (!rd_be(r, n, &v)) return 0;
        if (v >> (8 * n - 1)) return 0; /* negative */
    } else {
        return 0;
    }
    if (v >= limit) return 0;
    *out = v;
    return 1;
}

static int rd_nil(Reader *r) {
    if (r->p < r->end && *r->p == 0xc0) {
        r->p++;
        return 1;
    }
    return 0;
}

static int rd_str(Reader *r, Py_ssize_t max_len, const char **s, Py_ssize_t *len) {
    uint8_t b;
    uint64_t n;
    if (!rd_byte(r, &b)) return 0;
    if ((b & 0xe0) == 0xa0) {
        n = b & 0x1f;
    } else if (b >= 0xd9 && b <= 0xdb) {
        if (!rd_be(r, 1 << (b - 0xd9), &n)) return 0;
    } else {
        return 0;
    }
    if ((uint64_t)(r->end - r->p) < n || n > (uint64_t)max_len) return 0;
    *s = (const char *)r->p;
    *len = (Py_ssize_t)n;
    r->p += n;
    return 1;
}

/* The length of an array (fix 0x90, tag16 0xdc) or a map (0x80, 0xde), at most max_len. */
static int rd_count(Reader *r, Py_ssize_t max_len, uint8_t fix, uint8_t tag16, Py_ssize_t *len) {
    uint8_t b;
    uint64_t n;
    if (!rd_byte(r, &b)) return 0;
    if ((b & 0xf0) == fix) {
        n = b & 0x0f;
    } else if (b == tag16 || b == tag16 + 1) {
        if (!rd_be(r, b == tag16 ? 2 : 4, &n)) return 0;
    } else {
        return 0;
    }
    if (n > (uint64_t)max_len) return 0;
    *len = (Py_ssize_t)n;
    return 1;
}

#define rd_array(r, max_len, len) rd_count(r, max_len, 0x90, 0xdc, len)
#define rd_map(r, max_len, len) rd_count(r, max_len, 0x80, 0xde, len)

/* A float (msgpack float32 or float64) that is finite and not negative, as the short path
 * takes a push's lr. */
static int rd_lr(Reader *r, double *out) {
    uint8_t b;
    uint64_t v;
    if (!rd_byte(r, &b)) return 0;
    if (b == 0xcb) {
        if (!rd_be(r, 8, &v)) return 0;
        double d;
        memcpy(&d, &v, 8);
        *out = d;
    } else if (b == 0xca) {
        if (!rd_be(r, 4, &v)) return 0;
        uint32_t u = (uint32_t)v;
        float f;
        memcpy(&f, &u, 4);
        *out = f;
    } else {
        return 0;
    }
    return *out >= 0.0 && *out < INFINITY;
}

/* ---------------------------------------------------------------- msgpack, write */

typedef struct {
    uint8_t *buf;
    Py_ssize_t len, cap;
} Writer;

static int wr_reserve(Writer *w, Py_ssize_t n) {
    if (w->len + n <= w->cap) return 1;
    Py_ssize_t cap = (w->cap + n) * 2;
    uint8_t *b = PyMem_Realloc(w->buf, cap);
    if (!b) {
        PyErr_NoMemory();
        return 0;
    }
    w->buf = b;
    w->cap = cap;
    return 1;
}

static void wr_raw(Writer *w, const void *s, Py_ssize_t n) {
    memcpy(w->buf + w->len, s, n);
    w->len += n;
}

static void wr_be(Writer *w, uint8_t tag, uint64_t v, int n) {
    w->buf[w->len++] = tag;
    for (int i = n - 1; i >= 0; i--) w->buf[w->len++] = (uint8_t)(v >> (8 * i));
}

/* As msgpack's Packer writes a non-negative int: the shortest form. */
static int wr_uint(Writer *w, uint64_t v) {
    if (!wr_reserve(w, 9)) return 0;
    if (v < 0x80) w->buf[w->len++] = (uint8_t)v;
    else if (v < 0x100) wr_be(w, 0xcc, v, 1);
    else if (v < 0x10000) wr_be(w, 0xcd, v, 2);
    else if (v < 0x100000000ULL) wr_be(w, 0xce, v, 4);
    else wr_be(w, 0xcf, v, 8);
    return 1;
}

/* As msgpack's Packer writes an int: a negative one in the shortest signed form, else wr_uint's. */
static int wr_int(Writer *w, long long v) {
    if (v >= 0) return wr_uint(w, (uint64_t)v);
    if (!wr_reserve(w, 9)) return 0;
    if (v >= -32) w->buf[w->len++] = (uint8_t)(0xe0 | (v & 0x1f));
    else if (v >= -128) wr_be(w, 0xd0, (uint64_t)v, 1);
    else if (v >= -32768) wr_be(w, 0xd1, (uint64_t)v, 2);
    else if (v >= -2147483648LL) wr_be(w, 0xd2, (uint64_t)v, 4);
    else wr_be(w, 0xd3, (uint64_t)v, 8);
    return 1;
}

static int wr_str(Writer *w, const char *s, Py_ssize_t n) {
    if (!wr_reserve(w, n + 5)) return 0;
    if (n < 32) w->buf[w->len++] = (uint8_t)(0xa0 | n);
    else if (n < 0x100) wr_be(w, 0xd9, n, 1);
    else if (n < 0x10000) wr_be(w, 0xda, n, 2);
    else wr_be(w, 0xdb, n, 4);
    wr_raw(w, s, n);
    return 1;
}

static int wr_array(Writer *w, Py_ssize_t n) {
    if (!wr_reserve(w, 5)) return 0;
    if (n < 16) w->buf[w->len++] = (uint8_t)(0x90 | n);
    else if (n < 0x10000) wr_be(w, 0xdc, n, 2);
    else wr_be(w, 0xdd, n, 4);
    return 1;
}

#define WR_KEY(w, s) wr_str(w, s, (Py_ssize_t)(sizeof(s) - 1))

#endif
