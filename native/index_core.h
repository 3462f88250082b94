// IndexCore: the data of the two-level KV block index (see kvindex/native.py, the Python class
// around it, for the event semantics; they mirror kvindex/index.py).  Declared here with its small
// hot helpers inline; the other methods are in index_write.cpp (writes and their bookkeeping),
// index_apply.cpp (a decoded batch in one call), index_walk.cpp (the prefix match: the read path)
// and index_query.cpp (the other reads, stats, the consistency check).
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
#pragma once

#include "keys.h"
#include "raw_batch.h"
#include "records.h"

namespace kvnative {

class IndexCore {
  public:
    IndexCore(u64 capacity, bool compat) : capacity_(capacity), compat_(compat) {
        if (capacity < 1) throw std::invalid_argument("capacity must be >= 1");
    }

    // Store (pod, rank) holding request keys rks[i] as engine keys eks[i] in tier `bit`.
    size_t store_keys(const std::string& pod, int32_t rank, uint16_t mid, nb::handle eks_o, nb::handle rks_o,
                      u64 bit);

    // Chain the request keys of `tokens` from `state` (xxh3_chain) and store them; returns the keys.
    nb::bytes store_chain(const std::string& pod, int32_t rank, uint16_t mid, nb::handle eks_o,
                          u64 state, nb::handle toks_o, nb::handle K_o, u64 A, u64 bit);

    // Token-less BlockStored: add tier `bit` to blocks known by engine key.  Returns the request
    // keys updated (unknown engine keys are counted and skipped).
    nb::bytes store_tokenless(const std::string& pod, int32_t rank, uint16_t mid, nb::handle eks_o,
                              u64 bit);

    // BlockRemoved of publisher (pod, rank, model): per engine key, whether a held tier copy went.
    std::vector<bool> remove(const std::string& pod, int32_t rank, uint16_t mid, nb::handle eks_o, u64 bit);

    // Forget what `pod` holds (rank `rank` only when >= 0 ... or any when all_ranks). Returns entries removed.
    size_t clear(const std::string& pod, std::optional<int32_t> rank, int model);

    size_t clear_locked(const std::string& pod, std::optional<int32_t> rank, int model);

    // One decoded batch of publisher (pod, rank, model id `mid`), applied from events[start:] in
    // one call: BlockStored (with tokens, no extra keys, no LoRA, known tier, right block size),
    // BlockRemoved and AllBlocksCleared.  The events are read with the GIL held, then applied in
    // order under one exclusive lock with the GIL released (as apply_raw).  Stops before the first event it does
    // not take (another kind, an unknown tier, extra keys, a token-less store, a malformed one) or,
    // in xxh3_chain mode, whose parent engine key is unknown: the caller applies that one in Python
    // and calls again from the next.  Returns (next index, stored events, stored blocks, removed
    // events, removed blocks (sum of lengths), removals that hit, removals that missed, clears,
    // clears that removed something, stored blocks per tier bit, removed blocks per tier bit); the
    // per-bit lists end at the highest bit counted.
    // KV-cache groups (kvindex/groups.py): `gate` is () while the publisher has learned no group
    // (an event's group_idx is then ignored, except that a store naming one stops the run so that
    // Python learns it), else (primary group_idx or -1, its kind, its window, whether a store
    // without a kind is that spec): the run takes only what the primary group's tables take as
    // they are (stores of the primary spec or without group_idx, removals of the primary group or
    // without group_idx) and stops before any other store or removal and before a clear.
    using ApplyOut = std::tuple<size_t, size_t, size_t, size_t, size_t, size_t, size_t, size_t, size_t,
                                std::vector<u64>, std::vector<u64>>;
    ApplyOut apply_events(
        const std::string& pod, int32_t rank, uint16_t mid, nb::handle events_o, size_t start,
        nb::handle stored_t, nb::handle removed_t, nb::handle cleared_t, nb::handle tier_bits, u64 root,
        nb::handle K_o, u64 A, nb::handle gate);

