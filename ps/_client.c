/* A worker's compiled lane for the messages it sends and takes most: a push (or push+pull) of
 * whole dense float keys, and an 'ok' reply carrying whole keys (ps/client_compiled.py builds
 * it and says when it is used). Frames up to LANE_COPY_BYTES are copied into ZeroMQ's
 * messages, as pyzmq copies them; larger ones are lent (a Lease holds the tensor's memory
 * until ZeroMQ's thread says it is done with it, and the lane's next call lets it go).
 *
 * It calls libzmq itself, the one pyzmq loaded (its functions' addresses come from
 * client_compiled.py), on the sockets of the worker's ClientTransports, from the thread that
 * uses them, with the GIL released around each call that may wait. A push is checked and its
 * header written in one call (the same bytes as ps.protocol.encode's); a reply is read, checked
 * as ps.protocol_short.decode_reply checks it and made a ps.protocol.Message whose tensors lie
 * on ZeroMQ's own buffers. Anything else it does not take: push returns None before it has
 * sent anything, and take hands the frames over as the transport would (the header as bytes,
 * the other parts as writable byte views), for the Python paths to read and name what is wrong.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#if defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wunused-function" /* _msgpack.h's rd_lr is the shard's */
#endif
#include "shard/_msgpack.h"

#include "_zmq.h"

#define LANE_COPY_BYTES 65536 /* frames up to this are copied (pyzmq copies below 64 KiB), larger ones lent */

static PyObject *SendFailed; /* (shard, errno, bytes sent to shards before it, {request id: bytes} of those
                               * messages) of a send that failed */

/* ---------------------------------------------------------------- a reply's part */

/* One part of a received message, whose bytes stay ZeroMQ's until nothing holds it (a
 * tensor made on it holds it, as pyzmq's Frame does). */
typedef struct {
    PyObject_HEAD
    zmq_msg_t msg;
} Part;

static int Part_getbuffer(Part *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, z_msg_data(&self->msg), (Py_ssize_t)z_msg_size(&self->msg), 0,
                             flags);
}

static void Part_dealloc(Part *self) {
    z_msg_close(&self->msg);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyBufferProcs Part_buffer = {(getbufferproc)Part_getbuffer, NULL};

static PyTypeObject PartType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ps._client.Part",
    .tp_basicsize = sizeof(Part),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Part_dealloc,
    .tp_as_buffer = &Part_buffer,
    .tp_doc = "A part of a message a worker received, on ZeroMQ's buffer.",
};

/* ---------------------------------------------------------------- the lane */

typedef struct {
    int shard;            /* -1: not a key the lane takes */
    Py_ssize_t nbytes;    /* of its frame */
    char format;          /* its buffer format: 'f', 'd', 'e' */
    Py_ssize_t itemsize;
    PyObject *name;       /* its dtype's name (str) */
    PyObject *torch_dtype;
    const char *name_utf8;
    Py_ssize_t name_len;
    PyObject *shape;      /* its wire shape (a list of ints), as the header says it */
    Py_ssize_t ndim;
    uint64_t dims[4];
    uint64_t stamp;       /* the reply that last named it (a key named twice) */
} KeyInfo;

typedef struct {
    PyObject_HEAD
    int shards;
    void **socks;
    double *drained;      /* per shard: when the lane last left a send to the transport (its monitor) */
    PyObject *sock_objs;  /* the pyzmq sockets: alive while the lane is */
    Py_ssize_t nkeys;
    KeyInfo *keys;
    uint64_t worker, version_tag, max_int, stamp; /* max_int: ps.protocol_schema._MAX_INT */
    Py_ssize_t max_header, max_keys;
    double drain_s;       /* ps.transport.MONITOR_DRAIN_S */
    zmq_pollitem_t *polled; /* one a shard */
    int start, closed;
    PyObject *inflight, *versions, *reqs, *handle_cls, *message_cls, *frombuffer, *tensor_type, *dtype_kw;
    Writer out;
    struct Lease *leases; /* frames ZeroMQ may still be sending */
} Lane;

/* Let go of the frames ZeroMQ is done with; how many it still holds. */
static Py_ssize_t sweep(Lane *self) { return lease_sweep(&self->leases); }

static PyObject *s_numpy, *s_pending, *s_timeout_s, *s_dtype, *k_v, *k_op, *k_worker, *k_req, *k_version, *k_keys,
    *k_staleness, *k_waited_us, *k_dtypes, *k_shapes, *s_ok, *s_push, *s_push_pull;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The objects a lane holds, for the GC to visit and clear: OBJ(f) for each of its own, KEY(f) for
 * each of every key's. */
#define LANE_OBJECTS(OBJ, KEY)                                                                 \
    OBJ(sock_objs) OBJ(inflight) OBJ(versions) OBJ(reqs) OBJ(handle_cls) OBJ(message_cls)      \
    OBJ(frombuffer) OBJ(tensor_type) OBJ(dtype_kw)                                             \
    for (Py_ssize_t i = 0; i < self->nkeys; i++) {                                             \
        KEY(name) KEY(torch_dtype) KEY(shape)                                                  \
    }

