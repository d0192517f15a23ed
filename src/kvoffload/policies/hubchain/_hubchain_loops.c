/* kvoffload.policies.hubchain._hubchain_loops: hubchain's hot loops, in C.

   The C twin of loops.py (read that file first: it says what each
   function does, and its functions are the reference). An order is an
   OrderedDict of key -> last use. These make the same calls on the same
   dicts in the same order as the Python (od[k] = v, del od[k],
   od.move_to_end(k), od.popitem(False), iteration from the oldest) and the
   same double additions in the same order, so both leave the same state
   and return the same values; the saving is the interpreter's loop, not a
   different structure. tests/policies/test_hubchain_loops.py compares them
   on random operations. Where an argument is outside what hubchain passes
   (keys of mixed lengths, positions that are not ints, a clock past 2**54),
   follow and prefix_end return NotImplemented and the Python module runs its
   own twin; the others raise TypeError or ValueError where the Python might
   do something else, never crash. merge reads last uses and the threshold as
   doubles: exact below 2**53, which a clock counting requests never reaches. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

static PyObject *str_move_to_end, *str_popitem;
static PyTypeObject *odict_type;  /* collections.OrderedDict */
static PyObject *odict_move_to_end, *odict_popitem;  /* its methods (descriptors): no lookup per call */

/* od.method(arg): the cached descriptor for a plain OrderedDict, else a lookup (a subclass may override) */
static PyObject *call_method(PyObject *od, PyObject *cached, PyObject *name, PyObject *arg) {
    PyObject *args[2] = {od, arg};
    if (Py_TYPE(od) == odict_type)
        return PyObject_Vectorcall(cached, args, 2, NULL);
    return PyObject_VectorcallMethod(name, args, 2, NULL);
}

static int move_to_end(PyObject *od, PyObject *k) {
    PyObject *r = call_method(od, odict_move_to_end, str_move_to_end, k);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static int pop_oldest(PyObject *od, Py_ssize_t count) {
    for (; count > 0; count--) {
        PyObject *r = call_method(od, odict_popitem, str_popitem, Py_False);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    return 0;
}

static int contains(PyObject *container, PyObject *k) {
    if (PyDict_Check(container))
        return PyDict_Contains(container, k);
    if (PyAnySet_Check(container))
        return PySet_Contains(container, k);
    return PySequence_Contains(container, k);
}

/* od.pop(k, None) is not None: 1 popped, 0 absent, -1 error (values are never None here) */
static int pop(PyObject *od, PyObject *k) {
    PyObject *v = PyDict_GetItemWithError(od, k);
    if (v == NULL)
        return PyErr_Occurred() ? -1 : 0;
    return PyObject_DelItem(od, k) < 0 ? -1 : 1;
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

/* each of n objects a dict (an OrderedDict is one), else a TypeError: PyDict_Contains does not check */
static int need_dicts(const char *name, Py_ssize_t n, PyObject *const *objs) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyDict_Check(objs[i])) {
            PyErr_Format(PyExc_TypeError, "%s(): expected an OrderedDict, got %.100s", name, Py_TYPE(objs[i])->tp_name);
            return -1;
        }
    return 0;
}

static int check_args(Py_ssize_t nargs, Py_ssize_t want, const char *name) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    return 0;
}

/* stamp(od, keys, now) */
static PyObject *stamp(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 3, "stamp") < 0)
        return NULL;
    PyObject *od = args[0], *now = args[2];
    PyObject *keys = PySequence_Tuple(args[1]);
    if (keys == NULL)
        return NULL;
    for (Py_ssize_t i = PyTuple_GET_SIZE(keys) - 1; i >= 0; i--) {
        if (PyObject_SetItem(od, PyTuple_GET_ITEM(keys, i), now) < 0) {
            Py_DECREF(keys);
            return NULL;
        }
    }
    Py_DECREF(keys);
    Py_RETURN_NONE;
}

