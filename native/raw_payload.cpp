// decode_raw_payload: a whole vLLM KV-event payload of the plain shape read into a RawBatch in one
// pass over its bytes, without msgspec structures or Python objects per event (see raw_batch.h).
//
// It takes a strict subset of what kvevents/fastwire.py's msgspec structures take, and reads it
// to the same RawBatch read_raw_batch builds from them: the batch [ts (float64 or float32,
// finite), events, rank (a non-negative int or nil; optional)], no trailing bytes; events all
// maps (with "type") or all arrays (the tag first), each field known to its event type, given at
// most once and of the type those structures allow; block hashes and token ids as read_raw_batch
// reads them.  Anything else (including forms msgspec would take but this reader does not know:
// an int ts, signed-int encodings of ranks, extra batch elements) gives None, and the caller
// decodes the payload the msgspec way, which decides.
#include "raw_batch.h"

#include <iterator>

namespace kvnative {

namespace {

// The fields of the three events, one bit each (kvevents/fastwire.py's _StoredFields order).
enum Field : uint32_t {
    F_TYPE = 1u << 0, F_HASHES = 1u << 1, F_PARENT = 1u << 2, F_TOKENS = 1u << 3, F_BSIZE = 1u << 4,
    F_LORA_ID = 1u << 5, F_MEDIUM = 1u << 6, F_LORA_NAME = 1u << 7, F_EXTRA = 1u << 8, F_GROUP = 1u << 9,
    F_KIND = 1u << 10, F_WINDOW = 1u << 11, F_LOCALITY = 1u << 12, F_OWNERSHIP = 1u << 13,
    F_SESSION = 1u << 14, F_LOOKAHEAD = 1u << 15,
};
constexpr uint32_t STORED_FIELDS = F_TYPE | F_HASHES | F_PARENT | F_TOKENS | F_BSIZE | F_LORA_ID | F_MEDIUM |
                                   F_LORA_NAME | F_EXTRA | F_GROUP | F_KIND | F_WINDOW | F_LOCALITY | F_OWNERSHIP |
                                   F_SESSION | F_LOOKAHEAD;
constexpr uint32_t STORED_REQUIRED = F_HASHES | F_PARENT | F_TOKENS | F_BSIZE;
constexpr uint32_t REMOVED_FIELDS = F_TYPE | F_HASHES | F_MEDIUM | F_GROUP | F_LOCALITY | F_OWNERSHIP;

// Positional layouts of the array form (after the tag).
constexpr Field STORED_POS[] = {F_HASHES, F_PARENT, F_TOKENS, F_BSIZE, F_LORA_ID, F_MEDIUM, F_LORA_NAME,
                                F_EXTRA, F_GROUP, F_KIND, F_WINDOW, F_LOCALITY, F_OWNERSHIP, F_SESSION};
constexpr Field REMOVED_POS[] = {F_HASHES, F_MEDIUM, F_GROUP, F_LOCALITY, F_OWNERSHIP};

struct Reader {
    const uint8_t* p;
    const uint8_t* end;

    size_t left() const { return (size_t)(end - p); }

    u64 be(size_t n) {
        u64 v = 0;
        for (size_t i = 0; i < n; ++i) v = (v << 8) | p[i];
        p += n;
        return v;
    }

    bool nil() {
        if (p < end && *p == 0xc0) {
            ++p;
            return true;
        }
        return false;
    }

    // An array (or map) header: fixarray/array16/array32 (fixmap/map16/map32).
    bool header(bool map, size_t& n) {
        if (p >= end) return false;
        uint8_t b = *p;
        uint8_t fix = map ? 0x80 : 0x90, h16 = map ? 0xde : 0xdc;
        if ((b & 0xf0) == fix) {
            n = b & 0x0f;
            ++p;
            return true;
        }
        if (b != h16 && b != h16 + 1) return false;
        size_t ln = b == h16 ? 2 : 4;
        ++p;
        if (left() < ln) return false;
        n = (size_t)be(ln);
        return n <= left();  // every element takes at least one byte
    }

