/* The compiled path's push+pull under the sync rule (ps.shard.consistency.SyncRule, as
 * ps.shard.fastpath's Python path applies it), for ps/shard/_compiled.c.
 *
 * A sync step's push adds each key's gradient to the step's sum (the first one kept on its
 * frame, as the rule keeps it); the push that brings a key's last worker updates the key with
 * the mean (SGD's arithmetic with the count as divisor) and, with the step's last key, ends the
 * step. The pulls that waited for it are answered here (release_pulls), where every request
 * waiting is a push+pull's pull (else by the shard's _release); then this push's pull is
 * answered at once where its keys are at the version it asks for, or waits
 * (ps.shard.fastpath's wait: the shard's Waiting, as the Python path adds it). It takes the
 * common case only: every worker live and none rejoining, no backup workers (the shard's
 * config: compiled.py), no rows, held step or clip, a learning rate that agrees with the
 * step's; anything else, and every check that fails, it leaves to the Python paths before it
 * has changed anything. */
#ifndef PSAR_SYNC_H
#define PSAR_SYNC_H

/* A writable buffer of the tensor t's bytes (its numpy view), of nbytes: 1; 0 where it has none
 * (nothing held, no error set: the Python paths take the message). */
static int tensor_buffer(PyObject *t, Py_ssize_t nbytes, Py_buffer *view) {
    PyObject *array = PyObject_CallMethodNoArgs(t, s_numpy);
    if (!array) {
        PyErr_Clear(); /* another device, a tensor that needs grad: the Python paths' */
        return 0;
    }
    int rc = PyObject_GetBuffer(array, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS);
    Py_DECREF(array); /* the buffer holds the array */
    if (rc < 0) {
        PyErr_Clear();
        return 0;
    }
    if (view->len != nbytes) {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

/* sum += g, element by element, as torch's add_ rounds it (one rounding an element: the module
 * is built with -ffp-contract=off, and an add has nothing to fuse). */
static void add_into(int f64, void *restrict sum, const void *restrict g, Py_ssize_t n) {
    if (f64) {
        double *s = sum;
        const double *x = g;
        for (Py_ssize_t i = 0; i < n; i++) s[i] += x[i];
    } else {
        float *s = sum;
        const float *x = g;
        for (Py_ssize_t i = 0; i < n; i++) s[i] += x[i];
    }
}

/* The array each key of entries lends its replies (SnapshotPool.reply_bytes, which makes one
 * where there is none; arrays: the pool's _arrays), borrowed, in views: 1, or 0 with an error
 * set. */
static int reply_views(Path *self, PyObject *snapshots, PyObject *arrays, Py_ssize_t nkeys, const Py_ssize_t *entries,
                       PyObject **views) {
    for (Py_ssize_t j = 0; j < nkeys; j++) {
        PyObject *key = self->keys[entries[j]].obj;
        if (!(views[j] = PyDict_GetItem(arrays, key))) {
            PyObject *view = PyObject_CallMethodOneArg(snapshots, s_reply_bytes, key);
            Py_XDECREF(view);
            if (!view || !(views[j] = PyDict_GetItem(arrays, key))) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "SnapshotPool.reply_bytes kept no view");
                return 0;
            }
        }
    }
    return 1;
}

/* SyncRule.version_of(keys of entries): the shard's version now, one more where every key is
 * updated in the step under way; -1 with an error set. */
static long long version_of(Path *self, PyObject *updated, long long version_now, Py_ssize_t nkeys,
                            const Py_ssize_t *entries) {
    if (!PySet_GET_SIZE(updated)) return version_now;
    for (Py_ssize_t j = 0; j < nkeys; j++) {
        int in = PySet_Contains(updated, self->keys[entries[j]].obj);
        if (in <= 0) return in < 0 ? -1 : version_now;
    }
    return version_now + 1;
}

/* A request waiting (ps.shard.waiting's Waiter), read where it is a pull of keys of the table
 * as a push+pull leaves one (ps.protocol.pull_of: op, v, worker, req, keys and maybe
 * min_version; no rows; the staleness its only field). */