    // apply_events for a RawBatch (kvevents/fastwire.py: the integers read from msgpack without
    // Python objects), from event `start`: the same checks, order, stops and answer; the GIL is
    // released for the whole apply, however small (see index_apply.cpp).
    ApplyOut apply_raw(const std::string& pod, int32_t rank, uint16_t mid, const RawBatch& rb, size_t start,
                       u64 root, nb::bytes K_b, u64 A);

    // Before an event's puts: start loading what they will read first, the home slots of its
    // request keys (level 1) and engine keys (level 2), then the records those slots point to,
    // so that the cache misses of the event's blocks overlap instead of coming one by one.
    inline void prefetch_put(uint16_t mid, const u64* eks, const u64* rks, size_t n);

    // Makes `rk` the most recently used key (if held).
    void touch(nb::handle keys_o);

    // Longest consecutive prefix per candidate pod, as tier masks (OR over ranks) per block.
    // pods: list of names, or None = every pod holding blocks.  Refreshes recency of the
    // longest match (logged, see Locking).  Returns {pod: masks as uint64 bytes} for pods
    // matching >= 1 block; None when `guard` and a writer is inside a multi-call event.
    nb::object prefix_match(nb::handle keys_o, nb::handle pods_o, bool touch, bool guard);

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
                              bool guard, bool ranks);

    inline nb::dict summary_dict(const Summary& res, const std::vector<std::string>& names,
                                 const std::vector<nb::handle>& given);

    inline nb::dict rank_dict(const Summary& res, const std::vector<std::string>& names,
                              const std::vector<nb::handle>& given);

    // Request keys of `tokens` (xxh3_chain from `state`) and their prefix_summary, in one call:
    // (keys as uint64 bytes, rows, longest[, ranks]), or None when `guard` and a writer is inside
    // a multi-call event.
    nb::object match_tokens(u64 state, nb::handle toks_o, nb::handle K_o, u64 A, nb::handle pods_o,
                            std::vector<double> weights, bool touch, bool guard, bool ranks);

    // Writers of one event in several calls mark them (see Locking); nested marks count.
    void begin_multi();

    void end_multi();

    // Per candidate pod: tier mask (OR over ranks) of every key, 0 where it holds none.
    nb::dict pod_masks(nb::handle keys_o, std::vector<std::string> names);

    // Tier mask of each key held by publisher (pod, rank, model id `mid`), 0 where it holds none
    // (the primary KV-cache group's presence per block, for kvindex.groups' group_match).
    nb::bytes stream_masks(const std::string& pod, int32_t rank, uint16_t mid, nb::handle keys_o);

    // Every holder of each key: per key a list of (pod, tier mask, rank).
    std::vector<std::vector<std::tuple<std::string, u64, int32_t>>> lookup(nb::handle keys_o);

    // DP rank of `pod` holding the longest consecutive prefix (ties: lower rank).
    std::optional<int32_t> best_dp_rank(const std::string& pod, nb::handle keys_o);

    // The request key stream (pod, rank, model) maps `ek` to, else the model's level 2; None if unknown.
    std::optional<u64> resolve(const std::string& pod, int32_t rank, uint16_t mid, u64 ek);

    // Level 2 under model `model` (ALL: the first model, in first-use order, knowing it).
    std::optional<u64> request_key_of(u64 ek, int model);

    std::vector<std::string> pods();

    bool holds_pod(const std::string& pod);

    // Does `pod` (any rank) hold request key `rk`?
    bool pod_holds(const std::string& pod, u64 rk);

    // The subset of `keys` that `pod` holds (any rank): a bool per key.
    std::vector<bool> pod_holds_many(const std::string& pod, nb::handle keys_o);

    bool contains(u64 rk);

    std::vector<u64> pod_keys(const std::string& pod, std::optional<int32_t> rank);

    size_t len();

    nb::dict stats();