static int Lane_traverse(Lane *self, visitproc visit, void *arg) {
#define VISIT(f) Py_VISIT(self->f);
#define VISIT_KEY(f) Py_VISIT(self->keys[i].f);
    LANE_OBJECTS(VISIT, VISIT_KEY)
    return 0;
}

static int Lane_clear(Lane *self) {
    self->closed = 1;
#define CLEAR(f) Py_CLEAR(self->f);
#define CLEAR_KEY(f) Py_CLEAR(self->keys[i].f);
    LANE_OBJECTS(CLEAR, CLEAR_KEY)
    return 0;
}

static void Lane_dealloc(Lane *self) {
    PyObject_GC_UnTrack(self);
    Lane_clear(self);
    PyMem_Free(self->keys);
    PyMem_Free(self->socks);
    PyMem_Free(self->drained);
    PyMem_Free(self->polled);
    PyMem_Free(self->out.buf);
    lease_abandon(&self->leases); /* the frames ZeroMQ still holds stay held until it is done */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Lane(socket addresses, socket objects, keys, worker, protocol version, the protocol's int
 * bound, max header bytes, max keys, the transport's monitor interval (s), the client's
 * _inflight, versions and request counter, Handle, Message, torch.frombuffer, torch.Tensor). keys: per key id, None (not the lane's) or (shard, frame
 * bytes, buffer format, itemsize, dtype name, torch dtype, wire shape). */
static int Lane_init(Lane *self, PyObject *args, PyObject *kw) {
    PyObject *addrs, *socks, *keys, *inflight, *versions, *reqs, *handle_cls, *message_cls, *frombuffer, *tensor_type;
    unsigned long long worker, tag, max_int;
    Py_ssize_t max_header, max_keys;
    double drain_s;
    if (!linked) {
        PyErr_SetString(PyExc_RuntimeError, "ps._client: link() libzmq's functions first");
        return -1;
    }
    if (self->socks) {
        PyErr_SetString(PyExc_RuntimeError, "a lane is made once");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O!O!O!KKKnndO!O!OOOOO", &PyList_Type, &addrs, &PyList_Type, &socks, &PyList_Type,
                          &keys, &worker, &tag, &max_int, &max_header, &max_keys, &drain_s, &PyDict_Type, &inflight,
                          &PyDict_Type, &versions, &reqs, &handle_cls, &message_cls, &frombuffer, &tensor_type))
        return -1;
    if (worker >= max_int || tag >= max_int) {
        PyErr_SetString(PyExc_ValueError, "a worker id and a protocol version below the protocol's int bound");
        return -1;
    }
    int shards = (int)PyList_GET_SIZE(addrs);
    if (shards < 1 || PyList_GET_SIZE(socks) != shards) {
        PyErr_SetString(PyExc_ValueError, "a lane needs one socket per shard");
        return -1;
    }
    self->inflight = Py_NewRef(inflight);
    self->versions = Py_NewRef(versions);
    self->reqs = Py_NewRef(reqs);
    self->handle_cls = Py_NewRef(handle_cls);
    self->message_cls = Py_NewRef(message_cls);
    self->frombuffer = Py_NewRef(frombuffer);
    self->tensor_type = Py_NewRef(tensor_type);
    self->shards = shards;
    self->socks = PyMem_Calloc(self->shards, sizeof(void *));
    self->drained = PyMem_Calloc(self->shards, sizeof(double));
    self->polled = PyMem_Calloc(self->shards, sizeof(zmq_pollitem_t));
    if (!self->socks || !self->drained || !self->polled) {
        PyErr_NoMemory();
        return -1;
    }
    for (int s = 0; s < self->shards; s++) {
        self->socks[s] = PyLong_AsVoidPtr(PyList_GET_ITEM(addrs, s));
        if (!self->socks[s]) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a socket's address is 0");
            return -1;
        }
    }
    self->sock_objs = socks;
    Py_INCREF(socks);
    self->worker = worker;
    self->version_tag = tag;
    self->max_int = max_int;
    self->max_header = max_header;
    self->max_keys = max_keys;
    self->drain_s = drain_s;
    self->dtype_kw = PyTuple_Pack(1, s_dtype);
    if (!self->dtype_kw) return -1;
    self->nkeys = PyList_GET_SIZE(keys);
    self->keys = PyMem_Calloc(self->nkeys ? self->nkeys : 1, sizeof(KeyInfo));
    if (!self->keys) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < self->nkeys; i++) {
        KeyInfo *k = &self->keys[i];
        PyObject *e = PyList_GET_ITEM(keys, i);
        k->shard = -1;
        if (e == Py_None) continue;
        int shard;
        const char *format;
        if (!PyArg_ParseTuple(e, "insnUOO!", &shard, &k->nbytes, &format, &k->itemsize, &k->name, &k->torch_dtype,
                              &PyList_Type, &k->shape))
            return -1;
        Py_INCREF(k->name);
        Py_INCREF(k->torch_dtype);
        Py_INCREF(k->shape);
        k->name_utf8 = PyUnicode_AsUTF8AndSize(k->name, &k->name_len);
        if (!k->name_utf8) return -1;
        k->ndim = PyList_GET_SIZE(k->shape);
        if (shard < 0 || shard >= self->shards || k->ndim < 1 || k->ndim > 4 || strlen(format) != 1
            || k->nbytes <= 0)
            continue; /* not the lane's (shard stays -1) */
        int ok = 1;
        for (Py_ssize_t d = 0; d < k->ndim; d++) {
            PyObject *x = PyList_GET_ITEM(k->shape, d);
            unsigned long long v = PyLong_Check(x) ? PyLong_AsUnsignedLongLong(x) : (unsigned long long)-1;
            if (PyErr_Occurred()) PyErr_Clear();
            if (v >= max_int) ok = 0;
            else k->dims[d] = v;
        }
        if (!ok) continue;
        k->format = format[0];
        k->shard = shard;
    }
    return 0;
}

