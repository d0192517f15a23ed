/* _hubchain_loops_merge.c: merge (loops.py's twin): the victims, oldest first across the four
   orders, each order's last uses shifted by its offset, reading the last uses and the threshold as
   doubles (exact below 2**53). The invariants shared by every file are at the top of _hubchain_loops.c. */

#include "_hubchain_loops.h"
#include <math.h>

static int contains(PyObject *container, PyObject *k) {
    if (PyDict_Check(container))
        return PyDict_Contains(container, k);
    if (PyAnySet_Check(container))
        return PySet_Contains(container, k);
    return PySequence_Contains(container, k);
}

/* k not in own and k not in held and (can_evict is None or can_evict(k)) */
static int may_go(PyObject *k, PyObject *own, PyObject *held, PyObject *can_evict) {
    int r = contains(own, k);
    if (r)
        return r < 0 ? -1 : 0;
    r = contains(held, k);
    if (r)
        return r < 0 ? -1 : 0;
    if (can_evict == Py_None)
        return 1;
    PyObject *res = PyObject_CallOneArg(can_evict, k);
    if (res == NULL)
        return -1;
    r = PyObject_IsTrue(res);
    Py_DECREF(res);
    return r;
}

/* int(x) for a finite x, clamped far beyond any size (the callers only subtract it from a size) */
static Py_ssize_t to_size(double x) {
    double lim = (double)(PY_SSIZE_T_MAX / 4);
    return (Py_ssize_t)(x > lim ? lim : x < -lim ? -lim : x);
}

/* One order walked from its oldest: its iterator, the current key (owned)
   and that key's last use. */
typedef struct {
    PyObject *od, *it, *key;
    double last;
} Walk;

/* The walk's next key: 1, 0 at the end, -1 on error. */
static int walk_next(Walk *w) {
    Py_CLEAR(w->key);
    PyObject *k = PyIter_Next(w->it);
    if (k == NULL)
        return PyErr_Occurred() ? -1 : 0;
    PyObject *v = PyDict_GetItemWithError(w->od, k);
    if (v == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, k);
        Py_DECREF(k);
        return -1;
    }
    double d = PyFloat_AsDouble(v);  /* (an int converts exactly below 2**53: clocks do) */
    if (d == -1.0 && PyErr_Occurred()) {
        Py_DECREF(k);
        return -1;
    }
    w->key = k;
    w->last = d;
    return 1;
}

/* Append victims while may_go; the caller's loops decide when to stop. -1 on error. */
static int offer(PyObject *victims, PyObject *k, PyObject *own, PyObject *held, PyObject *can_evict) {
    int g = may_go(k, own, held, can_evict);
    if (g <= 0)
        return g;
    return PyList_Append(victims, k) < 0 ? -1 : 1;
}

static PyObject *merge_rest(Py_ssize_t n, PyObject *const *ods, double p, double threshold,
                            const double *offset, PyObject *own, PyObject *held, PyObject *can_evict) {
    Walk w[4] = {{0}};
    int alive[4] = {0, 0, 0, 0};
    double eff[4];
    Py_ssize_t need = n;
    PyObject *victims = PyList_New(0);
    if (victims == NULL)
        return NULL;
    for (int i = 0; i < 4; i++) {
        w[i].od = ods[i];
        if ((w[i].it = PyObject_GetIter(ods[i])) == NULL)
            goto fail;
    }
    Py_ssize_t over = PyDict_GET_SIZE(ods[0]) - to_size(p);
    if (over > 0) {  /* the loose order over its target: its oldest first */
        Py_ssize_t first = n < over ? n : over;
        for (;;) {
            int r = walk_next(&w[0]);
            if (r < 0)
                goto fail;
            if (r == 0)
                break;
            if ((r = offer(victims, w[0].key, own, held, can_evict)) < 0)
                goto fail;
            if (r && PyList_GET_SIZE(victims) == first)
                break;
        }
        need = n - PyList_GET_SIZE(victims);
        if (!need)
            goto done;
    }
    int left = 0;
    for (int i = 0; i < 4; i++) {
        int r = walk_next(&w[i]);
        if (r < 0)
            goto fail;
        alive[i] = r;
    }
    if (alive[1] && w[1].last >= threshold)
        alive[1] = 0;  /* chain's order is shielded from its first block */
    for (int i = 0; i < 4; i++) {
        eff[i] = alive[i] ? w[i].last + offset[i] : INFINITY;
        left += alive[i];
    }
    while (left > 1 && need) {
        int i = -1, j = 0;
        for (int x = 0; x < 4; x++)
            if (alive[x] && (i < 0 || eff[x] < eff[i]))
                i = x;  /* the oldest of the live walks (a tie to the lower order) */
        eff[i] = INFINITY;
        j = i == 0 ? 1 : 0;
        for (int x = 0; x < 4; x++)
            if (eff[x] < eff[j])
                j = x;
        double bound = eff[j];
        for (;;) {  /* a run of walk i */
            int r = offer(victims, w[i].key, own, held, can_evict);
            if (r < 0)
                goto fail;
            if (r && !--need)
                goto done;
            if ((r = walk_next(&w[i])) < 0)
                goto fail;
            if (r == 0 || (i == 1 && w[i].last >= threshold)) {
                alive[i] = 0;
                left--;
                break;
            }
            double e = w[i].last + offset[i];
            if (e < bound || (e == bound && i < j))
                continue;
            eff[i] = e;
            break;
        }
    }
    if (left == 1 && need) {  /* one order left: a plain walk */
        int i = 0;
        while (!alive[i])
            i++;
        for (;;) {
            if (i == 1 && w[i].last >= threshold)
                break;
            int r = offer(victims, w[i].key, own, held, can_evict);
            if (r < 0)
                goto fail;
            if (r && !--need)
                break;
            if ((r = walk_next(&w[i])) < 0)
                goto fail;
            if (r == 0)
                break;
        }
    }
done:
    for (int i = 0; i < 4; i++) {
        Py_XDECREF(w[i].it);
        Py_XDECREF(w[i].key);
    }
    return victims;
fail:
    for (int i = 0; i < 4; i++) {
        Py_XDECREF(w[i].it);
        Py_XDECREF(w[i].key);
    }
    Py_DECREF(victims);
    return NULL;
}

