// kvindex._native: the compiled core of kvindex.
//
// Two parts:
//  * xxh3_chain request keys (the block recurrence of kvindex/keys.py, bit-identical;
//    the scope root and per-block extras stay in Python and arrive as inputs);
//  * IndexCore: the data of the two-level KV block index (see kvindex/native.py, the
//    Python class around it, for the event semantics; they mirror kvindex/index.py).
//
// Layout (IndexCore), about 39 bytes per (block, pod) at 10 M entries, 8 pods:
//  * blocks: a vector of 27-byte Block records (request key, intrusive LRU links as 27-bit indices,
//    one 12-byte Holder inline or a heap array sized to the holders); freed records are reused
//    through a free list; a holder keeps its engine key, a 14-bit pod slot with two flags, and one
//    interned id of its (model, DP rank, tier mask);
//  * level 1: a set of block indices (4 bytes a slot: 27-bit index and 5-bit probe distance, Robin
//    Hood linear probing, 70-87.5 % full) keyed by the block's request key;
//  * level 2: per model, engine key -> (request key, number of streams), as a set of block indices
//    keyed by the engine key of the holder that carries the entry (FLAG_L), plus an explicit map
//    for entries no holder can carry;
//  * streams: per (pod slot, model, DP rank), engine key -> request key, so that clearing a pod
//    costs O(that pod's keys): the entries its holders carry (FLAG_S), found through level 2 (level
//    1 in compat mode) and listed for clears in a chunked set of record indices (IdxBits), plus an
//    explicit map for the others;
//  * pods: name <-> 14-bit slot (at most 16,381 pods); a slot is reused once its pod holds nothing.
//
// Locking: one std::shared_mutex.  Writers (store/remove/clear) hold it exclusively;
// readers (prefix match, lookup, best DP rank) hold it shared, so several readers run
// at once.  The recency refresh of a prefix match is logged, not applied: the reader appends
// the matched blocks' indices to a touch log (under a small mutex, inside its shared section),
// and every exclusive section applies the log, in order, before it changes anything (wlock()),
// so the LRU order any write sees, and so every eviction, is the one of refreshing at once.
// A reader that finds the log past TOUCH_LOG_MAX applies it itself under the exclusive lock.
// A writer whose one event takes several calls (kvindex.native attaches released orphans) marks
// them with begin_multi/end_multi; a guarded read (guard=true) answers None meanwhile, so a
// caller reading without its own lock never sees half of an event.
// Every call releases the GIL while it holds the index lock.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstddef>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace nb = nanobind;

namespace {

using u64 = uint64_t;
using u32 = uint32_t;
constexpr u32 NIL = 0xFFFFFFFFu;

inline u64 fmix64(u64 x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDULL;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ULL;
    x ^= x >> 33;
    return x;
}

// After a large table or array has grown, give the freed old one back to the system: glibc keeps
// freed blocks below its (adaptive) mmap threshold inside the heap, where they stay resident.
inline void release_freed(size_t old_bytes) {
#if defined(__GLIBC__)
    if (old_bytes >= (1u << 20)) malloc_trim(0);
#else
    (void)old_bytes;
#endif
}

// ---------------------------------------------------------------- open addressing

// uint64 -> V, linear probing, backward-shift deletion (no tombstones), load <= 3/4.
template <class V>
class U64Map {
  public:
    size_t size() const { return size_; }
    bool empty() const { return size_ == 0; }

    V* find(u64 k) {
        if (size_ == 0) return nullptr;
        size_t i = slot(k);
        while (used_[i]) {
            if (keys_[i] == k) return &vals_[i];
            i = (i + 1) & mask_;
        }
        return nullptr;
    }
    const V* find(u64 k) const { return const_cast<U64Map*>(this)->find(k); }

    // Returns (value, inserted).  A new value is value-initialised.
    std::pair<V*, bool> emplace(u64 k) {
        if ((size_ + 1) * 4 > cap() * 3) grow();
        size_t i = slot(k);
        while (used_[i]) {
            if (keys_[i] == k) return {&vals_[i], false};
            i = (i + 1) & mask_;
        }
        used_[i] = 1;
        keys_[i] = k;
        vals_[i] = V();
        ++size_;
        return {&vals_[i], true};
    }

    bool erase(u64 k) {
        if (size_ == 0) return false;
        size_t i = slot(k);
        while (true) {
            if (!used_[i]) return false;
            if (keys_[i] == k) break;
            i = (i + 1) & mask_;
        }
        size_t j = i;
        while (true) {
            j = (j + 1) & mask_;
            if (!used_[j]) break;
            size_t home = slot(keys_[j]);
            // move j back to i unless its home lies cyclically in (i, j]
            bool stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
            if (!stays) {
                keys_[i] = keys_[j];
                vals_[i] = vals_[j];
                i = j;
            }
        }
        used_[i] = 0;
        --size_;
        if (size_ == 0) release();
        return true;
    }

    template <class F>
    void for_each(F&& f) const {
        for (size_t i = 0; i < used_.size(); ++i)
            if (used_[i]) f(keys_[i], vals_[i]);
    }

    size_t bytes() const { return keys_.capacity() * sizeof(u64) + vals_.capacity() * sizeof(V) + used_.capacity(); }

  private:
    size_t cap() const { return used_.size(); }
    size_t slot(u64 k) const { return fmix64(k) & mask_; }
    void release() {
        std::vector<u64>().swap(keys_);
        std::vector<V>().swap(vals_);
        std::vector<uint8_t>().swap(used_);
        mask_ = 0;
    }
    void grow() {
        size_t ncap = cap() ? cap() * 2 : 8;
        std::vector<u64> ok;
        std::vector<V> ov;
        std::vector<uint8_t> ou;
        ok.swap(keys_);
        ov.swap(vals_);
        ou.swap(used_);
        keys_.assign(ncap, 0);
        vals_.assign(ncap, V());
        used_.assign(ncap, 0);
        mask_ = ncap - 1;
        for (size_t i = 0; i < ou.size(); ++i) {
            if (!ou[i]) continue;
            size_t s = slot(ok[i]);
            while (used_[s]) s = (s + 1) & mask_;
            used_[s] = 1;
            keys_[s] = ok[i];
            vals_[s] = ov[i];
        }
        size_t old_bytes = ok.capacity() * (sizeof(u64) + sizeof(V) + 1);
        std::vector<u64>().swap(ok);
        std::vector<V>().swap(ov);
        std::vector<uint8_t>().swap(ou);
        release_freed(old_bytes);
    }

    std::vector<u64> keys_;
    std::vector<V> vals_;
    std::vector<uint8_t> used_;
    size_t size_ = 0;
    size_t mask_ = 0;
};

// ---------------------------------------------------------------- input helpers

// A read-only view of uint64 values: a C-contiguous uint64 numpy array, or a copy of
// a Python sequence of ints (each must be in [0, 2**64)).
struct U64View {
    const u64* data = nullptr;
    size_t n = 0;
    std::vector<u64> owned;
};

// An exact int that fits one internal digit (|v| < 2**30): its value without a call.
inline bool compact_int(PyObject* o, long long& v) {
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject*)o)) return false;
    v = (long long)PyUnstable_Long_CompactValue((PyLongObject*)o);
    return true;
#else
    Py_ssize_t size = Py_SIZE(o);
    if (size == 0) {
        v = 0;
        return true;
    }
    if (size == 1 || size == -1) {
        v = (long long)((PyLongObject*)o)->ob_digit[0];
        if (size < 0) v = -v;
        return true;
    }
    return false;
#endif
}

void to_u64(nb::handle obj, U64View& out, const char* what) {
    using Arr = nb::ndarray<const u64, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
    Arr arr;
    // lists and tuples (the events' form) go straight to the sequence path
    if (!PyList_Check(obj.ptr()) && !PyTuple_Check(obj.ptr()) && nb::try_cast(obj, arr, false)) {
        out.data = arr.data();
        out.n = arr.shape(0);
        out.owned.clear();
        return;
    }
    PyObject* seq = PySequence_Fast(obj.ptr(), what);
    if (!seq) throw nb::python_error();
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    out.owned.resize((size_t)n);
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* it = items[i];
        // fast path: an exact int of one digit (token ids, small keys): read it without a call
        if (Py_IS_TYPE(it, &PyLong_Type)) {
            long long small;
            if (compact_int(it, small)) {
                if (small < 0) {
                    Py_DECREF(seq);
                    throw nb::value_error((std::string(what) + ": values must be in [0, 2**64)").c_str());
                }
                out.owned[(size_t)i] = (u64)small;
                continue;
            }
        }
        if (PyBool_Check(it) || !PyLong_Check(it)) {
            Py_DECREF(seq);
            throw nb::type_error((std::string(what) + ": integers expected").c_str());
        }
        unsigned long long v = PyLong_AsUnsignedLongLong(it);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            Py_DECREF(seq);
            throw nb::value_error((std::string(what) + ": values must be in [0, 2**64)").c_str());
        }
        out.owned[(size_t)i] = (u64)v;
    }
    Py_DECREF(seq);
    out.data = out.owned.data();
    out.n = out.owned.size();
}

// uint64 values as native-endian bytes (Python wraps them with numpy.frombuffer: creating a
// numpy array from C++ through DLPack costs several microseconds, bytes well under one).
nb::bytes new_u64_array(std::vector<u64>&& v) {
    return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(u64));
}

// key_{-1} = state; key_i = A * key_{i-1} + fmix64(sum_t tok[i*bs+t] * K[t] + add_i)
void chain_into(u64 state, const u64* toks, size_t nblocks, const u64* K, size_t bs, u64 A, const u64* add,
                u64* out) {
    for (size_t i = 0; i < nblocks; ++i) {
        const u64* b = toks + i * bs;
        u64 u = 0;
        for (size_t t = 0; t < bs; ++t) u += b[t] * K[t];
        if (add) u += add[i];
        state = A * state + fmix64(u);
        out[i] = state;
    }
}

// ---------------------------------------------------------------- the index

// One (pod, DP rank) holding a block: 12 bytes (byte-aligned: it sits inline in 27-byte records).  The holder's model, DP rank
// and tier mask are interned together as one 16-bit attribute id (IndexCore::attrs_: few
// distinct combinations, append-only); the pod slot takes 14 bits and two flags the top two.
constexpr uint16_t POD_BITS = 0x3FFF;   // pod slot bits of Holder::pf
constexpr uint16_t MAX_PODS = 0x3FFD;   // pod slots 0 .. MAX_PODS - 1
constexpr uint16_t POD_EMPTY = 0xFFFD;  // pf of an empty inline holder slot (no real holder has it)
constexpr uint16_t POD_SPILL = 0xFFFF;  // pf marking holders spilled to the heap
#pragma pack(push, 1)
struct Holder {
    u64 ek;       // the engine key this (pod, rank) stored the block under
    uint16_t pf;  // pod slot (low 14 bits), FLAG_S and FLAG_L (top 2)
    uint16_t at;  // interned (model of the stream that first stored it, DP rank, tier mask)
    uint16_t pod() const { return pf & POD_BITS; }
};
#pragma pack(pop)
static_assert(sizeof(Holder) == 12, "Holder is 12 bytes");

// One interned holder attribute: the model id (the reference keeps the model of the stream that
// first stored the copy), the interned DP rank and the tier mask.
struct Attr {
    u64 mask;
    uint16_t model, rid;
};

// The holders of one block in 12 bytes: one holder inline (most blocks have one), or a pointer
// to a heap array sized to the holders (two or more, at most 65535), marked by pf == POD_SPILL.
class HolderVec {
  public:
    HolderVec() { set_empty(); }
    HolderVec(const HolderVec&) = delete;
    HolderVec& operator=(const HolderVec&) = delete;
    HolderVec(HolderVec&& o) noexcept {
        u_ = o.u_;
        o.set_empty();
    }
    HolderVec& operator=(HolderVec&& o) noexcept {
        if (this != &o) {
            release();
            u_ = o.u_;
            o.set_empty();
        }
        return *this;
    }
    ~HolderVec() { release(); }

    size_t size() const { return spilled() ? u_.sp.n : (u_.one.pf == POD_EMPTY ? 0 : 1); }
    bool empty() const { return size() == 0; }
    size_t heap_bytes() const { return spilled() ? u_.sp.n * sizeof(Holder) : 0; }
    Holder* begin() { return data(); }
    Holder* end() { return data() + size(); }
    const Holder* begin() const { return data(); }
    const Holder* end() const { return data() + size(); }
    const void* heap() const { return spilled() ? (const void*)u_.sp.many : nullptr; }
    Holder& operator[](size_t i) { return data()[i]; }
    const Holder& operator[](size_t i) const { return data()[i]; }

    void push_back(const Holder& h) {
        size_t n = size();
        if (n == 0) {
            u_.one = h;
            return;
        }
        if (n >= 0xFFFF) throw std::length_error("more than 65535 holders of one block");
        Holder* m = static_cast<Holder*>(::operator new(sizeof(Holder) * (n + 1)));
        std::memcpy(m, data(), sizeof(Holder) * n);
        m[n] = h;
        release();
        u_.sp.many = m;
        u_.sp.tag = POD_SPILL;
        u_.sp.n = (uint16_t)(n + 1);
    }

    // Remove holder i (the others keep their order), shrinking to fit.
    void erase(size_t i) {
        size_t n = size();
        if (n == 1) {
            set_empty();
            return;
        }
        Holder* d = u_.sp.many;
        if (n == 2) {
            Holder keep = d[1 - i];
            ::operator delete(d);
            u_.one = keep;
            return;
        }
        Holder* m = static_cast<Holder*>(::operator new(sizeof(Holder) * (n - 1)));
        std::memcpy(m, d, sizeof(Holder) * i);
        std::memcpy(m + i, d + i + 1, sizeof(Holder) * (n - 1 - i));
        ::operator delete(d);
        u_.sp.many = m;
        u_.sp.n = (uint16_t)(n - 1);
    }

    void clear() {
        release();
        set_empty();
    }

  private:
    bool spilled() const { return u_.sp.tag == POD_SPILL; }
    Holder* data() { return spilled() ? u_.sp.many : &u_.one; }
    const Holder* data() const { return spilled() ? u_.sp.many : &u_.one; }
    void set_empty() { u_.one = Holder{0, POD_EMPTY, 0}; }
    void release() {
        if (spilled()) ::operator delete(u_.sp.many);
    }
#pragma pack(push, 1)
    union U {
        Holder one;
        struct {
            Holder* many;
            uint16_t tag;  // overlays Holder::pf
            uint16_t n;
        } sp;
        U() : one() {}
    } u_;
#pragma pack(pop)
};
static_assert(sizeof(HolderVec) == 12, "HolderVec is 12 bytes");

