/* A shard's compiled path for a push+pull of whole dense keys with torch's SGD, under async
 * and ssp here and under sync in _sync.h (ps/shard/compiled.py builds it and says when it is
 * used).
 *
 * It does what the Python short path (ps/shard/fastpath.py) does to the shard's state, on the
 * same Python objects, in one call: it reads the msgpack header without making a dict
 * (_msgpack.h), checks the keys against a table built once, updates the keys with SGD's
 * arithmetic (_sgd.h: fused multiply-adds, as torch's CPU kernels round them; compiled.py
 * checks it against torch before using it), counts what the shard counts, and writes the
 * reply's header (requests waiting that the push lets go on, ssp's pulls, are answered by the
 * shard's own _release, after it). A key a reply still points at is first moved to a copy, as
 * the Python paths move it (SnapshotPool.own: its values stay, its memory is the shard's
 * alone). Where anything else is not as the fast case needs it (a field it does not read, a
 * check that fails, a pull that would wait, a momentum buffer not made yet), it returns None
 * before it has changed any value, and the Python paths take the message: they name what is
 * wrong.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_msgpack.h"
#include "_sgd.h"
#include "_split.h"

/* ---------------------------------------------------------------- the path */

typedef struct {
    PyObject *obj;     /* the key id (int) */
    uint64_t id;       /* the same, for the reply */
    Py_ssize_t nbytes; /* of its frame */
    int f64;           /* float64, else float32 */
    const char *dtype; /* its dtype's name, as the header says it */
    Py_ssize_t dtype_len;
    uint64_t numel;
    uint64_t stamp; /* the call that last named it (a key named twice) */
    PyObject *buf_tensor, *buf_array; /* its momentum buffer, and a writable view of its bytes */
} Key;

typedef struct {
    PyObject_HEAD
    PyObject *server;
    PyObject *buffer_bytes; /* (tensor, nbytes, dtype name) -> a writable view of a momentum buffer, or None */
    Key *keys;
    Py_ssize_t *index; /* key id -> entry of keys, or -1 */
    Py_ssize_t max_id, nkeys;
    int ssp;           /* the rule waits a pull on the slowest clock */
    int mean;          /* async_scale="mean" */
    uint64_t staleness;
    uint64_t version_tag; /* PROTOCOL_VERSION */
    uint64_t max_int;
    Py_ssize_t max_header, max_keys, max_str_len, max_map_len;
    Py_ssize_t num_workers, shard_keys;
    uint64_t calls;
    Py_ssize_t taken, released;
    Writer out;
    int sync;                   /* the sync rule (_sync.h), else async or ssp */
    PyObject *tensor_of, *wait; /* (frame, key) -> its tensor; (peer, frames, staleness): a sync pull waits */
} Path;

static PyObject *s_aborted, *s_trace, *s_waiting, *s__waiting, *s_version, *s_workers, *s_seen, *s_lost,
    *s_left, *s_joining, *s_clocks, *s__partial, *s_counters, *s_staleness, *s_max_clock_gap, *s_save,
    *s_bump, *s_snapshots, *s__arrays, *s_lent, *s_optimizer, *s__group, *s_lr, *s_momentum,
    *s_weight_decay, *s_maximize, *s_clock, *s_rule, *s_rows, *s__read_at, *s_bytes_in, *s_bytes_out,
    *s_pushes, *s_pulls, *s_updates, *s__release, *s_chunks, *s_state, *s_momentum_buffer, *s_dampening, *s_nesterov,
    *s_own, *s_reply_bytes, *s_moved_keys, *s_numpy, *s__sum, *s__pushed, *s__updated, *s__held, *s__rows,
    *s__step_lr, *s__step_hold, *s_summing, *s_most_summing, *s_readied, *s_msg, *s_header, *s_ids, *s_fields,
    *s_since, *s_peer, *s_op, *s_keys, *s_min_version, *s_v, *s_worker, *s_req, *s_waits, *s_count, *s_total_s,
    *s_max_s;

enum { F_V, F_OP, F_WORKER, F_REQ, F_STEP, F_VERSION, F_KEYS, F_DTYPES, F_SHAPES, F_PULL, F_MIN_VERSION, F_CLOCK,
       F_LR, NFIELDS };
static const char *FIELD_NAMES[NFIELDS] = {"v", "op", "worker", "req", "step", "version", "keys", "dtypes",
                                           "shapes", "pull", "min_version", "clock", "lr"};
#define REQUIRED ((1u << F_MIN_VERSION) - 1)

typedef struct {
    uint64_t worker, req, step, version, min_version, clock;
    int has_min_version, has_clock, has_lr;
    double lr;
    Py_ssize_t nkeys;
} Push;

static int field_of(const char *s, Py_ssize_t n) {
    for (int f = 0; f < NFIELDS; f++)
        if ((Py_ssize_t)strlen(FIELD_NAMES[f]) == n && memcmp(FIELD_NAMES[f], s, n) == 0) return f;
    return -1;
}

/* The header of a push+pull of whole keys of the table: 1, or 0 where the Python paths must
 * read it (a field, form or value this path does not take). */
