/* The compiled path's push+pull under the sync rule (ps.shard.consistency.SyncRule, as
 * ps.shard.fastpath's Python path applies it), for ps/shard/_compiled.c.
 *
 * A sync step's push adds each key's gradient to the step's sum (the first one kept on its
 * frame, as the rule keeps it); the push that brings a key's last worker updates the key with
 * the mean (SGD's arithmetic with the count as divisor) and, with the step's last key, ends the
 * step. The pull then answers at once where the keys are at the version it asks for, or waits
 * (ps.shard.fastpath's wait: the shard's Waiting, as the Python path adds it). It takes the
 * common case only: every worker live and none rejoining, no backup workers (the shard's
 * config: compiled.py), no rows, held step or clip, a learning rate that agrees with the
 * step's; anything else, and every check that fails, it leaves to the Python paths before it
 * has changed anything. */
#ifndef PSAR_SYNC_H
#define PSAR_SYNC_H

/* A writable buffer of the tensor t's bytes (its numpy view), of nbytes: 1; 0 where it is not
 * one (nothing set); -1 with an error set. */
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

static int set_int_attr(PyObject *o, PyObject *name, long long v) {
    PyObject *x = PyLong_FromLongLong(v);
    int rc = x ? PyObject_SetAttr(o, name, x) : -1;
    Py_XDECREF(x);
    return rc == 0;
}

/* The sync rule's push+pull m (read by read_push; entries: its keys' entries): its replies, or
 * None for the Python paths. */