// Block records are 27 bytes, byte-aligned: the request key, the two LRU links (27-bit record
// indices, packed into 7 bytes; LINK_NIL stands for NIL) and the holders.
constexpr u32 LINK_BITS = 27;
constexpr u32 LINK_NIL = (1u << LINK_BITS) - 1;  // above every record index (MAX_BLOCKS)
#pragma pack(push, 1)
struct Block {
    u64 rk = 0;
    uint8_t lk[7];  // prev (bits 0-26; the less recently used neighbour) and next (bits 27-53), little-endian
    HolderVec hs;

    Block() { set_links(((u64)LINK_NIL << LINK_BITS) | LINK_NIL); }
    u32 prev() const { return unlink_nil((u32)(links() & LINK_NIL)); }
    u32 next() const { return unlink_nil((u32)((links() >> LINK_BITS) & LINK_NIL)); }
    void set_prev(u32 i) { set_links((links() & ~(u64)LINK_NIL) | link_nil(i)); }
    void set_next(u32 i) { set_links((links() & ~((u64)LINK_NIL << LINK_BITS)) | ((u64)link_nil(i) << LINK_BITS)); }

  private:
    static u32 unlink_nil(u32 v) { return v == LINK_NIL ? NIL : v; }
    static u64 link_nil(u32 i) { return i == NIL ? LINK_NIL : i; }
    u64 links() const {
        u64 v = 0;
        for (int k = 0; k < 7; ++k) v |= (u64)lk[k] << (8 * k);
        return v;
    }
    void set_links(u64 v) {
        for (int k = 0; k < 7; ++k) lk[k] = (uint8_t)(v >> (8 * k));
    }
};
#pragma pack(pop)
static_assert(sizeof(Block) == 27, "Block is 27 bytes");

#pragma pack(push, 4)
struct EngineRef {  // 12 bytes: level 2 holds one per (model, engine key)
    u64 rk;
    u32 refs;  // streams mapping the engine key (at most the number of streams)
};
#pragma pack(pop)

// A found block index (NIL: none), for `if (bi)` / `*bi`.
struct Found {
    u32 v = NIL;
    explicit operator bool() const { return v != NIL; }
    u32 operator*() const { return v; }
};

// Block indices are below 2^27 - 1: a set slot keeps the index in its low 27 bits and the entry's
// probe distance (capped at 31) in the top 5.
constexpr u32 IDX_BITS = 27;
constexpr u32 IDX_MASK = (1u << IDX_BITS) - 1;
constexpr u32 MAX_BLOCKS = IDX_MASK;  // indices 0 .. MAX_BLOCKS - 1 (slot NIL stays unambiguous)
constexpr u32 DIST_CAP = 31;

// An open-addressing set of block indices (4 bytes a slot) keyed by a key derived from the block
// (KeyOf(index) -> u64).  Robin Hood linear probing: within a run the entries are ordered by home
// slot, and each slot also records how far its entry sits from its home (5 bits, exact below 31).
// A lookup skips the entries whose distance differs from its own without reading their blocks,
// stops at the first one closer to its home than the key would be, and reads a block only for
// entries with the key's own home; deletion shifts the run back (no tombstones).  The home slot is
// Lemire's multiply-shift range reduction of fmix64(key), so the table size is any integer: once
// 7/8 full it doubles below 2^17 slots, and beyond grows by 1.25x, staying 70-87.5 % full.  Level 1 keys blocks by
// request key; each model's level 2 keys blocks by a holder's engine key.
template <class KeyOf>
class IdxSet {
  public:
    IdxSet() {}
    explicit IdxSet(KeyOf key) : key_(key) {}
    KeyOf& key() { return key_; }
    const KeyOf& key() const { return key_; }
    size_t size() const { return size_; }
    bool empty() const { return size_ == 0; }

    // The slot holding k, or NPOS (Robin Hood probing: the run ends at an empty slot or at an
    // entry closer to its home than k would be).
    static constexpr size_t NPOS = ~size_t(0);
    size_t slot_of(u64 k) const {
        if (size_ == 0) return NPOS;
        size_t cap = slots_.size();
        size_t i = home(k, cap);
        for (size_t d = 0;; ++d) {
            u32 e = slots_[i];
            if (e == NIL) return NPOS;
            size_t de = e >> IDX_BITS;
            if (de == DIST_CAP && d >= DIST_CAP) de = dist(i, home(key_(e & IDX_MASK), cap), cap);
            if (de < d) return NPOS;
            if (de == d && key_(e & IDX_MASK) == k) return i;
            if (++i == cap) i = 0;
        }
    }

    // The index stored under k, or NIL.
    u32 find(u64 k) const {
        size_t i = slot_of(k);
        return i == NPOS ? NIL : (slots_[i] & IDX_MASK);
    }
    Found find_ptr(u64 k) const { return Found{find(k)}; }

    // The read path's prefetch: k's home slot, and the index it holds (NIL if empty), no probing.
    void prefetch(u64 k) const {
        if (size_) __builtin_prefetch(&slots_[home(k, slots_.size())]);
    }
    u32 at_home(u64 k) const {
        if (!size_) return NIL;
        u32 e = slots_[home(k, slots_.size())];
        return e == NIL ? NIL : (e & IDX_MASK);
    }

    // Adds k -> idx; k must be absent and key(idx) == k once the caller has set the block up.
    void insert(u64 k, u32 idx) {
        if ((size_ + 1) * 8 > slots_.size() * 7) grow();
        place(k, idx);
        ++size_;
    }

    bool erase(u64 k) {
        size_t i = slot_of(k);
        if (i == NPOS) return false;
        size_t cap = slots_.size();
        // shift the rest of the run back by one, up to an empty slot or an entry at its home
        while (true) {
            size_t j = i + 1 == cap ? 0 : i + 1;
            u32 e = slots_[j];
            if (e == NIL || (e >> IDX_BITS) == 0) break;
            size_t de = e >> IDX_BITS;
            if (de == DIST_CAP) de = dist(j, home(key_(e & IDX_MASK), cap), cap);
            slots_[i] = tag(e & IDX_MASK, de - 1);
            i = j;
        }
        slots_[i] = NIL;
        --size_;
        if (size_ == 0) std::vector<u32>().swap(slots_);
        return true;
    }

    template <class F>
    void for_each(F&& f) const {
        for (u32 e : slots_)
            if (e != NIL) f(e & IDX_MASK);
    }

    size_t bytes() const { return slots_.capacity() * sizeof(u32); }

  private:
    static size_t home(u64 k, size_t cap) { return (size_t)(((unsigned __int128)fmix64(k) * cap) >> 64); }
    static size_t dist(size_t i, size_t h, size_t cap) { return i >= h ? i - h : i + cap - h; }
    static u32 tag(u32 idx, size_t d) { return idx | ((u32)std::min<size_t>(d, DIST_CAP) << IDX_BITS); }

    // Robin Hood insertion of an absent key: at the first entry closer to its home than k would
    // be, k takes the slot and the rest of the run moves up by one.
    void place(u64 k, u32 idx) {
        size_t cap = slots_.size();
        size_t i = home(k, cap);
        size_t d = 0;
        for (;; ++d) {
            u32 e = slots_[i];
            if (e == NIL) {
                slots_[i] = tag(idx, d);
                return;
            }
            size_t de = e >> IDX_BITS;
            if (de == DIST_CAP && d >= DIST_CAP) de = dist(i, home(key_(e & IDX_MASK), cap), cap);
            if (de < d) break;
            if (++i == cap) i = 0;
        }
        u32 carry = tag(idx, d);
        while (true) {
            u32 e = slots_[i];
            slots_[i] = carry;
            if (e == NIL) return;
            size_t de = e >> IDX_BITS;  // a capped distance stays capped
            carry = tag(e & IDX_MASK, de + 1);
            if (++i == cap) i = 0;
        }
    }

    void grow() {
        // small tables double (cheap, few rehashes); from 2^17 slots on they grow by 1.25x
        size_t cur = slots_.size();
        size_t ncap = cur == 0 ? 8 : cur < (1u << 17) ? cur * 2 : cur + cur / 4;
        std::vector<u32> old;
        old.swap(slots_);
        slots_.assign(ncap, NIL);
        // old slots in order: the keys come in about the order of their new homes, so each
        // placement only probes the slots just filled
        constexpr size_t AHEAD = 16;
        for (size_t j = 0; j < old.size(); ++j) {
            if (j + AHEAD < old.size() && old[j + AHEAD] != NIL) key_.prefetch(old[j + AHEAD] & IDX_MASK);
            u32 e = old[j];
            if (e != NIL) place(key_(e & IDX_MASK), e & IDX_MASK);
        }
        size_t old_bytes = old.capacity() * sizeof(u32);
        std::vector<u32>().swap(old);
        release_freed(old_bytes);
    }
    KeyOf key_;
    std::vector<u32> slots_;
    size_t size_ = 0;
};

// Holder::pf flags.  FLAG_S: the holder carries an entry of its stream (pod, model, rank):
// holder.ek -> the block's request key; the entry is found through the model's level 2 (or,
// in compat mode, where request keys are engine keys, through level 1), which always maps the
// engine key of a carried stream entry to that entry's request key (IndexCore::link detaches
// the carried entries of a level-2 value it replaces).  FLAG_L: the holder carries its model's
// level-2 entry holder.ek -> (the block's request key, 1 stream).  Entries that no holder can
// carry (the engine key or model of the holder differs, more than one stream, a value that
// outlived its holder) are kept explicitly in a U64Map beside the set.
constexpr uint16_t FLAG_S = 0x8000;
constexpr uint16_t FLAG_L = 0x4000;

struct RkOf {
    const std::vector<Block>* blocks = nullptr;
    u64 operator()(u32 i) const { return (*blocks)[i].rk; }
    void prefetch(u32 i) const { __builtin_prefetch(&(*blocks)[i]); }
};

// The holder of block i carrying a model's level-2 entry (flag FLAG_L).
struct HolderKey {
    const std::vector<Block>* blocks = nullptr;
    const std::vector<Attr>* attrs = nullptr;
    uint16_t model = 0, flag = 0;
    const Holder* holder(u32 i) const {
        for (const Holder& h : (*blocks)[i].hs)
            if ((h.pf & flag) && (*attrs)[h.at].model == model) return &h;
        return nullptr;
    }
    u64 operator()(u32 i) const {
        const Holder* h = holder(i);
        return h ? h->ek : ~0ULL;
    }
    void prefetch(u32 i) const { __builtin_prefetch(&(*blocks)[i]); }
};

using RkMap = IdxSet<RkOf>;

// A set of record indices (one stream's carried entries), so that clearing a stream costs
// O(its entries): indices are cut into chunks of 2^16; a chunk keeps its members' low 16 bits as
// a sorted array (2 bytes each, the array sized to them within 1/8) while it has at most 4,096,
// else as a 65,536-bit map (8 KiB: at most 2 bytes a member); a map that falls to 2,048 members
// becomes an array again.  The chunks are kept sorted by number; for_each visits the indices in
// ascending order.
class IdxBits {
  public:
    IdxBits() = default;
    IdxBits(const IdxBits&) = delete;
    IdxBits& operator=(const IdxBits&) = delete;
    IdxBits(IdxBits&& o) noexcept : ch_(std::move(o.ch_)), size_(o.size_), last_(o.last_) {
        o.ch_.clear();
        o.size_ = 0;
    }
    IdxBits& operator=(IdxBits&& o) noexcept {
        if (this != &o) {
            release();
            ch_ = std::move(o.ch_);
            size_ = o.size_;
            last_ = o.last_;
            o.ch_.clear();
            o.size_ = 0;
        }
        return *this;
    }
    ~IdxBits() { release(); }

    size_t size() const { return size_; }
    bool empty() const { return size_ == 0; }

    // Adds i (no-op if present).
    void insert(u32 i) {
        u32 id = i >> 16;
        uint16_t lo = (uint16_t)i;
        size_t k = find_chunk(id);
        if (k == NPOS) {
            auto it = std::lower_bound(ch_.begin(), ch_.end(), id, [](const Chunk& c, u32 v) { return c.id < v; });
            k = (size_t)(it - ch_.begin());
            void* p = std::malloc(4 * sizeof(uint16_t));
            if (!p) throw std::bad_alloc();
            ch_.insert(it, Chunk{id, 0, 4, p});
            last_ = k;
        }
        Chunk& c = ch_[k];
        if (c.cap == 0) {
            u64* w = static_cast<u64*>(c.p);
            u64 b = 1ULL << (lo & 63);
            if (w[lo >> 6] & b) return;
            w[lo >> 6] |= b;
        } else {
            uint16_t* a = static_cast<uint16_t*>(c.p);
            uint16_t* pos = std::lower_bound(a, a + c.n, lo);
            if (pos != a + c.n && *pos == lo) return;
            if (c.n == ARR_MAX) {
                u64* w = static_cast<u64*>(std::calloc(WORDS, sizeof(u64)));
                if (!w) throw std::bad_alloc();
                for (u32 j = 0; j < c.n; ++j) w[a[j] >> 6] |= 1ULL << (a[j] & 63);
                w[lo >> 6] |= 1ULL << (lo & 63);
                std::free(a);
                c.p = w;
                c.cap = 0;
            } else {
                if (c.n == c.cap) {
                    u32 ncap = std::min<u32>(ARR_MAX, c.cap + std::max<u32>(4, c.cap / 8));
                    size_t off = (size_t)(pos - a);
                    a = static_cast<uint16_t*>(std::realloc(a, ncap * sizeof(uint16_t)));
                    if (!a) throw std::bad_alloc();
                    c.p = a;
                    c.cap = ncap;
                    pos = a + off;
                }
                std::memmove(pos + 1, pos, (size_t)(a + c.n - pos) * sizeof(uint16_t));
                *pos = lo;
            }
        }
        ++c.n;
        ++size_;
    }

