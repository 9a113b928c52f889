/* kvflow.router._blockmap: block hash -> worker bitmask, compiled.
 *
 * One open-addressing table of (u64 block hash, u64 worker mask) entries with
 * linear probing and backward-shift deletion: an entry exists iff its mask is
 * non-zero, so there are no tombstones. Up to 64 workers per map (bit b is
 * worker slot b); kvflow.router.index keeps one map per 64 workers and tier.
 *
 * Why compiled: a lookup walks the prompt's chained block hashes once for
 * all workers and stops when no worker holds the prefix any more; in Python
 * every step costs an int object and a dict probe, here a multiply and one
 * cache line. The pure-Python twin, kvflow.router._blockmap_py, has the same
 * interface and semantics and is used when this module is not built.
 *
 * Hashes come as a sequence of Python ints, or as a C-contiguous buffer of
 * native unsigned 64-bit integers (a memoryview cast to 'Q', array('Q'), a
 * numpy uint64 array): the binary kv-events decoder hands the record's own
 * bytes over that way, so no int object is made per block.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MIN_CAP 64
#define CHUNK 256 /* keys converted per batch (stack buffer) */
#define MATCH_AHEAD 4
#define AHEAD 8   /* prefetch distance in keys: enough misses in flight to hide DRAM latency */
#define FIB 0x9E3779B97F4A7C15ULL /* 2^64 / golden ratio (Knuth, TAOCP vol. 3, 6.4) */

typedef struct {
    uint64_t key;
    uint64_t mask; /* 0 = empty slot */
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *table;
    uint64_t cap;   /* power of two */
    int shift;      /* 64 - log2(cap) */
    uint64_t used;  /* occupied slots */
    Py_ssize_t counts[64];
} BlockMap;

static inline uint64_t slot_of(const BlockMap *m, uint64_t key) {
    return (key * FIB) >> m->shift;
}

static int alloc_table(BlockMap *m, uint64_t cap) {
    Entry *t = PyMem_Calloc((size_t)cap, sizeof(Entry));
    if (t == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    m->table = t;
    m->cap = cap;
    int bits = 0;
    while (((uint64_t)1 << bits) < cap) bits++;
    m->shift = 64 - bits;
    return 0;
}

/* Re-insert every live entry into a fresh table of `cap` slots. */
static int rehash(BlockMap *m, uint64_t cap) {
    Entry *old = m->table;
    uint64_t old_cap = m->cap;
    if (alloc_table(m, cap) < 0) {
        m->table = old;
        m->cap = old_cap;
        return -1;
    }
    uint64_t mask = cap - 1;
    for (uint64_t i = 0; i < old_cap; i++) {
        if (old[i].mask) {
            uint64_t j = slot_of(m, old[i].key);
            while (m->table[j].mask) j = (j + 1) & mask;
            m->table[j] = old[i];
        }
    }
    PyMem_Free(old);
    return 0;
}

static inline uint64_t lookup(const BlockMap *m, uint64_t key) {
    uint64_t mask = m->cap - 1;
    uint64_t i = slot_of(m, key);
    for (;;) {
        const Entry *e = &m->table[i];
        if (!e->mask) return 0;
        if (e->key == key) return e->mask;
        i = (i + 1) & mask;
    }
}

/* Remove the entry at slot i, shifting later entries of its probe run back. */
static void delete_at(BlockMap *m, uint64_t i) {
    uint64_t mask = m->cap - 1;
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!m->table[j].mask) break;
        uint64_t k = slot_of(m, m->table[j].key);
        /* The entry at j may move to i unless its home k lies cyclically in (i, j]. */
        int stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            m->table[i] = m->table[j];
            i = j;
        }
    }
    m->table[i].mask = 0;
    m->used--;
}

static int to_key(PyObject *obj, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError) || PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "block hash must be an int in [0, 2**64), got %R", obj);
        }
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

/* Hashes given to a method: a sequence of ints, or a buffer of native u64. */
typedef struct {
    PyObject *fast;          /* sequence path: a new reference from PySequence_Fast */
    PyObject **items;
    Py_buffer view;          /* buffer path: view.obj != NULL */
    const unsigned char *raw;
    Py_ssize_t n;
} Keys;