typedef struct {
    PyObject *peer; /* borrowed from the Waiter, which the list holds */
    uint64_t worker, req;
    long long min_version, stale; /* min_version -1: none */
    long long at;                 /* release_pulls: the version its keys are at, where it is asked */
    double since;
    Py_ssize_t nkeys;
    Py_ssize_t entries[MAX_KEYS_ON_STACK];
} Pull;

/* 1 where waiter d is such a pull (p filled), 0 where not, -1 with an error set. */
static int read_pull(Path *self, PyObject *d, Pull *p) {
    int ok = 0;
    PyObject *msg = NULL, *header = NULL, *ids = NULL, *fields = NULL, *since = NULL, *peer = NULL;
    if (!(msg = attr(d, s_msg)) || !(header = attr(msg, s_header)) || !(ids = attr(msg, s_ids)) ||
        !(fields = attr(d, s_fields)) || !(since = attr(d, s_since)) || !(peer = attr(d, s_peer))) {
        ok = PyErr_ExceptionMatches(PyExc_AttributeError) ? (PyErr_Clear(), 0) : -1;
        goto done;
    }
    long long x;
    if (!PyDict_CheckExact(header) || !PyList_CheckExact(ids) || PyList_GET_SIZE(ids) || !PyDict_CheckExact(fields) ||
        PyDict_GET_SIZE(fields) != 1 || !get_i64(PyDict_GetItem(fields, s_staleness), &p->stale) || p->stale < 0 ||
        !PyFloat_CheckExact(since) || !PyBytes_CheckExact(peer))
        goto done;
    Py_ssize_t size = PyDict_GET_SIZE(header);
    PyObject *op = PyDict_GetItem(header, s_op), *keys = PyDict_GetItem(header, s_keys),
             *min_version = PyDict_GetItem(header, s_min_version);
    if (!op || !PyUnicode_CheckExact(op) || PyUnicode_CompareWithASCIIString(op, "pull") != 0 ||
        !PyDict_GetItem(header, s_v) || size != 5 + (min_version != NULL) ||
        !get_i64(PyDict_GetItem(header, s_worker), &x) || x < 0)
        goto done;
    p->worker = (uint64_t)x;
    if (!get_i64(PyDict_GetItem(header, s_req), &x) || x < 0) goto done;
    p->req = (uint64_t)x;
    p->min_version = -1;
    if (min_version && (!get_i64(min_version, &p->min_version) || p->min_version < 0)) goto done;
    if (!keys || !PyList_CheckExact(keys) || !(p->nkeys = PyList_GET_SIZE(keys)) || p->nkeys > MAX_KEYS_ON_STACK)
        goto done;
    for (Py_ssize_t j = 0; j < p->nkeys; j++) {
        if (!get_i64(PyList_GET_ITEM(keys, j), &x) || x < 0 || x > self->max_id || self->index[x] < 0) goto done;
        p->entries[j] = self->index[x];
    }
    p->since = PyFloat_AS_DOUBLE(since);
    p->peer = peer; /* the Waiter holds it */
    ok = 1;
done:
    Py_XDECREF(msg);
    Py_XDECREF(header);
    Py_XDECREF(ids);
    Py_XDECREF(fields);
    Py_XDECREF(since);
    Py_XDECREF(peer);
    return ok;
}

/* ShardServer._release(readied) where every request waiting is such a pull (read_pull):
 * Waiting.ready's look (readied: the keys the push made ready, or None: a new version), its
 * counts and the list it keeps, then each pull's answer as ShardServer._answer writes it, in
 * the order they waited. 1 with the replies in *out (a new list, or NULL: none); 0 where one
 * waiting is another request (nothing done: the shard's _release answers them); -1 with an
 * error set. */