    // Removes i; false if absent.
    bool erase(u32 i) {
        size_t k = find_chunk(i >> 16);
        if (k == NPOS) return false;
        uint16_t lo = (uint16_t)i;
        Chunk& c = ch_[k];
        if (c.cap == 0) {
            u64* w = static_cast<u64*>(c.p);
            u64 b = 1ULL << (lo & 63);
            if (!(w[lo >> 6] & b)) return false;
            w[lo >> 6] &= ~b;
            --c.n;
            if (c.n <= ARR_MIN) {
                uint16_t* a = static_cast<uint16_t*>(std::malloc(std::max<u32>(c.n, 1) * sizeof(uint16_t)));
                if (!a) {
                    w[lo >> 6] |= b;
                    ++c.n;
                    throw std::bad_alloc();
                }
                u32 n = 0;
                for (u32 j = 0; j < WORDS; ++j)
                    for (u64 m = w[j]; m; m &= m - 1) a[n++] = (uint16_t)(j * 64 + __builtin_ctzll(m));
                std::free(w);
                c.p = a;
                c.cap = std::max<u32>(c.n, 1);
            }
        } else {
            uint16_t* a = static_cast<uint16_t*>(c.p);
            uint16_t* pos = std::lower_bound(a, a + c.n, lo);
            if (pos == a + c.n || *pos != lo) return false;
            std::memmove(pos, pos + 1, (size_t)(a + c.n - pos - 1) * sizeof(uint16_t));
            --c.n;
            if (c.n == 0) {
                std::free(a);
                ch_.erase(ch_.begin() + (long)k);
                last_ = 0;
            } else if (c.cap >= 2 * c.n + 8) {
                u32 ncap = c.n + c.n / 8 + 4;
                if (void* p = std::realloc(a, ncap * sizeof(uint16_t))) {
                    c.p = p;
                    c.cap = ncap;
                }
            }
        }
        --size_;
        if (size_ == 0) std::vector<Chunk>().swap(ch_);
        return true;
    }

    bool contains(u32 i) const {
        size_t k = find_chunk(i >> 16);
        if (k == NPOS) return false;
        uint16_t lo = (uint16_t)i;
        const Chunk& c = ch_[k];
        if (c.cap == 0) return (static_cast<const u64*>(c.p)[lo >> 6] >> (lo & 63)) & 1;
        const uint16_t* a = static_cast<const uint16_t*>(c.p);
        return std::binary_search(a, a + c.n, lo);
    }

    // f(index) for every member, ascending; f must not change the set.
    template <class F>
    void for_each(F&& f) const {
        for (const Chunk& c : ch_) {
            u32 base = c.id << 16;
            if (c.cap == 0) {
                const u64* w = static_cast<const u64*>(c.p);
                for (u32 j = 0; j < WORDS; ++j)
                    for (u64 m = w[j]; m; m &= m - 1) f(base | (j * 64 + (u32)__builtin_ctzll(m)));
            } else {
                const uint16_t* a = static_cast<const uint16_t*>(c.p);
                for (u32 j = 0; j < c.n; ++j) f(base | a[j]);
            }
        }
    }

    size_t bytes() const {
        size_t b = ch_.capacity() * sizeof(Chunk);
        for (const Chunk& c : ch_) b += c.cap == 0 ? WORDS * sizeof(u64) : c.cap * sizeof(uint16_t);
        return b;
    }

  private:
    static constexpr u32 ARR_MAX = 4096, ARR_MIN = 2048, WORDS = 1024;
    static constexpr size_t NPOS = ~size_t(0);
    struct Chunk {
        u32 id;   // index >> 16
        u32 n;    // members
        u32 cap;  // array capacity (entries); 0: p is a bitmap of WORDS words
        void* p;
    };

    size_t find_chunk(u32 id) const {
        if (last_ < ch_.size() && ch_[last_].id == id) return last_;
        auto it = std::lower_bound(ch_.begin(), ch_.end(), id, [](const Chunk& c, u32 v) { return c.id < v; });
        if (it == ch_.end() || it->id != id) return NPOS;
        last_ = (size_t)(it - ch_.begin());
        return last_;
    }

    void release() {
        for (Chunk& c : ch_) std::free(c.p);
        ch_.clear();
    }

    std::vector<Chunk> ch_;
    size_t size_ = 0;
    mutable size_t last_ = 0;
};

// One publisher stream's engine key -> request key map: the entries its holders carry (FLAG_S;
// found through level 2, or level 1 in compat mode; `carried` lists their records for clears)
// and the others, explicit.
struct Stream {
    IdxBits carried;  // records whose holder of this stream carries an entry (FLAG_S)
    U64Map<u64> x;    // the others
    uint16_t pod = 0, rid = 0, model = 0;
    size_t size() const { return carried.size() + x.size(); }
    bool empty() const { return carried.empty() && x.empty(); }
};

// One model's level 2: engine key -> (request key, streams mapping it).
struct Engine {
    IdxSet<HolderKey> t;  // (rk, 1) entries carried by holders (FLAG_L)
    U64Map<EngineRef> x;  // the others
    size_t size() const { return t.size() + x.size(); }
    bool empty() const { return t.empty() && x.empty(); }
};

// A publisher stream: (pod slot, model id, DP rank).
inline u64 stream_id(uint16_t pod, uint16_t model, int32_t rank) {
    return ((u64)pod << 48) | ((u64)model << 32) | (u32)rank;
}
inline uint16_t stream_pod(u64 sid) { return (uint16_t)(sid >> 48); }
inline uint16_t stream_model(u64 sid) { return (uint16_t)(sid >> 32); }
inline int32_t stream_rank(u64 sid) { return (int32_t)(u32)sid; }
constexpr int ALL = -1;

class IndexCore {
  public:
    IndexCore(u64 capacity, bool compat) : capacity_(capacity), compat_(compat) {
        if (capacity < 1) throw std::invalid_argument("capacity must be >= 1");
    }

    // --------------------------------------------------------------- writes

    // Store (pod, rank) holding request keys rks[i] as engine keys eks[i] in tier `bit`.
    size_t store_keys(const std::string& pod, int32_t rank, uint16_t mid, nb::handle eks_o, nb::handle rks_o,
                      u64 bit) {
        U64View eks, rks;
        to_u64(eks_o, eks, "engine_keys");
        to_u64(rks_o, rks, "request_keys");
        if (eks.n != rks.n) throw nb::value_error("engine_keys and request_keys differ in length");
        nb::gil_scoped_release nogil;
        auto lk = wlock();
        uint16_t ps = pod_slot(pod);
        u64 sid = stream_id(ps, mid, rank);
        for (size_t i = 0; i < eks.n; ++i) put(ps, rank, mid, sid, eks.data[i], rks.data[i], bit);
        finish_write(ps);
        return eks.n;
    }

    // Chain the request keys of `tokens` from `state` (xxh3_chain) and store them; returns the keys.
    nb::bytes store_chain(const std::string& pod, int32_t rank, uint16_t mid, nb::handle eks_o,
                                                          u64 state, nb::handle toks_o, nb::handle K_o, u64 A,
                                                          u64 bit) {
        U64View eks, toks, K;
        to_u64(eks_o, eks, "engine_keys");
        to_u64(toks_o, toks, "token_ids");
        to_u64(K_o, K, "K");
        size_t bs = K.n;
        if (bs == 0 || toks.n != bs * eks.n) throw nb::value_error("token count is not block_size * blocks");
        std::vector<u64> rks(eks.n);
        {
            nb::gil_scoped_release nogil;
            chain_into(state, toks.data, eks.n, K.data, bs, A, nullptr, rks.data());
            auto lk = wlock();
            uint16_t ps = pod_slot(pod);
            u64 sid = stream_id(ps, mid, rank);
            for (size_t i = 0; i < eks.n; ++i) put(ps, rank, mid, sid, eks.data[i], rks[i], bit);
            finish_write(ps);
        }
        return new_u64_array(std::move(rks));
    }

    // Token-less BlockStored: add tier `bit` to blocks known by engine key.  Returns the request
    // keys updated (unknown engine keys are counted and skipped).
    nb::bytes store_tokenless(const std::string& pod, int32_t rank, uint16_t mid, nb::handle eks_o,
                                                              u64 bit) {
        U64View eks;
        to_u64(eks_o, eks, "engine_keys");
        std::vector<u64> done;
        {
            nb::gil_scoped_release nogil;
            auto lk = wlock();
            uint16_t ps = pod_slot(pod);
            u64 sid = stream_id(ps, mid, rank);
            stream_mk(sid);
            for (size_t i = 0; i < eks.n; ++i) {
                u64 ek = eks.data[i];
                std::optional<u64> rk = compat_ ? std::optional<u64>(ek) : resolve_locked(ps, rank, mid, ek);
                if (!rk) {
                    ++c_unknown_offloads_;
                    continue;
                }
                put(ps, rank, mid, sid, ek, *rk, bit);
                done.push_back(*rk);
            }
            finish_write(ps);
        }
        return new_u64_array(std::move(done));
    }

    // BlockRemoved of publisher (pod, rank, model): per engine key, whether a held tier copy went.
    std::vector<bool> remove(const std::string& pod, int32_t rank, uint16_t mid, nb::handle eks_o, u64 bit) {
        U64View eks;
        to_u64(eks_o, eks, "engine_keys");
        std::vector<bool> hit(eks.n, false);
        nb::gil_scoped_release nogil;
        auto lk = wlock();
        auto it = pod_by_name_.find(pod);
        if (it == pod_by_name_.end()) return hit;
        uint16_t ps = it->second;
        u64 sid = stream_id(ps, mid, rank);
        for (size_t i = 0; i < eks.n; ++i) {
            u64 ek = eks.data[i];
            Stream* st = stream(sid);
            u64 rk;
            if (st && s_find(*st, ek, rk) && drop_copy(ps, rank, ek, rk, bit)) hit[i] = true;
        }
        finish_write(ps);
        return hit;
    }

    // Forget what `pod` holds (rank `rank` only when >= 0 ... or any when all_ranks). Returns entries removed.
    size_t clear(const std::string& pod, std::optional<int32_t> rank, int model) {
        nb::gil_scoped_release nogil;
        auto lk = wlock();
        return clear_locked(pod, rank, model);
    }

    size_t clear_locked(const std::string& pod, std::optional<int32_t> rank, int model) {
        auto it = pod_by_name_.find(pod);
        if (it == pod_by_name_.end()) return 0;
        uint16_t ps = it->second;
        std::vector<u64> sids;
        for (auto& kv : streams_)
            if (stream_pod(kv.first) == ps && (!rank || stream_rank(kv.first) == *rank) &&
                (model == ALL || stream_model(kv.first) == (uint16_t)model))
                sids.push_back(kv.first);
        size_t n = 0;
        std::vector<std::pair<u64, u64>> ents;
        for (u64 sid : sids) {
            ents.clear();
            {
                // take the stream's entries out (the holders carrying them let go) and drop it
                Stream& st = streams_.find(sid)->second;
                st.carried.for_each([&](u32 bi) {
                    Holder* h = s_holder(st, bi);
                    ents.emplace_back(h->ek, blocks_[bi].rk);
                    h->pf &= (uint16_t)~FLAG_S;
                });
                st.x.for_each([&](u64 ek, u64 rk) { ents.emplace_back(ek, rk); });
                streams_.erase(sid);
            }
            int32_t r = stream_rank(sid);
            uint16_t sm = stream_model(sid);
            for (auto& [ek, rk] : ents) {
                unref_engine(ek, sm);
                Found bi = rk_map_.find_ptr(rk);
                if (!bi) continue;
                Block& b = blocks_[*bi];
                size_t h = find_holder(b, ps, r);
                if (h == NIL) continue;
                ++n;
                erase_holder(*bi, h);
            }
        }
        finish_write(ps);
        return n;
    }

    // ----------------------------------------------------------- batch apply

