/* The trainer's check of a received trajectory batch (stages/agent/trajectory.py, wire version 4) in one
 * call: `scan(buf)` accepts exactly the batches `TrajectoryBatch.read`'s Python checks accept and returns
 * what the reader needs, or None for anything else (the reader then runs its Python checks, which name
 * what does not fit). Why compiled: just after a receive every Python step of the read ran at a third of
 * its speed (12-16 us for 2 episodes against 5 us in a loop): the fewer steps there, the closer the
 * batch gets to a raw transfer of its bytes (`snowcat bench transport`). The layout is the Python
 * module's; it checks this module's FIELDS and REVISION at import and does not use a module built from
 * another source (docs/installs.md). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define REVISION 2 /* bump with any change here; trajectory.py expects it */
#define WIRE_VERSION 4
#define N_FIELDS 21
#define H 4 /* magic, version, batch index, field count; then each field's length */
#define HEAD (H + N_FIELDS)
#define HEAD_BYTES (8 * HEAD)
static const int64_t MAGIC = 0x6a617274776f6e73LL; /* b"snowtraj", little-endian */

/* FIELDS in wire order with their bytes per entry (trajectory.py checks that they are its own) */
enum {
    TOKEN_OFFSETS, TURN_OFFSETS, STRING_OFFSETS, ROUTE_WIDTH, SEGMENT, GROUP_ID, ATTEMPT, POLICY_VERSION,
    PROMPT_LEN, REWARD, STATUS, SEGMENT_KIND, SOURCE, TOKEN_IDS, LOSS_MASK, ROLLOUT_LOGPROBS,
    SUPPORT_LENGTHS, SUPPORT_IDS, ROUTES, TURNS, STRINGS
};
static const char *NAMES[N_FIELDS] = {
    "token_offsets", "turn_offsets", "string_offsets", "route_width", "segment", "group_id", "attempt",
    "policy_version", "prompt_len", "reward", "status", "segment_kind", "source", "token_ids", "loss_mask",
    "rollout_logprobs", "support_lengths", "support_ids", "routes", "turns", "strings"};
static const int64_t UNIT[N_FIELDS] = {8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 1, 1, 1, 4, 1, 4, 4, 4, 2, 16, 1};
/* the coded fields (status, segment_kind, source): how many names each has */
static const int CODES[3] = {4, 2, 2};

static inline int64_t word(const char *p) {
    int64_t v;
    memcpy(&v, p, 8); /* any alignment */
    return v;
}

/* the OR of `size` bytes at `p` masked by `mask` (per byte) is not 0 (a loop the compiler vectorises) */
static int any_bits_masked(const char *p, int64_t size, uint64_t mask) {
    uint64_t acc = 0, w;
    int64_t words = size / 8;
    for (int64_t i = 0; i < words; i++) {
        memcpy(&w, p + 8 * i, 8);
        acc |= w;
    }
    for (int64_t i = 8 * words; i < size; i++)
        acc |= (unsigned char)p[i];
    return (acc & mask) != 0;
}

static int any_bits(const char *p, int64_t size) { return any_bits_masked(p, size, ~(uint64_t)0); }

/* the `count` int64 entries at `p` as a list; NULL with no exception set when `offsets` and they are not
 * non-decreasing from 0 to `last` */