static PyObject *sync_call(Path *self, PyObject *peer, PyObject *frames, Push *m, Py_ssize_t *entries) {
    PyObject *s = self->server, *result = NULL;
    PyObject *aborted = NULL, *trace = NULL, *waiting = NULL, *waiters = NULL, *workers = NULL, *seen = NULL,
             *lost = NULL, *left = NULL, *joining = NULL, *clocks = NULL, *partials = NULL, *version_o = NULL,
             *rule = NULL, *sums = NULL, *pushed = NULL, *updated = NULL, *held = NULL, *rows = NULL,
             *step_lr = NULL, *step_hold = NULL, *summing_o = NULL, *most_o = NULL, *counters = NULL,
             *staleness = NULL, *snapshots = NULL, *arrays = NULL, *lent = NULL, *optimizer = NULL, *group = NULL,
             *save = NULL, *w_obj = NULL, *step_obj = NULL, *lr_obj = NULL, *readied = NULL, *others = NULL;
    Py_ssize_t ready[MAX_KEYS_ON_STACK], nready = 0, ngrads = 0, nsums = 0, nvalues = 0, nbufs = 0;
    int in_sum[MAX_KEYS_ON_STACK], is_ready[MAX_KEYS_ON_STACK];
    Py_buffer grads[MAX_KEYS_ON_STACK], sumv[MAX_KEYS_ON_STACK], values[MAX_KEYS_ON_STACK], bufs[MAX_KEYS_ON_STACK];
    PyObject *arrays_of[MAX_KEYS_ON_STACK], *reply_arrays[MAX_KEYS_ON_STACK];
    int mutated = 0;
    long long version_s, clock_w, summing, most;

#define GET(var, obj, name)                    \
    if (!(var = attr(obj, name))) goto error;
#define PASS goto pass
    if (m->has_clock) PASS; /* a sync push+pull asks for a version; a clock is the Python paths' to read */
    GET(aborted, s, s_aborted);
    GET(trace, s, s_trace);
    if (aborted != Py_None || trace != Py_None) PASS;
    GET(waiting, s, s_waiting);
    GET(waiters, waiting, s__waiting);
    if (!PyList_CheckExact(waiters)) PASS;
    if (!frames_fit(self, frames, m, entries)) PASS;
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
    if (PyDict_Contains(seen, w_obj) != 1) PASS;
    /* ShardServer.check_push: the version, the worker's clock, the rule's step, each key once a step */
    GET(version_o, s, s_version);
    if (!get_i64(version_o, &version_s) || (long long)m->version > version_s || (long long)m->step != version_s) PASS;
    GET(clocks, workers, s_clocks);
    if (!PyDict_Check(clocks) || !get_i64(PyDict_GetItem(clocks, w_obj), &clock_w) || (long long)m->step < clock_w)
        PASS;
    GET(partials, workers, s__partial);
    PyObject *partial = PyDict_Check(partials) ? PyDict_GetItem(partials, w_obj) : NULL; /* borrowed */
    if (!partial || !PyDict_Check(partial)) PASS;
    if (!(step_obj = PyLong_FromUnsignedLongLong(m->step))) goto error;
    PyObject *done = PyDict_GetItem(partial, step_obj); /* borrowed */
    if (done && !PyAnySet_CheckExact(done)) PASS;
    for (Py_ssize_t j = 0; done && j < m->nkeys; j++) {
        int in = PySet_Contains(done, self->keys[entries[j]].obj);
        if (in < 0) goto error;
        if (in) PASS;
    }
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
            int got = tensor_buffer(sum, k->nbytes, &sumv[j]);
            if (got < 0) goto error;
            if (!got) PASS;
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
        if (!PyDict_CheckExact(group)) PASS;
        if (!number(PyDict_GetItem(group, s_lr), &a.lr, 1) ||
            !number(PyDict_GetItem(group, s_momentum), &a.momentum, 0) ||
            !number(PyDict_GetItem(group, s_weight_decay), &a.wd, 0) ||
            !number(PyDict_GetItem(group, s_dampening), &a.dampening, 0) ||
            !flag(PyDict_GetItem(group, s_maximize), &a.maximize) ||
            !flag(PyDict_GetItem(group, s_nesterov), &a.nesterov))
            PASS;
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
    for (Py_ssize_t j = 0; j < m->nkeys; j++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(frames, j + 1), &grads[j], PyBUF_SIMPLE) < 0) goto error;
        ngrads++;
    }

    /* Every check of the Python paths holds: from here on the push is applied, as they do. */
    mutated = 1;
    Py_ssize_t in_bytes = PyBytes_GET_SIZE(PyList_GET_ITEM(frames, 0));
    for (Py_ssize_t j = 0; j < m->nkeys; j++) in_bytes += grads[j].len;
    if (!add_to(counters, s_bytes_in, in_bytes, 0)) goto error;
    {
        PyObject *clock = attr(s, s_clock);
        PyObject *now = clock ? PyObject_CallNoArgs(clock) : NULL;
        Py_XDECREF(clock);
        int rc = now ? PyDict_SetItem(seen, w_obj, now) : -1;
        Py_XDECREF(now);
        if (rc < 0) goto error;
    }
    long long stale = version_s - (long long)m->version;
    {
        PyObject *st = PyLong_FromLongLong(stale);
        int ok = st && add_to(staleness, st, 1, 1);
        Py_XDECREF(st);
        if (!ok) goto error;
    }
    if (!add_to(counters, s_pushes, 1, 0)) goto error;
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
    if (PyList_GET_SIZE(waiters)) {
        PyObject *now_readied = attr(rule, s_readied);
        if (!now_readied) goto error;
        others = PyObject_CallMethodOneArg(s, s__release, now_readied);
        Py_DECREF(now_readied);
        if (!others) goto error;
        if (!PyList_CheckExact(others)) {
            PyErr_SetString(PyExc_TypeError, "ShardServer._release gave no list");
            goto error;
        }
    }
    /* SyncRule.version_of(keys) */
    long long version_of = version_now;
    if (PySet_GET_SIZE(updated)) {
        int all = 1;
        for (Py_ssize_t j = 0; all && j < m->nkeys; j++) {
            int in = PySet_Contains(updated, self->keys[entries[j]].obj);
            if (in < 0) goto error;
            all = in;
        }
        version_of += all;
    }
    if (m->has_min_version && version_of < (long long)m->min_version) { /* the pull waits */
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
    for (Py_ssize_t j = 0; j < m->nkeys; j++) { /* SnapshotPool.reply_bytes: the view each key's replies lend */
        PyObject *key = self->keys[entries[j]].obj;
        if (!(reply_arrays[j] = PyDict_GetItem(arrays, key))) {
            PyObject *view = PyObject_CallMethodOneArg(snapshots, s_reply_bytes, key);
            Py_XDECREF(view);
            if (!view || !(reply_arrays[j] = PyDict_GetItem(arrays, key))) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "SnapshotPool.reply_bytes kept no view");
                goto error;
            }
        }
    }
    if (!(result = reply_of(self, peer, m, entries, reply_arrays, version_of, stale, counters, others))) goto error;
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
    PyObject *held_refs[] = {aborted, trace, waiting, waiters, workers, seen, lost, left, joining, clocks, partials,
                             version_o, rule, sums, pushed, updated, held, rows, step_lr, step_hold, summing_o,
                             most_o, counters, staleness, snapshots, arrays, lent, optimizer, group, save, w_obj,
                             step_obj, lr_obj, readied, others};
    for (size_t i = 0; i < sizeof held_refs / sizeof held_refs[0]; i++) Py_XDECREF(held_refs[i]);
    return result;
#undef GET
#undef PASS
}

#endif