    // One decoded batch of publisher (pod, rank, model id `mid`), applied from events[start:] in
    // one call: BlockStored (with tokens, no extra keys, no LoRA, known tier, right block size),
    // BlockRemoved and AllBlocksCleared.  The events are read with the GIL held, then applied in
    // order under one exclusive lock with the GIL released.  Stops before the first event it does
    // not take (another kind, an unknown tier, extra keys, a token-less store, a malformed one) or,
    // in xxh3_chain mode, whose parent engine key is unknown: the caller applies that one in Python
    // and calls again from the next.  Returns (next index, stored events, stored blocks, removed
    // events, removed blocks (sum of lengths), removals that hit, removals that missed, clears,
    // clears that removed something, stored blocks per tier bit, removed blocks per tier bit); the
    // per-bit lists end at the highest bit counted.
    std::tuple<size_t, size_t, size_t, size_t, size_t, size_t, size_t, size_t, size_t, std::vector<u64>,
               std::vector<u64>>
    apply_events(
        const std::string& pod, int32_t rank, uint16_t mid, nb::handle events_o, size_t start,
        nb::handle stored_t, nb::handle removed_t, nb::handle cleared_t, nb::handle tier_bits, u64 root,
        nb::handle K_o, u64 A) {
        U64View K;
        to_u64(K_o, K, "K");
        size_t bs = K.n;
        if (bs == 0) throw nb::value_error("empty K");
        if (!PyDict_Check(tier_bits.ptr())) throw nb::type_error("tier_bits must be a dict");
        PyObject* seq = PySequence_Fast(events_o.ptr(), "events");
        if (!seq) throw nb::python_error();
        nb::object seq_ref = nb::steal(seq);
        size_t n = (size_t)PySequence_Fast_GET_SIZE(seq);
        PyObject** items = PySequence_Fast_ITEMS(seq);
        static nb::str a_hashes("block_hashes"), a_parent("parent_block_hash"), a_tokens("token_ids"),
            a_bsize("block_size"), a_tier("tier"), a_lora("lora_name"), a_extra("extra_keys");

        struct Ev {
            int kind = 0;  // 0 stored, 1 removed, 2 cleared
            u64 bit = 0;
            bool has_parent = false;
            u64 parent = 0;
            U64View eks, toks;
        };
        std::vector<Ev> evs;
        evs.reserve(n > start ? n - start : 0);
        size_t stop = start;
        for (; stop < n; ++stop) {
            PyObject* ev = items[stop];
            PyObject* tp = (PyObject*)Py_TYPE(ev);
            if (tp == cleared_t.ptr()) {
                evs.emplace_back();
                evs.back().kind = 2;
                continue;
            }
            bool is_store = tp == stored_t.ptr();
            if (!is_store && tp != removed_t.ptr()) break;
            nb::handle e(ev);
            nb::object tier = nb::getattr(e, a_tier);
            PyObject* bit_o = PyDict_GetItemWithError(tier_bits.ptr(), tier.ptr());
            if (!bit_o) {
                if (PyErr_Occurred()) PyErr_Clear();
                break;
            }
            Ev x;
            x.kind = is_store ? 0 : 1;
            x.bit = PyLong_AsUnsignedLongLong(bit_o);
            if (x.bit == (u64)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                break;
            }
            try {
                to_u64(nb::getattr(e, a_hashes), x.eks, "block_hashes");
            } catch (nb::builtin_exception&) {
                break;
            } catch (nb::python_error&) {
                break;
            }
            if (is_store) {
                if (!nb::getattr(e, a_lora).is_none() || !nb::getattr(e, a_extra).is_none()) break;
                nb::object bsz = nb::getattr(e, a_bsize);
                if (!bsz.is_none()) {
                    long v = PyLong_AsLong(bsz.ptr());
                    if (v == -1 && PyErr_Occurred()) {
                        PyErr_Clear();
                        break;
                    }
                    if ((size_t)v != bs) break;
                }
                try {
                    to_u64(nb::getattr(e, a_tokens), x.toks, "token_ids");
                } catch (nb::builtin_exception&) {
                    break;
                } catch (nb::python_error&) {
                    break;
                }
                if (x.toks.n == 0 || x.toks.n != bs * x.eks.n) break;
                nb::object par = nb::getattr(e, a_parent);
                if (!par.is_none()) {
                    if (!PyLong_Check(par.ptr()) || PyBool_Check(par.ptr())) break;
                    x.parent = PyLong_AsUnsignedLongLong(par.ptr());
                    if (x.parent == (u64)-1 && PyErr_Occurred()) {
                        PyErr_Clear();
                        break;
                    }
                    x.has_parent = true;
                }
            }
            evs.push_back(std::move(x));
        }

        size_t st_ev = 0, st_blocks = 0, rm_ev = 0, rm_blocks = 0, hits = 0, misses = 0, clears = 0, clears_n = 0;
        std::vector<u64> st_bits(64, 0), rm_bits(64, 0);
        size_t applied = 0;
        {
            nb::gil_scoped_release nogil;
            auto lk = wlock();
            std::vector<u64> rks;
            for (; applied < evs.size(); ++applied) {
                Ev& x = evs[applied];
                if (x.kind == 2) {
                    size_t removed = clear_locked(pod, rank, mid);
                    ++clears;
                    if (removed) ++clears_n;
                    continue;
                }
                if (x.kind == 1) {
                    auto it = pod_by_name_.find(pod);
                    if (it == pod_by_name_.end()) {
                        misses += x.eks.n;
                    } else {
                        uint16_t ps = it->second;
                        u64 sid = stream_id(ps, mid, rank);
                        for (size_t i = 0; i < x.eks.n; ++i) {
                            u64 ek = x.eks.data[i];
                            Stream* stp = stream(sid);
                            u64 rk;
                            if (stp && s_find(*stp, ek, rk) && drop_copy(ps, rank, ek, rk, x.bit))
                                ++hits;
                            else
                                ++misses;
                        }
                        finish_write(ps);
                    }
                    ++rm_ev;
                    rm_blocks += x.eks.n;
                    if (x.bit) rm_bits[__builtin_ctzll(x.bit)] += x.eks.n;
                    continue;
                }
                size_t nb_ = x.eks.n;
                const u64* keys = x.eks.data;
                if (!compat_) {
                    u64 state = root;
                    if (x.has_parent) {
                        std::optional<u64> prk;
                        auto it = pod_by_name_.find(pod);
                        if (it != pod_by_name_.end()) {
                            prk = resolve_locked(it->second, rank, mid, x.parent);
                        } else {
                            prk = engine_find(mid, x.parent);
                        }
                        if (!prk) break;  // an orphan: the caller keeps it
                        state = *prk;
                    }
                    rks.resize(nb_);
                    chain_into(state, x.toks.data, nb_, K.data, bs, A, nullptr, rks.data());
                    keys = rks.data();
                }
                uint16_t ps = pod_slot(pod);
                u64 sid = stream_id(ps, mid, rank);
                for (size_t i = 0; i < nb_; ++i) put(ps, rank, mid, sid, x.eks.data[i], keys[i], x.bit);
                finish_write(ps);
                ++st_ev;
                st_blocks += nb_;
                if (x.bit) st_bits[__builtin_ctzll(x.bit)] += nb_;
            }
        }
        for (std::vector<u64>* v : {&st_bits, &rm_bits})
            while (!v->empty() && v->back() == 0) v->pop_back();
        return {start + applied, st_ev, st_blocks, rm_ev, rm_blocks, hits, misses, clears, clears_n,
                std::move(st_bits), std::move(rm_bits)};
    }

    // Makes `rk` the most recently used key (if held).
    void touch(nb::handle keys_o) {
        U64View keys;
        to_u64(keys_o, keys, "request_keys");
        nb::gil_scoped_release nogil;
        auto lk = wlock();
        touch_locked(keys.data, keys.n);
    }

    // --------------------------------------------------------------- reads

    // Longest consecutive prefix per candidate pod, as tier masks (OR over ranks) per block.
    // pods: list of names, or None = every pod holding blocks.  Refreshes recency of the
    // longest match (logged, see Locking).  Returns {pod: masks as uint64 bytes} for pods
    // matching >= 1 block; None when `guard` and a writer is inside a multi-call event.
    nb::object prefix_match(nb::handle keys_o, nb::handle pods_o, bool touch, bool guard) {
        U64View keys;
        to_u64(keys_o, keys, "request_keys");
        std::vector<std::string> names = candidate_names(pods_o);
        std::vector<std::vector<u64>> masks;
        std::vector<std::string> matched_names;
        bool busy = false;
        {
            nb::gil_scoped_release nogil;
            bool flush = false;
            std::shared_lock lk(mu_);
            if (guard && multi_) {
                busy = true;
            } else {
                std::vector<int> cand_slot;
                std::vector<std::string> cnames;
                slots_of(names, cand_slot, cnames);
                masks.assign(cand_slot.size(), {});
                std::vector<u32> path;
                walk(keys.data, keys.n, cand_slot, [&](size_t c, size_t, u64 m) { masks[c].push_back(m); },
                     touch ? &path : nullptr);
                std::vector<std::vector<u64>> kept;
                for (size_t c = 0; c < masks.size(); ++c) {
                    if (masks[c].empty()) continue;
                    matched_names.push_back(cnames[c]);
                    kept.push_back(std::move(masks[c]));
                }
                masks.swap(kept);
                if (touch) flush = log_touches(path);
            }
            lk.unlock();
            if (flush) {
                auto wl = wlock();
            }
        }
        if (busy) return nb::none();
        nb::dict out;
        for (size_t c = 0; c < masks.size(); ++c) out[nb::str(matched_names[c].c_str())] = new_u64_array(std::move(masks[c]));
        return out;
    }

    // (index of the pod in the candidate names, matched blocks, weighted blocks, OR of the masks,
    // the DP rank of every holder of the pod's matched blocks when they share one, else NO_RANK)
    using Summary = std::vector<std::tuple<size_t, size_t, double, u64, int64_t>>;
    static constexpr int64_t NO_RANK = INT64_MIN;

    // Per candidate pod with a match: {pod: (matched blocks, sum over the matched blocks of the
    // block's weight, OR of the masks)}.  weights[b] is the weight of tier bit b; a block weighs
    // its best tier.  Refreshes recency like prefix_match.  Returns (that dict, longest match), or
    // None when `guard` and a writer is inside a multi-call event.  The dict's keys are the
    // caller's pod objects when `pods` is given.  With `ranks`, also a third element {pod: DP
    // rank} for the pods whose matched blocks one DP rank holds (best_dp_rank's answer for them).
    nb::object prefix_summary(nb::handle keys_o, nb::handle pods_o, std::vector<double> weights, bool touch,
                              bool guard, bool ranks) {
        U64View keys;
        to_u64(keys_o, keys, "request_keys");
        std::vector<nb::handle> given;
        std::vector<std::string> names = candidate_names(pods_o, &given);
        Summary res;
        size_t longest;
        {
            std::optional<nb::gil_scoped_release> nogil;
            if (keys.n >= NOGIL_MIN_BLOCKS) nogil.emplace();
            longest = summary_locked(keys.data, keys.n, names, weights, touch, guard, res);
        }
        if (longest == BUSY) return nb::none();
        if (ranks) return nb::make_tuple(summary_dict(res, names, given), longest, rank_dict(res, names, given));
        return nb::make_tuple(summary_dict(res, names, given), longest);
    }

    nb::dict summary_dict(const Summary& res, const std::vector<std::string>& names,
                          const std::vector<nb::handle>& given) {
        nb::dict out;
        for (const auto& [c, n, w, u, r] : res) {
            nb::object key = given.empty() ? nb::object(nb::str(names[c].c_str())) : nb::borrow(given[c]);
            out[key] = nb::make_tuple(n, w, u);
        }
        return out;
    }

    nb::dict rank_dict(const Summary& res, const std::vector<std::string>& names,
                       const std::vector<nb::handle>& given) {
        nb::dict out;
        for (const auto& [c, n, w, u, r] : res) {
            if (r == NO_RANK) continue;
            nb::object key = given.empty() ? nb::object(nb::str(names[c].c_str())) : nb::borrow(given[c]);
            out[key] = nb::int_((long long)r);
        }
        return out;
    }

    // Request keys of `tokens` (xxh3_chain from `state`) and their prefix_summary, in one call:
    // (keys as uint64 bytes, rows, longest[, ranks]), or None when `guard` and a writer is inside
    // a multi-call event.
    nb::object match_tokens(u64 state, nb::handle toks_o, nb::handle K_o, u64 A, nb::handle pods_o,
                            std::vector<double> weights, bool touch, bool guard, bool ranks) {
        U64View toks, K;
        to_u64(toks_o, toks, "tokens");
        to_u64(K_o, K, "K");
        size_t bs = K.n;
        if (bs == 0) throw nb::value_error("empty K");
        std::vector<nb::handle> given;
        std::vector<std::string> names = candidate_names(pods_o, &given);
        std::vector<u64> keys(toks.n / bs);
        Summary res;
        size_t longest;
        {
            std::optional<nb::gil_scoped_release> nogil;
            if (keys.size() >= NOGIL_MIN_BLOCKS) nogil.emplace();
            chain_into(state, toks.data, keys.size(), K.data, bs, A, nullptr, keys.data());
            longest = summary_locked(keys.data(), keys.size(), names, weights, touch, guard, res);
        }
        if (longest == BUSY) return nb::none();
        if (ranks)
            return nb::make_tuple(new_u64_array(std::move(keys)), summary_dict(res, names, given), longest,
                                  rank_dict(res, names, given));
        return nb::make_tuple(new_u64_array(std::move(keys)), summary_dict(res, names, given), longest);
    }

    // Writers of one event in several calls mark them (see Locking); nested marks count.
    void begin_multi() {
        nb::gil_scoped_release nogil;
        auto lk = wlock();
        ++multi_;
    }
    void end_multi() {
        nb::gil_scoped_release nogil;
        auto lk = wlock();
        if (multi_ == 0) throw std::logic_error("end_multi without begin_multi");
        --multi_;
    }

    // Per candidate pod: tier mask (OR over ranks) of every key, 0 where it holds none.
    nb::dict pod_masks(nb::handle keys_o, std::vector<std::string> names) {
        U64View keys;
        to_u64(keys_o, keys, "request_keys");
        std::vector<std::vector<u64>> rows(names.size(), std::vector<u64>(keys.n, 0));
        {
            nb::gil_scoped_release nogil;
            std::shared_lock lk(mu_);
            for (size_t c = 0; c < names.size(); ++c) {
                auto it = pod_by_name_.find(names[c]);
                if (it == pod_by_name_.end()) continue;
                for (size_t i = 0; i < keys.n; ++i) {
                    Found bi = rk_map_.find_ptr(keys.data[i]);
                    if (!bi) continue;
                    u64 m = 0;
                    for (const Holder& h : blocks_[*bi].hs)
                        if (h.pod() == it->second) m |= hmask(h);
                    rows[c][i] = m;
                }
            }
        }
        nb::dict out;
        for (size_t c = 0; c < names.size(); ++c) out[nb::str(names[c].c_str())] = new_u64_array(std::move(rows[c]));
        return out;
    }

    // Every holder of each key: per key a list of (pod, tier mask, rank).
    std::vector<std::vector<std::tuple<std::string, u64, int32_t>>> lookup(nb::handle keys_o) {
        U64View keys;
        to_u64(keys_o, keys, "request_keys");
        std::vector<std::vector<std::tuple<std::string, u64, int32_t>>> out(keys.n);
        nb::gil_scoped_release nogil;
        std::shared_lock lk(mu_);
        for (size_t i = 0; i < keys.n; ++i) {
            Found bi = rk_map_.find_ptr(keys.data[i]);
            if (!bi) continue;
            for (const Holder& h : blocks_[*bi].hs) out[i].emplace_back(pod_names_[h.pod()], hmask(h), hrank(h));
        }
        return out;
    }

    // DP rank of `pod` holding the longest consecutive prefix (ties: lower rank).
    std::optional<int32_t> best_dp_rank(const std::string& pod, nb::handle keys_o) {
        U64View keys;
        to_u64(keys_o, keys, "request_keys");
        nb::gil_scoped_release nogil;
        std::shared_lock lk(mu_);
        auto it = pod_by_name_.find(pod);
        if (it == pod_by_name_.end() || keys.n == 0) return std::nullopt;
        uint16_t ps = it->second;
        // the common case: the pod publishes from one DP rank, which then holds its whole match
        int32_t only = 0;
        int nranks = 0;
        for (auto& kv : streams_) {
            if (stream_pod(kv.first) != ps || kv.second.empty()) continue;
            int32_t r = stream_rank(kv.first);
            if (nranks == 0 || r != only) {
                if (nranks == 1) {
                    nranks = 2;
                    break;
                }
                only = r;
                nranks = 1;
            }
        }
        if (nranks == 1) {
            Found bi = rk_map_.find_ptr(keys.data[0]);
            if (bi)
                for (const Holder& h : blocks_[*bi].hs)
                    if (h.pod() == ps && hrank(h) == only) return only;
            return std::nullopt;
        }
        std::vector<int32_t> alive, next;
        bool first = true;
        std::optional<int32_t> best;
        for (size_t i = 0; i < keys.n; ++i) {
            Found bi = rk_map_.find_ptr(keys.data[i]);
            next.clear();
            if (bi)
                for (const Holder& h : blocks_[*bi].hs)
                    if (h.pod() == ps && (first || std::find(alive.begin(), alive.end(), hrank(h)) != alive.end()))
                        next.push_back(hrank(h));
            first = false;
            alive.swap(next);
            if (alive.empty()) break;
            best = *std::min_element(alive.begin(), alive.end());
        }
        return best;
    }