static PyObject *Lane_close(Lane *self, PyObject *unused) {
    self->closed = 1;
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- push */

typedef struct {
    KeyInfo *key;
    uint64_t id;
    Py_buffer view;
    int held;
    int lease; /* lent (above LANE_COPY_BYTES): its message, until sent */
    zmq_msg_t msg;
} Pushed;

static int wr_shape(Writer *w, KeyInfo *k) {
    if (!wr_array(w, k->ndim)) return 0;
    for (Py_ssize_t d = 0; d < k->ndim; d++)
        if (!wr_uint(w, k->dims[d])) return 0;
    return 1;
}

/* A non-negative int below the protocol's bound, or -1 (another type or value: the Python
 * paths' to send). */
static long long small_int(Lane *self, PyObject *x) {
    if (!PyLong_CheckExact(x)) return -1;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (overflow || v < 0 || (unsigned long long)v >= self->max_int) {
        PyErr_Clear();
        return -1;
    }
    return v;
}

/* push(grads, step, version, pull, lr, hold, next_version, clock, timeout_s): PSClient.push of
 * whole keys (grads {key id: tensor}), sent, as (its Handle, bytes sent, {request id: bytes of
 * its message}); None where the lane does not take it (nothing sent). SendFailed (shard, errno,
 * bytes sent before, {request id: bytes} of the messages sent before) where a send failed. */
static PyObject *Lane_push(Lane *self, PyObject *args) {
    PyObject *grads, *step_obj, *version_obj, *lr_obj, *clock_obj;
    int pull, hold, next_version;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "O!OOpOppOd", &PyDict_Type, &grads, &step_obj, &version_obj, &pull, &lr_obj, &hold,
                          &next_version, &clock_obj, &timeout_s))
        return NULL;
    Py_ssize_t n = PyDict_GET_SIZE(grads);
    if (self->closed || !self->socks || n == 0 || n > self->max_keys) Py_RETURN_NONE;
    sweep(self);
    long long step = step_obj == Py_None ? -2 : small_int(self, step_obj);
    long long version = version_obj == Py_None ? -2 : small_int(self, version_obj);
    long long clock = clock_obj == Py_None ? -2 : small_int(self, clock_obj);
    double lr = 0.0;
    if (step == -1 || version == -1 || clock == -1) Py_RETURN_NONE;
    if (lr_obj != Py_None) {
        if (!PyFloat_CheckExact(lr_obj) && !PyLong_CheckExact(lr_obj)) Py_RETURN_NONE;
        lr = PyFloat_AsDouble(lr_obj);
        if (lr == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
    }
    Pushed *items = PyMem_Calloc(n, sizeof(Pushed));
    int *first = PyMem_Calloc(self->shards, sizeof(int)); /* shards in the order the keys first name them */
    long long *vers = PyMem_Calloc(self->shards, sizeof(long long));
    if (!items || !first || !vers) {
        PyMem_Free(items);
        PyMem_Free(first);
        PyMem_Free(vers);
        return PyErr_NoMemory();
    }
    PyObject *result = Py_None, *handle = NULL;
    PyObject *pending = NULL, *req_obj = NULL, *shard_key = NULL; /* the handle's, and a message's */
    PyObject *sizes = NULL; /* request id: bytes of its message */
    Py_INCREF(Py_None);
    int nshards = 0;
    Py_ssize_t pos = 0, i = 0;
    PyObject *k_obj, *g;
    double now = now_s();
    /* every key whole, in the lane's table, on a tensor whose bytes are its frame as they are */
    while (PyDict_Next(grads, &pos, &k_obj, &g)) {
        if (i == n) goto done; /* (grads grew meanwhile) */
        Pushed *it = &items[i];
        long long k = small_int(self, k_obj);
        if (k < 0 || k >= self->nkeys || self->keys[k].shard < 0 || Py_TYPE(g) != (PyTypeObject *)self->tensor_type)
            goto done;
        KeyInfo *key = &self->keys[k];
        PyObject *array = PyObject_CallMethodNoArgs(g, s_numpy); /* refuses autograd, other devices, sparse */
        if (!array) {
            PyErr_Clear();
            goto done;
        }
        int got = PyObject_GetBuffer(array, &it->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT);
        Py_DECREF(array); /* the view holds it */
        if (got < 0) {
            PyErr_Clear();
            goto done;
        }
        it->held = 1;
        i++;
        if (it->view.len != key->nbytes || it->view.itemsize != key->itemsize || !it->view.format
            || it->view.format[0] != key->format || it->view.format[1] != 0)
            goto done;
        it->key = key;
        it->id = (uint64_t)k;
        int seen = 0;
        for (int j = 0; j < nshards; j++) seen |= first[j] == key->shard;
        if (!seen) {
            if (now - self->drained[key->shard] >= self->drain_s) { /* this one the transport sends: it reads its monitor */
                self->drained[key->shard] = now;
                goto done;
            }
            first[nshards++] = key->shard;
        }
    }
    for (int j = 0; j < nshards; j++) { /* the version each shard's message names, where the call names none */
        PyObject *shard_obj = PyLong_FromLong(first[j]);
        if (!shard_obj) goto fail;
        PyObject *v = PyDict_GetItemWithError(self->versions, shard_obj);
        Py_DECREF(shard_obj);
        if (!v && PyErr_Occurred()) goto fail;
        vers[j] = v ? small_int(self, v) : 0;
        if (vers[j] < 0) goto done; /* a version the Python paths send as it is */
    }
    /* one message a shard; the same header bytes as ps.protocol.encode's */
    int conditional = next_version || clock >= 0;
    PyObject *kind = pull ? s_push_pull : s_push;
    PyObject *timeout = PyFloat_FromDouble(timeout_s + (conditional ? (timeout_s < 5.0 ? timeout_s : 5.0) : 0.0));
    if (!timeout) goto fail;
    PyObject *hargs[3] = {NULL, kind, timeout};
    PyObject *kwn = PyTuple_Pack(1, s_timeout_s);
    if (!kwn) {
        Py_DECREF(timeout);
        goto fail;
    }
    handle = PyObject_Vectorcall(self->handle_cls, hargs + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, kwn);
    Py_DECREF(kwn);
    Py_DECREF(timeout);
    if (!handle) goto fail;
    pending = PyObject_GetAttr(handle, s_pending);
    if (!pending) goto fail;
    sizes = PyDict_New();
    if (!sizes) goto fail;
    Py_ssize_t sent_bytes = 0;
    for (int j = 0; j < nshards; j++) {
        int s = first[j];
        shard_key = PyLong_FromLong(s);
        if (!shard_key) goto fail;
        long long seen_version = vers[j];
        req_obj = PyIter_Next(self->reqs);
        long long req = req_obj ? small_int(self, req_obj) : -1;
        if (req < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "request ids ran out");
            goto fail;
        }
        Py_ssize_t nk = 0, last = -1, data = 0; /* this shard's keys, the last of them, their bytes */
        for (Py_ssize_t a = 0; a < i; a++)
            if (items[a].key->shard == s) {
                nk++;
                last = a;
                data += items[a].view.len;
            }
        Writer *w = &self->out;
        w->len = 0;
        Py_ssize_t fields = 9 + (lr_obj != Py_None) + hold + (pull ? 1 + next_version + (clock >= 0) : 0);
        int ok = wr_reserve(w, 1) && (w->buf[w->len++] = (uint8_t)(0x80 | fields), 1) && WR_KEY(w, "v")
                 && wr_uint(w, self->version_tag) && WR_KEY(w, "op") && WR_KEY(w, "push") && WR_KEY(w, "step")
                 && wr_uint(w, step >= 0 ? (uint64_t)step : (uint64_t)seen_version) && WR_KEY(w, "version")
                 && wr_uint(w, version >= 0 ? (uint64_t)version : (uint64_t)seen_version) && WR_KEY(w, "keys")
                 && wr_array(w, nk);
        for (Py_ssize_t a = 0; ok && a < i; a++)
            if (items[a].key->shard == s) ok = wr_uint(w, items[a].id);
        if (ok && lr_obj != Py_None) {
            ok = WR_KEY(w, "lr") && wr_reserve(w, 9);
            if (ok) {
                uint64_t bits;
                memcpy(&bits, &lr, 8);
                wr_be(w, 0xcb, bits, 8);
            }
        }
        if (ok && hold) ok = WR_KEY(w, "hold") && wr_uint(w, 1);
        if (ok && pull) {
            ok = WR_KEY(w, "pull") && wr_uint(w, 1);
            if (ok && next_version) ok = WR_KEY(w, "min_version") && wr_uint(w, (uint64_t)seen_version + 1);
            if (ok && clock >= 0) ok = WR_KEY(w, "clock") && wr_uint(w, (uint64_t)clock);
        }
        ok = ok && WR_KEY(w, "dtypes") && wr_array(w, nk);
        for (Py_ssize_t a = 0; ok && a < i; a++)
            if (items[a].key->shard == s) ok = wr_str(w, items[a].key->name_utf8, items[a].key->name_len);
        ok = ok && WR_KEY(w, "shapes") && wr_array(w, nk);
        for (Py_ssize_t a = 0; ok && a < i; a++)
            if (items[a].key->shard == s) ok = wr_shape(w, items[a].key);
        ok = ok && WR_KEY(w, "worker") && wr_uint(w, self->worker) && WR_KEY(w, "req") && wr_uint(w, (uint64_t)req);
        if (!ok) goto fail;
        /* frames above LANE_COPY_BYTES are lent: ZeroMQ sends the tensor's own memory */
        for (Py_ssize_t a = 0; a <= last; a++) {
            if (items[a].key->shard != s || items[a].view.len <= LANE_COPY_BYTES) continue;
            if (!lease_msg(&self->leases, &items[a].view, &items[a].msg)) goto fail;
            items[a].held = 0; /* the lease holds it now */
            items[a].lease = 1;
        }
        int rc, err = 0;
        void *sock = self->socks[s];
        for (;;) { /* only a message's first part waits (ZeroMQ queues whole messages): a signal
                    * meanwhile is Python's to take, then the part is sent again */
            Py_BEGIN_ALLOW_THREADS
            rc = z_send(sock, w->buf, (size_t)w->len, Z_SNDMORE);
            if (rc < 0) err = z_errno();
            Py_END_ALLOW_THREADS
            if (rc >= 0 || err != EINTR) break;
            if (PyErr_CheckSignals() < 0) goto fail;
        }
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t a = 0; a <= last; a++) {
            if (items[a].key->shard != s) continue;
            int flags = a == last ? 0 : Z_SNDMORE;
            if (rc < 0) continue; /* not sent: a lent frame is closed at fail */
            if (items[a].lease) {
                rc = z_msg_send(&items[a].msg, sock, flags);
                if (rc < 0) err = z_errno();
                else items[a].lease = 0; /* ZeroMQ's now */
            } else {
                rc = z_send(sock, items[a].view.buf, (size_t)items[a].view.len, flags);
                if (rc < 0) err = z_errno();
            }
        }
        Py_END_ALLOW_THREADS
        if (rc < 0) {
            PyObject *e = Py_BuildValue("(iinO)", s, err, sent_bytes, sizes);
            if (e) {
                PyErr_SetObject(SendFailed, e);
                Py_DECREF(e);
            }
            goto fail; /* (a message of which only a first part left cannot be: ZeroMQ queues whole ones) */
        }
        sent_bytes += w->len + data;
        if (PyDict_SetItem(pending, req_obj, shard_key) < 0 || PyDict_SetItem(self->inflight, req_obj, handle) < 0)
            goto fail;
        PyObject *size = PyLong_FromSsize_t(w->len + data);
        int stored = size ? PyDict_SetItem(sizes, req_obj, size) : -1;
        Py_XDECREF(size);
        if (stored < 0) goto fail;
        Py_CLEAR(req_obj);
        Py_CLEAR(shard_key);
    }
    Py_DECREF(result);
    result = Py_BuildValue("(OnO)", handle, sent_bytes, sizes);
    goto done;