static int release_pulls(Path *self, PyObject *s, PyObject *readied, PyObject *updated, long long version_now,
                         PyObject *counters, PyObject **out) {
    int rc = -1;
    Pull *pulls = NULL;
    char *ready = NULL;
    PyObject *waiting = NULL, *waiters = NULL, *waits = NULL, *now_o = NULL, *kept = NULL, *snapshots = NULL,
             *arrays = NULL, *replies = NULL;
    *out = NULL;
    if (readied != Py_None && (!PyAnySet_CheckExact(readied) || !PySet_GET_SIZE(readied))) {
        rc = PyAnySet_CheckExact(readied) ? 1 : 0; /* nothing made ready: nothing asked */
        goto done;
    }
    if (!(waiting = attr(s, s_waiting)) || !(waiters = attr(waiting, s__waiting)) || !(waits = attr(waiting, s_waits)))
        goto done;
    rc = 0;
    if (!PyList_CheckExact(waiters) || !PyDict_CheckExact(waits)) goto done;
    Py_ssize_t n = PyList_GET_SIZE(waiters), found = 0;
    if (!n) {
        rc = 1;
        goto done;
    }
    pulls = PyMem_Malloc(n * sizeof(Pull));
    ready = PyMem_Malloc(n);
    if (!pulls || !ready) {
        PyErr_NoMemory();
        rc = -1;
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int got = read_pull(self, PyList_GET_ITEM(waiters, i), &pulls[i]);
        if (got <= 0) {
            rc = got;
            goto done;
        }
        Pull *p = &pulls[i];
        int asked = readied == Py_None;
        for (Py_ssize_t j = 0; !asked && j < p->nkeys; j++) {
            asked = PySet_Contains(readied, self->keys[p->entries[j]].obj);
            if (asked < 0) {
                rc = -1;
                goto done;
            }
        }
        p->at = asked ? version_of(self, updated, version_now, p->nkeys, p->entries) : 0;
        if (p->at < 0) {
            rc = -1;
            goto done;
        }
        ready[i] = asked && p->at >= p->min_version;
        found += ready[i];
    }
    PyObject *count = PyDict_GetItem(waits, s_count), *total = PyDict_GetItem(waits, s_total_s),
             *most = PyDict_GetItem(waits, s_max_s);
    long long counted;
    if (!get_i64(count, &counted) || !total || !PyFloat_CheckExact(total) || !most || !PyFloat_CheckExact(most))
        goto done;
    double sum = PyFloat_AS_DOUBLE(total), top = PyFloat_AS_DOUBLE(most);
    /* from here on Waiting.ready's: the clock, the pulls taken out and counted; then each answer */
    rc = -1;
    PyObject *clock = attr(s, s_clock);
    now_o = clock ? PyObject_CallNoArgs(clock) : NULL;
    Py_XDECREF(clock);
    if (!now_o) goto done;
    double now = PyFloat_AsDouble(now_o); /* (a clock that gives no number: Python's now - since raises too) */
    if (now == -1.0 && PyErr_Occurred()) goto done;
    if (!found) {
        rc = 1;
        goto done;
    }
    if (!(kept = PyList_New(0))) goto done;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!ready[i] && PyList_Append(kept, PyList_GET_ITEM(waiters, i)) < 0) goto done;
    if (PyObject_SetAttr(waiting, s__waiting, kept) < 0) goto done; /* waiters still holds the ones taken */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!ready[i]) continue;
        double waited = now - pulls[i].since;
        sum += waited;
        if (waited > top) top = waited;
    }
    PyObject *c = PyLong_FromLongLong(counted + found), *t = PyFloat_FromDouble(sum), *m = PyFloat_FromDouble(top);
    int set = c && t && m && PyDict_SetItem(waits, s_count, c) == 0 && PyDict_SetItem(waits, s_total_s, t) == 0 &&
              PyDict_SetItem(waits, s_max_s, m) == 0;
    Py_XDECREF(c);
    Py_XDECREF(t);
    Py_XDECREF(m);
    if (!set) goto done;
    if (!(replies = PyList_New(0))) goto done;
    if (!(snapshots = attr(s, s_snapshots)) || !(arrays = attr(snapshots, s__arrays))) goto done;
    if (!PyDict_Check(arrays)) {
        PyErr_SetString(PyExc_TypeError, "SnapshotPool._arrays is not a dict");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* ShardServer._answer: each in the order they waited */
        if (!ready[i]) continue;
        Pull *p = &pulls[i];
        long long waited_us = (long long)((now - p->since) * 1e6); /* int(): toward zero, as C's cast */
        PyObject *views[MAX_KEYS_ON_STACK];
        if (!reply_views(self, snapshots, arrays, p->nkeys, p->entries, views)) goto done;
        PyObject *frames = reply_frames(self, p->worker, p->req, p->nkeys, p->entries, views, p->at, &waited_us,
                                        p->stale, counters);
        PyObject *pair = frames ? PyTuple_Pack(2, p->peer, frames) : NULL;
        Py_XDECREF(frames);
        if (!pair || PyList_Append(replies, pair) < 0) {
            Py_XDECREF(pair);
            goto done;
        }
        Py_DECREF(pair);
    }
    *out = replies;
    replies = NULL;
    self->released += found;
    rc = 1;