    // The request key stream (pod, rank, model) maps `ek` to, else the model's level 2; None if unknown.
    std::optional<u64> resolve(const std::string& pod, int32_t rank, uint16_t mid, u64 ek) {
        nb::gil_scoped_release nogil;
        std::shared_lock lk(mu_);
        auto it = pod_by_name_.find(pod);
        if (it != pod_by_name_.end()) return resolve_locked(it->second, rank, mid, ek);
        return engine_find(mid, ek);
    }

    // Level 2 under model `model` (ALL: the first model, in first-use order, knowing it).
    std::optional<u64> request_key_of(u64 ek, int model) {
        nb::gil_scoped_release nogil;
        std::shared_lock lk(mu_);
        if (compat_) {
            u64 rk;
            for (auto& kv : streams_)
                if ((model == ALL || stream_model(kv.first) == (uint16_t)model) && s_find(kv.second, ek, rk)) return ek;
            return std::nullopt;
        }
        for (auto& e : engines_)
            if (model == ALL || e.first == (uint16_t)model)
                if (std::optional<u64> rk = e_find(e.second, ek)) return rk;
        return std::nullopt;
    }

    std::vector<std::string> pods() {
        std::shared_lock lk(mu_);
        std::vector<std::string> out;
        for (size_t s = 0; s < pod_names_.size(); ++s)
            if (pod_blocks_[s]) out.push_back(pod_names_[s]);
        return out;
    }

    bool holds_pod(const std::string& pod) {
        std::shared_lock lk(mu_);
        auto it = pod_by_name_.find(pod);
        return it != pod_by_name_.end() && pod_blocks_[it->second] > 0;
    }

    // Does `pod` (any rank) hold request key `rk`?
    bool pod_holds(const std::string& pod, u64 rk) {
        std::shared_lock lk(mu_);
        auto it = pod_by_name_.find(pod);
        if (it == pod_by_name_.end()) return false;
        Found bi = rk_map_.find_ptr(rk);
        if (!bi) return false;
        for (const Holder& h : blocks_[*bi].hs)
            if (h.pod() == it->second) return true;
        return false;
    }

    // The subset of `keys` that `pod` holds (any rank): a bool per key.
    std::vector<bool> pod_holds_many(const std::string& pod, nb::handle keys_o) {
        U64View keys;
        to_u64(keys_o, keys, "request_keys");
        std::vector<bool> out(keys.n, false);
        nb::gil_scoped_release nogil;
        std::shared_lock lk(mu_);
        auto it = pod_by_name_.find(pod);
        if (it == pod_by_name_.end()) return out;
        for (size_t i = 0; i < keys.n; ++i) {
            Found bi = rk_map_.find_ptr(keys.data[i]);
            if (!bi) continue;
            for (const Holder& h : blocks_[*bi].hs)
                if (h.pod() == it->second) {
                    out[i] = true;
                    break;
                }
        }
        return out;
    }

    bool contains(u64 rk) {
        std::shared_lock lk(mu_);
        return rk_map_.find(rk) != NIL;
    }

    std::vector<u64> pod_keys(const std::string& pod, std::optional<int32_t> rank) {
        std::vector<u64> out;
        nb::gil_scoped_release nogil;
        std::shared_lock lk(mu_);
        auto it = pod_by_name_.find(pod);
        if (it == pod_by_name_.end()) return out;
        for (auto& kv : streams_)
            if (stream_pod(kv.first) == it->second && (!rank || stream_rank(kv.first) == *rank))
                s_for_each(kv.second, [&](u64, u64 rk) { out.push_back(rk); });
        return out;
    }

    size_t len() {
        std::shared_lock lk(mu_);
        return rk_map_.size();
    }

    nb::dict stats() {
        size_t entries = 0, pods = 0;
        std::vector<bool> live;
        u64 keys, engine_keys, ev, st, rm, ur, uo;
        {
            std::shared_lock lk(mu_);
            live.assign(pod_names_.size(), false);
            for (auto& kv : streams_) {
                entries += kv.second.size();
                if (!kv.second.empty()) live[stream_pod(kv.first)] = true;
            }
            for (bool b : live) pods += b;
            keys = rk_map_.size();
            engine_keys = entries;
            if (!compat_) {
                engine_keys = 0;
                for (auto& e : engines_) engine_keys += e.second.size();
            }
            ev = c_evictions_;
            st = c_stored_blocks_;
            rm = c_removed_blocks_;
            ur = c_unknown_removals_;
            uo = c_unknown_offloads_;
        }
        nb::dict d;
        d["keys"] = keys;
        d["entries"] = entries;
        d["engine_keys"] = engine_keys;
        d["pods"] = pods;
        d["evictions"] = ev;
        d["stored_blocks"] = st;
        d["removed_blocks"] = rm;
        d["unknown_removals"] = ur;
        d["unknown_offloads"] = uo;
        return d;
    }

    // Per tier bit b (0..63): (keys whose holders' OR-mask has b, holders whose mask has b).
    std::vector<std::pair<u64, u64>> tier_counts() {
        std::vector<std::pair<u64, u64>> out(64, {0, 0});
        std::shared_lock lk(mu_);
        for (u32 i = lru_head_; i != NIL; i = blocks_[i].next()) {
            u64 uni = 0;
            for (const Holder& h : blocks_[i].hs) {
                uni |= hmask(h);
                for (u64 m = hmask(h); m; m &= m - 1) ++out[__builtin_ctzll(m)].second;
            }
            for (u64 m = uni; m; m &= m - 1) ++out[__builtin_ctzll(m)].first;
        }
        size_t n = 64;
        while (n && out[n - 1].first == 0) --n;
        out.resize(n);
        return out;
    }

    // Bytes the index's own structures hold (capacity, not size; without allocator overhead).
    size_t memory_bytes() {
        std::shared_lock lk(mu_);
        size_t b = blocks_.capacity() * sizeof(Block) + free_.capacity() * sizeof(u32) + rk_map_.bytes();
        for (auto& e : engines_) b += e.second.t.bytes() + e.second.x.bytes() + 64;
        for (const Block& blk : blocks_)
            b += blk.hs.heap_bytes();
        b += attrs_.capacity() * sizeof(Attr) + rank_vals_.capacity() * sizeof(int32_t);
        for (auto& kv : streams_) b += kv.second.carried.bytes() + kv.second.x.bytes() + 96;
        return b;
    }

    // Internal consistency (for tests): raises AssertionError-like RuntimeError when broken.
    void check() {
        std::shared_lock lk(mu_);
        size_t n = 0;
        u32 prev = NIL;
        for (u32 i = lru_head_; i != NIL; i = blocks_[i].next()) {
            if (blocks_[i].prev() != prev) throw std::runtime_error("LRU links broken");
            Found bi = rk_map_.find_ptr(blocks_[i].rk);
            if (!bi || *bi != i) throw std::runtime_error("level 1 does not map a listed block");
            if (blocks_[i].hs.empty()) throw std::runtime_error("a block without holders");
            prev = i;
            ++n;
        }
        if (prev != lru_tail_) throw std::runtime_error("LRU tail wrong");
        if (n != rk_map_.size()) throw std::runtime_error("LRU length != level 1 size");
        std::vector<u64> counted(pod_names_.size(), 0);
        for (u32 i = lru_head_; i != NIL; i = blocks_[i].next()) {
            std::vector<uint16_t> seen;
            for (const Holder& h : blocks_[i].hs)
                if (std::find(seen.begin(), seen.end(), h.pod()) == seen.end()) seen.push_back(h.pod());
            for (uint16_t p : seen) ++counted[p];
        }
        for (size_t s = 0; s < counted.size(); ++s)
            if (counted[s] != pod_blocks_[s]) throw std::runtime_error("pod block count wrong");
        // entries carried by holders: each set slot has its holder, each flagged holder its slot
        auto check_set = [&](const IdxSet<HolderKey>& t) {
            t.for_each([&](u32 bi) {
                const Holder* h = t.key().holder(bi);
                if (!h || t.find(h->ek) != bi) throw std::runtime_error("a carried entry without its holder");
            });
        };
        for (auto& e : engines_) check_set(e.second.t);
        // carried stream entries: each listed record has the stream's flagged holder, found through
        // level 2 (level 1 in compat mode) by its engine key, with no explicit entry beside it
        for (auto& kv : streams_) {
            const Stream& st = kv.second;
            st.carried.for_each([&](u32 bi) {
                const Holder* h = s_holder(st, bi);
                if (!h) throw std::runtime_error("a listed stream record without its holder");
                if (carried_block(st.model, h->ek) != bi)
                    throw std::runtime_error("a carried stream entry that its lookup does not find");
                if (st.x.find(h->ek)) throw std::runtime_error("a carried stream entry also kept explicitly");
            });
        }
        for (u32 i = lru_head_; i != NIL; i = blocks_[i].next())
            for (const Holder& h : blocks_[i].hs) {
                if (h.pf & FLAG_S) {
                    auto it = streams_.find(stream_id(h.pod(), hmodel(h), hrank(h)));
                    if (it == streams_.end() || !it->second.carried.contains(i))
                        throw std::runtime_error("a holder's stream entry is missing");
                }
                if (h.pf & FLAG_L) {
                    Engine* em = nullptr;
                    for (auto& e : engines_)
                        if (e.first == hmodel(h)) em = &e.second;
                    if (!em || em->t.find(h.ek) != i) throw std::runtime_error("a holder's level-2 entry is missing");
                }
            }
    }

  private:
    // ----------------------------------------------------------- helpers

    // Reads of fewer blocks keep the GIL: they take tens of microseconds, and giving the GIL up
    // costs a busy process more (the reader waits to be woken and scheduled again behind the
    // threads that took it: milliseconds on a loaded machine).  No thread waits for the GIL
    // while it holds mu_, so a reader holding the GIL while it waits for mu_ cannot deadlock.
    static constexpr size_t NOGIL_MIN_BLOCKS = 2048;
    static constexpr size_t BUSY = ~size_t(0);  // summary_locked's answer to a guarded read during a multi-call write

    size_t summary_locked(const u64* keys, size_t n, const std::vector<std::string>& names,
                          const std::vector<double>& weights, bool touch, bool guard, Summary& res) {
        size_t longest = 0;
        bool flush = false;
        {
            std::shared_lock lk(mu_);
            if (guard && multi_) return BUSY;
            std::vector<int> cand_slot;
            std::vector<std::string> cnames;
            std::vector<size_t> cidx;
            slots_of(names, cand_slot, cnames, &cidx);
            std::vector<size_t> cnt(cand_slot.size(), 0);
            std::vector<u64> uni(cand_slot.size(), 0);
            // per candidate: (mask, blocks) in first-seen order; weighted = sum of weight(mask) * blocks
            // in that order, the same float operations as scorer.prefix.prefix_scores_from_matches
            std::vector<std::vector<std::pair<u64, size_t>>> runs(cand_slot.size());
            std::vector<u32> path;
            std::vector<uint32_t> rid(cand_slot.size(), RID_NONE);
            summary_walk(keys, n, cand_slot, cnt, uni, runs, rid, touch ? &path : nullptr);
            for (size_t c = 0; c < cand_slot.size(); ++c) {
                if (!cnt[c]) continue;
                longest = std::max(longest, cnt[c]);
                double w = 0.0;
                for (auto& e : runs[c]) w += mask_weight(e.first, weights) * (double)e.second;
                res.emplace_back(cidx[c], cnt[c], w, uni[c],
                                 rid[c] < RID_MIXED ? (int64_t)rank_vals_[rid[c]] : NO_RANK);
            }
            if (touch) flush = log_touches(path);
        }
        if (flush) {
            auto wl = wlock();
        }
        return longest;
    }

    // The exclusive lock, with the logged recency refreshes applied first (every writer takes it so).
    std::unique_lock<std::shared_mutex> wlock() {
        std::unique_lock<std::shared_mutex> lk(mu_);
        flush_touches_locked();
        return lk;
    }

    // Under the shared lock: append a read's matched blocks (in match order) to the touch log.
    // Returns true when the log is past TOUCH_LOG_MAX (the caller then applies it).
    bool log_touches(const std::vector<u32>& path) {
        if (path.empty()) return false;
        std::lock_guard<std::mutex> g(log_mu_);
        touch_log_.insert(touch_log_.end(), path.begin(), path.end());
        return touch_log_.size() > TOUCH_LOG_MAX;
    }

    // Under the exclusive lock: apply the touch log as touch_locked would have, entry by entry.
    // Moving blocks to the tail one by one leaves the untouched blocks in their order followed
    // by the touched ones in the order of their last touch, so each block moves once, at its
    // last entry.
    void flush_touches_locked() {
        std::lock_guard<std::mutex> g(log_mu_);
        size_t n = touch_log_.size();
        if (n == 0) return;
        if (n <= 64) {
            for (u32 i : touch_log_) relink_tail(i);
        } else {
            size_t cap = 64;
            while (cap < 2 * n) cap <<= 1;
            std::vector<u32> seen(cap, NIL), order;
            order.reserve(n);
            for (size_t k = n; k-- > 0;) {
                u32 i = touch_log_[k];
                size_t s = fmix64(i) & (cap - 1);
                while (seen[s] != NIL && seen[s] != i) s = (s + 1) & (cap - 1);
                if (seen[s] == i) continue;
                seen[s] = i;
                order.push_back(i);
            }
            for (size_t k = order.size(); k-- > 0;) relink_tail(order[k]);
        }
        touch_log_.clear();
        if (touch_log_.capacity() > 2 * TOUCH_LOG_MAX) std::vector<u32>().swap(touch_log_);
    }

    void relink_tail(u32 i) {
        if (i == lru_tail_) return;
        lru_unlink(i);
        lru_push(i);
    }