fail:
    Py_CLEAR(result);
done:
    Py_XDECREF(handle);
    Py_XDECREF(pending);
    Py_XDECREF(sizes);
    Py_XDECREF(req_obj);
    Py_XDECREF(shard_key);
    for (Py_ssize_t a = 0; a < n; a++) {
        if (items[a].lease) z_msg_close(&items[a].msg); /* lent and not sent: ZeroMQ lets it go */
        if (items[a].held) PyBuffer_Release(&items[a].view);
    }
    PyMem_Free(items);
    PyMem_Free(first);
    PyMem_Free(vers);
    return result;
}

/* ---------------------------------------------------------------- take */

/* The Message of an 'ok' reply of whole keys of shard s, as decode_reply would read it; NULL
 * without an error set: not one the lane reads. */
static PyObject *read_reply(Lane *self, int s, Part **parts, Py_ssize_t nparts) {
    Py_ssize_t hlen = (Py_ssize_t)z_msg_size(&parts[0]->msg);
    if (hlen > self->max_header || nparts < 2) return NULL;
    Reader r = {z_msg_data(&parts[0]->msg), NULL};
    r.end = r.p + hlen;
    Py_ssize_t fields;
    if (!rd_map(&r, 10, &fields)) return NULL;
    enum { F_V = 1, F_OP = 2, F_WORKER = 4, F_REQ = 8, F_VERSION = 16, F_KEYS = 32, F_STALENESS = 64,
           F_WAITED = 128, F_DTYPES = 256, F_SHAPES = 512 };
    unsigned seen = 0, nil = 0;
    uint64_t v = 0, worker = 0, req = 0, version = 0, staleness = 0, waited = 0;
    Reader keys_at = r, dtypes_at = r, shapes_at = r;
    Py_ssize_t nkeys = -1, ndtypes = -1, nshapes = -1;
    for (Py_ssize_t f = 0; f < fields; f++) {
        const char *name;
        Py_ssize_t len;
        unsigned bit;
        uint64_t *out = NULL;
        if (!rd_str(&r, 16, &name, &len)) return NULL;
#define IS(s) (len == (Py_ssize_t)sizeof(s) - 1 && memcmp(name, s, sizeof(s) - 1) == 0)
        if (IS("v")) bit = F_V, out = &v;
        else if (IS("op")) bit = F_OP;
        else if (IS("worker")) bit = F_WORKER, out = &worker;
        else if (IS("req")) bit = F_REQ, out = &req;
        else if (IS("version")) bit = F_VERSION, out = &version;
        else if (IS("keys")) bit = F_KEYS;
        else if (IS("staleness")) bit = F_STALENESS, out = &staleness;
        else if (IS("waited_us")) bit = F_WAITED, out = &waited;
        else if (IS("dtypes")) bit = F_DTYPES;
        else if (IS("shapes")) bit = F_SHAPES;
        else return NULL;
#undef IS
        if (seen & bit) return NULL;
        seen |= bit;
        if (out) {
            if ((bit & (F_VERSION | F_STALENESS | F_WAITED)) && rd_nil(&r)) nil |= bit;
            else if (!rd_uint(&r, self->max_int, out)) return NULL;
        } else if (bit == F_OP) {
            if (!rd_str(&r, 16, &name, &len) || len != 2 || memcmp(name, "ok", 2) != 0) return NULL;
        } else if (bit == F_KEYS) {
            keys_at = r;
            if (!rd_array(&r, self->max_keys, &nkeys)) return NULL;
            for (Py_ssize_t i = 0; i < nkeys; i++) {
                uint64_t k;
                if (!rd_uint(&r, self->max_int, &k)) return NULL;
            }
        } else if (bit == F_DTYPES) {
            dtypes_at = r;
            if (!rd_array(&r, self->max_keys, &ndtypes)) return NULL;
            for (Py_ssize_t i = 0; i < ndtypes; i++)
                if (!rd_str(&r, 64, &name, &len)) return NULL;
        } else {
            shapes_at = r;
            if (!rd_array(&r, self->max_keys, &nshapes)) return NULL;
            for (Py_ssize_t i = 0; i < nshapes; i++) {
                Py_ssize_t ndim;
                uint64_t d;
                if (!rd_array(&r, 4, &ndim)) return NULL;
                for (Py_ssize_t j = 0; j < ndim; j++)
                    if (!rd_uint(&r, self->max_int, &d)) return NULL;
            }
        }
    }
    unsigned needed = F_V | F_OP | F_WORKER | F_REQ | F_KEYS | F_DTYPES | F_SHAPES;
    if (r.p != r.end || (seen & needed) != needed || v != self->version_tag || nkeys < 1 || nkeys != ndtypes
        || nkeys != nshapes || nkeys != nparts - 1)
        return NULL;
    /* each key whole, of this shard, named once, its dtype and shape as the layout has them and
     * its part of its size */
    uint64_t stamp = ++self->stamp;
    PyObject *key_list = PyList_New(nkeys), *dtype_list = PyList_New(nkeys), *shape_list = PyList_New(nkeys),
             *tensors = PyList_New(nkeys), *header = NULL, *msg = NULL;
    if (!key_list || !dtype_list || !shape_list || !tensors) goto out;
    Py_ssize_t count;
    rd_array(&keys_at, self->max_keys, &count);
    rd_array(&dtypes_at, self->max_keys, &count);
    rd_array(&shapes_at, self->max_keys, &count);
    for (Py_ssize_t i = 0; i < nkeys; i++) {
        uint64_t k;
        const char *name;
        Py_ssize_t len, ndim;
        rd_uint(&keys_at, self->max_int, &k);
        rd_str(&dtypes_at, 64, &name, &len);
        if (k >= (uint64_t)self->nkeys) goto out;
        KeyInfo *key = &self->keys[k];
        if (key->shard != s || key->stamp == stamp || len != key->name_len || memcmp(name, key->name_utf8, len) != 0
            || (Py_ssize_t)z_msg_size(&parts[i + 1]->msg) != key->nbytes)
            goto out;
        key->stamp = stamp;
        rd_array(&shapes_at, 4, &ndim);
        int same = ndim == key->ndim;
        for (Py_ssize_t j = 0; j < ndim; j++) {
            uint64_t d;
            rd_uint(&shapes_at, self->max_int, &d);
            same &= j < key->ndim && d == key->dims[j];
        }
        if (!same) goto out;
        PyObject *kid = PyLong_FromUnsignedLongLong(k), *shape = PyList_GetSlice(key->shape, 0, key->ndim);
        PyObject *targs[3] = {NULL, (PyObject *)parts[i + 1], key->torch_dtype};
        PyObject *t = kid && shape ? PyObject_Vectorcall(self->frombuffer, targs + 1,
                                                         1 | PY_VECTORCALL_ARGUMENTS_OFFSET, self->dtype_kw)
                                   : NULL;
        if (!t) {
            Py_XDECREF(kid);
            Py_XDECREF(shape);
            goto out;
        }
        PyList_SET_ITEM(key_list, i, kid);
        Py_INCREF(key->name);
        PyList_SET_ITEM(dtype_list, i, key->name);
        PyList_SET_ITEM(shape_list, i, shape);
        PyList_SET_ITEM(tensors, i, t);
    }
    header = PyDict_New();
    if (!header) goto out;
#define SET(k, val)                                                                                                    \
    do {                                                                                                               \
        PyObject *x_ = (val);                                                                                          \
        if (!x_ || PyDict_SetItem(header, k, x_) < 0) {                                                                \
            Py_XDECREF(x_);                                                                                            \
            goto out;                                                                                                  \
        }                                                                                                              \
        Py_DECREF(x_);                                                                                                 \
    } while (0)
#define OPT(bit, k, val)                                                                                               \
    if (seen & (bit)) {                                                                                                \
        if (nil & (bit)) {                                                                                             \
            Py_INCREF(Py_None);                                                                                        \
            SET(k, Py_None);                                                                                           \
        } else                                                                                                         \
            SET(k, PyLong_FromUnsignedLongLong(val));                                                                  \
    }
    SET(k_v, PyLong_FromUnsignedLongLong(v));
    Py_INCREF(s_ok);
    SET(k_op, s_ok);
    SET(k_worker, PyLong_FromUnsignedLongLong(worker));
    SET(k_req, PyLong_FromUnsignedLongLong(req));
    OPT(F_VERSION, k_version, version);
    Py_INCREF(key_list);
    SET(k_keys, key_list);
    OPT(F_STALENESS, k_staleness, staleness);
    OPT(F_WAITED, k_waited_us, waited);
    Py_INCREF(dtype_list);
    SET(k_dtypes, dtype_list);
    Py_INCREF(shape_list);
    SET(k_shapes, shape_list);
#undef OPT
#undef SET
    PyObject *margs[3] = {NULL, header, tensors};
    msg = PyObject_Vectorcall(self->message_cls, margs + 1, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
out:
    Py_XDECREF(key_list);
    Py_XDECREF(dtype_list);
    Py_XDECREF(shape_list);
    Py_XDECREF(tensors);
    Py_XDECREF(header);
    return msg;
}

/* The parts of shard s's next message, NULL where none is there (or an error is set). */
static Part **receive(Lane *self, int s, Py_ssize_t *nparts) {
    Py_ssize_t cap = 4, n = 0;
    Part **parts = PyMem_Malloc(cap * sizeof(Part *));
    if (!parts) {
        PyErr_NoMemory();
        return NULL;
    }
    for (;;) {
        Part *p = PyObject_New(Part, &PartType);
        if (!p) goto fail;
        z_msg_init(&p->msg);
        int rc, err = 0;
        void *sock = self->socks[s];
        Py_BEGIN_ALLOW_THREADS
        rc = z_msg_recv(&p->msg, sock, n == 0 ? Z_DONTWAIT : 0);
        if (rc < 0) err = z_errno();
        Py_END_ALLOW_THREADS
        if (rc < 0) {
            Py_DECREF(p);
            if (n == 0 && err == EAGAIN) { /* nothing there after all */
                PyMem_Free(parts);
                return NULL;
            }
            PyErr_Format(PyExc_OSError, "could not receive from shard %d: errno %d", s, err);
            goto fail;
        }
        if (n == cap) {
            Part **more = PyMem_Realloc(parts, (cap *= 2) * sizeof(Part *));
            if (!more) {
                Py_DECREF(p);
                PyErr_NoMemory();
                goto fail;
            }
            parts = more;
        }
        parts[n++] = p;
        if (!z_msg_more(&p->msg)) break;
    }
    *nparts = n;
    return parts;
fail:
    for (Py_ssize_t i = 0; i < n; i++) Py_DECREF(parts[i]);
    PyMem_Free(parts);
    return NULL;
}

/* take(timeout_ms): (shard, Message or frames, bytes) of the next message a shard has sent,
 * waiting at most timeout_ms for one; None where none came. Frames (a message the lane does not
 * read) are as ps.transport hands them over: the header as bytes, the other parts as writable
 * byte views. */
static PyObject *Lane_take(Lane *self, PyObject *arg) {
    long timeout = PyLong_AsLong(arg);
    if (timeout == -1 && PyErr_Occurred()) return NULL;
    if (self->closed || !self->socks) {
        PyErr_SetString(PyExc_RuntimeError, "the lane is closed");
        return NULL;
    }
    sweep(self);
    zmq_pollitem_t *items = self->polled;
    int n = self->shards, rc, err = 0;
    for (int i = 0; i < n; i++) {
        items[i].socket = self->socks[(self->start + i) % self->shards];
        items[i].fd = 0;
        items[i].events = Z_POLLIN;
        items[i].revents = 0;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = z_poll(items, n, timeout);
    if (rc < 0) err = z_errno();
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        if (err == EINTR) {
            if (PyErr_CheckSignals() < 0) return NULL;
            Py_RETURN_NONE;
        }
        return PyErr_Format(PyExc_OSError, "could not poll the shards: errno %d", err);
    }
    for (int i = 0; rc > 0 && i < n; i++) {
        if (!(items[i].revents & Z_POLLIN)) continue;
        int s = (self->start + i) % self->shards;
        Py_ssize_t nparts = 0;
        Part **parts = receive(self, s, &nparts);
        if (!parts) {
            if (PyErr_Occurred()) return NULL;
            continue;
        }
        self->start = (s + 1) % self->shards; /* the next take looks at the others first */
        Py_ssize_t nbytes = 0;
        for (Py_ssize_t j = 0; j < nparts; j++) nbytes += (Py_ssize_t)z_msg_size(&parts[j]->msg);
        PyObject *item = read_reply(self, s, parts, nparts);
        if (!item && !PyErr_Occurred()) { /* the transport's frames, for the Python paths */
            item = PyList_New(nparts);
            for (Py_ssize_t j = 0; item && j < nparts; j++) {
                PyObject *x = j == 0 ? PyBytes_FromStringAndSize(z_msg_data(&parts[0]->msg), (Py_ssize_t)z_msg_size(&parts[0]->msg))
                                     : PyMemoryView_FromObject((PyObject *)parts[j]);
                if (!x) Py_CLEAR(item);
                else PyList_SET_ITEM(item, j, x);
            }
        }
        for (Py_ssize_t j = 0; j < nparts; j++) Py_DECREF(parts[j]);
        PyMem_Free(parts);
        if (!item) return NULL;
        return Py_BuildValue("(iNn)", s, item, nbytes);
    }
    Py_RETURN_NONE;
}

static PyObject *Lane_leased(Lane *self, PyObject *unused) { return PyLong_FromSsize_t(sweep(self)); }

static PyMethodDef Lane_methods[] = {
    {"leased", (PyCFunction)Lane_leased, METH_NOARGS, "How many frames lent to ZeroMQ it still holds."},
    {"push", (PyCFunction)Lane_push, METH_VARARGS,
     "push(grads, step, version, pull, lr, hold, next_version, clock, timeout_s): (Handle, bytes sent), or None."},
    {"take", (PyCFunction)Lane_take, METH_O,
     "take(timeout_ms): (shard, Message or frames, bytes) of the next message, or None."},
    {"close", (PyCFunction)Lane_close, METH_NOARGS, "Use the sockets no more (they are about to close)."},
    {NULL}};

static PyTypeObject LaneType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ps._client.Lane",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)Lane_traverse,
    .tp_clear = (inquiry)Lane_clear,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Lane_init,
    .tp_dealloc = (destructor)Lane_dealloc,
    .tp_methods = Lane_methods,
    .tp_doc = "A worker's compiled lane for whole-key pushes and their replies (ps.client_compiled).",
};

