/* libzmq as pyzmq loaded it, for psar's compiled modules (ps/_client.c, ps/_send.c): its
 * message and poll types, its functions (their addresses come from Python: ps/zmq_link.py,
 * through each module's link()), and frames lent to ZeroMQ. Each module that includes it has
 * its own copy of these statics, linked once. */
#ifndef PSAR_ZMQ_H
#define PSAR_ZMQ_H
#include <Python.h>

typedef struct {
    _Alignas(8) unsigned char _[64];
} zmq_msg_t;
typedef struct {
    void *socket;
    int fd;
    short events, revents;
} zmq_pollitem_t;
#define Z_DONTWAIT 1
#define Z_SNDMORE 2
#define Z_POLLIN 1

static int (*z_send)(void *, const void *, size_t, int);
static int (*z_msg_init)(zmq_msg_t *);
static int (*z_msg_recv)(zmq_msg_t *, void *, int);
static void *(*z_msg_data)(zmq_msg_t *);
static size_t (*z_msg_size)(const zmq_msg_t *);
static int (*z_msg_more)(const zmq_msg_t *);
static int (*z_msg_close)(zmq_msg_t *);
static int (*z_msg_init_data)(zmq_msg_t *, void *, size_t, void (*)(void *, void *), void *);
static int (*z_msg_send)(zmq_msg_t *, void *, int);
static int (*z_poll)(zmq_pollitem_t *, int, long);
static int (*z_errno)(void);
static int linked = 0;

#define Z_FUNCTIONS 11

/* link(addresses): libzmq's zmq_send, zmq_msg_init, zmq_msg_recv, zmq_msg_data, zmq_msg_size,
 * zmq_msg_more, zmq_msg_close, zmq_poll, zmq_errno, zmq_msg_init_data and zmq_msg_send, as ints
 * (ctypes' addresses of the library pyzmq loaded: ps.zmq_link). */
static PyObject *link_zmq(PyObject *self, PyObject *args) {
    PyObject *addresses;
    void *f[Z_FUNCTIONS];
    if (!PyArg_ParseTuple(args, "O!", &PyTuple_Type, &addresses)) return NULL;
    if (PyTuple_GET_SIZE(addresses) != Z_FUNCTIONS) {
        PyErr_SetString(PyExc_ValueError, "link: 11 functions' addresses");
        return NULL;
    }
    for (int i = 0; i < Z_FUNCTIONS; i++) {
        f[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(addresses, i));
        if (!f[i]) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "link: a function's address is 0");
            return NULL;
        }
    }
    z_send = f[0];
    z_msg_init = f[1];
    z_msg_recv = f[2];
    z_msg_data = f[3];
    z_msg_size = f[4];
    z_msg_more = f[5];
    z_msg_close = f[6];
    z_poll = f[7];
    z_errno = f[8];
    z_msg_init_data = f[9];
    z_msg_send = f[10];
    linked = 1;
    Py_RETURN_NONE;
}

/* A frame lent to ZeroMQ: the memory of the object it was taken from, held (view) until
 * ZeroMQ is done with it. ZeroMQ's thread marks it done, without the GIL; the owner's next
 * call lets it go (lease_sweep). pyzmq instead hands each such frame to its collector thread,
 * which takes the GIL to let it go. */
typedef struct Lease {
    Py_buffer view;
    int done;
    struct Lease *next;
} Lease;

static void lease_done(void *data, void *hint) { __atomic_store_n(&((Lease *)hint)->done, 1, __ATOMIC_RELEASE); }

/* A message part for the bytes of view, lent: the lease (added to *leases) holds the view
 * now. 0 with an error set (then the caller still holds the view). */
static int lease_msg(Lease **leases, Py_buffer *view, zmq_msg_t *msg) {
    Lease *l = PyMem_Malloc(sizeof(Lease));
    if (!l) {
        PyErr_NoMemory();
        return 0;
    }
    if (z_msg_init_data(msg, view->buf, (size_t)view->len, lease_done, l) < 0) {
        PyMem_Free(l);
        PyErr_NoMemory();
        return 0;
    }
    l->view = *view;
    l->done = 0;
    l->next = *leases;
    *leases = l;
    return 1;
}

static Lease *lease_orphans = NULL; /* leases of owners gone (lease_abandon), until ZeroMQ is done */

/* Let go of the frames ZeroMQ is done with, and of the orphans': how many of *leases it still
 * holds. Under the GIL. The done ones are taken off the lists before any is let go (letting go
 * may run Python code, which may call here again). */
static Py_ssize_t lease_sweep(Lease **leases) {
    Py_ssize_t held = 0;
    Lease *gone = NULL;
    for (int list = 0; list < 2; list++) {
        Lease **at = list ? &lease_orphans : leases;
        while (*at) {
            Lease *l = *at;
            if (__atomic_load_n(&l->done, __ATOMIC_ACQUIRE)) {
                *at = l->next;
                l->next = gone;
                gone = l;
            } else {
                held += !list;
                at = &l->next;
            }
        }
    }
    while (gone) {
        Lease *l = gone;
        gone = l->next;
        PyBuffer_Release(&l->view);
        PyMem_Free(l);
    }
    return held;
}

/* The owner of *leases is going: what ZeroMQ still holds becomes an orphan, let go by a later
 * sweep of any owner once ZeroMQ is done (ZeroMQ's thread may yet mark it: it is never freed
 * before). */
static void lease_abandon(Lease **leases) {
    lease_sweep(leases);
    Lease **at = leases;
    while (*at) at = &(*at)->next;
    *at = lease_orphans;
    lease_orphans = *leases;
    *leases = NULL;
}

#endif