    // The candidates' names (None: every pod holding blocks); `given` (if asked) receives the
    // caller's objects, borrowed from `pods_o` (which the caller keeps alive).
    std::vector<std::string> candidate_names(nb::handle pods_o, std::vector<nb::handle>* given = nullptr) {
        std::vector<std::string> names;
        if (pods_o.is_none()) {
            std::shared_lock lk(mu_);
            for (size_t s = 0; s < pod_names_.size(); ++s)
                if (pod_blocks_[s]) names.push_back(pod_names_[s]);
            return names;
        }
        if (given && (PyList_CheckExact(pods_o.ptr()) || PyTuple_CheckExact(pods_o.ptr()))) {
            for (nb::handle h : pods_o) {
                names.push_back(nb::cast<std::string>(h));
                given->push_back(h);
            }
            return names;
        }
        for (nb::handle h : pods_o) names.push_back(nb::cast<std::string>(h));
        return names;
    }

    // Candidate names -> slots (unknown or empty pods are dropped; duplicates once); `idx` (if
    // given) receives each kept name's position in `names`.
    void slots_of(const std::vector<std::string>& names, std::vector<int>& slots, std::vector<std::string>& kept,
                  std::vector<size_t>* idx = nullptr) {
        for (size_t k = 0; k < names.size(); ++k) {
            const std::string& nm = names[k];
            auto it = pod_by_name_.find(nm);
            if (it == pod_by_name_.end() || !pod_blocks_[it->second]) continue;
            if (std::find(slots.begin(), slots.end(), (int)it->second) != slots.end()) continue;
            slots.push_back(it->second);
            kept.push_back(nm);
            if (idx) idx->push_back(k);
        }
    }

    // Block indices of keys[0..m) into bis (NIL where absent), with their table slots, records and
    // holder arrays (up to 1 KiB) prefetched first: a walk's group of lookups overlaps its misses.
    void lookup_group(const u64* gk, size_t m, u32* bis) const {
        for (size_t j = 0; j < m; ++j) rk_map_.prefetch(gk[j]);
        for (size_t j = 0; j < m; ++j) {
            u32 h = rk_map_.at_home(gk[j]);
            if (h != NIL) __builtin_prefetch(&blocks_[h]);
        }
        for (size_t j = 0; j < m; ++j) {
            Found bi = rk_map_.find_ptr(gk[j]);
            bis[j] = bi ? *bi : NIL;
            if (!bi) continue;
            const Block& b = blocks_[*bi];
            const char* heap = static_cast<const char*>(b.hs.heap());
            if (!heap) continue;
            size_t bytes = b.hs.size() * sizeof(Holder);
            for (size_t off = 0; off < bytes && off < 1024; off += 64) __builtin_prefetch(heap + off);
        }
    }

    // Walk keys for the candidate slots; emit(c, pos, mask) for every block candidate c
    // still matches; stops when no candidate matches.  `path` (if given) receives the index of
    // every block some candidate matched, in order (the blocks the recency refresh moves).
    // Keys are looked up in groups: the group's home slots, then its block records, then their
    // holder arrays are prefetched before the group is walked, so the cache misses of a group
    // overlap (the walk is bound by them: a prompt's blocks are scattered over the tables).
    template <class Emit>
    void walk(const u64* keys, size_t n, const std::vector<int>& cand_slot, Emit&& emit,
              std::vector<u32>* path = nullptr) {
        size_t nc = cand_slot.size();
        if (nc == 0) return;
        std::vector<int> of_slot(pod_names_.size(), -1);
        for (size_t c = 0; c < nc; ++c) of_slot[cand_slot[c]] = (int)c;
        std::vector<u64> cur(nc, 0);
        // the candidates still matching, compact: a candidate that stops matching leaves the list
        // and its slot maps to -1, so later blocks cost only the holders and candidates still alive
        std::vector<size_t> live(nc);
        for (size_t c = 0; c < nc; ++c) live[c] = c;
        constexpr size_t GROUP = 16;
        u32 bis[GROUP];
        size_t group = 4;  // a miss at the first block (a new prompt) costs few lookups
        for (size_t g0 = 0; g0 < n && !live.empty(); g0 += group, group = std::min(GROUP, group * 2)) {
            size_t m = std::min(group, n - g0);
            lookup_group(keys + g0, m, bis);
            for (size_t j = 0; j < m && !live.empty(); ++j) {
                size_t i = g0 + j;
                if (bis[j] == NIL) return;
                for (const Holder& h : blocks_[bis[j]].hs) {
                    int c = of_slot[h.pod()];
                    if (c >= 0) cur[(size_t)c] |= hmask(h);
                }
                for (size_t k = 0; k < live.size();) {
                    size_t c = live[k];
                    if (cur[c]) {
                        emit(c, i, cur[c]);
                        cur[c] = 0;
                        ++k;
                    } else {
                        of_slot[cand_slot[c]] = -1;
                        live[k] = live.back();
                        live.pop_back();
                    }
                }
                if (path && !live.empty()) path->push_back(bis[j]);
            }
        }
    }

    // The walk of summary_locked: per candidate, blocks matched (cnt), OR of the masks (uni) and
    // the (mask, blocks) runs in first-seen order, as walk() with an emit that counts them, but
    // with flat per-candidate state: a block's holders stamp the candidates they belong to, the
    // live list is compacted only when fewer candidates than live ones hold the block, and a
    // candidate's run grows by one while its mask repeats (the usual case).  rid[c]: the interned
    // DP rank of every holder of c met, RID_MIXED once two differ.
    static constexpr uint32_t RID_NONE = 0x20000, RID_MIXED = 0x10000;  // rid[c] before a holder, and once two differ

    void summary_walk(const u64* keys, size_t n, const std::vector<int>& cand_slot, std::vector<size_t>& cnt,
                      std::vector<u64>& uni, std::vector<std::vector<std::pair<u64, size_t>>>& runs,
                      std::vector<uint32_t>& rid, std::vector<u32>* path) {
        size_t nc = cand_slot.size();
        if (nc == 0) return;
        std::vector<int> of_slot(pod_names_.size(), -1);
        for (size_t c = 0; c < nc; ++c) of_slot[cand_slot[c]] = (int)c;
        std::vector<size_t> stamp(nc, ~size_t(0)), runn(nc, 0);
        std::vector<u64> cur(nc, 0), runm(nc, 0);
        std::vector<size_t> live(nc);
        for (size_t c = 0; c < nc; ++c) live[c] = c;
        auto flush = [&](size_t c) {
            if (!runn[c]) return;
            cnt[c] += runn[c];
            uni[c] |= runm[c];
            for (auto& e : runs[c])
                if (e.first == runm[c]) {
                    e.second += runn[c];
                    return;
                }
            runs[c].emplace_back(runm[c], runn[c]);
        };
        const Attr* av = attrs_.data();
        constexpr size_t GROUP = 16;
        u32 bis[GROUP];
        size_t group = 4;
        bool done = false;
        const HolderVec* prev = nullptr;  // the last block walked holder by holder
        size_t streak = 0;                // blocks since then with the same holders
        for (size_t g0 = 0; g0 < n && !done; g0 += group, group = std::min(GROUP, group * 2)) {
            size_t m = std::min(group, n - g0);
            lookup_group(keys + g0, m, bis);
            for (size_t j = 0; j < m; ++j) {
                size_t i = g0 + j;
                if (bis[j] == NIL) {
                    done = true;
                    break;
                }
                const HolderVec& hv = blocks_[bis[j]].hs;
                // the same holders (pods, attributes) as the previous block: every live candidate
                // holds this block with the same mask and rank, so its run grows by one (credited
                // in bulk below); this reads the holders but does none of the per-holder work
                if (prev && same_holders(hv, *prev)) {
                    ++streak;
                    if (path) path->push_back(bis[j]);
                    continue;
                }
                if (streak) {
                    for (size_t c : live) runn[c] += streak;
                    streak = 0;
                }
                prev = &hv;
                size_t hits = 0;
                for (const Holder& h : hv) {
                    int c = of_slot[h.pod()];
                    if (c < 0) continue;
                    const Attr& at = av[h.at];
                    u64 hm = at.mask;
                    if (!hm) continue;
                    uint32_t& r = rid[(size_t)c];
                    if (r != at.rid) r = r == RID_NONE ? at.rid : RID_MIXED;
                    if (stamp[(size_t)c] != i) {
                        stamp[(size_t)c] = i;
                        cur[(size_t)c] = hm;
                        ++hits;
                    } else {
                        cur[(size_t)c] |= hm;
                    }
                }
                if (hits != live.size()) {
                    for (size_t k = 0; k < live.size();) {
                        size_t c = live[k];
                        if (stamp[c] == i) {
                            ++k;
                        } else {
                            of_slot[cand_slot[c]] = -1;
                            live[k] = live.back();
                            live.pop_back();
                        }
                    }
                    if (live.empty()) {
                        done = true;
                        break;
                    }
                }
                for (size_t c : live) {
                    u64 cm = cur[c];
                    if (cm == runm[c]) {
                        ++runn[c];
                    } else {
                        flush(c);
                        runm[c] = cm;
                        runn[c] = 1;
                    }
                }
                if (path) path->push_back(bis[j]);
            }
        }
        if (streak)
            for (size_t c : live) runn[c] += streak;
        for (size_t c = 0; c < nc; ++c) flush(c);
    }

    // Two blocks' holders are the same (pod slot, flags, attributes) in the same order.
    static bool same_holders(const HolderVec& a, const HolderVec& b) {
        size_t n = a.size();
        if (n != b.size()) return false;
        const Holder* x = a.begin();
        const Holder* y = b.begin();
        for (size_t k = 0; k < n; ++k)
            if (x[k].pf != y[k].pf || x[k].at != y[k].at) return false;
        return true;
    }

    static double mask_weight(u64 m, const std::vector<double>& w) {
        double best = 0.0;
        bool any = false;
        for (size_t b = 0; m; ++b, m >>= 1)
            if (m & 1) {
                double x = b < w.size() ? w[b] : 0.0;
                if (!any || x > best) best = x;
                any = true;
            }
        return best;
    }

    uint16_t pod_slot(const std::string& pod) {
        auto it = pod_by_name_.find(pod);
        if (it != pod_by_name_.end()) return it->second;
        uint16_t s;
        if (!free_pods_.empty()) {
            s = free_pods_.back();
            free_pods_.pop_back();
            pod_names_[s] = pod;
            pod_blocks_[s] = 0;
        } else {
            if (pod_names_.size() >= MAX_PODS) throw std::length_error("more than 16381 pods hold blocks");
            s = (uint16_t)pod_names_.size();
            pod_names_.push_back(pod);
            pod_blocks_.push_back(0);
        }
        pod_by_name_.emplace(pod, s);
        return s;
    }

    // A pod that holds nothing gives its slot back (its empty streams go).
    void maybe_release(uint16_t ps) {
        if (pod_blocks_[ps] || pod_names_[ps].empty()) return;
        std::vector<u64> sids;
        for (auto& kv : streams_)
            if (stream_pod(kv.first) == ps) {
                if (!kv.second.empty()) return;
                sids.push_back(kv.first);
            }
        for (u64 sid : sids) streams_.erase(sid);
        pod_by_name_.erase(pod_names_[ps]);
        pod_names_[ps].clear();
        free_pods_.push_back(ps);
    }

    Stream* stream(u64 sid) {
        auto it = streams_.find(sid);
        return it == streams_.end() ? nullptr : &it->second;
    }

    Stream& stream_mk(u64 sid) {
        auto [it, ins] = streams_.try_emplace(sid);
        if (ins) {
            it->second.pod = stream_pod(sid);
            it->second.rid = rank_id(stream_rank(sid));
            it->second.model = stream_model(sid);
        }
        return it->second;
    }

    // ---- the entries of one stream (engine key -> request key)

    // The holder of block bi carrying an entry of stream st (FLAG_S), or nullptr.
    Holder* s_holder(const Stream& st, u32 bi) {
        for (Holder& h : blocks_[bi].hs) {
            if (!(h.pf & FLAG_S) || h.pod() != st.pod) continue;
            const Attr& a = attrs_[h.at];
            if (a.model == st.model && a.rid == st.rid) return &h;
        }
        return nullptr;
    }
    const Holder* s_holder(const Stream& st, u32 bi) const { return const_cast<IndexCore*>(this)->s_holder(st, bi); }

    // The record that would carry a stream entry of model mid for engine key ek: the record of
    // level 2's request key for (mid, ek) (compat mode: of request key ek), or NIL.
    u32 carried_block(uint16_t mid, u64 ek) const {
        if (compat_) return rk_map_.find(ek);
        const Engine* em = nullptr;
        for (auto& e : engines_)
            if (e.first == mid) em = &e.second;
        if (!em) return NIL;
        if (const EngineRef* v = em->x.find(ek)) return rk_map_.find(v->rk);
        return em->t.find(ek);
    }

    // The holder carrying stream st's entry for ek (its record in *bi), or nullptr.
    Holder* s_carrier(const Stream& st, u64 ek, u32* bi) {
        if (st.carried.empty()) return nullptr;
        u32 b = carried_block(st.model, ek);
        if (b == NIL) return nullptr;
        Holder* h = s_holder(st, b);
        if (!h || h->ek != ek) return nullptr;
        *bi = b;
        return h;
    }

    bool s_find(const Stream& st, u64 ek, u64& rk) {
        if (const u64* v = st.x.find(ek)) {
            rk = *v;
            return true;
        }
        u32 bi;
        if (!s_carrier(st, ek, &bi)) return false;
        rk = blocks_[bi].rk;
        return true;
    }

    // Erase ek from the stream if it maps to rk; true if it did.
    bool s_erase_if(Stream& st, u64 ek, u64 rk) {
        if (const u64* v = st.x.find(ek)) {
            if (*v != rk) return false;
            st.x.erase(ek);
            return true;
        }
        u32 bi;
        Holder* h = s_carrier(st, ek, &bi);
        if (!h || blocks_[bi].rk != rk) return false;
        h->pf &= (uint16_t)~FLAG_S;
        st.carried.erase(bi);
        return true;
    }

    template <class F>
    void s_for_each(const Stream& st, F&& f) const {
        st.carried.for_each([&](u32 bi) { f(s_holder(st, bi)->ek, blocks_[bi].rk); });
        st.x.for_each([&](u64 ek, u64 rk) { f(ek, rk); });
    }