    // A str: fixstr/str8/str16/str32.
    bool str(const char*& s, size_t& n) {
        if (p >= end) return false;
        uint8_t b = *p++;
        if ((b & 0xe0) == 0xa0) {
            n = b & 0x1f;
        } else if (b >= 0xd9 && b <= 0xdb) {
            size_t ln = (size_t)1 << (b - 0xd9);
            if (left() < ln) return false;
            n = (size_t)be(ln);
        } else {
            return false;
        }
        if (left() < n) return false;
        s = (const char*)p;
        p += n;
        return true;
    }

    // Any msgpack int: its value as two's complement and whether it is negative.
    bool integer(u64& v, bool& neg) {
        if (p >= end) return false;
        uint8_t b = *p++;
        neg = false;
        if (b <= 0x7f) {
            v = b;
            return true;
        }
        if (b >= 0xe0) {
            v = (u64)(int64_t)(int8_t)b;
            neg = true;
            return true;
        }
        if (b < 0xcc || b > 0xd3) return false;
        size_t n = (size_t)1 << ((b - 0xcc) & 3);
        if (left() < n) return false;
        v = be(n);
        if (b >= 0xd0) {
            int shift = 64 - 8 * (int)n;
            int64_t s = shift ? (int64_t)(v << shift) >> shift : (int64_t)v;
            v = (u64)s;
            neg = s < 0;
        }
        return true;
    }