static int renew_keys(PyObject *od, PyObject *keys, PyObject *now, int all) {
    for (Py_ssize_t i = PyTuple_GET_SIZE(keys) - 1; i >= 0; i--) {
        PyObject *k = PyTuple_GET_ITEM(keys, i);
        if (!all) {
            int r = PyDict_Contains(od, k);
            if (r < 0)
                return -1;
            if (!r)
                continue;
        }
        if (PyObject_SetItem(od, k, now) < 0 || move_to_end(od, k) < 0)
            return -1;
    }
    return 0;
}

/* renew(od, keys, now) */
static PyObject *renew(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 3, "renew") < 0 || need_dicts("renew", 1, args) < 0)
        return NULL;
    PyObject *keys = PySequence_Tuple(args[1]);
    if (keys == NULL)
        return NULL;
    int r = renew_keys(args[0], keys, args[2], 0);
    Py_DECREF(keys);
    if (r < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* renew_all(od, keys, now) -> bool */
static PyObject *renew_all(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 3, "renew_all") < 0 || need_dicts("renew_all", 1, args) < 0)
        return NULL;
    PyObject *od = args[0];
    PyObject *keys = PySequence_Tuple(args[1]);
    if (keys == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        int r = PyDict_Contains(od, PyTuple_GET_ITEM(keys, i));
        if (r <= 0) {
            Py_DECREF(keys);
            if (r < 0)
                return NULL;
            Py_RETURN_FALSE;
        }
    }
    int r = renew_keys(od, keys, args[2], 1);
    Py_DECREF(keys);
    if (r < 0)
        return NULL;
    Py_RETURN_TRUE;
}

/* touch(keys, order, loose, heads, hubbed, used, now) */
static PyObject *touch(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 7, "touch") < 0 || need_dicts("touch", 4, args + 1) < 0)
        return NULL;
    PyObject *order = args[1], *loose = args[2], *heads = args[3], *hubbed = args[4];
    PyObject *used = args[5], *now = args[6];
    PyObject *keys = PySequence_Tuple(args[0]);
    if (keys == NULL)
        return NULL;
    for (Py_ssize_t i = PyTuple_GET_SIZE(keys) - 1; i >= 0; i--) {
        PyObject *k = PyTuple_GET_ITEM(keys, i);
        int r;
        if ((r = PyDict_Contains(order, k)) != 0) {
            if (r < 0 || PyObject_SetItem(order, k, used) < 0 || move_to_end(order, k) < 0)
                goto fail;
        } else if ((r = PyDict_Contains(loose, k)) != 0) {
            if (r < 0 || PyObject_DelItem(loose, k) < 0 || PyObject_SetItem(order, k, used) < 0)
                goto fail;
        } else if ((r = PyDict_Contains(heads, k)) != 0) {
            if (r < 0 || PyObject_SetItem(heads, k, now) < 0 || move_to_end(heads, k) < 0)
                goto fail;
        } else if ((r = PyDict_Contains(hubbed, k)) != 0) {
            if (r < 0 || PyObject_DelItem(hubbed, k) < 0 || PyObject_SetItem(order, k, used) < 0)
                goto fail;
        }
    }
    Py_DECREF(keys);
    Py_RETURN_NONE;
fail:
    Py_DECREF(keys);
    return NULL;
}