static int read_push(Path *self, const uint8_t *data, Py_ssize_t size, Push *m, Py_ssize_t *entries,
                     Py_ssize_t entries_len) {
    Reader r = {data, data + size};
    Py_ssize_t n;
    unsigned seen = 0;
    Py_ssize_t nk = -1, nd = -1, ns = -1;
    if (!rd_map(&r, self->max_map_len, &n)) return 0;
    self->calls++;
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *s;
        Py_ssize_t len;
        if (!rd_str(&r, self->max_str_len, &s, &len)) return 0;
        int f = field_of(s, len);
        if (f < 0 || seen & (1u << f)) return 0;
        seen |= 1u << f;
        uint64_t v;
        switch (f) {
        case F_V:
            if (!rd_uint(&r, self->max_int, &v) || v != self->version_tag) return 0;
            break;
        case F_PULL:
            if (!rd_uint(&r, self->max_int, &v) || v != 1) return 0;
            break;
        case F_OP:
            if (!rd_str(&r, self->max_str_len, &s, &len) || len != 4 || memcmp(s, "push", 4) != 0) return 0;
            break;
        case F_WORKER: if (!rd_uint(&r, self->max_int, &m->worker)) return 0; break;
        case F_REQ: if (!rd_uint(&r, self->max_int, &m->req)) return 0; break;
        case F_STEP: if (!rd_uint(&r, self->max_int, &m->step)) return 0; break;
        case F_VERSION: if (!rd_uint(&r, self->max_int, &m->version)) return 0; break;
        case F_MIN_VERSION:
            if (!rd_nil(&r)) {
                if (!rd_uint(&r, self->max_int, &m->min_version)) return 0;
                m->has_min_version = 1;
            }
            break;
        case F_CLOCK:
            if (!rd_nil(&r)) {
                if (!rd_uint(&r, self->max_int, &m->clock)) return 0;
                m->has_clock = 1;
            }
            break;
        case F_LR:
            if (!rd_nil(&r)) {
                if (!rd_lr(&r, &m->lr)) return 0;
                m->has_lr = 1;
            }
            break;
        case F_KEYS:
            if (!rd_array(&r, self->max_keys, &nk) || nk < 1 || nk > entries_len) return 0;
            for (Py_ssize_t j = 0; j < nk; j++) {
                if (!rd_uint(&r, self->max_int, &v) || v > (uint64_t)self->max_id) return 0;
                Py_ssize_t e = self->index[v];
                if (e < 0 || self->keys[e].stamp == self->calls) return 0; /* not in the table, or twice */
                self->keys[e].stamp = self->calls;
                entries[j] = e;
            }
            break;
        case F_DTYPES:
            if (nk < 0 || !rd_array(&r, self->max_keys, &nd) || nd != nk) return 0; /* keys come first */
            for (Py_ssize_t j = 0; j < nd; j++) {
                Key *k = &self->keys[entries[j]];
                if (!rd_str(&r, self->max_str_len, &s, &len) || len != k->dtype_len || memcmp(s, k->dtype, len) != 0)
                    return 0;
            }
            break;
        case F_SHAPES:
            if (nk < 0 || !rd_array(&r, self->max_keys, &ns) || ns != nk) return 0;
            for (Py_ssize_t j = 0; j < ns; j++) {
                if (!rd_array(&r, self->max_keys, &len) || len != 1 || !rd_uint(&r, self->max_int, &v) ||
                    v != self->keys[entries[j]].numel)
                    return 0;
            }
            break;
        }
    }
    if (r.p != r.end || (seen & REQUIRED) != REQUIRED) return 0;
    m->nkeys = nk;
    return 1;
}

static int get_i64(PyObject *o, long long *out) {
    if (!o || !PyLong_CheckExact(o)) return 0;
    int overflow;
    *out = PyLong_AsLongLongAndOverflow(o, &overflow);
    return !overflow && !(*out == -1 && PyErr_Occurred());
}

/* d[name] += by (a name d lacks counts from 0 where missing_ok); 0 with an error set. */
static int add_to(PyObject *d, PyObject *name, long long by, int missing_ok) {
    long long now = 0;
    PyObject *was = PyDict_GetItemWithError(d, name);
    if (!(was ? get_i64(was, &now) : missing_ok && !PyErr_Occurred())) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "counter %R is not an int", name);
        return 0;
    }
    PyObject *v = PyLong_FromLongLong(now + by);
    if (!v) return 0;
    int rc = PyDict_SetItem(d, name, v);
    Py_DECREF(v);
    return rc == 0;
}

static PyObject *attr(PyObject *o, PyObject *name) { return o ? PyObject_GetAttr(o, name) : NULL; }

/* The slowest live worker's clock, with worker w's clock taken as w_clock; -1: none live. */
static long long slowest_clock(Path *self, PyObject *workers, long long w, long long w_clock, int *err) {
    PyObject *lost = attr(workers, s_lost), *left = attr(workers, s_left), *joining = attr(workers, s_joining),
             *clocks = attr(workers, s_clocks);
    long long best = -1;
    *err = 1;
    if (!lost || !left || !joining || !clocks || !PyDict_Check(lost) || !PyAnySet_Check(left) ||
        !PyAnySet_Check(joining) || !PyDict_Check(clocks))
        goto done;
    for (Py_ssize_t i = 0; i < self->num_workers; i++) {
        PyObject *id = PyLong_FromSsize_t(i);
        if (!id) goto done;
        int out = PyDict_Contains(lost, id) || PySet_Contains(left, id) || PySet_Contains(joining, id);
        long long c = w_clock;
        if (!out && i != w && !get_i64(PyDict_GetItem(clocks, id), &c)) {
            Py_DECREF(id);
            goto done;
        }
        Py_DECREF(id);
        if (!out && (best < 0 || c < best)) best = c;
    }
    *err = 0;
done:
    Py_XDECREF(lost);
    Py_XDECREF(left);
    Py_XDECREF(joining);
    Py_XDECREF(clocks);
    return best;
}

#define MAX_KEYS_ON_STACK 64

/* Workers.note_keys(w, step, keys) on partial (the worker's steps -> keys pushed; done: the
 * step's set, or NULL where there is none yet), where completes says whether they complete
 * the step here: 1, or 0 with an error set. */
static int note_keys(Path *self, PyObject *partials, PyObject *partial, PyObject *clocks, PyObject *w_obj,
                     PyObject *step_obj, PyObject *done, uint64_t step, Py_ssize_t nkeys, const Py_ssize_t *entries,
                     int completes) {
    if (!done) {
        PyObject *fresh = PySet_New(NULL);
        if (!fresh) return 0;
        int rc = PyDict_SetItem(partial, step_obj, fresh);
        Py_DECREF(fresh);
        if (rc < 0) return 0;
        done = PyDict_GetItem(partial, step_obj);
    }
    for (Py_ssize_t j = 0; j < nkeys; j++)
        if (PySet_Add(done, self->keys[entries[j]].obj) < 0) return 0;
    if (!completes) {
        while (PyDict_GET_SIZE(partial) > 64) { /* Workers' PARTIAL_STEPS */
            PyObject *kk, *vv, *least = NULL;
            Py_ssize_t pos = 0;
            long long lo = 0;
            while (PyDict_Next(partial, &pos, &kk, &vv)) {
                long long x;
                if (!get_i64(kk, &x)) return 0;
                if (!least || x < lo) {
                    least = kk;
                    lo = x;
                }
            }
            if (PyDict_DelItem(partial, least) < 0) return 0;
        }
        return 1;
    }
    PyObject *next = PyLong_FromLongLong((long long)step + 1);
    int rc = next ? PyDict_SetItem(clocks, w_obj, next) : -1;
    Py_XDECREF(next);
    if (rc < 0) return 0;
    PyObject *later = PyDict_New(), *kk, *vv;
    Py_ssize_t pos = 0;
    if (!later) return 0;
    while (PyDict_Next(partial, &pos, &kk, &vv)) {
        long long x;
        if (!get_i64(kk, &x) || (x > (long long)step && PyDict_SetItem(later, kk, vv) < 0)) {
            Py_DECREF(later);
            return 0;
        }
    }
    rc = PyDict_SetItem(partials, w_obj, later);
    Py_DECREF(later);
    return rc == 0;
}

