// The index's records: holders, their interned attributes, block records, level-2 and stream entries.
#pragma once

#include "tables.h"

namespace kvnative {


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

}  // namespace kvnative
