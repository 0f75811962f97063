/* A shard's sends (ps.transport.ServerTransport): a message's parts in one call, on the
 * shard's own ROUTER socket, through the libzmq pyzmq loaded (ps/_zmq.h). Parts up to
 * copy_bytes are copied into ZeroMQ's messages; larger ones are lent: a Lease holds the
 * exporting object's buffer (a key's bytes, through the numpy view its replies lend) until
 * ZeroMQ's I/O thread is done with it, and the sender's next call (a send, or sweep, which the
 * transport calls after each receive) lets it go; pyzmq instead hands each lent part to its
 * collector thread, which takes the GIL to let it go. A key whose reply is still held counts
 * as in use (ps.shard.snapshots.in_use), and its next update first moves it to a copy. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <string.h>

#include "_zmq.h"

#define MAX_PARTS_ON_STACK 64

typedef struct {
    PyObject_HEAD
    void *sock;
    PyObject *sock_obj; /* the pyzmq socket: alive while the sender is */
    Py_ssize_t copy_bytes;
    Lease *leases;
    int closed; /* the socket is closed (or about to be): libzmq may have freed it */
} Sender;

static void Sender_dealloc(Sender *self) {
    lease_abandon(&self->leases); /* the parts ZeroMQ still holds stay held until it is done */
    Py_XDECREF(self->sock_obj);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Sender(socket address, socket object, copy_bytes). */
static int Sender_init(Sender *self, PyObject *args, PyObject *kw) {
    PyObject *address, *sock;
    Py_ssize_t copy_bytes;
    if (!linked) {
        PyErr_SetString(PyExc_RuntimeError, "ps._send: link() libzmq's functions first (ps.zmq_link)");
        return -1;
    }
    if (self->sock_obj) {
        PyErr_SetString(PyExc_RuntimeError, "a Sender is made once");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OOn", &address, &sock, &copy_bytes)) return -1;
    void *p = PyLong_AsVoidPtr(address);
    if (!p) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a socket's address is not 0");
        return -1;
    }
    if (copy_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_bytes must be >= 0");
        return -1;
    }
    self->sock = p;
    self->copy_bytes = copy_bytes;
    Py_INCREF(sock);
    self->sock_obj = sock;
    return 0;
}

enum { COPIED, LENT, SENT }; /* a part: copied by ZeroMQ, lent under a lease and not sent yet, or sent lent */

/* Send one part (flags: Z_SNDMORE but for the last): 0, or ZeroMQ's errno. Without the GIL. */
static int send_part(void *sock, Py_buffer *view, zmq_msg_t *msg, char *kind, int flags) {
    int rc = *kind == LENT ? z_msg_send(msg, sock, flags) : z_send(sock, view->buf, (size_t)view->len, flags);
    if (rc < 0) return z_errno();
    if (*kind == LENT) *kind = SENT; /* ZeroMQ's now */
    return 0;
}

/* send(parts) -> 0 once sent, else ZeroMQ's errno (nothing sent: EAGAIN where the peer's queue
 * stayed full for the socket's send timeout, EHOSTUNREACH where no such peer is connected).
 * parts: a list or tuple of objects with a C-contiguous buffer, the peer's identity first. */
static PyObject *Sender_send(Sender *self, PyObject *parts) {
    lease_sweep(&self->leases);
    if (self->closed) return PyLong_FromLong(ENOTSOCK); /* as pyzmq answers a closed socket */
    PyObject *seq = PySequence_Fast(parts, "send: parts must be a list or tuple");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "send: a message has at least one part");
        return NULL;
    }
    Py_buffer stack_views[MAX_PARTS_ON_STACK];
    zmq_msg_t stack_msgs[MAX_PARTS_ON_STACK];
    char stack_kinds[MAX_PARTS_ON_STACK];
    Py_buffer *views = stack_views;
    zmq_msg_t *msgs = stack_msgs;
    char *kinds = stack_kinds;
    Py_ssize_t held = 0; /* views taken */
    PyObject *result = NULL;
    if (n > MAX_PARTS_ON_STACK) {
        views = PyMem_Calloc(n, sizeof(Py_buffer));
        msgs = PyMem_Calloc(n, sizeof(zmq_msg_t));
        kinds = PyMem_Calloc(n, 1);
        if (!views || !msgs || !kinds) {
            PyErr_NoMemory();
            goto free;
        }
    }
    memset(kinds, COPIED, (size_t)n);
    for (; held < n; held++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, held), &views[held], PyBUF_SIMPLE) < 0) goto release;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (views[i].len <= self->copy_bytes) continue;
        if (!lease_msg(&self->leases, &views[i], &msgs[i])) goto release;
        kinds[i] = LENT; /* the lease holds its view now */
    }
    int err;
    for (;;) { /* only a message's first part waits (ZeroMQ queues whole messages): a signal
                * meanwhile is Python's to take, then the part is sent again */
        Py_BEGIN_ALLOW_THREADS
        err = send_part(self->sock, &views[0], &msgs[0], &kinds[0], n > 1 ? Z_SNDMORE : 0);
        Py_END_ALLOW_THREADS
        if (err != EINTR) break;
        if (PyErr_CheckSignals() < 0) goto release;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 1; !err && i < n; i++)
        err = send_part(self->sock, &views[i], &msgs[i], &kinds[i], i < n - 1 ? Z_SNDMORE : 0);
    Py_END_ALLOW_THREADS
    result = PyLong_FromLong(err);
release:
    for (Py_ssize_t i = 0; i < held; i++) {
        if (kinds[i] == COPIED) PyBuffer_Release(&views[i]);
        else if (kinds[i] == LENT) z_msg_close(&msgs[i]); /* not sent: ZeroMQ lets it go, its lease is done */
    }
free:
    if (views != stack_views) {
        PyMem_Free(views);
        PyMem_Free(msgs);
        PyMem_Free(kinds);
    }
    Py_DECREF(seq);
    return result;
}

static PyObject *Sender_sweep(Sender *self, PyObject *unused) {
    return PyLong_FromSsize_t(lease_sweep(&self->leases));
}

static PyObject *Sender_close(Sender *self, PyObject *unused) {
    self->closed = 1;
    Py_RETURN_NONE;
}

static PyMethodDef Sender_methods[] = {
    {"send", (PyCFunction)Sender_send, METH_O, "Send a message's parts (the peer's first): 0, or ZeroMQ's errno."},
    {"sweep", (PyCFunction)Sender_sweep, METH_NOARGS,
     "Let go of the parts ZeroMQ is done with; how many lent parts it still holds."},
    {"close", (PyCFunction)Sender_close, METH_NOARGS, "Send no more (the socket is about to close): ENOTSOCK."},
    {NULL}};

static PyTypeObject SenderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "ps._send.Sender",
    .tp_basicsize = sizeof(Sender),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Sender_init,
    .tp_dealloc = (destructor)Sender_dealloc,
    .tp_methods = Sender_methods,
    .tp_doc = "A shard's sends on its ROUTER socket, large parts lent to ZeroMQ (ps.transport).",
};

static PyMethodDef methods[] = {
    {"link", link_zmq, METH_VARARGS, "Give the sender libzmq's functions (see ps.zmq_link)."}, {NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "ps._send", NULL, -1, methods};

PyMODINIT_FUNC PyInit__send(void) {
    if (PyType_Ready(&SenderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Sender", (PyObject *)&SenderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