done:
    PyMem_Free(pulls);
    PyMem_Free(ready);
    Py_XDECREF(waiting);
    Py_XDECREF(waiters);
    Py_XDECREF(waits);
    Py_XDECREF(now_o);
    Py_XDECREF(kept);
    Py_XDECREF(snapshots);
    Py_XDECREF(arrays);
    Py_XDECREF(replies);
    return rc;
}

/* The sync rule's push+pull m (read by read_push; entries: its keys' entries): its replies, or
 * None for the Python paths. */
static PyObject *sync_call(Path *self, PyObject *peer, PyObject *frames, Push *m, Py_ssize_t *entries) {
    PyObject *s = self->server, *result = NULL;
    PyObject *waiting = NULL, *waiters = NULL, *workers = NULL, *seen = NULL,
             *lost = NULL, *left = NULL, *joining = NULL, *clocks = NULL, *partials = NULL, *version_o = NULL,
             *rule = NULL, *sums = NULL, *pushed = NULL, *updated = NULL, *held = NULL, *rows = NULL,
             *step_lr = NULL, *step_hold = NULL, *summing_o = NULL, *most_o = NULL, *counters = NULL,
             *staleness = NULL, *snapshots = NULL, *arrays = NULL, *lent = NULL, *optimizer = NULL, *group = NULL,
             *save = NULL, *w_obj = NULL, *step_obj = NULL, *lr_obj = NULL, *readied = NULL, *others = NULL,
             *partial = NULL, *done = NULL; /* held: Python code runs between their look-up and their use */
    Py_ssize_t ready[MAX_KEYS_ON_STACK], nready = 0, ngrads = 0, nsums = 0, nvalues = 0, nbufs = 0;
    int in_sum[MAX_KEYS_ON_STACK], is_ready[MAX_KEYS_ON_STACK];
    Py_buffer grads[MAX_KEYS_ON_STACK], sumv[MAX_KEYS_ON_STACK], values[MAX_KEYS_ON_STACK], bufs[MAX_KEYS_ON_STACK];
    PyObject *arrays_of[MAX_KEYS_ON_STACK], *reply_arrays[MAX_KEYS_ON_STACK];
    int mutated = 0;
    long long version_s, clock_w, summing, most;

#define GET(var, obj, name)                    \
    if (!(var = attr(obj, name))) goto error;
#define PASS goto pass
#define TRY(call)             \
    switch (call) {           \
    case -1: goto error;      \
    case 0: goto pass;        \
    }
    if (m->has_clock) PASS; /* a sync push+pull asks for a version; a clock is the Python paths' to read */
    TRY(shard_open(s, &waiting, &waiters));
    if (!frames_fit(self, frames, m, entries)) PASS;
    for (Py_ssize_t j = 0; j < m->nkeys; j++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(frames, j + 1), &grads[j], PyBUF_SIMPLE) < 0) goto error;
        ngrads++;
    }
    /* the worker: joined, heard from; every worker live, none rejoining (the rule's needed() is all) */
    GET(workers, s, s_workers);
    GET(seen, workers, s_seen);
    GET(lost, workers, s_lost);
    GET(left, workers, s_left);
    GET(joining, workers, s_joining);
    if (!PyDict_Check(seen) || !PyDict_Check(lost) || PyDict_GET_SIZE(lost) || !PyAnySet_Check(left) ||
        PySet_GET_SIZE(left) || !PyAnySet_Check(joining) || PySet_GET_SIZE(joining))
        PASS;
    if (!(w_obj = PyLong_FromUnsignedLongLong(m->worker))) goto error;
    int joined = PyDict_Contains(seen, w_obj);
    if (joined < 0) goto error;
    if (!joined) PASS;
    /* ShardServer.check_push: the version, the worker's clock, the rule's step, each key once a step */
    GET(version_o, s, s_version);
    if (!get_i64(version_o, &version_s) || (long long)m->version > version_s || (long long)m->step != version_s) PASS;
    GET(clocks, workers, s_clocks);
    if (!PyDict_Check(clocks) || !get_i64(PyDict_GetItem(clocks, w_obj), &clock_w) || (long long)m->step < clock_w)
        PASS;
    GET(partials, workers, s__partial);
    if (!(step_obj = PyLong_FromUnsignedLongLong(m->step))) goto error;
    TRY(step_pushed(self, partials, w_obj, step_obj, m, entries, &partial, &done));
    int completes = (done ? PySet_GET_SIZE(done) : 0) + m->nkeys >= self->shard_keys;
    /* the rule: no held step, no rows, the step's learning rate, no key already updated */
    GET(rule, s, s_rule);
    GET(sums, rule, s__sum);
    GET(pushed, rule, s__pushed);
    GET(updated, rule, s__updated);
    GET(held, rule, s__held);
    GET(rows, rule, s__rows);
    GET(step_lr, rule, s__step_lr);
    GET(step_hold, rule, s__step_hold);
    GET(summing_o, rule, s_summing);
    GET(most_o, rule, s_most_summing);
    if (!PyDict_CheckExact(sums) || !PyDict_CheckExact(pushed) || !PyAnySet_CheckExact(updated) ||
        !PyDict_Check(held) || PyDict_GET_SIZE(held) || !PyDict_Check(rows) || PyDict_GET_SIZE(rows) ||
        step_hold == Py_True || (step_hold != Py_None && step_hold != Py_False) ||
        (step_lr != Py_None && !PyFloat_CheckExact(step_lr)) || !get_i64(summing_o, &summing) ||
        !get_i64(most_o, &most))
        PASS;
    if (m->has_lr && step_lr != Py_None && PyFloat_AS_DOUBLE(step_lr) != m->lr) PASS; /* refused: Python's */
    for (Py_ssize_t j = 0; j < m->nkeys; j++) {
        Key *k = &self->keys[entries[j]];
        int in = PySet_Contains(updated, k->obj);
        if (in) { /* updated already this step (late), or an error */
            if (in < 0) goto error;
            PASS;
        }
        PyObject *by = PyDict_GetItem(pushed, k->obj); /* borrowed */
        Py_ssize_t n = 0;
        if (by) {
            if (!PyAnySet_CheckExact(by)) PASS;
            if ((in = PySet_Contains(by, w_obj))) {
                if (in < 0) goto error;
                PASS;
            }
            n = PySet_GET_SIZE(by);
        }
        is_ready[j] = n + 1 >= self->num_workers;
        if (is_ready[j]) ready[nready++] = entries[j];
        PyObject *sum = PyDict_GetItem(sums, k->obj); /* borrowed */
        in_sum[j] = sum != NULL;
        if (sum) {
            if (!tensor_buffer(sum, k->nbytes, &sumv[j])) PASS;
            nsums = j + 1; /* sumv[j] held where in_sum[j], for j < nsums */
        }
    }
    /* the optimizer's settings, and the memory of the keys this push makes ready */
    GET(counters, s, s_counters);
    GET(staleness, s, s_staleness);
    GET(save, s, s_save);
    if (!PyDict_CheckExact(counters) || !PyDict_CheckExact(staleness)) PASS;
    Step a = {.divisor = 1.0, .scale = 1.0};
    if (m->has_lr) {
        if (!(lr_obj = PyFloat_FromDouble(m->lr))) goto error;
    } else {
        lr_obj = step_lr;
        Py_INCREF(lr_obj);
    }
    if (nready) {
        GET(optimizer, s, s_optimizer);
        GET(group, optimizer, s__group);
        if (!group_step(group, &a)) PASS;
        if (lr_obj != Py_None) a.lr = PyFloat_AS_DOUBLE(lr_obj);
        if (a.momentum != 0.0 && !momentum_buffers(self, s, optimizer, nready, ready, bufs, &nbufs)) {
            if (PyErr_Occurred()) goto error;
            PASS;
        }
        GET(snapshots, s, s_snapshots);
        GET(arrays, snapshots, s__arrays);
        GET(lent, snapshots, s_lent);
        if (!PyDict_Check(arrays) || !PyAnySet_Check(lent)) PASS;
        int got = key_arrays(self, snapshots, arrays, lent, counters, nready, ready, arrays_of);
        if (got < 0) goto error;
        if (!got) PASS;
        for (Py_ssize_t j = 0; j < nready; j++) {
            if (PyObject_GetBuffer(arrays_of[j], &values[j], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto error;
            nvalues++;
            if (values[j].len != self->keys[ready[j]].nbytes) PASS;
        }
    }

    /* Every check of the Python paths holds: from here on the push is applied, as they do. */
    mutated = 1;
    long long stale = version_s - (long long)m->version;
    if (!count_push(s, counters, staleness, seen, w_obj, PyList_GET_ITEM(frames, 0), grads, m->nkeys, stale))
        goto error;
    /* SyncRule.push */
    if (!(readied = PySet_New(NULL)) || PyObject_SetAttr(rule, s_readied, readied) < 0) goto error;
    if (!note_keys(self, partials, partial, clocks, w_obj, step_obj, done, m->step, m->nkeys, entries, completes))
        goto error;
    if (PyObject_SetAttr(rule, s__step_lr, lr_obj) < 0 || PyObject_SetAttr(rule, s__step_hold, Py_False) < 0)
        goto error;
    for (Py_ssize_t j = 0; j < m->nkeys; j++) {
        Key *k = &self->keys[entries[j]];
        if (in_sum[j]) {
            add_into(k->f64, sumv[j].buf, grads[j].buf, (Py_ssize_t)k->numel);
        } else {
            summing += k->nbytes;
            if (summing > most) most = summing;
            if (!is_ready[j]) { /* kept on its frame, as the rule keeps it */
                PyObject *t = PyObject_CallFunctionObjArgs(self->tensor_of, PyList_GET_ITEM(frames, j + 1), k->obj, NULL);
                int rc = t ? PyDict_SetItem(sums, k->obj, t) : -1;
                Py_XDECREF(t);
                if (rc < 0) goto error;
            }
        }
        PyObject *by = PyDict_GetItem(pushed, k->obj);
        if (!by) {
            PyObject *fresh = PySet_New(NULL);
            int rc = fresh ? PyDict_SetItem(pushed, k->obj, fresh) : -1;
            Py_XDECREF(fresh);
            if (rc < 0 || !(by = PyDict_GetItem(pushed, k->obj))) goto error;
        }
        if (PySet_Add(by, w_obj) < 0) goto error;
    }
    /* SyncRule._update_ready: the ready keys, in the push's order, updated with the mean */
    if (nready) {
        if (lr_obj != Py_None && PyDict_SetItem(group, s_lr, lr_obj) < 0) goto error; /* ShardOptimizer.step */
        a.divisor = (double)self->num_workers;
        Py_ssize_t r = 0;
        for (Py_ssize_t j = 0; j < m->nkeys; j++) {
            if (!is_ready[j]) continue;
            Key *k = &self->keys[entries[j]];
            if (PySet_Add(readied, k->obj) < 0) goto error;
            const void *g = in_sum[j] ? sumv[j].buf : grads[j].buf;
            sgd_split(k->f64, values[r].buf, g, nbufs ? bufs[r].buf : NULL, (Py_ssize_t)k->numel, &a);
            r++;
            summing -= k->nbytes;
            if (in_sum[j] && PyDict_DelItem(sums, k->obj) < 0) goto error;
            if (PySet_Add(updated, k->obj) < 0) goto error;
        }
    }
    if (!set_int_attr(rule, s_summing, summing) || !set_int_attr(rule, s_most_summing, most)) goto error;
    long long version_now = version_s;
    if (PySet_GET_SIZE(updated) >= self->shard_keys) { /* SyncRule._end_step */
        if (PyObject_SetAttr(rule, s_readied, Py_None) < 0 || !add_to(counters, s_updates, 1, 0) ||
            PyObject_SetAttr(rule, s__step_lr, Py_None) < 0 || PyObject_SetAttr(rule, s__step_hold, Py_None) < 0 ||
            PySet_Clear(updated) < 0)
            goto error;
        PyDict_Clear(pushed); /* (its rows and held steps are empty: checked above) */
        if (!bump(s, save, version_s + 1)) goto error;
        version_now = version_s + 1;
    }
    /* fastpath._apply: the pull, after the requests the push lets go on */
    if (!add_to(counters, s_pulls, 1, 0)) goto error;
    if (PyList_GET_SIZE(waiters)) { /* the requests this push lets go on: ours where they are pulls, else Python's */
        PyObject *now_readied = attr(rule, s_readied);
        if (!now_readied) goto error;
        int got = release_pulls(self, s, now_readied, updated, version_now, counters, &others);
        if (!got) {
            others = PyObject_CallMethodOneArg(s, s__release, now_readied);
            if (others && !PyList_CheckExact(others)) {
                PyErr_SetString(PyExc_TypeError, "ShardServer._release gave no list");
                Py_CLEAR(others);
            }
        }
        Py_DECREF(now_readied);
        if (got < 0 || (!got && !others)) goto error;
    }
    long long at = version_of(self, updated, version_now, m->nkeys, entries);
    if (at < 0) goto error;
    if (m->has_min_version && at < (long long)m->min_version) { /* the pull waits */
        PyObject *r = PyObject_CallFunction(self->wait, "OOL", peer, frames, stale);
        if (!r) goto error;
        Py_DECREF(r);
        if (others) {
            result = others;
            others = NULL;
        } else if (!(result = PyList_New(0))) {
            goto error;
        }
        self->taken++;
        goto done;
    }
    if (!snapshots) {
        GET(snapshots, s, s_snapshots);
        GET(arrays, snapshots, s__arrays);
        if (!PyDict_Check(arrays)) {
            PyErr_SetString(PyExc_TypeError, "SnapshotPool._arrays is not a dict");
            goto error;
        }
    }
    if (!reply_views(self, snapshots, arrays, m->nkeys, entries, reply_arrays)) goto error;
    if (!(result = reply_of(self, peer, m, entries, reply_arrays, at, stale, counters, others))) goto error;
    self->taken++;
    goto done;
pass:
    result = Py_None;
    Py_INCREF(result);
    goto done;
error:
    result = failed(self, peer, m, mutated);
done:
    for (Py_ssize_t j = 0; j < nvalues; j++) PyBuffer_Release(&values[j]);
    for (Py_ssize_t j = 0; j < ngrads; j++) PyBuffer_Release(&grads[j]);
    for (Py_ssize_t j = 0; j < nbufs; j++) PyBuffer_Release(&bufs[j]);
    for (Py_ssize_t j = 0; j < nsums; j++)
        if (in_sum[j]) PyBuffer_Release(&sumv[j]);
    PyObject *held_refs[] = {waiting, waiters, workers, seen, lost, left, joining, clocks, partials,
                             version_o, rule, sums, pushed, updated, held, rows, step_lr, step_hold, summing_o,
                             most_o, counters, staleness, snapshots, arrays, lent, optimizer, group, save, w_obj,
                             step_obj, lr_obj, readied, others, partial, done};
    for (size_t i = 0; i < sizeof held_refs / sizeof held_refs[0]; i++) Py_XDECREF(held_refs[i]);
    return result;
#undef GET
#undef PASS
#undef TRY
}

#endif