static PyMethodDef methods[] = {{"link", link_zmq, METH_VARARGS, "Give the lane libzmq's functions (see ps.client_compiled)."},
                                {NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "ps._client", NULL, -1, methods};

PyMODINIT_FUNC PyInit__client(void) {
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {{&s_numpy, "numpy"},       {&s_pending, "pending"},     {&s_timeout_s, "timeout_s"},
                 {&s_dtype, "dtype"},       {&k_v, "v"},                 {&k_op, "op"},
                 {&k_worker, "worker"},     {&k_req, "req"},             {&k_version, "version"},
                 {&k_keys, "keys"},         {&k_staleness, "staleness"}, {&k_waited_us, "waited_us"},
                 {&k_dtypes, "dtypes"},     {&k_shapes, "shapes"},       {&s_ok, "ok"},
                 {&s_push, "push"},         {&s_push_pull, "push+pull"}};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (!(*names[i].slot = PyUnicode_InternFromString(names[i].text))) return NULL;
    if (PyType_Ready(&PartType) < 0 || PyType_Ready(&LaneType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    SendFailed = PyErr_NewException("ps._client.SendFailed", NULL, NULL);
    if (!SendFailed || PyModule_AddObjectRef(m, "SendFailed", SendFailed) < 0
        || PyModule_AddObjectRef(m, "Lane", (PyObject *)&LaneType) < 0
        || PyModule_AddObjectRef(m, "Part", (PyObject *)&PartType) < 0
        || PyModule_AddIntConstant(m, "COPY_BYTES", LANE_COPY_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