/* o.name = v: 1, or 0 with an error set. */
static int set_int_attr(PyObject *o, PyObject *name, long long v) {
    PyObject *x = PyLong_FromLongLong(v);
    int rc = x ? PyObject_SetAttr(o, name, x) : -1;
    Py_XDECREF(x);
    return rc == 0;
}

/* The shard's bump (a checkpoint may be due) where it saves, else its version set to after:
 * 1, or 0 with an error set. */
static int bump(PyObject *s, PyObject *save, long long after) {
    if (save == Py_None) return set_int_attr(s, s_version, after);
    PyObject *r = PyObject_CallMethodNoArgs(s, s_bump);
    Py_XDECREF(r);
    return r != NULL;
}


/* SnapshotPool.own(key) as the Python paths call it before an update (a chunk a reply still
 * points at moves to a copy; moved_keys counts it), then its reply_bytes(key), which makes the
 * view of its memory the replies lend: 1, or 0 with an error set. */
static int own(PyObject *snapshots, PyObject *key, PyObject *counters) {
    PyObject *moved = PyObject_CallMethodOneArg(snapshots, s_own, key);
    if (!moved) return 0;
    int yes = PyObject_IsTrue(moved);
    Py_DECREF(moved);
    if (yes < 0) return 0;
    if (yes && !add_to(counters, s_moved_keys, 1, 0)) return 0;
    PyObject *view = PyObject_CallMethodOneArg(snapshots, s_reply_bytes, key);
    Py_XDECREF(view);
    return view != NULL;
}

/* Each key's memory (of entries): the numpy view its replies lend (SnapshotPool.reply_bytes),
 * which no reply holds now, of a chunk no other reply was given (SnapshotPool.lent); a key a
 * reply may still point at moved to a copy first, as the Python paths move it (its values
 * stay). 1, with arrays_of filled (borrowed); 0 where one is not as this path writes it; -1
 * with an error set. */
static int key_arrays(Path *self, PyObject *snapshots, PyObject *arrays, PyObject *lent, PyObject *counters,
                      Py_ssize_t nkeys, const Py_ssize_t *entries, PyObject **arrays_of) {
    for (Py_ssize_t j = 0; j < nkeys; j++) {
        Key *k = &self->keys[entries[j]];
        PyObject *a = PyDict_GetItem(arrays, k->obj); /* borrowed */
        int in = PySet_Contains(lent, k->obj);
        if (in < 0) return -1;
        if (!a || Py_REFCNT(a) != 1 || in) {
            if (!own(snapshots, k->obj, counters)) return -1;
            if (!(a = PyDict_GetItem(arrays, k->obj)) || Py_REFCNT(a) != 1) return 0;
            if ((in = PySet_Contains(lent, k->obj)) < 0) return -1;
            if (in) return 0;
        }
        arrays_of[j] = a;
    }
    return 1;
}

/* The frames of an 'ok' reply carrying the keys of entries (nkeys), whose memory is
 * arrays_of's: {"v", "op", "worker", "req", "version", "keys"[, "waited_us"], "staleness",
 * "dtypes", "shapes"} as ps.protocol.pack_header writes them (waited_us NULL: none), then each
 * key's bytes, counted in bytes_out. A new list, or NULL with an error set. */
static PyObject *reply_frames(Path *self, uint64_t worker, uint64_t req, Py_ssize_t nkeys, const Py_ssize_t *entries,
                              PyObject **arrays_of, long long version, const long long *waited_us, long long stale,
                              PyObject *counters) {
    Writer *o = &self->out;
    o->len = 0;
    if (!wr_reserve(o, 16) || !(o->buf[o->len++] = waited_us ? 0x8a : 0x89, 1) || !WR_KEY(o, "v") ||
        !wr_uint(o, self->version_tag) || !WR_KEY(o, "op") || !WR_KEY(o, "ok") || !WR_KEY(o, "worker") ||
        !wr_uint(o, worker) || !WR_KEY(o, "req") || !wr_uint(o, req) || !WR_KEY(o, "version") ||
        !wr_uint(o, version) || !WR_KEY(o, "keys") || !wr_array(o, nkeys))
        return NULL;
    for (Py_ssize_t j = 0; j < nkeys; j++)
        if (!wr_uint(o, self->keys[entries[j]].id)) return NULL;
    if (waited_us && (!WR_KEY(o, "waited_us") || !wr_int(o, *waited_us))) return NULL;
    if (!WR_KEY(o, "staleness") || !wr_uint(o, stale) || !WR_KEY(o, "dtypes") || !wr_array(o, nkeys)) return NULL;
    for (Py_ssize_t j = 0; j < nkeys; j++) {
        Key *k = &self->keys[entries[j]];
        if (!wr_str(o, k->dtype, k->dtype_len)) return NULL;
    }
    if (!WR_KEY(o, "shapes") || !wr_array(o, nkeys)) return NULL;
    for (Py_ssize_t j = 0; j < nkeys; j++)
        if (!wr_array(o, 1) || !wr_uint(o, self->keys[entries[j]].numel)) return NULL;
    PyObject *out = PyList_New(nkeys + 1);
    if (!out) return NULL;
    PyObject *hb = PyBytes_FromStringAndSize((const char *)o->buf, o->len);
    if (!hb) {
        Py_DECREF(out);
        return NULL;
    }
    PyList_SET_ITEM(out, 0, hb);
    Py_ssize_t out_bytes = o->len;
    for (Py_ssize_t j = 0; j < nkeys; j++) {
        PyObject *mv = PyMemoryView_FromObject(arrays_of[j]);
        if (!mv) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, j + 1, mv);
        out_bytes += self->keys[entries[j]].nbytes;
    }
    if (!add_to(counters, s_bytes_out, out_bytes, 0)) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* The reply to push+pull m (reply_frames, no waited_us) with the replies in others (or NULL)
 * after it: [(peer, frames), *others], or NULL with an error set. */