/* drop(victims, order, loose, hubbed, heads, b1, b2, hub_ghosts, recent, branches, c) */
static PyObject *drop(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 11, "drop") < 0 || need_dicts("drop", 9, args + 1) < 0)
        return NULL;
    PyObject *order = args[1], *loose = args[2], *hubbed = args[3], *heads = args[4];
    PyObject *b1 = args[5], *b2 = args[6], *hub_ghosts = args[7], *recent = args[8], *branches = args[9];
    Py_ssize_t c = PyLong_AsSsize_t(args[10]);
    if (c == -1 && PyErr_Occurred())
        return NULL;
    if (c < 1 || c > PY_SSIZE_T_MAX / 4) {  /* (2c below must not overflow) */
        PyErr_SetString(PyExc_ValueError, "drop(): the capacity must be a positive size");
        return NULL;
    }
    PyObject *branch = NULL;
    PyObject *victims = PySequence_Tuple(args[0]);
    if (victims == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(victims);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PyTuple_GET_ITEM(victims, i);
        int r;
        if ((r = pop(order, k)) != 0) {
            if (r < 0 || PyObject_SetItem(b2, k, Py_None) < 0)
                goto fail;
        } else if ((r = pop(loose, k)) != 0) {
            if (r < 0 || PyObject_SetItem(b1, k, Py_None) < 0)
                goto fail;
        } else if ((r = pop(hubbed, k)) != 0) {
            if (r < 0 || PyObject_SetItem(b1, k, Py_None) < 0 || PyObject_SetItem(hub_ghosts, k, Py_None) < 0)
                goto fail;
            if (branch == NULL && (branch = PyList_New(0)) == NULL)
                goto fail;
            if (PyList_Append(branch, k) < 0)
                goto fail;
        } else {
            if (PyObject_DelItem(heads, k) < 0 || PyObject_SetItem(b2, k, Py_None) < 0)
                goto fail;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (PyObject_SetItem(recent, PyTuple_GET_ITEM(victims, i), Py_None) < 0)
            goto fail;
    /* (every argument is a dict here: need_dicts) */
    if (PyDict_GET_SIZE(branches))
        for (Py_ssize_t i = 0; i < n; i++)
            if (pop(branches, PyTuple_GET_ITEM(victims, i)) < 0)
                goto fail;
    if (PyDict_GET_SIZE(recent) > c && pop_oldest(recent, PyDict_GET_SIZE(recent) - c) < 0)
        goto fail;
    /* ARC's bounds */
    Py_ssize_t n_loose = PyDict_GET_SIZE(loose), n_b1 = PyDict_GET_SIZE(b1), n_b2 = PyDict_GET_SIZE(b2);
    Py_ssize_t resident = PyDict_GET_SIZE(order) + n_loose + PyDict_GET_SIZE(hubbed) + PyDict_GET_SIZE(heads);
    Py_ssize_t over = n_loose + n_b1 - c < n_b1 ? n_loose + n_b1 - c : n_b1;
    if (over > 0) {
        if (pop_oldest(b1, over) < 0)
            goto fail;
        n_b1 -= over;
    }
    over = resident + n_b1 + n_b2 - 2 * c;
    if (over > 0) {
        Py_ssize_t from2 = over < n_b2 ? over : n_b2, from1 = over - from2 < n_b1 ? over - from2 : n_b1;
        if (pop_oldest(b2, from2) < 0 || pop_oldest(b1, from1) < 0)
            goto fail;
    }
    if (branch != NULL) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(branch); i++)
            if (pop(b1, PyList_GET_ITEM(branch, i)) < 0)
                goto fail;
        if (PyDict_GET_SIZE(hub_ghosts) > c && pop_oldest(hub_ghosts, PyDict_GET_SIZE(hub_ghosts) - c) < 0)
            goto fail;
        Py_DECREF(branch);
    }
    Py_DECREF(victims);
    Py_RETURN_NONE;
fail:
    Py_DECREF(victims);
    Py_XDECREF(branch);
    return NULL;
}