    // Per tier bit b (0..63): (keys whose holders' OR-mask has b, holders whose mask has b).
    std::vector<std::pair<u64, u64>> tier_counts();

    // Bytes the index's own structures hold (capacity, not size; without allocator overhead).
    size_t memory_bytes();

    // Internal consistency (for tests): raises AssertionError-like RuntimeError when broken.
    void check();

  private:
    // Helpers declared `inline` are defined in the one .cpp file that calls them, so that the compiler
    // inlines them there as it did when they were defined in the class body.

    // Reads of fewer blocks keep the GIL: they take tens of microseconds, and giving the GIL up
    // costs a busy process more (the reader waits to be woken and scheduled again behind the
    // threads that took it: milliseconds on a loaded machine).  No thread waits for the GIL
    // while it holds mu_, so a reader holding the GIL while it waits for mu_ cannot deadlock.
    static constexpr size_t NOGIL_MIN_BLOCKS = 2048;
    static constexpr size_t BUSY = ~size_t(0);  // summary_locked's answer to a guarded read during a multi-call write

    // apply_events' parts: the events it takes, read with the GIL held (read_events stops before
    // the first one read_event declines), then each applied under the exclusive lock;
    // apply_stored answers false for an orphan (a parent engine key it does not know).
    struct BatchEvent;
    struct BatchCounts;
    struct GroupGate;
    static inline void read_events(PyObject** items, size_t start, size_t n, nb::handle stored_t,
                                   nb::handle removed_t, nb::handle cleared_t, nb::handle tier_bits, size_t bs,
                                   const GroupGate& gate, std::vector<BatchEvent>& evs);
    static inline bool read_event(PyObject* ev, bool is_store, nb::handle tier_bits, size_t bs, const GroupGate& gate,
                                  BatchEvent& x);
    static inline bool group_ok(nb::handle e, bool is_store, const GroupGate& gate);
    inline size_t apply_locked(const std::string& pod, int32_t rank, uint16_t mid, std::vector<BatchEvent>& evs,
                               u64 root, const U64View& K, u64 A, BatchCounts& c);
    static inline ApplyOut apply_out(size_t next, BatchCounts& c);
    inline void apply_removed(const std::string& pod, int32_t rank, uint16_t mid, const BatchEvent& x, BatchCounts& c);
    inline bool apply_stored(const std::string& pod, int32_t rank, uint16_t mid, const BatchEvent& x, u64 root,
                             const U64View& K, u64 A, std::vector<u64>& rks, BatchCounts& c);

    inline size_t summary_locked(const u64* keys, size_t n, const std::vector<std::string>& names,
                                 const std::vector<double>& weights, bool touch, bool guard, Summary& res);

    // The exclusive lock, with the logged recency refreshes applied first (every writer takes it so).
    std::unique_lock<std::shared_mutex> wlock() {
        std::unique_lock<std::shared_mutex> lk(mu_);
        flush_touches_locked();
        return lk;
    }

    // Under the shared lock: append a read's matched blocks (in match order) to the touch log.
    // Returns true when the log is past TOUCH_LOG_MAX (the caller then applies it).
    inline bool log_touches(const std::vector<u32>& path);

    // Under the exclusive lock: apply the touch log as touch_locked would have, entry by entry.
    // Moving blocks to the tail one by one leaves the untouched blocks in their order followed
    // by the touched ones in the order of their last touch, so each block moves once, at its
    // last entry.
    void flush_touches_locked();

    inline void relink_tail(u32 i);

    // The candidates' names (None: every pod holding blocks); `given` (if asked) receives the
    // caller's objects, borrowed from `pods_o` (which the caller keeps alive).
    inline std::vector<std::string> candidate_names(nb::handle pods_o, std::vector<nb::handle>* given = nullptr);

    // Candidate names -> slots (unknown or empty pods are dropped; duplicates once); `idx` (if
    // given) receives each kept name's position in `names`.
    inline void slots_of(const std::vector<std::string>& names, std::vector<int>& slots,
                         std::vector<std::string>& kept, std::vector<size_t>* idx = nullptr);

