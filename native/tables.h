// Open-addressing tables of the index: U64Map (uint64 -> V), IdxSet (block indices keyed through
// the records) and IdxBits (a chunked set of record indices).
#pragma once

#include "common.h"

namespace kvnative {

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

}  // namespace kvnative