/* ---- merge ---------------------------------------------------------------- */

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
static PyObject *merge(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
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

/* ---- the resident prefix ------------------------------------------------------ */

/* an int's value into *v: 1, 0 if not an int that fits (the Python twin takes it), -1 on error */
static int as_ll(PyObject *o, long long *v) {
    if (!PyLong_CheckExact(o))
        return 0;
    int overflow;
    *v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (*v == -1 && PyErr_Occurred())
        return -1;
    return !overflow;
}

/* k's last use in the first of `orders` that holds it: 1 found (in *last), 0 in none, 2 not an int, -1 error */
static int last_use(PyObject *orders, PyObject *k, long long *last) {
    for (Py_ssize_t o = 0; o < PyTuple_GET_SIZE(orders); o++) {
        PyObject *v = PyDict_GetItemWithError(PyTuple_GET_ITEM(orders, o), k);
        if (v != NULL) {
            int r = as_ll(v, last);
            return r == 1 ? 1 : r < 0 ? -1 : 2;
        }
        if (PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* prefix_end(positions, first_key, orders) -> (last, key) | (None, None), or NotImplemented where positions
   is not a dict of ints, orders not a tuple of dicts or a last use not an int (the Python twin then does it) */
static PyObject *prefix_end(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 3, "prefix_end") < 0)
        return NULL;
    PyObject *positions = args[0], *orders = args[2];
    if (!PyDict_CheckExact(positions) || !PyTuple_Check(orders))
        Py_RETURN_NOTIMPLEMENTED;
    for (Py_ssize_t o = 0; o < PyTuple_GET_SIZE(orders); o++)
        if (!PyDict_Check(PyTuple_GET_ITEM(orders, o)))
            Py_RETURN_NOTIMPLEMENTED;
    PyObject *fv = PyDict_GetItemWithError(positions, args[1]);
    if (fv == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return Py_BuildValue("(OO)", Py_None, Py_None);
    }
    long long first, last;
    int r = as_ll(fv, &first);
    if (r <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_NotImplemented);
    /* The entries in order, read once (PyDict_Next: no lookups), then walked from the deep end: the
       store's own keys and those after it cost a step each, not a lookup. */
    Py_ssize_t n = PyDict_GET_SIZE(positions), at = 0, pos = 0;
    PyObject **ks = PyMem_Malloc((n ? n : 1) * sizeof(PyObject *)), *pk, *pv, *res = NULL;
    long long *ps = PyMem_Malloc((n ? n : 1) * sizeof(long long));
    if (ks == NULL || ps == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    while (PyDict_Next(positions, &pos, &pk, &pv)) {  /* (borrowed: nothing here changes positions) */
        if ((r = as_ll(pv, &ps[at])) <= 0) {
            res = r < 0 ? NULL : Py_NewRef(Py_NotImplemented);
            goto out;
        }
        ks[at++] = pk;
    }
    Py_ssize_t i = at - 1;
    for (; i >= 0; i--) {
        if (i < at - 1 && ps[i] >= ps[i + 1])
            break;  /* out of prefix order: the full walk below */
        if (ps[i] < first) {
            r = last_use(orders, ks[i], &last);
            if (r < 0)
                goto out;
            if (r == 2) {
                res = Py_NewRef(Py_NotImplemented);
                goto out;
            }
            if (r == 1 && last >= 0) {
                res = Py_BuildValue("(LO)", last, ks[i]);
                goto out;
            }
        }
    }
    if (i < 0) {
        res = Py_BuildValue("(OO)", Py_None, Py_None);
        goto out;
    }
    long long best = -1, prev = 0;
    PyObject *parent = NULL;
    for (i = 0; i < at; i++) {
        if (best < ps[i] && ps[i] < first) {
            r = last_use(orders, ks[i], &last);
            if (r < 0)
                goto out;
            if (r == 2) {
                res = Py_NewRef(Py_NotImplemented);
                goto out;
            }
            if (r == 1 && last >= 0) {
                best = ps[i];
                prev = last;
                parent = ks[i];
            }
        }
    }
    res = parent == NULL ? Py_BuildValue("(OO)", Py_None, Py_None) : Py_BuildValue("(LO)", prev, parent);
out:
    PyMem_Free(ks);
    PyMem_Free(ps);
    return res;
}

/* ---- the learning ---------------------------------------------------------- */

/* shadow's work on keys[0..m): adds to *ours, *lru */
static int shadow_keys(PyObject *sim, PyObject **keys, Py_ssize_t m, int hit, Py_ssize_t cap, int counting,
                       long long *ours, long long *lru) {
    if (counting) {
        Py_ssize_t found = 0;
        for (Py_ssize_t i = 0; i < m; i++) {
            int r = PyDict_Contains(sim, keys[i]);
            if (r < 0)
                return -1;
            found += r;
        }
        if (hit)
            *ours += m - found;
        else
            *lru += found;
    }
    for (Py_ssize_t i = 0; i < m; i++)
        if (pop(sim, keys[i]) < 0)
            return -1;
    for (Py_ssize_t i = m - 1; i >= 0; i--)
        if (PyObject_SetItem(sim, keys[i], Py_None) < 0)
            return -1;
    Py_ssize_t size = PyDict_GET_SIZE(sim);  /* (a dict: shadow and follow check) */
    return size > cap ? pop_oldest(sim, size - cap) : 0;
}

/* shadow(sim, keys, hit, cap, counting) -> (ours, lru) */
static PyObject *shadow(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 5, "shadow") < 0 || need_dicts("shadow", 1, args) < 0)
        return NULL;
    int hit = PyObject_IsTrue(args[2]), counting = PyObject_IsTrue(args[4]);
    Py_ssize_t cap = PyLong_AsSsize_t(args[3]);
    if (hit < 0 || counting < 0 || (cap == -1 && PyErr_Occurred()))
        return NULL;
    PyObject *keys = PySequence_Tuple(args[1]);
    if (keys == NULL)
        return NULL;
    long long ours = 0, lru = 0;
    int r = shadow_keys(args[0], &PyTuple_GET_ITEM(keys, 0), PyTuple_GET_SIZE(keys), hit, cap, counting,
                        &ours, &lru);
    Py_DECREF(keys);
    if (r < 0)
        return NULL;
    return Py_BuildValue("(LL)", ours, lru);
}

/* list[i] += delta (ints) */
static int add_int(PyObject *list, Py_ssize_t i, long long delta) {
    if (!PyList_Check(list) || i < 0 || i >= PyList_GET_SIZE(list)) {
        PyErr_SetString(PyExc_IndexError, "follow: counter index out of range");
        return -1;
    }
    long long v = PyLong_AsLongLong(PyList_GET_ITEM(list, i));
    if (v == -1 && PyErr_Occurred())
        return -1;
    PyObject *o = PyLong_FromLongLong(v + delta);
    return o == NULL ? -1 : PyList_SetItem(list, i, o);
}

/* list[i] += w (floats: the same double addition as Python's) */
static int add_float(PyObject *list, Py_ssize_t i, double w) {
    if (!PyList_Check(list) || i < 0 || i >= PyList_GET_SIZE(list)) {
        PyErr_SetString(PyExc_IndexError, "follow: histogram index out of range");
        return -1;
    }
    double v = PyFloat_AsDouble(PyList_GET_ITEM(list, i));
    if (v == -1.0 && PyErr_Occurred())
        return -1;
    PyObject *o = PyFloat_FromDouble(v + w);
    return o == NULL ? -1 : PyList_SetItem(list, i, o);
}

/* follow(keys, cls, hit, now, low, k, s, episodes, live, dist, met, sim, sim_cap, counting, bin_of)
   -> (started, ours, lru), or NotImplemented when a key is not bytes of the first key's length (5 or more):
   the Python twin then does it (its hash bytes differ there). */
static PyObject *follow(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 15, "follow") < 0)
        return NULL;
    long cls = PyLong_AsLong(args[1]), low = PyLong_AsLong(args[4]), k = PyLong_AsLong(args[5]);
    long s = PyLong_AsLong(args[6]);
    long long now = PyLong_AsLongLong(args[3]);
    Py_ssize_t sim_cap = PyLong_AsSsize_t(args[12]);
    if (PyErr_Occurred())
        return NULL;
    int hit = PyObject_IsTrue(args[2]), counting = PyObject_IsTrue(args[13]);
    if (hit < 0 || counting < 0)
        return NULL;
    PyObject *episodes = args[7], *live = args[8], *dist = args[9], *met = args[10], *sim = args[11];
    PyObject *bin_of = args[14];
    if (cls < 0 || cls > 1 || low < 0 || low > 8 || k < low || k > 8 || s < 0 || s > 8 || !PyDict_Check(episodes)
        || !PySequence_Check(dist) || PySequence_Size(dist) != 2 || !PyBytes_Check(bin_of) || PyBytes_GET_SIZE(bin_of) < 1
        || !PyDict_Check(sim)) {
        PyErr_SetString(PyExc_ValueError, "follow: bad arguments");
        return NULL;
    }
    PyObject *seq = PySequence_Tuple(args[0]);
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    PyObject **keys = &PyTuple_GET_ITEM(seq, 0);
    PyObject **pick = NULL, **cand = NULL;
    unsigned char *hb = NULL;
    long long *ended = NULL, ours = 0, lru = 0, started = 0;
    if (n == 0) {
        Py_DECREF(seq);
        return Py_BuildValue("(iii)", 0, 0, 0);
    }
    Py_ssize_t size = PyBytes_Check(keys[0]) ? PyBytes_GET_SIZE(keys[0]) : 0;
    if (size < 5 || now < 0 || now >= (1LL << 54))  /* ((now << 8) must fit) */
        goto python;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyBytes_Check(keys[i]) || PyBytes_GET_SIZE(keys[i]) != size)
            goto python;
    hb = PyMem_Malloc(n);
    pick = PyMem_Malloc(n * sizeof(PyObject *));
    cand = PyMem_Malloc(n * sizeof(PyObject *));
    ended = PyMem_Malloc(n * sizeof(long long));
    if (hb == NULL || pick == NULL || cand == NULL || ended == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        hb[i] = (unsigned char)PyBytes_AS_STRING(keys[i])[size - 5];
    /* the keys that end episodes (the lowest live rate's sample), checked before anything changes: an
       episode that is not an int of this clock's past goes to the Python twin, whatever it makes of it */
    unsigned mask = (1u << low) - 1;
    Py_ssize_t nc = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!(hb[i] & mask))
            cand[nc++] = keys[i];
    for (Py_ssize_t i = 0; i < nc; i++) {
        PyObject *v = PyDict_GetItemWithError(episodes, cand[i]);
        if (v == NULL) {
            if (PyErr_Occurred())
                goto fail;
            continue;
        }
        long long e;
        int r = as_ll(v, &e);
        if (r < 0)
            goto fail;
        if (r == 0 || e < 0 || (e >> 8) > now || ((e >> 1) & 127) > 62)
            goto python;
    }
    /* the shadow LRU's sample */
    mask = (1u << s) - 1;
    Py_ssize_t np = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (!(hb[i] & mask))
            pick[np++] = keys[i];
    if (np && shadow_keys(sim, pick, np, hit, sim_cap, counting, &ours, &lru) < 0)
        goto fail;
    /* episodes: the lowest live rate's sample ends them, class cls's starts them */
    if (nc == 0)
        goto done;
    Py_ssize_t ne = 0;
    for (Py_ssize_t i = 0; i < nc; i++) {
        PyObject *v = PyDict_GetItemWithError(episodes, cand[i]);  /* (a key twice: found once) */
        if (v == NULL) {
            if (PyErr_Occurred())
                goto fail;
            continue;
        }
        long long e = PyLong_AsLongLong(v);
        if ((e == -1 && PyErr_Occurred()) || PyDict_DelItem(episodes, cand[i]) < 0)
            goto fail;
        ended[ne++] = e;
    }
    Py_ssize_t before = PyDict_GET_SIZE(episodes);
    PyObject *packed = NULL;
    mask = (1u << k) - 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (hb[i] & mask)
            continue;
        if (packed == NULL && (packed = PyLong_FromLongLong((now << 8) | (k << 1) | cls)) == NULL)
            goto fail;
        if (PyDict_SetItem(episodes, keys[i], packed) < 0) {
            Py_DECREF(packed);
            goto fail;
        }
    }
    if (packed != NULL) {
        Py_DECREF(packed);
        Py_ssize_t added = PyDict_GET_SIZE(episodes) - before;
        started = (long long)added << k;
        if (add_int(live, k, added) < 0)
            goto fail;
    }
    Py_ssize_t last = PyBytes_GET_SIZE(bin_of) - 1;
    const unsigned char *bins = (const unsigned char *)PyBytes_AS_STRING(bin_of);
    for (Py_ssize_t i = 0; i < ne; i++) {
        long long e = ended[i], d = now - (e >> 8);
        long ek = (long)((e >> 1) & 127);
        Py_ssize_t b = bins[d < last ? d : last];
        double w = (double)(1LL << ek);
        PyObject *h = PySequence_GetItem(dist, e & 1);
        int bad = h == NULL || add_int(live, ek, -1) < 0 || add_float(h, b, w) < 0 || add_float(met, b, w) < 0;
        Py_XDECREF(h);
        if (bad)
            goto fail;
    }