static PyObject *int64_list(const char *p, int64_t count, int offsets, int64_t last) {
    if (offsets) {
        int64_t prev = 0;
        if (word(p) != 0 || word(p + 8 * (count - 1)) != last)
            return NULL;
        for (int64_t i = 1; i < count; i++) {
            int64_t v = word(p + 8 * i);
            if (v < prev)
                return NULL;
            prev = v;
        }
    }
    PyObject *out = PyList_New(count);
    if (out == NULL)
        return NULL;
    for (int64_t i = 0; i < count; i++) {
        PyObject *v = PyLong_FromLongLong(word(p + 8 * i));
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* 1 if the batch in `p[0:size]` is one the Python checks accept (filling `len` and `at`), else 0 */
static int fits(const char *p, int64_t size, int64_t *len, int64_t *at) {
    if (size < HEAD_BYTES || word(p) != MAGIC || word(p + 8) != WIRE_VERSION || word(p + 24) != N_FIELDS)
        return 0;
    int64_t end = HEAD_BYTES;
    for (int i = 0; i < N_FIELDS; i++) {
        len[i] = word(p + 8 * (H + i));
        if (len[i] < 0 || len[i] > size) /* (bounds every product below) */
            return 0;
        at[i] = end;
        end += (len[i] * UNIT[i] + 7) & ~(int64_t)7;
    }
    int64_t n = len[TOKEN_OFFSETS] - 1, tokens = len[TOKEN_IDS];
    if (end != size || n < 0 || len[TURN_OFFSETS] != n + 1 || len[STRING_OFFSETS] != 3 * n + 1)
        return 0;
    for (int i = ROUTE_WIDTH; i < TOKEN_IDS; i++)
        if (len[i] != n)
            return 0;
    if (len[LOSS_MASK] != tokens || len[ROLLOUT_LOGPROBS] != tokens || len[SUPPORT_LENGTHS] != tokens)
        return 0;

    /* support lengths: each >= 0, adding up to the support ids; none at all (the common case): all 0 */
    if (len[SUPPORT_IDS] == 0) {
        if (any_bits(p + at[SUPPORT_LENGTHS], 4 * tokens))
            return 0;
    } else {
        int64_t support = 0;
        for (int64_t i = 0; i < tokens; i++) {
            int32_t s;
            memcpy(&s, p + at[SUPPORT_LENGTHS] + 4 * i, 4);
            if (s < 0 || __builtin_add_overflow(support, (int64_t)s, &support))
                return 0;
        }
        if (support != len[SUPPORT_IDS])
            return 0;
    }

    /* route widths: each >= 0, each record's tokens x its width adding up to the routes entries */
    int64_t routes = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t w = word(p + at[ROUTE_WIDTH] + 8 * i), lo = word(p + at[TOKEN_OFFSETS] + 8 * i);
        int64_t hi = word(p + at[TOKEN_OFFSETS] + 8 * (i + 1)), tokens_i, part;
        if (w < 0 || hi < lo || __builtin_sub_overflow(hi, lo, &tokens_i) || __builtin_mul_overflow(tokens_i, w, &part) ||
            __builtin_add_overflow(routes, part, &routes))
            return 0; /* (offsets out of order or out of range fail their own check: the lists below) */
    }
    if (routes != len[ROUTES])
        return 0;

    /* each code within its names (the padding after them is not read) */
    for (int c = 0; c < 3; c++) {
        const unsigned char *q = (const unsigned char *)p + at[STATUS + c];
        for (int64_t i = 0; i < n; i++)
            if (q[i] >= CODES[c])
                return 0;
    }
    /* segments: each record segment 0 of its episode or the one after the record before it */
    for (int64_t j = 0; j < n; j++) {
        int64_t s = word(p + at[SEGMENT] + 8 * j);
        if (s != 0 && (j == 0 || s != word(p + at[SEGMENT] + 8 * (j - 1)) + 1))
            return 0;
    }
    return 1;
}

/* scan(buf) -> (head, token_offsets, turn_offsets, string_offsets, route_width, segment, starts, text)
 * or None. `starts`: each episode's first record and n, None when no record is past segment 0; `text`:
 * the strings as one str when ASCII, None otherwise (the reader decodes them string by string). */
static PyObject *scan(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    const char *p = view.buf;
    int64_t len[N_FIELDS], at[N_FIELDS];
    PyObject *out = NULL, *head = NULL, *lists[5] = {NULL}, *starts = NULL, *text = NULL;
    if (!fits(p, view.len, len, at)) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    int64_t n = len[TOKEN_OFFSETS] - 1;
    const int64_t last[5] = {len[TOKEN_IDS], len[TURNS], len[STRINGS], 0, 0};
    head = PyTuple_New(HEAD);
    if (head == NULL)
        goto done;
    for (int i = 0; i < HEAD; i++) {
        PyObject *v = PyLong_FromLongLong(word(p + 8 * i));
        if (v == NULL)
            goto done;
        PyTuple_SET_ITEM(head, i, v);
    }
    for (int k = 0; k < 5; k++) {
        lists[k] = int64_list(p + at[k], len[k], k < 3, last[k]);
        if (lists[k] == NULL) {
            if (!PyErr_Occurred()) { /* offsets out of order: not a batch the reader accepts */
                Py_INCREF(Py_None);
                out = Py_None;
            }
            goto done;
        }
    }
    int any = 0;
    for (int64_t j = 0; j < n && !any; j++)
        any = word(p + at[SEGMENT] + 8 * j) != 0;
    if (any) {
        starts = PyList_New(0);
        if (starts == NULL)
            goto done;
        for (int64_t j = 0; j <= n; j++) {
            if (j < n && word(p + at[SEGMENT] + 8 * j) != 0)
                continue;
            PyObject *v = PyLong_FromLongLong(j);
            if (v == NULL || PyList_Append(starts, v) < 0) {
                Py_XDECREF(v);
                goto done;
            }
            Py_DECREF(v);
        }
    } else {
        Py_INCREF(Py_None);
        starts = Py_None;
    }
    if (!any_bits_masked(p + at[STRINGS], len[STRINGS], 0x8080808080808080ULL)) { /* ASCII */
        text = PyUnicode_DecodeASCII(p + at[STRINGS], len[STRINGS], NULL);
        if (text == NULL)
            goto done;
    } else {
        Py_INCREF(Py_None);
        text = Py_None;
    }
    out = PyTuple_Pack(8, head, lists[0], lists[1], lists[2], lists[3], lists[4], starts, text);
done:
    Py_XDECREF(head);
    for (int k = 0; k < 5; k++)
        Py_XDECREF(lists[k]);
    Py_XDECREF(starts);
    Py_XDECREF(text);
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_O, "The checked parts of a trajectory batch's message, or None (see _wire.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wire", NULL, -1, methods};

PyMODINIT_FUNC PyInit__wire(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *fields = PyTuple_New(N_FIELDS);
    if (fields == NULL)
        goto fail;
    for (int i = 0; i < N_FIELDS; i++) {
        PyObject *f = Py_BuildValue("(sL)", NAMES[i], (long long)UNIT[i]);
        if (f == NULL) {
            Py_DECREF(fields);
            goto fail;
        }
        PyTuple_SET_ITEM(fields, i, f);
    }
    if (PyModule_AddObject(m, "FIELDS", fields) < 0) {
        Py_DECREF(fields);
        goto fail;
    }
    if (PyModule_AddIntConstant(m, "REVISION", REVISION) < 0 || PyModule_AddObject(m, "MAGIC", PyLong_FromLongLong(MAGIC)) < 0 || PyModule_AddIntConstant(m, "WIRE_VERSION", WIRE_VERSION) < 0 ||
        PyModule_AddObject(m, "CODES", Py_BuildValue("(iii)", CODES[0], CODES[1], CODES[2])) < 0)
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
