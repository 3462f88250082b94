// read_raw_batch and its msgpack integer-array reader (see raw_batch.h).
#include "raw_batch.h"

namespace kvnative {

namespace {

inline u64 be(const uint8_t* p, size_t n) {
    u64 v = 0;
    for (size_t i = 0; i < n; ++i) v = (v << 8) | p[i];
    return v;
}

// One integer (or, for hashes, a bin digest) at p; advances p.  msgpack: positive fixint 0x00-0x7f,
// negative fixint 0xe0-0xff, uint8..64 0xcc-0xcf, int8..64 0xd0-0xd3, bin8/16/32 0xc4-0xc6.
inline bool read_one(const uint8_t*& p, const uint8_t* end, bool hashes, u64& out) {
    if (p >= end) return false;
    uint8_t b = *p++;
    if (b <= 0x7f) {
        out = b;
        return true;
    }
    if (b >= 0xe0) {  // -32..-1
        if (!hashes) return false;
        out = (u64)(int64_t)(int8_t)b;
        return true;
    }
    size_t n;
    bool sgn;
    switch (b) {
        case 0xcc: n = 1; sgn = false; break;
        case 0xcd: n = 2; sgn = false; break;
        case 0xce: n = 4; sgn = false; break;
        case 0xcf: n = 8; sgn = false; break;
        case 0xd0: n = 1; sgn = true; break;
        case 0xd1: n = 2; sgn = true; break;
        case 0xd2: n = 4; sgn = true; break;
        case 0xd3: n = 8; sgn = true; break;
        case 0xc4: case 0xc5: case 0xc6: {
            if (!hashes) return false;
            size_t ln = b == 0xc4 ? 1 : b == 0xc5 ? 2 : 4;
            if ((size_t)(end - p) < ln) return false;
            size_t len = (size_t)be(p, ln);
            p += ln;
            if (len == 0 || (size_t)(end - p) < len) return false;  // an empty digest is not a hash
            size_t k = len < 8 ? len : 8;
            out = be(p + len - k, k);
            p += len;
            return true;
        }
        default: return false;
    }
    if ((size_t)(end - p) < n) return false;
    u64 v = be(p, n);
    p += n;
    if (sgn) {
        int shift = 64 - 8 * (int)n;
        int64_t s = shift ? (int64_t)(v << shift) >> shift : (int64_t)v;
        if (s < 0 && !hashes) return false;  // a negative token id
        v = (u64)s;
    }
    out = v;
    return true;
}

}  // namespace

bool read_msgpack_u64s(const uint8_t* p, const uint8_t* end, bool hashes, std::vector<u64>& out) {
    const uint8_t* q = read_msgpack_u64s_at(p, end, hashes, out);
    return q != nullptr && q == end;
}

const uint8_t* read_msgpack_u64s_at(const uint8_t* p, const uint8_t* end, bool hashes, std::vector<u64>& out) {
    if (p >= end) return nullptr;
    uint8_t b = *p++;
    size_t n;
    if ((b & 0xf0) == 0x90) {
        n = b & 0x0f;
    } else if (b == 0xdc || b == 0xdd) {
        size_t ln = b == 0xdc ? 2 : 4;
        if ((size_t)(end - p) < ln) return nullptr;
        n = (size_t)be(p, ln);
        p += ln;
    } else {
        return nullptr;
    }
    if (n > (size_t)(end - p)) return nullptr;  // every element takes at least one byte
    size_t base = out.size();
    out.resize(base + n);
    u64* dst = out.data() + base;
    for (size_t i = 0; i < n; ++i) {
        // the forms engines write most (fixint, uint16, uint32, uint64) inline; the rest in read_one
        size_t left = (size_t)(end - p);
        if (left >= 1 && *p <= 0x7f) {
            dst[i] = *p++;
        } else if (left >= 3 && *p == 0xcd) {
            dst[i] = ((u64)p[1] << 8) | p[2];
            p += 3;
        } else if (left >= 5 && *p == 0xce) {
            uint32_t v;
            std::memcpy(&v, p + 1, 4);
            dst[i] = __builtin_bswap32(v);
            p += 5;
        } else if (left >= 9 && *p == 0xcf) {
            u64 v;
            std::memcpy(&v, p + 1, 8);
            dst[i] = __builtin_bswap64(v);
            p += 9;
        } else if (!read_one(p, end, hashes, dst[i])) {
            return nullptr;
        }
    }
    return p;
}

namespace {

constexpr size_t NOGIL_MIN_BYTES = 16384;

// A Raw field's bytes, held until the batch is read.
struct Span {
    Py_buffer view{};
    bool held = false;
    ~Span() {
        if (held) PyBuffer_Release(&view);
    }
};

// The attribute `name` of `ev` as a buffer (a msgspec.Raw); false if it is none.
bool raw_attr(PyObject* ev, PyObject* name, Span& s) {
    PyObject* o = PyObject_GetAttr(ev, name);
    if (!o) {
        PyErr_Clear();
        return false;
    }
    int rc = PyObject_GetBuffer(o, &s.view, PyBUF_SIMPLE);
    Py_DECREF(o);
    if (rc != 0) {
        PyErr_Clear();
        return false;
    }
    s.held = true;
    return true;
}

// The tier bit of the event's medium (None included), from the caller's medium -> bit dict.
bool medium_bit(PyObject* ev, PyObject* name, PyObject* medium_bits, u64& bit) {
    PyObject* m = PyObject_GetAttr(ev, name);
    if (!m) {
        PyErr_Clear();
        return false;
    }
    bool ok = tier_bit_of(medium_bits, m, bit);
    Py_DECREF(m);
    return ok;
}

// Whether attribute `name` of `ev` is not None.
bool is_set(PyObject* ev, PyObject* name) {
    PyObject* o = PyObject_GetAttr(ev, name);
    if (!o) {
        PyErr_Clear();
        return true;
    }
    bool set = o != Py_None;
    Py_DECREF(o);
    return set;
}

struct Names {
    PyObject *hashes, *tokens, *parent, *bsize, *medium, *group, *kind;
    Names() {
        hashes = PyUnicode_InternFromString("block_hashes");
        tokens = PyUnicode_InternFromString("token_ids");
        parent = PyUnicode_InternFromString("parent_block_hash");
        bsize = PyUnicode_InternFromString("block_size");
        medium = PyUnicode_InternFromString("medium");
        group = PyUnicode_InternFromString("group_idx");
        kind = PyUnicode_InternFromString("kv_cache_spec_kind");
    }
};

// The structure of one stored event (GIL held): tier, parent, block size, its two Raw fields.
bool read_stored(PyObject* ev, const Names& nm, PyObject* medium_bits, RawEvent& x, Span& hs, Span& ts) {
    x.kind = 0;
    if (!medium_bit(ev, nm.medium, medium_bits, x.bit)) return false;
    PyObject* bs = PyObject_GetAttr(ev, nm.bsize);
    if (!bs) {
        PyErr_Clear();
        return false;
    }
    int overflow = 0;
    x.block_size = PyLong_AsLongLongAndOverflow(bs, &overflow);
    Py_DECREF(bs);
    if (overflow || (x.block_size == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
    }
    if (x.block_size < 1) return false;  // the reference decoder leaves such an event out (lossy)
    PyObject* par = PyObject_GetAttr(ev, nm.parent);
    if (!par) {
        PyErr_Clear();
        return false;
    }
    if (par != Py_None) {
        if (!PyLong_CheckExact(par)) {
            Py_DECREF(par);
            return false;
        }
        x.parent = PyLong_AsUnsignedLongLongMask(par);  // a negative int64: two's complement, as the reference
        x.has_parent = true;
        if (PyErr_Occurred()) {
            PyErr_Clear();
            Py_DECREF(par);
            return false;
        }
    }
    Py_DECREF(par);
    return raw_attr(ev, nm.hashes, hs) && raw_attr(ev, nm.tokens, ts);
}

}  // namespace

nb::object read_raw_batch(nb::handle events, nb::handle stored_t, nb::handle removed_t, nb::handle cleared_t,
                          nb::handle medium_bits) {
    static Names nm;
    if (!PyList_Check(events.ptr()) || !PyDict_Check(medium_bits.ptr())) throw nb::type_error("list and dict expected");
    size_t n = (size_t)PyList_GET_SIZE(events.ptr());
    auto rb = std::make_unique<RawBatch>();
    rb->evs.resize(n);
    std::vector<Span> hs(n), ts(n);
    size_t bytes = 0;
    for (size_t i = 0; i < n; ++i) {
        PyObject* ev = PyList_GET_ITEM(events.ptr(), (Py_ssize_t)i);
        PyObject* tp = (PyObject*)Py_TYPE(ev);
        RawEvent& x = rb->evs[i];
        if (tp == cleared_t.ptr()) {
            x.kind = 2;
            rb->resets = true;
            continue;
        }
        if (tp == stored_t.ptr()) {
            if (!read_stored(ev, nm, medium_bits.ptr(), x, hs[i], ts[i])) return nb::none();
            if (is_set(ev, nm.group) || is_set(ev, nm.kind)) rb->grouped = true;
            bytes += (size_t)ts[i].view.len;
        } else if (tp == removed_t.ptr()) {
            x.kind = 1;
            if (!medium_bit(ev, nm.medium, medium_bits.ptr(), x.bit) || !raw_attr(ev, nm.hashes, hs[i]))
                return nb::none();
            if (is_set(ev, nm.group)) rb->grouped = true;
        } else {
            return nb::none();
        }
        bytes += (size_t)hs[i].view.len;
    }
    bool ok = true;
    {
        // a large batch is read without the GIL (another shard runs meanwhile); a small one takes
        // less time than giving the GIL up and taking it back
        std::optional<nb::gil_scoped_release> nogil;
        if (bytes >= NOGIL_MIN_BYTES) nogil.emplace();
        std::vector<u64>& d = rb->data;
        for (size_t i = 0; i < n && ok; ++i) {
            RawEvent& x = rb->evs[i];
            if (x.kind == 2) continue;
            const uint8_t* hp = (const uint8_t*)hs[i].view.buf;
            x.h_off = d.size();
            ok = read_msgpack_u64s(hp, hp + hs[i].view.len, true, d);
            x.h_n = d.size() - x.h_off;
            if (!ok || x.kind == 1) continue;
            const uint8_t* tp = (const uint8_t*)ts[i].view.buf;
            x.t_off = d.size();
            ok = read_msgpack_u64s(tp, tp + ts[i].view.len, false, d);
            x.t_n = d.size() - x.t_off;
            // a token-less store (the reference applies it another way) or a token count that is
            // not block_size per hash (the reference leaves it out): not read here
            if (ok && (x.t_n == 0 || x.t_n != (size_t)x.block_size * x.h_n || x.t_n / (size_t)x.block_size != x.h_n))
                ok = false;
        }
    }
    if (!ok) return nb::none();
    return nb::cast(rb.release(), nb::rv_policy::take_ownership);
}

bool tier_bit_of(PyObject* medium_bits, PyObject* medium, u64& bit) {
    PyObject* b = PyDict_GetItemWithError(medium_bits, medium);  // borrowed
    if (!b) {
        PyErr_Clear();
        return false;
    }
    bit = PyLong_AsUnsignedLongLong(b);
    if (bit == (u64)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
    }
    return true;
}

}  // namespace kvnative