done:
    PyMem_Free(hb);
    PyMem_Free(pick);
    PyMem_Free(cand);
    PyMem_Free(ended);
    Py_DECREF(seq);
    return Py_BuildValue("(LLL)", started, ours, lru);
python:
    PyMem_Free(hb);
    PyMem_Free(pick);
    PyMem_Free(cand);
    PyMem_Free(ended);
    Py_DECREF(seq);
    Py_RETURN_NOTIMPLEMENTED;
fail:
    PyMem_Free(hb);
    PyMem_Free(pick);
    PyMem_Free(cand);
    PyMem_Free(ended);
    Py_DECREF(seq);
    return NULL;
}

static PyMethodDef methods[] = {
    {"stamp", (PyCFunction)(void (*)(void))stamp, METH_FASTCALL, "stamp(od, keys, now)"},
    {"renew", (PyCFunction)(void (*)(void))renew, METH_FASTCALL, "renew(od, keys, now)"},
    {"renew_all", (PyCFunction)(void (*)(void))renew_all, METH_FASTCALL, "renew_all(od, keys, now) -> bool"},
    {"touch", (PyCFunction)(void (*)(void))touch, METH_FASTCALL, "touch(keys, order, loose, heads, hubbed, used, now)"},
    {"drop", (PyCFunction)(void (*)(void))drop, METH_FASTCALL,
     "drop(victims, order, loose, hubbed, heads, b1, b2, hub_ghosts, recent, branches, c)"},
    {"merge", (PyCFunction)(void (*)(void))merge, METH_FASTCALL,
     "merge(n, loose, order, hubbed, heads, p, q, threshold, hub_off, head_off, own, held, can_evict) -> list"},
    {"prefix_end", (PyCFunction)(void (*)(void))prefix_end, METH_FASTCALL,
     "prefix_end(positions, first_key, orders) -> (last, key) | (None, None)"},
    {"shadow", (PyCFunction)(void (*)(void))shadow, METH_FASTCALL, "shadow(sim, keys, hit, cap, counting) -> (ours, lru)"},
    {"follow", (PyCFunction)(void (*)(void))follow, METH_FASTCALL,
     "follow(keys, cls, hit, now, low, k, s, episodes, live, dist, met, sim, sim_cap, counting, bin_of) -> tuple"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hubchain_loops",
                                     "hubchain's hot loops over its orders (C twin of loops.py)", -1, methods};

PyMODINIT_FUNC PyInit__hubchain_loops(void) {
    str_move_to_end = PyUnicode_InternFromString("move_to_end");
    str_popitem = PyUnicode_InternFromString("popitem");
    if (str_move_to_end == NULL || str_popitem == NULL)
        return NULL;
    PyObject *collections = PyImport_ImportModule("collections");
    if (collections == NULL)
        return NULL;
    odict_type = (PyTypeObject *)PyObject_GetAttrString(collections, "OrderedDict");
    Py_DECREF(collections);
    if (odict_type == NULL || !PyType_Check(odict_type))
        return NULL;
    odict_move_to_end = PyObject_GetAttr((PyObject *)odict_type, str_move_to_end);
    odict_popitem = PyObject_GetAttr((PyObject *)odict_type, str_popitem);
    if (odict_move_to_end == NULL || odict_popitem == NULL)
        return NULL;
    return PyModule_Create(&module);
}