    // Block indices of keys[0..m) into bis (NIL where absent), with their table slots, records and
    // holder arrays (up to 1 KiB) prefetched first: a walk's group of lookups overlaps its misses.
    inline void lookup_group(const u64* gk, size_t m, u32* bis) const;

    // Walk keys for the candidate slots; emit(c, pos, mask) for every block candidate c
    // still matches; stops when no candidate matches.  `path` (if given) receives the index of
    // every block some candidate matched, in order (the blocks the recency refresh moves).
    // Keys are looked up in groups: the group's home slots, then its block records, then their
    // holder arrays are prefetched before the group is walked, so the cache misses of a group
    // overlap (the walk is bound by them: a prompt's blocks are scattered over the tables).
    template <class Emit>
    inline void walk(const u64* keys, size_t n, const std::vector<int>& cand_slot, Emit&& emit,
                     std::vector<u32>* path = nullptr);

    // The walk of summary_locked: per candidate, blocks matched (cnt), OR of the masks (uni) and
    // the (mask, blocks) runs in first-seen order, as walk() with an emit that counts them, but
    // with flat per-candidate state: a block's holders stamp the candidates they belong to, the
    // live list is compacted only when fewer candidates than live ones hold the block, and a
    // candidate's run grows by one while its mask repeats (the usual case).  rid[c]: the interned
    // DP rank of every holder of c met, RID_MIXED once two differ.
    static constexpr uint32_t RID_NONE = 0x20000, RID_MIXED = 0x10000;  // rid[c] before a holder, and once two differ

    inline void summary_walk(const u64* keys, size_t n, const std::vector<int>& cand_slot, std::vector<size_t>& cnt,
                             std::vector<u64>& uni, std::vector<std::vector<std::pair<u64, size_t>>>& runs,
                             std::vector<uint32_t>& rid, std::vector<u32>* path);

    // summary_walk's state, and its work at a block whose holders differ from the previous block's:
    // stamp the candidates holding it, drop the others from the live list, extend or start their
    // runs; false when no candidate is left.
    struct SummaryState;
    inline bool summary_block(SummaryState& s, const HolderVec& hv, size_t i);

    // Two blocks' holders are the same (pod slot, flags, attributes) in the same order.
    static inline bool same_holders(const HolderVec& a, const HolderVec& b);

    static inline double mask_weight(u64 m, const std::vector<double>& w);

    uint16_t pod_slot(const std::string& pod);

    // A pod that holds nothing gives its slot back (its empty streams go).
    inline void maybe_release(uint16_t ps);

    Stream* stream(u64 sid) {
        auto it = streams_.find(sid);
        return it == streams_.end() ? nullptr : &it->second;
    }

    Stream& stream_mk(u64 sid);

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
    inline bool s_erase_if(Stream& st, u64 ek, u64 rk);

    template <class F>
    void s_for_each(const Stream& st, F&& f) const {
        st.carried.for_each([&](u32 bi) { f(s_holder(st, bi)->ek, blocks_[bi].rk); });
        st.x.for_each([&](u64 ek, u64 rk) { f(ek, rk); });
    }

    // The stream entry holder h of block bi carries becomes explicit (its engine key or level-2
    // value is about to change, or the holder goes).
    inline void s_detach(u32 bi, Holder& h);

    // Level 2's value for (mid, ek) is changing from `old`: the stream entries carried for ek
    // (all on old's record) become explicit, so that their lookups, which go through level 2,
    // still find them.
    inline void s_detach_value(uint16_t mid, u64 ek, u64 old);

    std::optional<u64> resolve_locked(uint16_t ps, int32_t rank, uint16_t mid, u64 ek) {
        u64 rk;
        if (Stream* st = stream(stream_id(ps, mid, rank)))
            if (s_find(*st, ek, rk)) return rk;
        return engine_find(mid, ek);
    }

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
    inline void e_untake(Engine& em, u64 ek, u32 bi);

