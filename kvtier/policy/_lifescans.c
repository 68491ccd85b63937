/* The life table's loops in C: the exposure sums, the smoothing of the hazards (with the local
 * rates it pulls towards), the density windows, the running minimum and the retiring of a ring
 * slot. kvtier/policy/lifescans.py holds the numpy form of each, which is the reference: these
 * loops form every value with the same operands in the same order (the prefix compositions
 * doubling as there, the local rates' lookup as np.interp does it over the states' columns laid
 * end to end, from the same guess), so the results are the same to the bit. Built without
 * contraction to fused multiply-adds (setup.py: -ffp-contract=off), which numpy's elementwise
 * loops never form. tests/test_lifescans.py checks the two against each other.
 *
 * Arrays are float64 (the ring rows int64), C-contiguous, bucket-major ([bucket, state]) but
 * where named otherwise; the Python side makes them so (lifescans.py) and this side checks them
 * again (a clear error, never a read out of bounds). The only state kept is a scratch buffer;
 * the GIL is held throughout (a call takes tens of microseconds), so calls never overlap.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

/* A C-contiguous buffer of 8-byte items of one of the struct ``kinds`` ("d": float64, "lq":
 * int64), of ``ndim`` dimensions, writable if asked. */
static int
get_array(PyObject *obj, Py_buffer *view, int ndim, int writable, const char *kinds,
          const char *name)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    const char *f = view->format == NULL ? "B" : view->format;
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (view->ndim != ndim || view->itemsize != 8 || f[0] == '\0' || f[1] != '\0' ||
        strchr(kinds, f[0]) == NULL) {
        PyErr_Format(PyExc_ValueError, "%s: a C-contiguous %s array of %d dimensions", name,
                     kinds[0] == 'd' ? "float64" : "int64", ndim);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Release the first ``count`` of ``views``. */
static void
release(Py_buffer *views, int count)
{
    for (int i = 0; i < count; i++)
        PyBuffer_Release(&views[i]);
}

/* The loops below are built twice where the compiler and the C library can pick at load time
 * (GCC's target_clones, an ifunc): for AVX2 (4 doubles a step) and for the baseline (2).
 * Neither contracts to fused multiply-adds (-ffp-contract=off; FMA is not in either target). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* Scratch space kept between calls, grown as needed: the scans run under the GIL, one at a
 * time, and a refit's few hundred KB allocated afresh each time may be mapped and faulted in
 * anew. */
static double *scratch = NULL;
static size_t scratch_len = 0;

static double *
get_scratch(size_t len)
{
    if (len > scratch_len) {
        double *grown = realloc(scratch, sizeof(double) * len);
        if (grown == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        scratch = grown;
        scratch_len = len;
    }
    return scratch;
}

/* np.interp's search: the index of the last ``arr[i] <= key`` (-1 below the first, ``len``
 * above the last), trying the neighbours of ``guess`` first. The same comparisons in the same
 * order as numpy's, so it answers the same even where ``arr`` is not sorted (exposure sums a
 * rounding below zero). */
#define IN_CACHE 8
static Py_ssize_t
search(double key, const double *arr, Py_ssize_t len, Py_ssize_t guess)
{
    Py_ssize_t lo = 0, hi = len;
    if (key > arr[len - 1])
        return len;
    if (key < arr[0])
        return -1;
    if (len <= 4) {
        Py_ssize_t i = 1;
        while (i < len && key >= arr[i])
            ++i;
        return i - 1;
    }
    if (guess > len - 3)
        guess = len - 3;
    if (guess < 1)
        guess = 1;
    if (key < arr[guess]) {
        if (key >= arr[guess - 1])
            return guess - 1;
        hi = guess - 1;
        if (guess > IN_CACHE && key >= arr[guess - IN_CACHE])
            lo = guess - IN_CACHE;
    }
    else {
        if (key < arr[guess + 1])
            return guess;
        if (key < arr[guess + 2])
            return guess + 1;
        lo = guess + 2;
        if (guess < len - IN_CACHE - 1 && key < arr[guess + IN_CACHE])
            hi = guess + IN_CACHE;
    }
    while (lo < hi) {
        Py_ssize_t mid = lo + ((hi - lo) >> 1);
        if (key >= arr[mid])
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo - 1;
}

/* events[b, s] += pull_w * r[b, s]: r the local rates (lifescans._local_rates_bm) */
VECTOR_CLONES static int
add_local_rates(double *ev, const double *ex, const double *mean, Py_ssize_t k, Py_ssize_t n,
                double window, double pull_w)
{
    Py_ssize_t rows = k + 1, len = rows * n;
    /* exposure and events in the buckets before each (xc, ec), summed a row at a time (no
     * chain of dependent additions per state); then state-major, exposure offset per state,
     * for the lookup (xp, es) */
    double *xc = get_scratch((size_t)len * 5);
    if (xc == NULL)
        return -1;
    double *ec = xc + len, *xp = ec + len, *es = xp + len, *rate = es + len;
    for (Py_ssize_t s = 0; s < n; s++) {
        xc[s] = 0.0;
        ec[s] = 0.0;
        xc[n + s] = ex[s];
        ec[n + s] = ev[s];
    }
    for (Py_ssize_t b = 1; b < k; b++) {
        const double *restrict xr = xc + b * n, *restrict er = ec + b * n;
        const double *restrict xa = ex + b * n, *restrict ea = ev + b * n;
        double *restrict xw = xc + (b + 1) * n, *restrict ew = ec + (b + 1) * n;
        for (Py_ssize_t s = 0; s < n; s++) {
            xw[s] = xr[s] + xa[s];
            ew[s] = er[s] + ea[s];
        }
    }
    double top = xc[k * n];
    for (Py_ssize_t s = 1; s < n; s++)
        if (xc[k * n + s] > top)
            top = xc[k * n + s];
    double step = top + 1.0;
    for (Py_ssize_t s = 0; s < n; s++) {
        double off = step * (double)s;
        for (Py_ssize_t j = 0; j < rows; j++) {
            xp[s * rows + j] = xc[j * n + s] + off;
            es[s * rows + j] = ec[j * n + s];
        }
    }
    Py_ssize_t guess = 0;
    for (Py_ssize_t s = 0; s < n; s++) {
        double off = step * (double)s;
        const double *x = xc + s, *e = es + s * rows;
        for (Py_ssize_t b = 0; b < k; b++) {
            double back = x[b * n] - window;
            double key = (back > 0.0 ? back : 0.0) + off;
            double at;
            Py_ssize_t j = search(key, xp, len, guess);
            if (j == -1)
                at = es[0];
            else if (j == len || j == len - 1)
                at = es[len - 1];
            else if (xp[j] == key)
                at = es[j];
            else {
                double slope = (es[j + 1] - es[j]) / (xp[j + 1] - xp[j]);
                at = slope * (key - xp[j]) + es[j];
                if (at != at) {
                    at = slope * (key - xp[j + 1]) + es[j + 1];
                    if (at != at && es[j] == es[j + 1])
                        at = es[j];
                }
            }
            guess = j;
            double missing = -back;
            rate[b * n + s] = (e[b] - at) + (missing > 0.0 ? missing : 0.0) * mean[s];
        }
    }
    /* the divisions by the window in a pass of their own (vectorised: a division's latency
     * kept off the lookup's loop) */
    for (Py_ssize_t i = 0; i < k * n; i++)
        ev[i] = ev[i] + pull_w * (rate[i] / window);
    return 0;
}

/* The buffers of ``count`` objects into ``views`` (kinds[i]: 'd' float64, else int64); on
 * failure releases those it got and returns -1. */
static int
get_all(PyObject **objs, Py_buffer *views, const char *const *names, const char *kinds,
        const int *ndims, const int *writable, int count)
{
    for (int i = 0; i < count; i++) {
        const char *kind = kinds[i] == 'd' ? "d" : "lq";
        if (get_array(objs[i], &views[i], ndims[i], writable[i], kind, names[i]) < 0) {
            release(views, i);
            return -1;
        }
    }
    return 0;
}

/* out[b] = in[0] + ... + in[b], for rows b < k of bucket-major ``in`` (np.cumsum's order). */
VECTOR_CLONES static void
accumulate(const double *in, double *out, Py_ssize_t k, Py_ssize_t n)
{
    memcpy(out, in, sizeof(double) * (size_t)n);
    for (Py_ssize_t b = 1; b < k; b++) {
        const double *restrict prev = out + (b - 1) * n, *restrict add = in + b * n;
        double *restrict row = out + b * n;
        for (Py_ssize_t s = 0; s < n; s++)
            row[s] = prev[s] + add[s];
    }
}

static PyObject *
exposure(PyObject *self, PyObject *args)
{
    PyObject *o[9];
    if (!PyArg_ParseTuple(args, "OOOOOOOOO:exposure", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5],
                          &o[6], &o[7], &o[8]))
        return NULL;
    static const char *const names[] = {"xd", "ev", "opened", "done", "openw", "tail", "f",
                                        "expo", "events"};
    static const int ndims[] = {2, 2, 1, 1, 2, 1, 1, 2, 2};
    static const int writable[] = {0, 0, 0, 0, 0, 0, 0, 1, 1};
    Py_buffer v[9];
    if (get_all(o, v, names, "dddiddddd", ndims, writable, 9) < 0)
        return NULL;
    Py_ssize_t n = v[0].shape[0], k = v[0].shape[1] - 1, ring = v[3].shape[0];
    PyObject *out = NULL;
    if (k < 1 || v[1].shape[0] != n || v[1].shape[1] != k || v[2].shape[0] != n ||
        v[4].shape[0] != n || v[4].shape[1] != ring || v[5].shape[0] != n ||
        v[6].shape[0] != k || v[7].shape[0] != k || v[7].shape[1] != n ||
        v[8].shape[0] != k || v[8].shape[1] != n) {
        PyErr_SetString(PyExc_ValueError, "exposure: xd [n, k + 1], ev [n, k], opened, tail "
                        "[n], done [ring], openw [n, ring], f [k], expo and events [k, n]");
        goto done;
    }
    const double *xd = v[0].buf, *ev = v[1].buf, *opened = v[2].buf, *openw = v[4].buf;
    const double *tail = v[5].buf, *f = v[6].buf;
    const int64_t *rows = v[3].buf;
    double *expo = v[7].buf, *events = v[8].buf;
    for (Py_ssize_t j = 0; j < ring; j++) {
        if (rows[j] < 0 || rows[j] > k) {
            PyErr_SetString(PyExc_ValueError, "exposure: done rows in 0 .. k");
            goto done;
        }
    }
    /* the differences bucket-major ([k + 1, n]), summed a row at a time (no chain of
     * dependent additions per state) */
    double *diff = get_scratch((size_t)((k + 1) * n));
    if (diff == NULL)
        goto done;
    for (Py_ssize_t s = 0; s < n; s++)
        for (Py_ssize_t b = 0; b <= k; b++)
            diff[b * n + s] = xd[s * (k + 1) + b];
    for (Py_ssize_t s = 0; s < n; s++)
        diff[s] = diff[s] + opened[s];
    for (Py_ssize_t s = 0; s < n; s++) { /* each element in slot order, as np.subtract.at */
        const double *w = openw + s * ring;
        for (Py_ssize_t j = 0; j < ring; j++)
            diff[rows[j] * n + s] = diff[rows[j] * n + s] - w[j];
    }
    accumulate(diff, expo, k, n);
    for (Py_ssize_t s = 0; s < n; s++)
        expo[(k - 1) * n + s] = expo[(k - 1) * n + s] + tail[s];
    for (Py_ssize_t b = 0; b < k; b++) {
        for (Py_ssize_t s = 0; s < n; s++) {
            expo[b * n + s] = expo[b * n + s] * f[b];
            events[b * n + s] = ev[s * k + b] * f[b];
        }
    }
    out = Py_NewRef(Py_None);
done:
    release(v, 9);
    return out;
}

/* The smoothed hazards into c, from the events pulled towards their targets (c) and the
 * exposure (a): h[b] = a[b] h[b - 1] + c[b] with a = chain / (exposure + prior) and c = events
 * / (exposure + prior), for all b at once: (a, c)[b] := (a, c)[b] after (a, c)[b - d], d
 * doubling (rows from the last down, so row b - d is still the one before this step); then
 * h = a x pooled + c, clipped to [0, 1]. */
VECTOR_CLONES static void
smooth_scan(double *c, double *a, Py_ssize_t k, Py_ssize_t n, double prior, double chain,
            double pooled)
{
    Py_ssize_t len = k * n;
    for (Py_ssize_t i = 0; i < len; i++) {
        double x = a[i] + prior;
        c[i] = c[i] / x;
        a[i] = chain / x;
    }
    for (Py_ssize_t d = 1; d < k; d *= 2) {
        for (Py_ssize_t b = k - 1; b >= d; b--) {
            double *restrict cb = c + b * n, *restrict ab = a + b * n;
            const double *restrict cp = c + (b - d) * n, *restrict ap = a + (b - d) * n;
            for (Py_ssize_t s = 0; s < n; s++) {
                cb[s] = cb[s] + ab[s] * cp[s];
                ab[s] = ab[s] * ap[s];
            }
        }
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        double h = a[i] * pooled + c[i];
        c[i] = h < 0.0 ? 0.0 : (h > 1.0 ? 1.0 : h);
    }
}

static PyObject *
smooth(PyObject *self, PyObject *args)
{
    PyObject *o[3];
    double prior, pooled, pull, window;
    if (!PyArg_ParseTuple(args, "OOOdddd:smooth", &o[0], &o[1], &o[2], &prior, &pooled, &pull,
                          &window))
        return NULL;
    static const char *const names[] = {"events", "expo", "mean"};
    static const int ndims[] = {2, 2, 1};
    static const int writable[] = {1, 1, 0};
    Py_buffer v[3];
    if (get_all(o, v, names, "ddd", ndims, writable, 3) < 0)
        return NULL;
    Py_ssize_t k = v[0].shape[0], n = v[0].shape[1];
    PyObject *out = NULL;
    if (v[1].shape[0] != k || v[1].shape[1] != n || k < 1 ||
        (pull > 0.0 && v[2].shape[0] != n)) {
        PyErr_SetString(PyExc_ValueError, "smooth: events and expo [k, n], mean [n]");
        goto done;
    }
    double *c = v[0].buf, *a = v[1].buf;
    const double *mean = v[2].buf;
    if (pull > 0.0) {
        double pull_w = prior * pull;
        if (window > 0.0) {
            if (add_local_rates(c, a, mean, k, n, window, pull_w) < 0)
                goto done;
        }
        else {
            for (Py_ssize_t b = 0; b < k; b++)
                for (Py_ssize_t s = 0; s < n; s++)
                    c[b * n + s] = c[b * n + s] + pull_w * mean[s];
        }
    }
    smooth_scan(c, a, k, n, prior, prior * (1.0 - pull), pooled);
    out = Py_NewRef(Py_None);
done:
    release(v, 3);
    return out;
}

/* Survival (sv) and expected time held (hd) over the next ``steps`` buckets from each bucket
 * (rows 0 .. k - 1; row k: every window from the last bucket on). Windows of 2m buckets from
 * windows of m: row i takes row i + m as its later half (row k for windows past it); rows in
 * increasing order, row k last, so each reads rows not yet doubled in this step. With
 * ``finish``, sv's rows 0 .. k - 1 become the densities: the chance of a use within the window
 * over the time held. */
VECTOR_CLONES static void
window_scan(const double *h, double *sv, double *hd, Py_ssize_t k, Py_ssize_t n,
            Py_ssize_t steps, int finish)
{
    for (Py_ssize_t i = 0; i < k * n; i++)
        sv[i] = 1.0 - h[i];
    for (Py_ssize_t s = 0; s < n; s++)
        sv[k * n + s] = sv[(k - 1) * n + s];
    for (Py_ssize_t i = 0; i < (k + 1) * n; i++)
        hd[i] = (1.0 + sv[i]) * 0.5;
    for (Py_ssize_t m = 1; m < steps; m *= 2) {
        Py_ssize_t j = k + 1 - m > 0 ? k + 1 - m : 0;
        for (Py_ssize_t i = 0; i <= k; i++) {
            Py_ssize_t later = i < j ? i + m : k;
            double *si = sv + i * n, *hi = hd + i * n;
            const double *sl = sv + later * n, *hl = hd + later * n;
            for (Py_ssize_t s = 0; s < n; s++) {
                double held = si[s] * hl[s] + hi[s];
                si[s] = si[s] * sl[s];
                hi[s] = held;
            }
        }
    }
    if (finish) {
        for (Py_ssize_t i = 0; i < k * n; i++)
            sv[i] = (1.0 - sv[i]) / (hd[i] >= 1e-12 || hd[i] != hd[i] ? hd[i] : 1e-12);
    }
}

static PyObject *
windows(PyObject *self, PyObject *args)
{
    PyObject *o[3];
    Py_ssize_t steps;
    int finish;
    if (!PyArg_ParseTuple(args, "OnOOp:windows", &o[0], &steps, &o[1], &o[2], &finish))
        return NULL;
    static const char *const names[] = {"h", "surv", "held"};
    static const int ndims[] = {2, 2, 2};
    static const int writable[] = {0, 1, 1};
    Py_buffer v[3];
    if (get_all(o, v, names, "ddd", ndims, writable, 3) < 0)
        return NULL;
    Py_ssize_t k = v[0].shape[0], n = v[0].shape[1];
    PyObject *out = NULL;
    if (k < 1 || v[1].shape[0] != k + 1 || v[1].shape[1] != n || v[2].shape[0] != k + 1 ||
        v[2].shape[1] != n) {
        PyErr_SetString(PyExc_ValueError, "windows: h [k, n], surv and held [k + 1, n]");
        goto done;
    }
    window_scan(v[0].buf, v[1].buf, v[2].buf, k, n, steps, finish);
    out = Py_NewRef(Py_None);
done:
    release(v, 3);
    return out;
}

static PyObject *
running_min(PyObject *self, PyObject *args)
{
    PyObject *o[2];
    if (!PyArg_ParseTuple(args, "OO:running_min", &o[0], &o[1]))
        return NULL;
    static const char *const names[] = {"dens", "out"};
    static const int ndims[] = {2, 2};
    static const int writable[] = {0, 1};
    Py_buffer v[2];
    if (get_all(o, v, names, "dd", ndims, writable, 2) < 0)
        return NULL;
    Py_ssize_t k = v[0].shape[0], n = v[0].shape[1];
    PyObject *out = NULL;
    if (k < 1 || v[1].shape[0] != n || v[1].shape[1] != k) {
        PyErr_SetString(PyExc_ValueError, "running_min: dens [k, n], out [n, k]");
        goto done;
    }
    const double *d = v[0].buf;
    double *r = v[1].buf;
    for (Py_ssize_t s = 0; s < n; s++) {
        double low = d[s];
        r[s * k] = low;
        for (Py_ssize_t b = 1; b < k; b++) {
            double x = d[b * n + s];
            if (x < low || x != x)
                low = x;
            r[s * k + b] = low;
        }
    }
    out = Py_NewRef(Py_None);
done:
    release(v, 2);
    return out;
}

static PyObject *
retire(PyObject *self, PyObject *args)
{
    PyObject *o[3];
    Py_ssize_t slot;
    double start;
    if (!PyArg_ParseTuple(args, "OOOnd:retire", &o[0], &o[1], &o[2], &slot, &start))
        return NULL;
    static const char *const names[] = {"open", "old", "old_sb"};
    static const int ndims[] = {2, 1, 1};
    static const int writable[] = {1, 1, 1};
    Py_buffer v[3];
    if (get_all(o, v, names, "ddd", ndims, writable, 3) < 0)
        return NULL;
    Py_ssize_t rows = v[0].shape[0], ring = v[0].shape[1];
    PyObject *out = NULL;
    if (v[1].shape[0] != rows || v[2].shape[0] != rows || slot < 0 || slot >= ring) {
        PyErr_SetString(PyExc_ValueError, "retire: open [n, ring], old and old_sb [n], a slot");
        goto done;
    }
    double *op = v[0].buf, *old = v[1].buf, *old_sb = v[2].buf;
    for (Py_ssize_t s = 0; s < rows; s++) {
        double c = op[s * ring + slot];
        old[s] = old[s] + (c + 0.0);
        old_sb[s] = old_sb[s] + (c * start + 0.0);
        op[s * ring + slot] = 0.0;
    }
    out = Py_NewRef(Py_None);
done:
    release(v, 3);
    return out;
}

static PyMethodDef methods[] = {
    {"retire", retire, METH_VARARGS,
     "retire(open, old, old_sb, slot, start): the open lives of ring slot ``slot`` (start "
     "bucket ``start``) into the old pool (lifescans.retire_slot)."},
    {"exposure", exposure, METH_VARARGS,
     "exposure(xd, ev, opened, done, openw, tail, f, expo, events): the weighted exposure and "
     "events by [bucket, state] into expo and events (lifescans.exposure_bm)."},
    {"smooth", smooth, METH_VARARGS,
     "smooth(events, expo, mean, prior, pooled, mean_pull, window): the smoothed hazards into "
     "events (bucket-major, in place; expo is overwritten); mean: each state's mean rate."},
    {"windows", windows, METH_VARARGS,
     "windows(h, steps, surv, held, finish): survival and expected time held over the next "
     "steps buckets from each bucket, into surv and held ([k + 1, n]; rows 0 .. k - 1 are the "
     "answer); with finish, surv's rows 0 .. k - 1 become the densities."},
    {"running_min", running_min, METH_VARARGS,
     "running_min(dens, out): out[s, b] = min(dens[0 .. b, s]) (dens [k, n], out [n, k])."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_lifescans",
    "The life table's scans in C (kvtier/policy/lifescans.py is the reference).", -1, methods,
};

PyMODINIT_FUNC
PyInit__lifescans(void)
{
    return PyModule_Create(&module);
}