/* A buffer format naming a native unsigned 64-bit integer ("Q", "=Q", "@Q",
   "<Q" on a little-endian host, ">Q" on a big-endian one; "L" where long is
   64-bit). */
static int is_native_u64(const char *fmt, Py_ssize_t itemsize) {
    if (itemsize != 8 || fmt == NULL) return 0;
    if (*fmt == '@' || *fmt == '=') fmt++;
#if PY_LITTLE_ENDIAN
    else if (*fmt == '<') fmt++;
#else
    else if (*fmt == '>') fmt++;
#endif
    return (fmt[0] == 'Q' || fmt[0] == 'L') && fmt[1] == '\0';
}

/* Convert `len` Python ints to keys; ValueError (as to_key) on the first bad one. */
static int convert_keys(PyObject **items, Py_ssize_t len, uint64_t *keys) {
    for (Py_ssize_t k = 0; k < len; k++)
        if (to_key(items[k], &keys[k]) < 0) return -1;
    return 0;
}

/* Open ``seq`` as keys. With ``validate``, every int is checked before
   anything changes (all or nothing); a buffer of u64 needs no check. */
static int keys_open(PyObject *seq, Keys *k, int validate) {
    memset(k, 0, sizeof(*k));
    if (!PyList_Check(seq) && !PyTuple_Check(seq) && PyObject_CheckBuffer(seq)) {
        if (PyObject_GetBuffer(seq, &k->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
            if (k->view.ndim == 1 && is_native_u64(k->view.format, k->view.itemsize)) {
                k->raw = (const unsigned char *)k->view.buf;
                k->n = k->view.len / 8;
                return 0;
            }
            PyBuffer_Release(&k->view);
        } else {
            PyErr_Clear();  /* not contiguous: read it as a sequence */
        }
        k->view.obj = NULL;
    }
    k->fast = PySequence_Fast(seq, "hashes must be a sequence");
    if (!k->fast) return -1;
    k->items = PySequence_Fast_ITEMS(k->fast);
    k->n = PySequence_Fast_GET_SIZE(k->fast);
    if (validate) {
        uint64_t key;
        for (Py_ssize_t i = 0; i < k->n; i++)
            if (to_key(k->items[i], &key) < 0) {
                Py_CLEAR(k->fast);
                return -1;
            }
    }
    return 0;
}

/* Keys base..base+len-1 into ``out``. */
static int keys_fill(const Keys *k, Py_ssize_t base, Py_ssize_t len, uint64_t *out) {
    if (k->raw) {
        memcpy(out, k->raw + (size_t)base * 8, (size_t)len * 8);
        return 0;
    }
    return convert_keys(k->items + base, len, out);
}

static void keys_close(Keys *k) {
    if (k->view.obj) PyBuffer_Release(&k->view);
    Py_CLEAR(k->fast);
}

static int parse_bit(PyObject *obj, int *bit) {
    long b = PyLong_AsLong(obj);
    if (b == -1 && PyErr_Occurred()) return -1;
    if (b < 0 || b > 63) {
        PyErr_Format(PyExc_ValueError, "worker bit must be in [0, 63], got %ld", b);
        return -1;
    }
    *bit = (int)b;
    return 0;
}

/* Parse ``(bit, hashes)`` and open the hashes, every one checked, so a
   mutation that follows is all or nothing. */
static int bit_and_keys(PyObject *args, const char *format, int *bit, Keys *keys) {
    PyObject *bit_obj, *seq;
    if (!PyArg_ParseTuple(args, format, &bit_obj, &seq)) return -1;
    if (parse_bit(bit_obj, bit) < 0) return -1;
    return keys_open(seq, keys, 1);
}

static PyObject *bm_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, ":BlockMap", kwlist)) return NULL;
    BlockMap *m = (BlockMap *)type->tp_alloc(type, 0);
    if (!m) return NULL;
    if (alloc_table(m, MIN_CAP) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return (PyObject *)m;
}