static PyObject *reply_of(Path *self, PyObject *peer, const Push *m, const Py_ssize_t *entries, PyObject **arrays_of,
                          long long version, long long stale, PyObject *counters, PyObject *others) {
    PyObject *out = reply_frames(self, m->worker, m->req, m->nkeys, entries, arrays_of, version, NULL, stale, counters);
    if (!out) return NULL;
    PyObject *pair = PyTuple_Pack(2, peer, out);
    Py_DECREF(out);
    if (!pair) return NULL;
    PyObject *result = PyList_New(1);
    if (!result) {
        Py_DECREF(pair);
        return NULL;
    }
    PyList_SET_ITEM(result, 0, pair);
    if (others && PyList_SetSlice(result, 1, 1, others) < 0) Py_CLEAR(result);
    return result;
}

/* A float, or an int (not a bool) where ints may be: 1, or 0. */
static int number(PyObject *o, double *out, int float_only) {
    if (o && PyFloat_CheckExact(o)) {
        *out = PyFloat_AS_DOUBLE(o);
        return 1;
    }
    if (float_only || !o || !PyLong_CheckExact(o)) return 0;
    *out = PyLong_AsDouble(o);
    if (*out == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

static int flag(PyObject *o, int *out) {
    if (!o || !PyBool_Check(o)) return 0;
    *out = o == Py_True;
    return 1;
}

/* The momentum buffer of each key of m, as writable buffers in bufs (*nbufs of them taken):
 * 1, or 0 where one is not there yet (the first step makes it: Python's) or not as this path
 * updates it, with an error set only where one occurred. A key's buffer is looked up in the
 * optimizer's state on each call; the view of its bytes is made once per buffer tensor. */
static int momentum_buffers(Path *self, PyObject *s, PyObject *shard_optimizer, Py_ssize_t nkeys,
                            const Py_ssize_t *entries, Py_buffer *bufs, Py_ssize_t *nbufs) {
    int ok = 0;
    PyObject *chunks = attr(s, s_chunks), *torch_optimizer = attr(shard_optimizer, s_optimizer),
             *state = attr(torch_optimizer, s_state);
    if (!chunks || !state || !PyDict_Check(chunks) || !PyDict_Check(state)) goto done;
    for (Py_ssize_t j = 0; j < nkeys; j++) {
        Key *k = &self->keys[entries[j]];
        PyObject *chunk = PyDict_GetItemWithError(chunks, k->obj);
        PyObject *param = chunk ? PyDict_GetItemWithError(state, chunk) : NULL;
        PyObject *buf = param && PyDict_Check(param) ? PyDict_GetItemWithError(param, s_momentum_buffer) : NULL;
        if (!buf || buf == Py_None) goto done;
        if (buf != k->buf_tensor) {
            PyObject *view = PyObject_CallFunction(self->buffer_bytes, "Onz#", buf, k->nbytes, k->dtype, k->dtype_len);
            if (!view) goto done;
            if (view == Py_None) {
                Py_DECREF(view);
                goto done;
            }
            Py_INCREF(buf);
            Py_XSETREF(k->buf_tensor, buf);
            Py_XSETREF(k->buf_array, view);
        }
        if (PyObject_GetBuffer(k->buf_array, &bufs[j], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
        ++*nbufs;
        if (bufs[j].len != k->nbytes) goto done;
    }
    ok = 1;
done:
    Py_XDECREF(chunks);
    Py_XDECREF(torch_optimizer);
    Py_XDECREF(state);
    return ok;
}

/* Whether the shard's compiled path may take a message now: not aborted, no trace, and its
 * waiting requests a list (held in *waiting and *waiters): 1; 0 where not; -1 with an error set. */
static int shard_open(PyObject *s, PyObject **waiting, PyObject **waiters) {
    PyObject *aborted = attr(s, s_aborted);
    if (!aborted) return -1;
    PyObject *trace = attr(s, s_trace);
    int open = aborted == Py_None && trace == Py_None;
    Py_DECREF(aborted);
    Py_XDECREF(trace);
    if (!trace) return -1;
    if (!open) return 0;
    if (!(*waiting = attr(s, s_waiting)) || !(*waiters = attr(*waiting, s__waiting))) return -1;
    return PyList_CheckExact(*waiters);
}

/* What worker w_obj has pushed of m's step here (Workers.pushed): its steps' keys (*partial,
 * Workers._partial[w]) and the step's set (*done, or NULL where none yet), both held: 1; 0
 * where they are not as this path reads them, or a key of m is among them (pushed twice in a
 * step: refused, by the Python paths); -1 with an error set. */
static int step_pushed(Path *self, PyObject *partials, PyObject *w_obj, PyObject *step_obj, const Push *m,
                       const Py_ssize_t *entries, PyObject **partial, PyObject **done) {
    PyObject *p = PyDict_Check(partials) ? PyDict_GetItem(partials, w_obj) : NULL;
    if (!p || !PyDict_Check(p)) return 0;
    PyObject *d = PyDict_GetItem(p, step_obj);
    if (d && !PyAnySet_CheckExact(d)) return 0;
    for (Py_ssize_t j = 0; d && j < m->nkeys; j++) {
        int in = PySet_Contains(d, self->keys[entries[j]].obj);
        if (in) return in < 0 ? -1 : 0;
    }
    Py_INCREF(p);
    Py_XINCREF(d);
    *partial = p;
    *done = d;
    return 1;
}

/* SGD's settings in the shard optimizer's parameter group (a float learning rate) into a: 1, or
 * 0 where one is not as this path reads it. */
static int group_step(PyObject *group, Step *a) {
    return PyDict_CheckExact(group) && number(PyDict_GetItem(group, s_lr), &a->lr, 1) &&
           number(PyDict_GetItem(group, s_momentum), &a->momentum, 0) &&
           number(PyDict_GetItem(group, s_weight_decay), &a->wd, 0) &&
           number(PyDict_GetItem(group, s_dampening), &a->dampening, 0) &&
           flag(PyDict_GetItem(group, s_maximize), &a->maximize) && flag(PyDict_GetItem(group, s_nesterov), &a->nesterov);
}

/* What the Python paths count of a push taken (fastpath._apply, ShardServer.take_push): its
 * bytes in (header and grads), the worker heard from now, its staleness, one more push: 1, or 0
 * with an error set. */
static int count_push(PyObject *s, PyObject *counters, PyObject *staleness, PyObject *seen, PyObject *w_obj,
                      PyObject *head, const Py_buffer *grads, Py_ssize_t nkeys, long long stale) {
    Py_ssize_t in_bytes = PyBytes_GET_SIZE(head);
    for (Py_ssize_t j = 0; j < nkeys; j++) in_bytes += grads[j].len;
    if (!add_to(counters, s_bytes_in, in_bytes, 0)) return 0;
    PyObject *clock = attr(s, s_clock);
    PyObject *now = clock ? PyObject_CallNoArgs(clock) : NULL;
    Py_XDECREF(clock);
    int rc = now ? PyDict_SetItem(seen, w_obj, now) : -1;
    Py_XDECREF(now);
    if (rc < 0) return 0;
    PyObject *st = PyLong_FromLongLong(stale);
    int ok = st && add_to(staleness, st, 1, 1);
    Py_XDECREF(st);
    return ok && add_to(counters, s_pushes, 1, 0);
}

/* Whether each key's frame (frames[1:]) is a writable, contiguous byte view of its size. */
static int frames_fit(Path *self, PyObject *frames, const Push *m, const Py_ssize_t *entries) {
    for (Py_ssize_t j = 0; j < m->nkeys; j++) {
        PyObject *f = PyList_GET_ITEM(frames, j + 1);
        Key *k = &self->keys[entries[j]];
        if (!PyMemoryView_Check(f) || Py_TYPE(f) != &PyMemoryView_Type) return 0;
        Py_buffer *b = PyMemoryView_GET_BUFFER(f);
        if (b->readonly || b->ndim != 1 || (b->format && strcmp(b->format, "B") != 0) || b->len != k->nbytes ||
            !PyBuffer_IsContiguous(b, 'C'))
            return 0;
    }
    return 1;
}

/* What a call that stopped on an error (set, or not) returns: None where nothing changed yet
 * (the Python paths take the message and say what is wrong); else, as the Python paths, an
 * error reply to push m (ShardServer._dispatch.failed), never a dead shard. */
static PyObject *failed(Path *self, PyObject *peer, const Push *m, int mutated) {
    PyObject *result = NULL;
    if (!mutated) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "the shard's state is not as its compiled path reads it");
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *dispatch = PyObject_GetAttrString(self->server, "_dispatch");
    PyObject *was_type, *was_value, *was_tb; /* the error as the one being handled: its log has its traceback */
    PyErr_GetExcInfo(&was_type, &was_value, &was_tb);
    if (value && tb) PyException_SetTraceback(value, tb);
    Py_XINCREF(type);
    Py_XINCREF(value);
    Py_XINCREF(tb);
    PyErr_SetExcInfo(type, value, tb);
    PyObject *reply = dispatch ? PyObject_CallMethod(dispatch, "failed", "OKKsO", peer, (unsigned long long)m->worker,
                                                     (unsigned long long)m->req, "push", value ? value : Py_None)
                               : NULL;
    PyErr_SetExcInfo(was_type, was_value, was_tb);
    Py_XDECREF(dispatch);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (reply) {
        result = PyList_New(1);
        if (result) PyList_SET_ITEM(result, 0, reply);
        else Py_DECREF(reply);
    }
    return result;
}

#include "_sync.h"

/* Path(peer, frames) -> [(peer, frames)] or None (see the top of the file). */
static PyObject *Path_call(Path *self, PyObject *args, PyObject *kwargs) {
    PyObject *peer, *frames;
    if (!PyArg_ParseTuple(args, "OO", &peer, &frames)) return NULL;
    if (!PyList_CheckExact(frames)) Py_RETURN_NONE;
    Py_ssize_t nframes = PyList_GET_SIZE(frames);
    if (nframes < 2 || nframes - 1 > MAX_KEYS_ON_STACK) Py_RETURN_NONE;
    PyObject *head = PyList_GET_ITEM(frames, 0);
    if (!PyBytes_CheckExact(head) || PyBytes_GET_SIZE(head) > self->max_header) Py_RETURN_NONE;

    Py_ssize_t entries[MAX_KEYS_ON_STACK];
    Py_buffer grads[MAX_KEYS_ON_STACK], values[MAX_KEYS_ON_STACK], bufs[MAX_KEYS_ON_STACK];
    PyObject *arrays_of[MAX_KEYS_ON_STACK];
    Py_ssize_t ngrads = 0, nvalues = 0, nbufs = 0;
    Push m;
    memset(&m, 0, sizeof m);
    if (!read_push(self, (const uint8_t *)PyBytes_AS_STRING(head), PyBytes_GET_SIZE(head), &m, entries,
                   nframes - 1) ||
        m.nkeys != nframes - 1)
        Py_RETURN_NONE;
    if (self->sync) return sync_call(self, peer, frames, &m, entries);

    PyObject *result = NULL, *s = self->server;
    PyObject *waiting = NULL, *waiters = NULL, *version_o = NULL, *workers = NULL, *seen = NULL, *lost = NULL,
             *clocks = NULL, *partials = NULL, *partial = NULL, *done = NULL, *counters = NULL, *staleness = NULL,
             *snapshots = NULL, *arrays = NULL, *lent = NULL, *optimizer = NULL, *group = NULL, *w_obj = NULL,
             *step_obj = NULL, *save = NULL, *rule = NULL, *rows = NULL, *read_at = NULL, *gap_o = NULL,
             *others = NULL;
    int mutated = 0;
    long long version_s, clock_w;

#define GET(var, obj, name)                    \
    if (!(var = attr(obj, name))) goto error;
#define PASS goto pass
#define TRY(call)             \
    switch (call) {           \
    case -1: goto error;      \
    case 0: goto pass;        \
    }
    TRY(shard_open(s, &waiting, &waiters));
    if (!frames_fit(self, frames, &m, entries)) PASS;
    GET(workers, s, s_workers);
    GET(seen, workers, s_seen);
    GET(lost, workers, s_lost);
    if (!PyDict_Check(seen) || !PyDict_Check(lost)) PASS;
    if (!(w_obj = PyLong_FromUnsignedLongLong(m.worker))) goto error;
    if (PyDict_Contains(seen, w_obj) != 1 || PyDict_Contains(lost, w_obj) != 0) PASS;
    GET(version_o, s, s_version);
    if (!get_i64(version_o, &version_s) || (long long)m.version > version_s) PASS;
    GET(clocks, workers, s_clocks);
    if (!PyDict_Check(clocks) || !get_i64(PyDict_GetItem(clocks, w_obj), &clock_w) || (long long)m.step < clock_w)
        PASS;
    GET(partials, workers, s__partial);
    if (!(step_obj = PyLong_FromUnsignedLongLong(m.step))) goto error;
    TRY(step_pushed(self, partials, w_obj, step_obj, &m, entries, &partial, &done));
    int completes = (done ? PySet_GET_SIZE(done) : 0) + m.nkeys >= self->shard_keys;
    long long version_after = version_s + completes;
    if (m.has_min_version && version_after < (long long)m.min_version) PASS; /* the pull waits */
    long long slowest = -1;
    if (m.has_clock) {
        int err;
        slowest = slowest_clock(self, workers, (long long)m.worker, completes ? (long long)m.step + 1 : clock_w, &err);
        if (err) PASS;
        if (self->ssp && slowest >= 0 && (long long)m.clock - slowest > (long long)self->staleness) PASS;
    }
    /* the optimizer: SGD, a float learning rate; with momentum, each key's buffer made already */
    GET(optimizer, s, s_optimizer);
    GET(group, optimizer, s__group);
    Step a = {.divisor = 1.0, .scale = 1.0};
    if (!group_step(group, &a)) PASS;
    if (m.has_lr) a.lr = m.lr;
    if (a.momentum != 0.0 && !momentum_buffers(self, s, optimizer, m.nkeys, entries, bufs, &nbufs)) {
        if (PyErr_Occurred()) goto error;
        PASS;
    }
    /* each key's memory: the numpy view its replies lend (SnapshotPool.reply_bytes), which no
     * reply holds now, of a chunk no other reply was given (SnapshotPool.lent) */
    GET(counters, s, s_counters);
    if (!PyDict_CheckExact(counters)) PASS;
    GET(snapshots, s, s_snapshots);
    GET(arrays, snapshots, s__arrays);
    GET(lent, snapshots, s_lent);
    if (!PyDict_Check(arrays) || !PyAnySet_Check(lent)) PASS;
    {
        int got = key_arrays(self, snapshots, arrays, lent, counters, m.nkeys, entries, arrays_of);
        if (got < 0) goto error;
        if (!got) PASS;
    }
    for (Py_ssize_t j = 0; j < m.nkeys; j++) {
        if (PyObject_GetBuffer(arrays_of[j], &values[j], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto error;
        nvalues++;
        if (values[j].len != self->keys[entries[j]].nbytes) PASS;
        if (PyObject_GetBuffer(PyList_GET_ITEM(frames, j + 1), &grads[j], PyBUF_SIMPLE) < 0) goto error;
        ngrads++;
    }
    GET(staleness, s, s_staleness);
    GET(save, s, s_save);
    GET(rule, s, s_rule);
    GET(rows, rule, s_rows);
    GET(read_at, rows, s__read_at);
    GET(gap_o, s, s_max_clock_gap);
    long long gap;
    if (!PyDict_CheckExact(counters) || !PyDict_CheckExact(staleness) || !PyDict_Check(read_at) ||
        !get_i64(gap_o, &gap))
        PASS;

    /* Every check of the Python paths holds: from here on the push is applied, as they do. */
    mutated = 1;
    long long stale = version_s - (long long)m.version;
    if (!count_push(s, counters, staleness, seen, w_obj, head, grads, m.nkeys, stale)) goto error;
    Py_ssize_t live = self->num_workers - PyDict_GET_SIZE(lost);
    a.scale = self->mean ? 1.0 / (double)live : 1.0;
    if (m.has_lr) {
        PyObject *v = PyFloat_FromDouble(m.lr);
        int rc = v ? PyDict_SetItem(group, s_lr, v) : -1;
        Py_XDECREF(v);
        if (rc < 0) goto error;
    }
    for (Py_ssize_t j = 0; j < m.nkeys; j++) {
        Key *k = &self->keys[entries[j]];
        sgd_split(k->f64, values[j].buf, grads[j].buf, nbufs ? bufs[j].buf : NULL, (Py_ssize_t)k->numel, &a);
    }
    if (!add_to(counters, s_updates, 1, 0)) goto error;
    /* Workers.note_keys, then the rule's bump where the step is complete */
    if (!note_keys(self, partials, partial, clocks, w_obj, step_obj, done, m.step, m.nkeys, entries, completes))
        goto error;
    if (completes) {
        if (!bump(s, save, version_s + 1)) goto error;
    }
    if (!add_to(counters, s_pulls, 1, 0)) goto error;
    if (PyList_GET_SIZE(waiters)) { /* the requests this push lets go on, answered by Python (_release) */
        others = PyObject_CallMethodOneArg(s, s__release, Py_None);
        if (!others) goto error;
        if (!PyList_CheckExact(others)) {
            PyErr_SetString(PyExc_TypeError, "ShardServer._release gave no list");
            goto error;
        }
        Py_XSETREF(gap_o, attr(s, s_max_clock_gap)); /* their pulls may have widened it */
        if (!get_i64(gap_o, &gap)) goto error;
    }
    if (m.has_clock && slowest >= 0 && (long long)m.clock - slowest > gap &&
        !set_int_attr(s, s_max_clock_gap, (long long)m.clock - slowest))
        goto error;
    {   /* rule.read: rows.read(w, updates) */
        PyObject *updates = PyDict_GetItem(counters, s_updates);
        if (!updates || PyDict_SetItem(read_at, w_obj, updates) < 0) goto error;
    }
    if (!(result = reply_of(self, peer, &m, entries, arrays_of, version_after, stale, counters, others))) goto error;
    self->taken++;
    goto done;
pass:
    result = Py_None;
    Py_INCREF(result);
    goto done;
error:
    result = failed(self, peer, &m, mutated);
done:
    for (Py_ssize_t j = 0; j < nvalues; j++) PyBuffer_Release(&values[j]);
    for (Py_ssize_t j = 0; j < ngrads; j++) PyBuffer_Release(&grads[j]);
    for (Py_ssize_t j = 0; j < nbufs; j++) PyBuffer_Release(&bufs[j]);
    Py_XDECREF(waiting);
    Py_XDECREF(waiters);
    Py_XDECREF(version_o);
    Py_XDECREF(workers);
    Py_XDECREF(seen);
    Py_XDECREF(lost);
    Py_XDECREF(clocks);
    Py_XDECREF(partials);
    Py_XDECREF(partial);
    Py_XDECREF(done);
    Py_XDECREF(counters);
    Py_XDECREF(staleness);
    Py_XDECREF(snapshots);
    Py_XDECREF(arrays);
    Py_XDECREF(lent);
    Py_XDECREF(optimizer);
    Py_XDECREF(group);
    Py_XDECREF(w_obj);
    Py_XDECREF(step_obj);
    Py_XDECREF(save);
    Py_XDECREF(rule);
    Py_XDECREF(rows);
    Py_XDECREF(read_at);
    Py_XDECREF(gap_o);
    Py_XDECREF(others);
    return result;
#undef GET
#undef PASS
#undef TRY
}

/* Path(server, table, buffer_bytes, ssp, mean, staleness, version, max_int, max_header, max_keys, max_str_len,
 *      max_map_len, num_workers, shard_keys, sync, tensor_of, wait): table is [(key id, nbytes, float64?,
 *      dtype name, numel)]. */
static int Path_init(Path *self, PyObject *args, PyObject *kwargs) {
    PyObject *server, *table, *buffer_bytes, *tensor_of, *wait;
    unsigned long long staleness, version, max_int;
    if (!PyArg_ParseTuple(args, "OO!OppKKKnnnnnnpOO", &server, &PyList_Type, &table, &buffer_bytes, &self->ssp,
                          &self->mean, &staleness, &version, &max_int, &self->max_header, &self->max_keys,
                          &self->max_str_len, &self->max_map_len, &self->num_workers, &self->shard_keys, &self->sync,
                          &tensor_of, &wait))
        return -1;
    Py_INCREF(tensor_of);
    Py_XSETREF(self->tensor_of, tensor_of);
    Py_INCREF(wait);
    Py_XSETREF(self->wait, wait);
    self->staleness = staleness;
    self->version_tag = version;
    self->max_int = max_int;
    Py_INCREF(server);
    Py_XSETREF(self->server, server);
    Py_INCREF(buffer_bytes);
    Py_XSETREF(self->buffer_bytes, buffer_bytes);
    Py_ssize_t n = PyList_GET_SIZE(table);
    self->nkeys = n;
    self->max_id = -1;
    self->keys = PyMem_Calloc(n ? n : 1, sizeof(Key));
    if (!self->keys) return PyErr_NoMemory(), -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Key *k = &self->keys[i];
        PyObject *id;
        unsigned long long numel;
        int f64;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(table, i), "O!npz#K", &PyLong_Type, &id, &k->nbytes, &f64, &k->dtype,
                              &k->dtype_len, &numel))
            return -1;
        Py_ssize_t v = PyLong_AsSsize_t(id);
        if (v < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a key id is negative");
            return -1;
        }
        char *name = PyMem_Malloc(k->dtype_len + 1);
        if (!name) return PyErr_NoMemory(), -1;
        memcpy(name, k->dtype, k->dtype_len + 1);
        k->dtype = name;
        k->f64 = f64;
        k->numel = numel;
        k->id = (uint64_t)v;
        Py_INCREF(id);
        k->obj = id;
        if (v > self->max_id) self->max_id = v;
    }
    self->index = PyMem_Malloc((self->max_id + 1 > 0 ? self->max_id + 1 : 1) * sizeof(Py_ssize_t));
    if (!self->index) return PyErr_NoMemory(), -1;
    for (Py_ssize_t i = 0; i <= self->max_id; i++) self->index[i] = -1;
    for (Py_ssize_t i = 0; i < n; i++) self->index[self->keys[i].id] = i;
    return 0;
}

/* The path holds its shard, which holds it: the collector may break the cycle. */
static int Path_traverse(Path *self, visitproc visit, void *arg) {
    Py_VISIT(self->server);
    Py_VISIT(self->buffer_bytes);
    Py_VISIT(self->tensor_of);
    Py_VISIT(self->wait);
    for (Py_ssize_t i = 0; self->keys && i < self->nkeys; i++) {
        Py_VISIT(self->keys[i].buf_tensor);
        Py_VISIT(self->keys[i].buf_array);
    }
    return 0;
}

static int Path_clear(Path *self) {
    Py_CLEAR(self->server);
    Py_CLEAR(self->buffer_bytes);
    Py_CLEAR(self->tensor_of);
    Py_CLEAR(self->wait);
    for (Py_ssize_t i = 0; self->keys && i < self->nkeys; i++) {
        Py_CLEAR(self->keys[i].buf_tensor);
        Py_CLEAR(self->keys[i].buf_array);
    }
    return 0;
}

static void Path_dealloc(Path *self) {
    PyObject_GC_UnTrack(self);
    Path_clear(self);
    for (Py_ssize_t i = 0; self->keys && i < self->nkeys; i++) {
        Py_XDECREF(self->keys[i].obj);
        PyMem_Free((void *)self->keys[i].dtype);
    }
    PyMem_Free(self->keys);
    PyMem_Free(self->index);
    PyMem_Free(self->out.buf);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Path_taken(Path *self, void *closure) { return PyLong_FromSsize_t(self->taken); }
static PyObject *Path_released(Path *self, void *closure) { return PyLong_FromSsize_t(self->released); }

static PyGetSetDef Path_getset[] = {
    {"taken", (getter)Path_taken, NULL, "push+pulls this path took", NULL},
    {"released", (getter)Path_released, NULL, "pulls that waited, answered by this path", NULL},
    {NULL},
};

static PyTypeObject PathType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ps.shard._compiled.Path",
    .tp_basicsize = sizeof(Path),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)Path_traverse,
    .tp_clear = (inquiry)Path_clear,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Path_init,
    .tp_dealloc = (destructor)Path_dealloc,
    .tp_call = (ternaryfunc)Path_call,
    .tp_getset = Path_getset,
    .tp_doc = "A shard's compiled push+pull path (ps.shard.compiled).",
};

/* sgd(values, grads, buffer or None, float64, lr, weight_decay, maximize, scale, momentum,
 * dampening, nesterov[, divisor]): the path's arithmetic on writable buffers of one dtype, for
 * the check against torch and for the Python paths' updates (compiled.py). Above RELEASE_BYTES
 * it lets other threads run meanwhile (a key updated in slices, ps.shard.slices). */
#define RELEASE_BYTES (1 << 20)

/* Whether two buffers' bytes overlap (the arithmetic's pointers are restrict). */
static int overlap(const Py_buffer *x, const Py_buffer *y) {
    const char *a = x->buf, *b = y->buf;
    return a < b + y->len && b < a + x->len;
}

static PyObject *py_sgd(PyObject *mod, PyObject *args) {
    Py_buffer p, g, b = {0};
    PyObject *buf;
    int f64;
    Step a = {.divisor = 1.0};
    if (!PyArg_ParseTuple(args, "w*y*Opddpdddp|d", &p, &g, &buf, &f64, &a.lr, &a.wd, &a.maximize, &a.scale,
                          &a.momentum, &a.dampening, &a.nesterov, &a.divisor))
        return NULL;
    if (buf != Py_None && PyObject_GetBuffer(buf, &b, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&p);
        PyBuffer_Release(&g);
        return NULL;
    }
    Py_ssize_t size = f64 ? 8 : 4;
    PyObject *result = Py_None;
    if (p.len != g.len || p.len % size || (buf != Py_None && b.len != p.len)) {
        PyErr_SetString(PyExc_ValueError, "values, grads and buffer must be buffers of the same whole number of elements");
        result = NULL;
    } else if (overlap(&p, &g) || (buf != Py_None && (overlap(&p, &b) || overlap(&g, &b)))) {
        PyErr_SetString(PyExc_ValueError, "values, grads and buffer must not share memory");
        result = NULL;
    } else if (a.divisor != 1.0 && a.scale != 1.0) {
        PyErr_SetString(PyExc_ValueError, "a step divides the gradient or scales it, not both");
        result = NULL;
    } else {
        PyThreadState *released = p.len >= RELEASE_BYTES ? PyEval_SaveThread() : NULL;
        sgd_split(f64, p.buf, g.buf, buf != Py_None ? b.buf : NULL, p.len / size, &a);
        if (released) PyEval_RestoreThread(released);
    }
    PyBuffer_Release(&p);
    PyBuffer_Release(&g);
    if (buf != Py_None) PyBuffer_Release(&b);
    Py_XINCREF(result);
    return result;
}

/* set_threads(n): the threads a key of SPLIT_MIN_BYTES or more is updated on, the caller's
 * among them (_split.h); threads(): how many. */
static PyObject *py_set_threads(PyObject *mod, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1) {
        PyErr_Format(PyExc_ValueError, "a key is updated on at least 1 thread, got %ld", n);
        return NULL;
    }
    split_threads(n);
    Py_RETURN_NONE;
}