/* merge(n, loose, order, hubbed, heads, p, q, threshold, hub_off, head_off, own, held, can_evict) */
PyObject *hc_merge(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 13, "merge") < 0 || need_dicts("merge", 4, args + 1) < 0)
        return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[0]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    PyObject *const *ods = args + 1;  /* loose, order, hubbed, heads */
    double v[5];
    for (int x = 0; x < 5; x++) {
        v[x] = PyFloat_AsDouble(args[5 + x]);
        if (v[x] == -1.0 && PyErr_Occurred())
            return NULL;
    }
    double p = v[0], q = v[1], threshold = v[2];
    double offset[4] = {0.0, 0.0, v[3], v[4]};
    PyObject *own = args[10], *held = args[11], *can_evict = args[12], *hubbed = ods[2];
    if (!isfinite(p) || !isfinite(q) || !isfinite(v[3]) || !isfinite(v[4])) {
        PyErr_SetString(PyExc_ValueError, "merge: p, q and the offsets must be finite");
        return NULL;
    }
    Py_ssize_t over = PyDict_GET_SIZE(hubbed) - to_size(q);
    if (over <= 0)
        return merge_rest(n, ods, p, threshold, offset, own, held, can_evict);
    Py_ssize_t first = n < over ? n : over;
    PyObject *victims = PyList_New(0), *taken = NULL, *more = NULL;
    PyObject *it = PyObject_GetIter(hubbed), *k;
    if (victims == NULL || it == NULL)
        goto fail;
    while ((k = PyIter_Next(it)) != NULL) {  /* the hub branch order over its target: its oldest first */
        int r = offer(victims, k, own, held, can_evict);
        Py_DECREF(k);
        if (r < 0)
            goto fail;
        if (r && PyList_GET_SIZE(victims) == first)
            break;
    }
    if (PyErr_Occurred())
        goto fail;
    Py_CLEAR(it);
    if (PyList_GET_SIZE(victims) < n) {  /* the rest's pick may name these again: ask for that many more */
        if ((taken = PySet_New(victims)) == NULL)
            goto fail;
        if ((more = merge_rest(n, ods, p, threshold, offset, own, held, can_evict)) == NULL)
            goto fail;
        Py_ssize_t room = n - PyList_GET_SIZE(victims);
        for (Py_ssize_t x = 0; x < PyList_GET_SIZE(more) && room > 0; x++) {
            PyObject *mk = PyList_GET_ITEM(more, x);
            int r = PySet_Contains(taken, mk);
            if (r < 0)
                goto fail;
            if (!r) {
                if (PyList_Append(victims, mk) < 0)
                    goto fail;
                room--;
            }
        }
        Py_DECREF(taken);
        Py_DECREF(more);
    }
    return victims;
fail:
    Py_XDECREF(it);
    Py_XDECREF(taken);
    Py_XDECREF(more);
    Py_XDECREF(victims);
    return NULL;
}