static void bm_dealloc(BlockMap *m) {
    PyMem_Free(m->table);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

PyDoc_STRVAR(store_doc,
"store(bit, hashes) -> int\n\n"
"Mark the worker of slot ``bit`` (0..63) as holding every hash of\n"
"``hashes``: a sequence of ints in [0, 2**64), or a C-contiguous buffer\n"
"of native unsigned 64-bit integers (format 'Q'). Idempotent per hash.\n"
"Returns how many hashes were new for that worker. Raises ValueError for\n"
"a bit or hash out of range, and then changes nothing.");

static PyObject *bm_store(BlockMap *m, PyObject *args) {
    int bit;
    Keys src;
    if (bit_and_keys(args, "OO:store", &bit, &src) < 0) return NULL;
    Py_ssize_t n = src.n;
    uint64_t bitmask = (uint64_t)1 << bit;
    Py_ssize_t added = 0;
    uint64_t keys[CHUNK];
    for (Py_ssize_t base = 0; base < n; base += CHUNK) {
        Py_ssize_t len = n - base < CHUNK ? n - base : CHUNK;
        if (keys_fill(&src, base, len, keys) < 0) goto fail;
        /* Grow once per chunk so prefetched slots stay valid while inserting. */
        while ((m->used + (uint64_t)len) * 10 > m->cap * 7)
            if (rehash(m, m->cap * 2) < 0) goto fail;
        uint64_t tmask = m->cap - 1;
        for (Py_ssize_t k = 0; k < len; k++) {
            if (k + AHEAD < len) __builtin_prefetch(&m->table[slot_of(m, keys[k + AHEAD])], 1);
            uint64_t key = keys[k];
            uint64_t i = slot_of(m, key);
            for (;;) {
                Entry *e = &m->table[i];
                if (!e->mask) {
                    e->key = key;
                    e->mask = bitmask;
                    m->used++;
                    added++;
                    break;
                }
                if (e->key == key) {
                    if (!(e->mask & bitmask)) {
                        e->mask |= bitmask;
                        added++;
                    }
                    break;
                }
                i = (i + 1) & tmask;
            }
        }
    }
    keys_close(&src);
    m->counts[bit] += added;
    return PyLong_FromSsize_t(added);
fail:
    keys_close(&src);
    m->counts[bit] += added;
    return NULL;
}

static void maybe_shrink(BlockMap *m) {
    /* Below 10% load, halve down to at most 30% load, so a drained map gives
       memory back; growth happens at 70%, so the two never oscillate. */
    uint64_t cap = m->cap;
    while (cap > MIN_CAP && m->used * 10 <= (cap / 2) * 3) cap /= 2;
    if (cap != m->cap && rehash(m, cap) < 0) PyErr_Clear(); /* shrinking is optional */
}

PyDoc_STRVAR(remove_doc,
"remove(bit, hashes) -> int\n\n"
"Mark the worker of slot ``bit`` as no longer holding the hashes in\n"
"``hashes`` (ints, or a buffer of native u64 as for store); hashes it\n"
"does not hold are ignored. Returns how many were\n"
"removed. Raises ValueError for a bit or hash out of range, and then\n"
"changes nothing.");

static PyObject *bm_remove(BlockMap *m, PyObject *args) {
    int bit;
    Keys src;
    if (bit_and_keys(args, "OO:remove", &bit, &src) < 0) return NULL;
    Py_ssize_t n = src.n;
    uint64_t bitmask = (uint64_t)1 << bit;
    Py_ssize_t removed = 0;
    uint64_t tmask = m->cap - 1;
    uint64_t keys[CHUNK];
    for (Py_ssize_t base = 0; base < n; base += CHUNK) {
        Py_ssize_t len = n - base < CHUNK ? n - base : CHUNK;
        if (keys_fill(&src, base, len, keys) < 0) {
            keys_close(&src);
            m->counts[bit] -= removed;
            return NULL;
        }
        for (Py_ssize_t k = 0; k < len; k++) {
            if (k + AHEAD < len) __builtin_prefetch(&m->table[slot_of(m, keys[k + AHEAD])], 1);
            uint64_t key = keys[k];
            uint64_t i = slot_of(m, key);
            for (;;) {
                Entry *e = &m->table[i];
                if (!e->mask) break;
                if (e->key == key) {
                    if (e->mask & bitmask) {
                        removed++;
                        e->mask &= ~bitmask;
                        if (!e->mask) delete_at(m, i);
                    }
                    break;
                }
                i = (i + 1) & tmask;
            }
        }
    }
    keys_close(&src);
    m->counts[bit] -= removed;
    if (m->used * 10 < m->cap) maybe_shrink(m);
    return PyLong_FromSsize_t(removed);
}

PyDoc_STRVAR(clear_doc,
"clear(bit) -> int\n\n"
"Drop every hash of the worker of slot ``bit``; returns how many. O(table).");

static PyObject *bm_clear(BlockMap *m, PyObject *bit_obj) {
    int bit;
    if (parse_bit(bit_obj, &bit) < 0) return NULL;
    Py_ssize_t had = m->counts[bit];
    if (!had) return PyLong_FromLong(0);
    uint64_t bitmask = (uint64_t)1 << bit;
    uint64_t emptied = 0;
    for (uint64_t i = 0; i < m->cap; i++) {
        if (m->table[i].mask & bitmask) {
            m->table[i].mask &= ~bitmask;
            if (!m->table[i].mask) emptied++;
        }
    }
    m->counts[bit] = 0;
    if (emptied) {
        /* Emptied slots broke probe runs: rebuild from the live entries. */
        m->used -= emptied;
        uint64_t cap = MIN_CAP;
        while ((m->used + 1) * 10 > cap * 7) cap *= 2;
        if (rehash(m, cap) < 0) return NULL;
    }
    return PyLong_FromSsize_t(had);
}

PyDoc_STRVAR(get_doc, "get(hash) -> int\n\nThe mask of workers holding ``hash`` (0 if none).");

static PyObject *bm_get(BlockMap *m, PyObject *obj) {
    uint64_t key;
    if (to_key(obj, &key) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(lookup(m, key));
}

PyDoc_STRVAR(count_doc, "count(bit) -> int\n\nHashes held by the worker of slot ``bit``.");

static PyObject *bm_count(BlockMap *m, PyObject *bit_obj) {
    int bit;
    if (parse_bit(bit_obj, &bit) < 0) return NULL;
    return PyLong_FromSsize_t(m->counts[bit]);
}

PyDoc_STRVAR(hashes_doc, "hashes(bit) -> list[int]\n\nThe hashes held by the worker of slot ``bit``, unordered.");

static PyObject *bm_hashes(BlockMap *m, PyObject *bit_obj) {
    int bit;
    if (parse_bit(bit_obj, &bit) < 0) return NULL;
    uint64_t bitmask = (uint64_t)1 << bit;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (uint64_t i = 0; i < m->cap; i++) {
        if (m->table[i].mask & bitmask) {
            PyObject *v = PyLong_FromUnsignedLongLong(m->table[i].key);
            if (!v || PyList_Append(out, v) < 0) {
                Py_XDECREF(v);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(v);
        }
    }
    return out;
}

static int set_overlap(PyObject *out, PyObject *names, uint64_t bits, Py_ssize_t depth) {
    PyObject *d = NULL;
    Py_ssize_t n_names = PyList_GET_SIZE(names);
    while (bits) {
        int b = __builtin_ctzll(bits);
        bits &= bits - 1;
        if (b >= n_names) continue;
        PyObject *name = PyList_GET_ITEM(names, b);
        if (name == Py_None) continue;
        if (!d && !(d = PyLong_FromSsize_t(depth))) return -1;
        if (PyDict_SetItem(out, name, d) < 0) {
            Py_DECREF(d);
            return -1;
        }
    }
    Py_XDECREF(d);
    return 0;
}

PyDoc_STRVAR(match_doc,
"match(hashes, names, out) -> None\n\n"
"Walk the chained sequence hashes ``hashes`` (ints, or a buffer of\n"
"native u64 as for store) from block 0 and, for every\n"
"worker slot b holding a non-empty leading run of them, set\n"
"``out[names[b]] = run length`` (blocks). ``names`` is a list of worker\n"
"ids by slot (None or a short list skips a slot); ``out`` a dict, updated\n"
"in place. The walk stops at the first block no still-matching worker\n"
"holds, so it costs one probe per block of the longest match, plus one.\n"
"Raises ValueError for a hash out of range, TypeError for bad arguments.");

static PyObject *bm_match(BlockMap *m, PyObject *args) {
    PyObject *seq, *names, *out;
    if (!PyArg_ParseTuple(args, "OO!O!:match", &seq, &PyList_Type, &names, &PyDict_Type, &out)) return NULL;
    Keys src;
    if (keys_open(seq, &src, 0) < 0) return NULL;
    Py_ssize_t n = src.n;
    uint64_t running = ~(uint64_t)0;
    uint64_t keys[CHUNK];
    Py_ssize_t i = 0;
    for (Py_ssize_t base = 0; base < n && running; base += CHUNK) {
        Py_ssize_t len = n - base < CHUNK ? n - base : CHUNK;
        if (keys_fill(&src, base, len, keys) < 0) goto fail;
        for (Py_ssize_t k = 0; k < len && running; k++) {
            /* A short lookahead: the walk usually stops within a few blocks. */
            if (k + MATCH_AHEAD < len) __builtin_prefetch(&m->table[slot_of(m, keys[k + MATCH_AHEAD])], 0);
            i = base + k;
            uint64_t now = lookup(m, keys[k]) & running;
            if (now != running) {
                if (i > 0 && set_overlap(out, names, running & ~now, i) < 0) goto fail;
                running = now;
            }
        }
    }
    if (running && n > 0 && set_overlap(out, names, running, n) < 0) goto fail;
    keys_close(&src);
    Py_RETURN_NONE;
fail:
    keys_close(&src);
    return NULL;
}

static Py_ssize_t bm_len(BlockMap *m) { return (Py_ssize_t)m->used; }

static PyObject *bm_sizeof(BlockMap *m, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromSize_t(sizeof(BlockMap) + (size_t)m->cap * sizeof(Entry));
}

static PyMethodDef bm_methods[] = {
    {"store", (PyCFunction)bm_store, METH_VARARGS, store_doc},
    {"remove", (PyCFunction)bm_remove, METH_VARARGS, remove_doc},
    {"clear", (PyCFunction)bm_clear, METH_O, clear_doc},
    {"get", (PyCFunction)bm_get, METH_O, get_doc},
    {"count", (PyCFunction)bm_count, METH_O, count_doc},
    {"hashes", (PyCFunction)bm_hashes, METH_O, hashes_doc},
    {"match", (PyCFunction)bm_match, METH_VARARGS, match_doc},
    {"__sizeof__", (PyCFunction)bm_sizeof, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods bm_as_sequence = {
    .sq_length = (lenfunc)bm_len,
};

PyDoc_STRVAR(bm_doc,
"BlockMap()\n\n"
"Block hash -> bitmask of up to 64 worker slots holding it. Compiled\n"
"twin of kvflow.router._blockmap_py.BlockMap; len() is the number of\n"
"distinct hashes held by any slot.");

static PyTypeObject BlockMapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvflow.router._blockmap.BlockMap",
    .tp_basicsize = sizeof(BlockMap),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = bm_doc,
    .tp_new = bm_new,
    .tp_dealloc = (destructor)bm_dealloc,
    .tp_methods = bm_methods,
    .tp_as_sequence = &bm_as_sequence,
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_blockmap", "Compiled block hash -> worker bitmask map (see BlockMap).", -1, NULL,
};

PyMODINIT_FUNC PyInit__blockmap(void) {
    if (PyType_Ready(&BlockMapType) < 0) return NULL;
    PyObject *mod = PyModule_Create(&moduledef);
    if (!mod) return NULL;
    Py_INCREF(&BlockMapType);
    if (PyModule_AddObject(mod, "BlockMap", (PyObject *)&BlockMapType) < 0) {
        Py_DECREF(&BlockMapType);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