    // The stream entry holder h of block bi carries becomes explicit (its engine key or level-2
    // value is about to change, or the holder goes).
    void s_detach(u32 bi, Holder& h) {
        Stream* st = stream(stream_id(h.pod(), hmodel(h), hrank(h)));
        st->carried.erase(bi);
        h.pf &= (uint16_t)~FLAG_S;
        *st->x.emplace(h.ek).first = blocks_[bi].rk;
    }

    // Level 2's value for (mid, ek) is changing from `old`: the stream entries carried for ek
    // (all on old's record) become explicit, so that their lookups, which go through level 2,
    // still find them.
    void s_detach_value(uint16_t mid, u64 ek, u64 old) {
        u32 bi = rk_map_.find(old);
        if (bi == NIL) return;
        for (Holder& h : blocks_[bi].hs)
            if ((h.pf & FLAG_S) && h.ek == ek && hmodel(h) == mid) s_detach(bi, h);
    }

    std::optional<u64> resolve_locked(uint16_t ps, int32_t rank, uint16_t mid, u64 ek) {
        u64 rk;
        if (Stream* st = stream(stream_id(ps, mid, rank)))
            if (s_find(*st, ek, rk)) return rk;
        return engine_find(mid, ek);
    }

    // ---- level 2 (per model: engine key -> (request key, streams))

    Engine* engine_map(uint16_t mid) {
        for (auto& e : engines_)
            if (e.first == mid) return &e.second;
        return nullptr;
    }

    std::optional<u64> e_find(const Engine& em, u64 ek) const {
        if (const EngineRef* v = em.x.find(ek)) return v->rk;
        u32 bi = em.t.find(ek);
        if (bi == NIL) return std::nullopt;
        return blocks_[bi].rk;
    }

    std::optional<u64> engine_find(uint16_t mid, u64 ek) {
        Engine* m = engine_map(mid);
        return m ? e_find(*m, ek) : std::nullopt;
    }

    // Drop the level-2 entry (mid, ek) carried by a holder of block bi; returns its request key.
    void e_untake(Engine& em, u64 ek, u32 bi) {
        Holder* h = const_cast<Holder*>(em.t.key().holder(bi));
        em.t.erase(ek);
        h->pf &= (uint16_t)~FLAG_L;
    }

    // The entries holder h (of block bi) carries move to the explicit maps, before its engine key
    // changes or it goes: the stream and level-2 contents stay what they were.
    void detach(u32 bi, Holder& h) {
        if (!(h.pf & (FLAG_S | FLAG_L))) return;
        u64 rk = blocks_[bi].rk;
        if (h.pf & FLAG_S) s_detach(bi, h);
        if (h.pf & FLAG_L) {
            Engine* em = engine_map(hmodel(h));
            em->t.erase(h.ek);
            h.pf &= (uint16_t)~FLAG_L;
            EngineRef* e = em->x.emplace(h.ek).first;
            e->rk = rk;
            e->refs = 1;
        }
    }

    size_t find_holder(const Block& b, uint16_t ps, int32_t rank) {
        uint16_t rid = rank_find(rank);
        if (rid == NO_RID) return NIL;
        for (size_t i = 0; i < b.hs.size(); ++i)
            if (b.hs[i].pod() == ps && attrs_[b.hs[i].at].rid == rid) return i;
        return NIL;
    }

    static bool has_pod(const Block& b, uint16_t ps) {
        for (const Holder& h : b.hs)
            if (h.pod() == ps) return true;
        return false;
    }

    void lru_unlink(u32 i) {
        Block& b = blocks_[i];
        u32 p = b.prev(), n = b.next();
        if (p != NIL) blocks_[p].set_next(n); else lru_head_ = n;
        if (n != NIL) blocks_[n].set_prev(p); else lru_tail_ = p;
        b.set_prev(NIL);
        b.set_next(NIL);
    }

    void lru_push(u32 i) {
        Block& b = blocks_[i];
        b.set_prev(lru_tail_);
        b.set_next(NIL);
        if (lru_tail_ != NIL) blocks_[lru_tail_].set_next(i); else lru_head_ = i;
        lru_tail_ = i;
    }

    void touch_locked(const u64* keys, size_t n) {
        for (size_t k = 0; k < n; ++k) {
            Found bi = rk_map_.find_ptr(keys[k]);
            if (!bi || *bi == lru_tail_) continue;
            u32 i = *bi;
            lru_unlink(i);
            lru_push(i);
        }
    }

    u32 new_block(u64 rk) {
        u32 i;
        if (!free_.empty()) {
            i = free_.back();
            free_.pop_back();
        } else {
            if (blocks_.size() >= MAX_BLOCKS) throw std::length_error("index full (134,217,727 blocks)");
            i = (u32)blocks_.size();
            size_t cap = blocks_.capacity();
            blocks_.emplace_back();
            if (blocks_.capacity() != cap) release_freed(cap * sizeof(Block));
        }
        blocks_[i].rk = rk;
        rk_map_.insert(rk, i);
        lru_push(i);
        return i;
    }

    void free_block(u32 i) {
        Block& b = blocks_[i];
        for (Holder& h : b.hs) detach(i, h);
        lru_unlink(i);
        rk_map_.erase(b.rk);
        b.hs.clear();
        free_.push_back(i);
    }

    // Remove holder h of block bi; drops the block when no holder is left.
    void erase_holder(u32 bi, size_t h) {
        Block& b = blocks_[bi];
        uint16_t ps = b.hs[h].pod();
        detach(bi, b.hs[h]);
        b.hs.erase(h);
        if (!has_pod(b, ps)) --pod_blocks_[ps];
        if (b.hs.empty()) free_block(bi);
    }

    void unref_engine(u64 ek, uint16_t mid) {
        if (compat_) return;
        for (size_t i = 0; i < engines_.size(); ++i) {
            if (engines_[i].first != mid) continue;
            Engine& em = engines_[i].second;
            if (EngineRef* v = em.x.find(ek)) {
                if (--v->refs == 0) em.x.erase(ek);
            } else {
                u32 bi = em.t.find(ek);
                if (bi == NIL) return;
                e_untake(em, ek, bi);
            }
            if (em.empty()) engines_.erase(engines_.begin() + (long)i);
            return;
        }
    }

    // Map ek -> rk in stream st (and level 2); hd: the (pod, rank) holder of block bi, whose
    // engine key is ek, which carries the entries when it can.
    void link(uint16_t mid, Stream& st, u64 ek, u64 rk, u32 bi, Holder& hd) {
        u64 cur;
        bool has = s_find(st, ek, cur);
        if (!has || cur != rk) {
            if (has) s_erase_if(st, ek, cur);
            if (!compat_) {
                Engine* em = engine_map(mid);
                if (!em) {
                    engines_.emplace_back(mid, Engine());
                    em = &engines_.back().second;
                    em->t.key() = HolderKey{&blocks_, &attrs_, mid, FLAG_L};
                }
                if (EngineRef* v = em->x.find(ek)) {
                    if (v->rk != rk) s_detach_value(mid, ek, v->rk);
                    v->rk = rk;
                    v->refs += 1;
                } else if (u32 bj = em->t.find(ek); bj != NIL) {
                    if (blocks_[bj].rk != rk) s_detach_value(mid, ek, blocks_[bj].rk);
                    e_untake(*em, ek, bj);
                    EngineRef* e = em->x.emplace(ek).first;
                    e->rk = rk;
                    e->refs = 2;
                } else if (hmodel(hd) == mid && hd.ek == ek && !(hd.pf & FLAG_L) && !em->t.key().holder(bi)) {
                    em->t.insert(ek, bi);
                    hd.pf |= FLAG_L;
                } else {
                    EngineRef* e = em->x.emplace(ek).first;
                    e->rk = rk;
                    e->refs = 1;
                }
            }
            // the holder carries the entry when its lookup (level 2, or level 1 in compat mode)
            // leads to this record
            if (hmodel(hd) == mid && hd.ek == ek && !(hd.pf & FLAG_S) && (!compat_ || rk == ek)) {
                hd.pf |= FLAG_S;
                st.carried.insert(bi);
            } else {
                *st.x.emplace(ek).first = rk;
            }
        }
        ++c_stored_blocks_;
    }

    // Record (pod, rank) holding rk as ek in tier bit (kvindex/index.py _put).
    void put(uint16_t ps, int32_t rank, uint16_t mid, u64 sid, u64 ek, u64 rk, u64 bit) {
        if (Stream* stp = stream(sid)) {
            u64 old_rk;
            if (s_find(*stp, ek, old_rk) && old_rk != rk) drop_copy(ps, rank, ek, old_rk, ~0ULL);
        }
        Stream& st = stream_mk(sid);
        Found bip = rk_map_.find_ptr(rk);
        u32 bi;
        if (!bip) {
            bi = new_block(rk);
            if (rk_map_.size() > capacity_) evict_one();
        } else {
            bi = *bip;
            if (bi != lru_tail_) {
                lru_unlink(bi);
                lru_push(bi);
            }
        }
        Block& b = blocks_[bi];
        size_t h = find_holder(b, ps, rank);
        if (h == NIL) {
            if (!has_pod(b, ps)) ++pod_blocks_[ps];
            b.hs.push_back(Holder{ek, ps, attr_id(mid, rank_id(rank), bit)});
            h = b.hs.size() - 1;
        } else {
            Holder& hd = b.hs[h];
            set_hmask(hd, hmask(hd) | bit);
            if (hd.ek != ek) {
                if (s_erase_if(st, hd.ek, rk)) unref_engine(hd.ek, mid);
                detach(bi, hd);
                hd.ek = ek;
            }
        }
        link(mid, st, ek, rk, bi, b.hs[h]);
    }

    // Clear `bit` (~0 = all) of (pod, rank)'s copy of rk; true if it held that tier.
    bool drop_copy(uint16_t ps, int32_t rank, u64 ek, u64 rk, u64 bit) {
        Found bip = rk_map_.find_ptr(rk);
        if (!bip) return false;
        u32 bi = *bip;
        Block& b = blocks_[bi];
        size_t h = find_holder(b, ps, rank);
        if (h == NIL || !(hmask(b.hs[h]) & bit)) return false;
        u64 left = hmask(b.hs[h]) & ~bit;
        if (left) {
            set_hmask(b.hs[h], left);
        } else {
            uint16_t hm = hmodel(b.hs[h]);
            Stream* st = stream(stream_id(ps, hm, rank));
            if (st && s_erase_if(*st, ek, rk)) unref_engine(ek, hm);
            erase_holder(bi, h);
        }
        return true;
    }

    void evict_one() {
        u32 bi = lru_head_;
        Block& b = blocks_[bi];
        u64 rk = b.rk;
        std::vector<uint16_t> seen;
        for (size_t k = 0; k < b.hs.size(); ++k) {
            Holder h = b.hs[k];
            if (std::find(seen.begin(), seen.end(), h.pod()) == seen.end()) {
                seen.push_back(h.pod());
                --pod_blocks_[h.pod()];
            }
            if (Stream* st = stream(stream_id(h.pod(), hmodel(h), hrank(h))))
                if (s_erase_if(*st, h.ek, rk)) unref_engine(h.ek, hmodel(h));
        }
        free_block(bi);
        ++c_evictions_;
        // a pod left with nothing gives its slot back at the end of the write call
        for (uint16_t p : seen)
            if (!pod_blocks_[p]) pending_release_.push_back(p);
    }

    // End of a write call: release the slots of pods left holding nothing.
    void finish_write(uint16_t ps) {
        maybe_release(ps);
        std::vector<uint16_t> pend;
        pend.swap(pending_release_);
        for (uint16_t p : pend)
            if (!pod_names_[p].empty()) maybe_release(p);
    }

    // Interned DP ranks of the holders (append-only; id -> value).
    static constexpr uint16_t NO_RID = 0xFFFF;
    std::vector<int32_t> rank_vals_;
    std::unordered_map<int32_t, uint16_t> rank_ids_;
    int32_t last_rank_ = 0;
    uint16_t last_rid_ = NO_RID;

    u64 hmask(const Holder& h) const { return attrs_[h.at].mask; }
    int32_t hrank(const Holder& h) const { return rank_vals_[attrs_[h.at].rid]; }
    uint16_t hmodel(const Holder& h) const { return attrs_[h.at].model; }
    void set_hmask(Holder& h, u64 m) {
        Attr a = attrs_[h.at];
        h.at = attr_id(a.model, a.rid, m);
    }

    // The interned (model, DP rank, tier mask) of the holders (append-only; id -> value).
    std::vector<Attr> attrs_;
    std::unordered_map<u64, std::vector<uint16_t>> attr_ids_;  // (model, rid) -> the ids with that pair
    struct AttrCache {
        u64 key = ~0ULL, mask = 0;
        uint16_t id = 0;
    };
    AttrCache attr_cache_[16];  // recent lookups, direct-mapped

    uint16_t attr_id(uint16_t model, uint16_t rid, u64 m) {
        u64 key = ((u64)model << 16) | rid;
        AttrCache& c = attr_cache_[fmix64(key ^ (m * 0x9E3779B97F4A7C15ULL)) & 15];
        if (c.key == key && c.mask == m) return c.id;
        std::vector<uint16_t>& ids = attr_ids_[key];
        uint16_t id = 0xFFFF;
        for (uint16_t x : ids)
            if (attrs_[x].mask == m) {
                id = x;
                break;
            }
        if (id == 0xFFFF) {
            if (attrs_.size() >= 0xFFFF)
                throw std::length_error("more than 65535 distinct (model, DP rank, tier mask) combinations");
            id = (uint16_t)attrs_.size();
            attrs_.push_back(Attr{m, model, rid});
            ids.push_back(id);
        }
        c = AttrCache{key, m, id};
        return id;
    }

    uint16_t rank_find(int32_t r) {
        if (r == last_rank_ && last_rid_ != NO_RID) return last_rid_;
        auto it = rank_ids_.find(r);
        if (it == rank_ids_.end()) return NO_RID;
        last_rank_ = r;
        last_rid_ = it->second;
        return it->second;
    }

    uint16_t rank_id(int32_t r) {
        uint16_t id = rank_find(r);
        if (id != NO_RID) return id;
        if (rank_vals_.size() >= NO_RID) throw std::length_error("more than 65535 distinct DP ranks");
        id = (uint16_t)rank_vals_.size();
        rank_vals_.push_back(r);
        rank_ids_.emplace(r, id);
        return id;
    }

