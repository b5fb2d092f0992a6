/* The divergence check's shared-memory board (comm/divergence.py's _Board), compiled: a check's
 * post and verdict are a few loads and stores, but run as Python right after a 1 MiB copy has
 * evicted the interpreter's caches they cost ~1.4 us each, about 2 % of a 1 MiB redistribute
 * at 2 ranks (issue 23 item 12); here ~0.5 and ~0.9 us (the verdict reads the other ranks'
 * cache lines). The rules are _Board._post and
 * _Board._verdict's, word for word (tests/test_divergence.py runs one test on both): a word is
 * the fingerprint's low 48 bits above the check's number mod 2**16; the same number decides,
 * the next means agreed, the previous means not yet posted. The stores and loads are atomic
 * (release/acquire): one aligned 64-bit access, never torn. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define COUNT_MASK 0xFFFFu

typedef struct {
    PyObject_HEAD
    Py_buffer view;       /* the window's words (kept for the board's life) */
    uint64_t *words;
    Py_ssize_t me;
    Py_ssize_t nothers;
    Py_ssize_t *others;
    uint64_t count;
    uint64_t mine;
} Board;

static void Board_dealloc(Board *self) {
    if (self->words) PyBuffer_Release(&self->view);
    PyMem_Free(self->others);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Board_init(Board *self, PyObject *args, PyObject *kwds) {
    PyObject *buffer, *others;
    Py_ssize_t me;
    unsigned long long count, mine;
    if (!PyArg_ParseTuple(args, "OnOKK", &buffer, &me, &others, &count, &mine)) return -1;
    if (self->words) { PyErr_SetString(PyExc_RuntimeError, "Board is already initialized"); return -1; }
    if (PyObject_GetBuffer(buffer, &self->view, PyBUF_WRITABLE) < 0) return -1;
    self->words = (uint64_t *)self->view.buf;
    Py_ssize_t n = self->view.len / 8;
    PyObject *seq = PySequence_Fast(others, "others: a sequence of word indices");
    if (!seq) return -1;
    self->nothers = PySequence_Fast_GET_SIZE(seq);
    self->others = PyMem_Calloc(self->nothers ? self->nothers : 1, sizeof(Py_ssize_t));
    if (!self->others) { Py_DECREF(seq); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < self->nothers; i++) {
        Py_ssize_t at = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i));
        if (at < 0 || at >= n) { Py_DECREF(seq); PyErr_SetString(PyExc_IndexError, "word index outside the board"); return -1; }
        self->others[i] = at;
    }
    Py_DECREF(seq);
    if (me < 0 || me >= n) { PyErr_SetString(PyExc_IndexError, "word index outside the board"); return -1; }
    self->me = me;
    self->count = count;
    self->mine = mine;
    return 0;
}

static PyObject *Board_post(Board *self, PyObject *fp) {
    uint64_t f = PyLong_AsUnsignedLongLongMask(fp);
    if (f == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    self->mine = (f << 16) | (self->count & COUNT_MASK);
    self->count += 1;
    __atomic_store_n(&self->words[self->me], self->mine, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *Board_verdict(Board *self, PyObject *unused) {
    uint64_t mine = self->mine, number = mine & COUNT_MASK;
    int pending = 0;
    for (Py_ssize_t i = 0; i < self->nothers; i++) {
        uint64_t word = __atomic_load_n(&self->words[self->others[i]], __ATOMIC_ACQUIRE);
        if (word == mine || (word & COUNT_MASK) == ((number + 1) & COUNT_MASK)) continue;
        if ((word & COUNT_MASK) == ((number - 1) & COUNT_MASK)) { pending = 1; continue; }
        Py_RETURN_FALSE;
    }
    if (pending) Py_RETURN_NONE;
    Py_RETURN_TRUE;
}

static PyMethodDef Board_methods[] = {
    {"post", (PyCFunction)Board_post, METH_O, "Post this rank's word for its next check (the fingerprint's low 48 bits above the check's number)."},
    {"verdict", (PyCFunction)Board_verdict, METH_NOARGS, "True: every rank posted this word or moved past it; False: some rank posted another; None: some rank has not posted."},
    {NULL}
};

static PyObject *Board_get_count(Board *self, void *c) { return PyLong_FromUnsignedLongLong(self->count); }
static PyObject *Board_get_mine(Board *self, void *c) { return PyLong_FromUnsignedLongLong(self->mine); }
static PyGetSetDef Board_getset[] = {
    {"count", (getter)Board_get_count, NULL, "checks posted", NULL},
    {"mine", (getter)Board_get_mine, NULL, "this rank's last word", NULL},
    {NULL}
};

static PyTypeObject BoardType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dtorch_mpi.comm._board.Board",
    .tp_basicsize = sizeof(Board),
    .tp_dealloc = (destructor)Board_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Board(buffer, me, others, count, mine): the post and verdict of comm/divergence.py's _Board, compiled.",
    .tp_methods = Board_methods,
    .tp_getset = Board_getset,
    .tp_init = (initproc)Board_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_board", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__board(void) {
    if (PyType_Ready(&BoardType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&BoardType);
    if (PyModule_AddObject(m, "Board", (PyObject *)&BoardType) < 0) { Py_DECREF(&BoardType); Py_DECREF(m); return NULL; }
    return m;
}