static PyObject *py_threads(PyObject *mod, PyObject *unused) { return PyLong_FromLong(split_threads_now()); }

/* fp_controls(): this thread's floating-point controls (_split.h); set_fp_controls(c): take
 * them on this thread (another thread's, for Python's slice threads, ps.shard.slices). */
static PyObject *py_fp_controls(PyObject *mod, PyObject *unused) { return PyLong_FromUnsignedLong(FP_CONTROLS()); }

static PyObject *py_set_fp_controls(PyObject *mod, PyObject *arg) {
    unsigned long c = PyLong_AsUnsignedLong(arg);
    if (c == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    if (c > 0xffffffffUL || !FP_VALID((unsigned)c)) {
        PyErr_Format(PyExc_ValueError, "%lu is not a thread's floating-point controls (fp_controls())", c);
        return NULL;
    }
    FP_SET((unsigned)c);
    Py_RETURN_NONE;
}

/* split_counts(): (keys split over the pool, chunks its helpers updated) since the process began. */
static PyObject *py_split_counts(PyObject *mod, PyObject *unused) {
    return Py_BuildValue("(KK)", (unsigned long long)pool.keys, (unsigned long long)pool.helped);
}

static PyMethodDef methods[] = {
    {"sgd", py_sgd, METH_VARARGS, "The compiled SGD update of values by grads (ps.shard.compiled)."},
    {"set_threads", py_set_threads, METH_O, "The threads a large key's SGD is split over, the caller's among them."},
    {"threads", py_threads, METH_NOARGS, "The threads a large key's SGD is split over."},
    {"split_counts", py_split_counts, METH_NOARGS, "(keys split, chunks the helpers updated)."},
    {"fp_controls", py_fp_controls, METH_NOARGS, "This thread's floating-point controls."},
    {"set_fp_controls", py_set_fp_controls, METH_O, "Take floating-point controls (fp_controls()'s) on this thread."},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "ps.shard._compiled", NULL, -1, methods};

PyMODINIT_FUNC PyInit__compiled(void) {
    __builtin_cpu_init();
    have_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    struct {
        PyObject **var;
        const char *name;
    } names[] = {{&s_aborted, "aborted"},   {&s_trace, "trace"},       {&s_waiting, "waiting"},
                 {&s__waiting, "_waiting"}, {&s_version, "version"},   {&s_workers, "workers"},
                 {&s_seen, "seen"},         {&s_lost, "lost"},         {&s_left, "left"},
                 {&s_joining, "joining"},   {&s_clocks, "clocks"},     {&s__partial, "_partial"},
                 {&s_counters, "counters"}, {&s_staleness, "staleness"}, {&s_max_clock_gap, "max_clock_gap"},
                 {&s_save, "save"},         {&s_bump, "bump"},         {&s_snapshots, "snapshots"},
                 {&s__arrays, "_arrays"},   {&s_lent, "lent"},         {&s_optimizer, "optimizer"},
                 {&s__group, "_group"},     {&s_lr, "lr"},             {&s_momentum, "momentum"},
                 {&s_weight_decay, "weight_decay"}, {&s_maximize, "maximize"}, {&s_clock, "clock"},
                 {&s_rule, "rule"},         {&s_rows, "rows"},         {&s__read_at, "_read_at"},
                 {&s_bytes_in, "bytes_in"}, {&s_bytes_out, "bytes_out"}, {&s_pushes, "pushes"},
                 {&s_pulls, "pulls"},       {&s_updates, "updates"},   {&s_chunks, "chunks"}, {&s__release, "_release"},
                 {&s_state, "state"},       {&s_momentum_buffer, "momentum_buffer"},
                 {&s_dampening, "dampening"}, {&s_nesterov, "nesterov"},
                 {&s_own, "own"},           {&s_reply_bytes, "reply_bytes"}, {&s_moved_keys, "moved_keys"},
                 {&s_numpy, "numpy"},       {&s__sum, "_sum"},         {&s__pushed, "_pushed"},
                 {&s__updated, "_updated"}, {&s__held, "_held"},       {&s__rows, "_rows"},
                 {&s__step_lr, "_step_lr"}, {&s__step_hold, "_step_hold"}, {&s_summing, "summing"},
                 {&s_most_summing, "most_summing"}, {&s_readied, "readied"}, {&s_msg, "msg"},
                 {&s_header, "header"},     {&s_ids, "ids"},           {&s_fields, "fields"},
                 {&s_since, "since"},       {&s_peer, "peer"},         {&s_op, "op"},
                 {&s_keys, "keys"},         {&s_min_version, "min_version"}, {&s_v, "v"},
                 {&s_worker, "worker"},     {&s_req, "req"},           {&s_waits, "waits"},
                 {&s_count, "count"},       {&s_total_s, "total_s"},   {&s_max_s, "max_s"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!(*names[i].var = PyUnicode_InternFromString(names[i].name))) return NULL;
    if (PyType_Ready(&PathType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "SPLIT_MIN_BYTES", SPLIT_MIN_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&PathType);
    if (PyModule_AddObject(m, "Path", (PyObject *)&PathType) < 0) {
        Py_DECREF(&PathType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