    std::shared_mutex mu_;
    static constexpr size_t TOUCH_LOG_MAX = size_t(1) << 16;  // logged refreshes a reader leaves (256 KiB)
    std::mutex log_mu_;            // guards touch_log_ among readers (a writer holds mu_ alone)
    std::vector<u32> touch_log_;   // matched block indices whose recency refresh is pending
    u32 multi_ = 0;                // writers inside a multi-call event (changed under mu_ exclusively)
    u64 capacity_;
    bool compat_;
    std::vector<Block> blocks_;
    std::vector<u32> free_;
    u32 lru_head_ = NIL, lru_tail_ = NIL;
    RkMap rk_map_{RkOf{&blocks_}};
    std::vector<std::pair<uint16_t, Engine>> engines_;  // level 2 per model id, first-use order
    std::unordered_map<u64, Stream> streams_;
    std::unordered_map<std::string, uint16_t> pod_by_name_;
    std::vector<std::string> pod_names_;
    std::vector<u64> pod_blocks_;
    std::vector<uint16_t> free_pods_;
    std::vector<uint16_t> pending_release_;
    u64 c_evictions_ = 0, c_stored_blocks_ = 0, c_removed_blocks_ = 0, c_unknown_removals_ = 0,
        c_unknown_offloads_ = 0;
};


// ---------------------------------------------------------------- the ttft picker's rows

// scorer.picker.TTFTPicker.pick's per-candidate pass and ranking for the common inputs, with the
// same float operations in the same order (so every value is bit-identical).  Returns the ranked
// tuple of PodInputs, or None when an input needs the Python path's clamping or conversion (a
// load or prefix field that is not an exact float/int in range, a pod id that is not an exact
// str, kv_stall > 0, a prefix or load value that is not None and lacks a field): the caller then
// runs the Python loop, which handles (or raises for) every such input as before.
struct PickRow {
    double key, cost, qlen;
    PyObject* pod;
    nb::object row;
};

// An exact float in [lo, hi) (hi_incl: [lo, hi]); false (no error set) otherwise.
inline bool float_in(PyObject* o, double lo, double hi, bool hi_incl, double& v) {
    if (!PyFloat_CheckExact(o)) return false;
    v = PyFloat_AS_DOUBLE(o);
    return v >= lo && (hi_incl ? v <= hi : v < hi);
}

// An exact int of magnitude below 2**53 (exact as a double); false (no error set) otherwise.
inline bool int53(PyObject* o, long long& v) {
    if (!PyLong_CheckExact(o)) return false;
    int overflow = 0;
    v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
    }
    return v > -(1LL << 53) && v < (1LL << 53);
}

// The attribute `name` of o as a new reference, or null (error cleared) when it has none.
inline PyObject* attr(PyObject* o, PyObject* name) {
    PyObject* r = PyObject_GetAttr(o, name);
    if (!r) PyErr_Clear();
    return r;
}

nb::object ttft_rows(nb::handle prefix_o, nb::handle loads_o, nb::handle pods_o, long long n_prompt, double kvp,
                     double stall, double reserve, double tie, nb::handle row_type) {
    (void)reserve;  // only the overflow term (kv_stall > 0, the Python path) reads it
    if (!PyDict_CheckExact(prefix_o.ptr()) || !PyDict_CheckExact(loads_o.ptr()) || !PyList_CheckExact(pods_o.ptr()))
        return nb::none();
    if (stall > 0.0 || n_prompt < 0 || n_prompt >= (1LL << 53)) return nb::none();
    static PyObject *s_waiting = PyUnicode_InternFromString("waiting"),
                    *s_in_flight = PyUnicode_InternFromString("in_flight"),
                    *s_kv_usage = PyUnicode_InternFromString("kv_usage"),
                    *s_prefill = PyUnicode_InternFromString("prefill_tokens"),
                    *s_coverage = PyUnicode_InternFromString("coverage"),
                    *s_matched_tokens = PyUnicode_InternFromString("matched_tokens"),
                    *s_matched_blocks = PyUnicode_InternFromString("matched_blocks"),
                    *s_weighted = PyUnicode_InternFromString("weighted_blocks");
    const double np_d = (double)n_prompt;
    const double hit_cap = (double)(n_prompt > 1 ? n_prompt - 1 : 0);
    PyObject* prefix = prefix_o.ptr();
    PyObject* loads = loads_o.ptr();
    Py_ssize_t n = PyList_GET_SIZE(pods_o.ptr());
    std::vector<PickRow> rows;
    rows.reserve((size_t)n);
    nb::object zero_f = nb::steal(PyFloat_FromDouble(0.0)), zero_i = nb::steal(PyLong_FromLong(0));
    for (Py_ssize_t k = 0; k < n; ++k) {
        PyObject* pod = PyList_GET_ITEM(pods_o.ptr(), k);
        if (!PyUnicode_CheckExact(pod)) return nb::none();
        PyObject* ps = PyDict_GetItemWithError(prefix, pod);  // borrowed
        if (!ps && PyErr_Occurred()) throw nb::python_error();
        PyObject* ld = PyDict_GetItemWithError(loads, pod);
        if (!ld && PyErr_Occurred()) throw nb::python_error();
        if (ps == Py_None) ps = nullptr;
        if (ld == Py_None) ld = nullptr;
        nb::object waiting_o = zero_f, in_flight_o = zero_i, usage_o = zero_f, cov_o = zero_f, matched_o = zero_i;
        double waiting = 0.0, usage = 0.0, q = 0.0, cov = 0.0, cached = 0.0;
        long long in_flight = 0;
        if (ld) {
            waiting_o = nb::steal(attr(ld, s_waiting));
            in_flight_o = nb::steal(attr(ld, s_in_flight));
            usage_o = nb::steal(attr(ld, s_kv_usage));
            nb::object q_o = nb::steal(attr(ld, s_prefill));
            if (!waiting_o.is_valid() || !in_flight_o.is_valid() || !usage_o.is_valid() || !q_o.is_valid())
                return nb::none();
            if (!float_in(waiting_o.ptr(), 0.0, HUGE_VAL, false, waiting)) return nb::none();
            if (!int53(in_flight_o.ptr(), in_flight) || in_flight < 0) return nb::none();
            if (!float_in(usage_o.ptr(), 0.0, 1.0, true, usage)) return nb::none();
            if (q_o.is_none()) {
                q = waiting * np_d;
            } else if (!float_in(q_o.ptr(), 0.0, HUGE_VAL, false, q)) {
                return nb::none();
            }
        }
        if (ps) {
            cov_o = nb::steal(attr(ps, s_coverage));
            matched_o = nb::steal(attr(ps, s_matched_tokens));
            nb::object mb_o = nb::steal(attr(ps, s_matched_blocks));
            if (!cov_o.is_valid() || !matched_o.is_valid() || !mb_o.is_valid()) return nb::none();
            long long matched, mb;
            if (!float_in(cov_o.ptr(), 0.0, 1.0, true, cov)) return nb::none();
            if (!int53(matched_o.ptr(), matched) || !int53(mb_o.ptr(), mb)) return nb::none();
            if (mb > 0) {
                nb::object wb_o = nb::steal(attr(ps, s_weighted));
                double wb;
                if (!wb_o.is_valid() || !float_in(wb_o.ptr(), 0.0, HUGE_VAL, false, wb)) return nb::none();
                cached = wb * ((double)matched / (double)mb);
                if (cached > hit_cap) cached = hit_cap;
            }
        }
        double un = np_d > cached ? np_d - cached : 0.0;
        double over = 0.0;
        double cost = q + un * (1.0 + kvp * usage) + stall * over;
        double qlen = waiting + (double)in_flight;
        PyObject* args[14];
        nb::object total = nb::steal(PyFloat_FromDouble(-cost)), kv = nb::steal(PyFloat_FromDouble(1.0 - usage)),
                   qlen_o = nb::steal(PyFloat_FromDouble(qlen)), un_o = nb::steal(PyLong_FromDouble(std::nearbyint(un))),
                   q_f = nb::steal(PyFloat_FromDouble(q)), cost_o = nb::steal(PyFloat_FromDouble(cost)),
                   over_o = nb::steal(PyFloat_FromDouble(over));
        if (!total.is_valid() || !kv.is_valid() || !qlen_o.is_valid() || !un_o.is_valid() || !q_f.is_valid() ||
            !cost_o.is_valid() || !over_o.is_valid())
            throw nb::python_error();
        args[0] = pod;
        args[1] = total.ptr();
        args[2] = ps ? cov_o.ptr() : zero_f.ptr();
        args[3] = kv.ptr();
        args[4] = qlen_o.ptr();
        args[5] = ps ? matched_o.ptr() : zero_i.ptr();
        args[6] = waiting_o.ptr();
        args[7] = in_flight_o.ptr();
        args[8] = usage_o.ptr();
        args[9] = ld ? Py_True : Py_False;
        args[10] = un_o.ptr();
        args[11] = q_f.ptr();
        args[12] = cost_o.ptr();
        args[13] = over_o.ptr();
        PyObject* row = PyObject_Vectorcall(row_type.ptr(), args, 14, nullptr);
        if (!row) throw nb::python_error();
        rows.push_back(PickRow{cost, cost, qlen, pod, nb::steal(row)});
    }
    if (tie > 0.0 && !rows.empty()) {
        double best = rows[0].cost;
        for (const PickRow& r : rows)
            if (r.cost < best) best = r.cost;
        for (PickRow& r : rows) r.key = r.cost - best <= tie ? best : r.cost;
    }
    bool failed = false;
    // (key, queue, pod): pod ids are unique, so this is the Python sort's total order
    std::sort(rows.begin(), rows.end(), [&](const PickRow& a, const PickRow& b) {
        if (a.key != b.key) return a.key < b.key;
        if (a.qlen != b.qlen) return a.qlen < b.qlen;
        int c = PyUnicode_Compare(a.pod, b.pod);
        if (c == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            failed = true;
        }
        return c < 0;
    });
    if (failed) return nb::none();
    nb::object out = nb::steal(PyTuple_New((Py_ssize_t)rows.size()));
    if (!out.is_valid()) throw nb::python_error();
    for (size_t k = 0; k < rows.size(); ++k) PyTuple_SET_ITEM(out.ptr(), (Py_ssize_t)k, rows[k].row.release().ptr());
    return out;
}

}  // namespace

NB_MODULE(_native, m) {
    m.doc() = "kvindex compiled core: xxh3_chain request keys and the index data (see kvindex.native)";
    m.attr("ABI_VERSION") = 1;
    m.def("ttft_rows", &ttft_rows, nb::arg("prefix"), nb::arg("loads"), nb::arg("pods"), nb::arg("prompt_tokens"),
          nb::arg("kv_pressure"), nb::arg("kv_stall"), nb::arg("decode_reserve"), nb::arg("tie_tokens"),
          nb::arg("row_type"),
          "scorer.picker.TTFTPicker's ranked rows for the common inputs (None: use the Python path).");

    m.def(
        "xxh3_chain",
        [](u64 state, nb::handle toks_o, nb::handle K_o, u64 A, nb::handle add_o) {
            U64View toks, K, add;
            to_u64(toks_o, toks, "token_ids");
            to_u64(K_o, K, "K");
            size_t bs = K.n;
            if (bs == 0) throw nb::value_error("empty K");
            size_t n = toks.n / bs;
            const u64* addp = nullptr;
            if (!add_o.is_none()) {
                to_u64(add_o, add, "add");
                if (add.n != n) throw nb::value_error("one addend per block expected");
                addp = add.data;
            }
            std::vector<u64> out(n);
            {
                nb::gil_scoped_release nogil;
                chain_into(state, toks.data, n, K.data, bs, A, addp, out.data());
            }
            return new_u64_array(std::move(out));
        },
        nb::arg("state"), nb::arg("tokens"), nb::arg("K"), nb::arg("A"), nb::arg("add").none() = nb::none(),
        "Request keys of the full blocks of ``tokens`` chained from ``state`` (kvindex.keys xxh3_chain):\n"
        "key_i = A * key_{i-1} + fmix64(sum_t tokens[i*bs+t] * K[t] + add[i]), bs = len(K).\n"
        "Returns the keys as native-endian uint64 bytes (numpy.frombuffer(..., numpy.uint64)).");

    nb::class_<IndexCore>(m, "IndexCore")
        .def(nb::init<u64, bool>(), nb::arg("capacity"), nb::arg("compat"))
        .def("store_keys", &IndexCore::store_keys)
        .def("store_chain", &IndexCore::store_chain)
        .def("store_tokenless", &IndexCore::store_tokenless)
        .def("remove", &IndexCore::remove)
        .def("clear", &IndexCore::clear, nb::arg("pod"), nb::arg("rank").none(), nb::arg("model"))
        .def("apply_events", &IndexCore::apply_events)
        .def("touch", &IndexCore::touch)
        .def("prefix_match", &IndexCore::prefix_match, nb::arg("keys"), nb::arg("pods").none(), nb::arg("touch"),
             nb::arg("guard") = false)
        .def("prefix_summary", &IndexCore::prefix_summary, nb::arg("keys"), nb::arg("pods").none(),
             nb::arg("weights"), nb::arg("touch"), nb::arg("guard") = false, nb::arg("ranks") = false)
        .def("match_tokens", &IndexCore::match_tokens, nb::arg("state"), nb::arg("tokens"), nb::arg("K"),
             nb::arg("A"), nb::arg("pods").none(), nb::arg("weights"), nb::arg("touch"), nb::arg("guard") = false,
             nb::arg("ranks") = false)
        .def("begin_multi", &IndexCore::begin_multi)
        .def("end_multi", &IndexCore::end_multi)
        .def("pod_masks", &IndexCore::pod_masks)
        .def("lookup", &IndexCore::lookup)
        .def("best_dp_rank", &IndexCore::best_dp_rank)
        .def("resolve", &IndexCore::resolve)
        .def("request_key_of", &IndexCore::request_key_of)
        .def("pods", &IndexCore::pods)
        .def("holds_pod", &IndexCore::holds_pod)
        .def("pod_holds", &IndexCore::pod_holds)
        .def("pod_holds_many", &IndexCore::pod_holds_many)
        .def("contains", &IndexCore::contains)
        .def("pod_keys", &IndexCore::pod_keys, nb::arg("pod"), nb::arg("rank").none())
        .def("__len__", &IndexCore::len)
        .def("stats", &IndexCore::stats)
        .def("memory_bytes", &IndexCore::memory_bytes)
        .def("tier_counts", &IndexCore::tier_counts)
        .def("check", &IndexCore::check);
}