    // A non-negative int in the unsigned encodings (positive fixint, uint8..64).
    bool uint(u64& v) {
        if (p >= end || (*p > 0x7f && (*p < 0xcc || *p > 0xcf))) return false;
        bool neg;
        return integer(v, neg);
    }
};

inline bool str_is(const char* s, size_t n, const char* lit) {
    return n == std::strlen(lit) && std::memcmp(s, lit, n) == 0;
}

// The field a map key names, or 0.
uint32_t field_of(const char* s, size_t n) {
    switch (n) {  // by length first: one comparison for most keys
        case 4: return str_is(s, n, "type") ? F_TYPE : 0;
        case 6: return str_is(s, n, "medium") ? F_MEDIUM : 0;
        case 7: return str_is(s, n, "lora_id") ? F_LORA_ID : 0;
        case 8: return str_is(s, n, "locality") ? F_LOCALITY : 0;
        case 9:
            return str_is(s, n, "token_ids") ? F_TOKENS : str_is(s, n, "lora_name") ? F_LORA_NAME
                   : str_is(s, n, "group_idx") ? F_GROUP : str_is(s, n, "ownership") ? F_OWNERSHIP : 0;
        case 10:
            return str_is(s, n, "block_size") ? F_BSIZE : str_is(s, n, "extra_keys") ? F_EXTRA
                   : str_is(s, n, "session_id") ? F_SESSION : 0;
        case 12: return str_is(s, n, "block_hashes") ? F_HASHES : 0;
        case 17: return str_is(s, n, "parent_block_hash") ? F_PARENT : 0;
        case 18: return str_is(s, n, "kv_cache_spec_kind") ? F_KIND : 0;
        case 19: return str_is(s, n, "lookahead_token_ids") ? F_LOOKAHEAD : 0;
        case 28: return str_is(s, n, "kv_cache_spec_sliding_window") ? F_WINDOW : 0;
        default: return 0;
    }
}

// A str is valid UTF-8 (msgspec refuses it otherwise).
bool utf8_ok(const char* s, size_t n) {
    PyObject* o = PyUnicode_DecodeUTF8(s, (Py_ssize_t)n, "strict");
    if (!o) {
        PyErr_Clear();
        return false;
    }
    Py_DECREF(o);
    return true;
}

// The event being read: its kind (from the tag), fields seen, and its values.
struct EventParse {
    int kind = -1;  // 0 stored, 1 removed, 2 cleared; -1 before the tag
    uint32_t seen = 0;
    RawEvent x;
    bool medium_set = false;  // medium given as a str (else: nil or absent)
    const char* medium = nullptr;
    size_t medium_n = 0;
    bool grouped = false;
};

// The event type a tag names (-1: another).
int kind_of(const char* s, size_t n) {
    if (str_is(s, n, "BlockStored")) return 0;
    if (str_is(s, n, "BlockRemoved")) return 1;
    if (str_is(s, n, "AllBlocksCleared")) return 2;
    return -1;
}

// One field's value, of the type the fastwire structures allow for it.
bool read_field(Reader& r, uint32_t f, EventParse& e, std::vector<u64>& data) {
    switch (f) {
        case F_HASHES: {
            e.x.h_off = data.size();
            const uint8_t* q = read_msgpack_u64s_at(r.p, r.end, true, data);
            if (!q) return false;
            r.p = q;
            e.x.h_n = data.size() - e.x.h_off;
            return true;
        }
        case F_TOKENS: {
            e.x.t_off = data.size();
            const uint8_t* q = read_msgpack_u64s_at(r.p, r.end, false, data);
            if (!q) return false;
            r.p = q;
            e.x.t_n = data.size() - e.x.t_off;
            return true;
        }
        case F_PARENT: {
            if (r.nil()) return true;
            bool neg;
            if (!r.integer(e.x.parent, neg)) return false;
            e.x.has_parent = true;
            return true;
        }
        case F_BSIZE: {
            u64 v;
            bool neg;
            if (!r.integer(v, neg) || neg || v < 1 || v > (u64)INT64_MAX) return false;
            e.x.block_size = (int64_t)v;
            return true;
        }
        case F_MEDIUM:
            if (r.nil()) return true;
            e.medium_set = true;
            return r.str(e.medium, e.medium_n);
        case F_GROUP: {
            if (r.nil()) return true;
            u64 v;
            bool neg;
            if (!r.integer(v, neg) || v != 0) return false;
            e.grouped = true;
            return true;
        }
        case F_KIND: {
            if (r.nil()) return true;
            const char* s;
            size_t n;
            if (!r.str(s, n) || !str_is(s, n, "full_attention")) return false;
            e.grouped = true;
            return true;
        }
        case F_SESSION: {
            if (r.nil()) return true;
            const char* s;
            size_t n;
            return r.str(s, n) && utf8_ok(s, n);
        }
        default:  // lora_id, lora_name, extra_keys, the window, locality, ownership, lookahead tokens
            return r.nil();
    }
}

// One event, map or array form (`map`), into e; false to decline the payload.
bool read_event(Reader& r, bool map, EventParse& e, std::vector<u64>& data) {
    size_t n;
    if (!r.header(map, n)) return false;
    if (map) {
        for (size_t i = 0; i < n; ++i) {
            const char* s;
            size_t ln;
            if (!r.str(s, ln)) return false;
            uint32_t f = field_of(s, ln);
            if (!f || (e.seen & f)) return false;  // unknown or repeated: msgspec decides
            e.seen |= f;
            if (f == F_TYPE) {
                if (!r.str(s, ln) || (e.kind = kind_of(s, ln)) < 0) return false;
            } else if (!read_field(r, f, e, data)) {
                return false;
            }
        }
        if (!(e.seen & F_TYPE)) return false;
        if (e.kind == 0) return (e.seen & ~STORED_FIELDS) == 0 && (e.seen & STORED_REQUIRED) == STORED_REQUIRED;
        if (e.kind == 1) return (e.seen & ~REMOVED_FIELDS) == 0 && (e.seen & F_HASHES);
        return e.seen == F_TYPE;
    }
    const char* s;
    size_t ln;
    if (n < 1 || !r.str(s, ln) || (e.kind = kind_of(s, ln)) < 0) return false;
    const Field* pos = e.kind == 0 ? STORED_POS : REMOVED_POS;
    size_t most = e.kind == 0 ? std::size(STORED_POS) : e.kind == 1 ? std::size(REMOVED_POS) : 0;
    size_t least = e.kind == 0 ? 4 : e.kind == 1 ? 1 : 0;
    if (n - 1 < least || n - 1 > most) return false;
    for (size_t i = 0; i + 1 < n; ++i)
        if (!read_field(r, pos[i], e, data)) return false;
    return true;
}

// The tier bit of an event's medium (nil or absent: None's), from the caller's medium -> bit dict.
bool medium_bit(const EventParse& e, PyObject* medium_bits, u64& bit) {
    PyObject* key = Py_None;
    nb::object s;
    if (e.medium_set) {
        PyObject* o = PyUnicode_DecodeUTF8(e.medium, (Py_ssize_t)e.medium_n, "strict");
        if (!o) {
            PyErr_Clear();
            return false;
        }
        s = nb::steal(o);
        key = o;
    }
    return tier_bit_of(medium_bits, key, bit);
}

}  // namespace

nb::object decode_raw_payload(nb::bytes payload, nb::handle medium_bits) {
    if (!PyDict_Check(medium_bits.ptr())) throw nb::type_error("medium_bits: a dict expected");
    Reader r{(const uint8_t*)payload.c_str(), (const uint8_t*)payload.c_str() + payload.size()};
    size_t top;
    if (!r.header(false, top) || top < 2 || top > 3) return nb::none();
    double ts;
    if (r.left() >= 9 && *r.p == 0xcb) {
        ++r.p;
        u64 v = r.be(8);
        std::memcpy(&ts, &v, 8);
    } else if (r.left() >= 5 && *r.p == 0xca) {
        ++r.p;
        uint32_t v = (uint32_t)r.be(4);
        float f;
        std::memcpy(&f, &v, 4);
        ts = f;
    } else {
        return nb::none();
    }
    if (!std::isfinite(ts)) return nb::none();
    size_t n;
    if (!r.header(false, n)) return nb::none();
    auto rb = std::make_unique<RawBatch>();
    rb->evs.resize(n);
    rb->data.reserve(payload.size() / 2);  // most integers take 2 bytes or more
    int form = -1;  // 1 maps, 0 arrays: one form per batch
    for (size_t i = 0; i < n; ++i) {
        if (r.p >= r.end) return nb::none();
        uint8_t b = *r.p;
        bool map = (b & 0xf0) == 0x80 || b == 0xde || b == 0xdf;
        if (form >= 0 && form != (int)map) return nb::none();
        form = map;
        EventParse e;
        if (!read_event(r, map, e, rb->data)) return nb::none();
        RawEvent& x = rb->evs[i];
        x = e.x;
        x.kind = e.kind;
        if (e.kind == 2) {
            rb->resets = true;
            continue;
        }
        if (e.grouped) rb->grouped = true;
        if (!medium_bit(e, medium_bits.ptr(), x.bit)) return nb::none();
        // read_raw_batch's stop: a token-less store, or not block_size tokens per hash
        if (e.kind == 0 &&
            (x.t_n == 0 || x.t_n != (size_t)x.block_size * x.h_n || x.t_n / (size_t)x.block_size != x.h_n))
            return nb::none();
    }
    nb::object rank = nb::none();
    if (top == 3 && !r.nil()) {
        u64 v;
        if (!r.uint(v)) return nb::none();
        rank = nb::steal(PyLong_FromUnsignedLongLong(v));
    }
    if (r.p != r.end) return nb::none();
    nb::object raw = nb::cast(rb.release(), nb::rv_policy::take_ownership);
    return nb::make_tuple(ts, rank, raw);
}

}  // namespace kvnative