    // The entries holder h (of block bi) carries move to the explicit maps, before its engine key
    // changes or it goes: the stream and level-2 contents stay what they were.
    inline void detach(u32 bi, Holder& h);

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

    inline void touch_locked(const u64* keys, size_t n);

    inline u32 new_block(u64 rk);

    inline void free_block(u32 i);

    // Remove holder h of block bi; drops the block when no holder is left.
    inline void erase_holder(u32 bi, size_t h);

    inline void unref_engine(u64 ek, uint16_t mid);

    // Map ek -> rk in stream st (and level 2); hd: the (pod, rank) holder of block bi, whose
    // engine key is ek, which carries the entries when it can.
    // `absent`: the caller knows st has no entry for ek (skips the lookup); `l2_absent`: it knows
    // level 2 of mid has none either (skips that lookup too).
    inline void link(uint16_t mid, Stream& st, u64 ek, u64 rk, u32 bi, Holder& hd, bool absent = false,
                     bool l2_absent = false);

    // Record (pod, rank) holding rk as ek in tier bit (kvindex/index.py _put).
    void put(uint16_t ps, int32_t rank, uint16_t mid, u64 sid, u64 ek, u64 rk, u64 bit) {
        put_s(stream_mk(sid), ps, rank, mid, ek, rk, bit);
    }

    // put() into stream st = (ps, mid, rank), which the caller looked up once for a whole event
    // (streams_ only loses elements in clear and at the end of a write call, so st stays valid).
    // The stream's entry for ek is looked up once: when absent, nothing below can add one before
    // link() (drop_copy is not called, evictions and the holder's engine-key change only remove
    // entries of other keys), so link() skips its own lookup; the same holds for level 2's entry
    // for ek when put_s looked it up and found none.
    void put_s(Stream& st, uint16_t ps, int32_t rank, uint16_t mid, u64 ek, u64 rk, u64 bit);

    // Clear `bit` (~0 = all) of (pod, rank)'s copy of rk; true if it held that tier.
    bool drop_copy(uint16_t ps, int32_t rank, u64 ek, u64 rk, u64 bit);

    inline void evict_one();

    // End of a write call: release the slots of pods left holding nothing.
    void finish_write(uint16_t ps);

    // Interned DP ranks of the holders (append-only; id -> value).
    static constexpr uint16_t NO_RID = 0xFFFF;
    std::vector<int32_t> rank_vals_;
    std::unordered_map<int32_t, uint16_t> rank_ids_;
    int32_t last_rank_ = 0;
    uint16_t last_rid_ = NO_RID;

    u64 hmask(const Holder& h) const { return attrs_[h.at].mask; }
    int32_t hrank(const Holder& h) const { return rank_vals_[attrs_[h.at].rid]; }
    uint16_t hmodel(const Holder& h) const { return attrs_[h.at].model; }
    inline void set_hmask(Holder& h, u64 m);

    // The interned (model, DP rank, tier mask) of the holders (append-only; id -> value).
    std::vector<Attr> attrs_;
    std::unordered_map<u64, std::vector<uint16_t>> attr_ids_;  // (model, rid) -> the ids with that pair
    struct AttrCache {
        u64 key = ~0ULL, mask = 0;
        uint16_t id = 0;
    };
    AttrCache attr_cache_[16];  // recent lookups, direct-mapped

    inline uint16_t attr_id(uint16_t model, uint16_t rid, u64 m);

    uint16_t rank_find(int32_t r) {
        if (r == last_rank_ && last_rid_ != NO_RID) return last_rid_;
        auto it = rank_ids_.find(r);
        if (it == rank_ids_.end()) return NO_RID;
        last_rank_ = r;
        last_rid_ = it->second;
        return it->second;
    }

    inline uint16_t rank_id(int32_t r);

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

}  // namespace kvnative
