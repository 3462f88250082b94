// IndexCore's read path: the prefix match of every candidate pod in one walk over the request keys.
#include "index_core.h"

namespace kvnative {

nb::object IndexCore::prefix_match(nb::handle keys_o, nb::handle pods_o, bool touch, bool guard) {
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

nb::object IndexCore::prefix_summary(nb::handle keys_o, nb::handle pods_o, std::vector<double> weights, bool touch,
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

inline nb::dict IndexCore::summary_dict(const Summary& res, const std::vector<std::string>& names,
                                        const std::vector<nb::handle>& given) {
    nb::dict out;
    for (const auto& [c, n, w, u, r] : res) {
        nb::object key = given.empty() ? nb::object(nb::str(names[c].c_str())) : nb::borrow(given[c]);
        out[key] = nb::make_tuple(n, w, u);
    }
    return out;
}

inline nb::dict IndexCore::rank_dict(const Summary& res, const std::vector<std::string>& names,
                                     const std::vector<nb::handle>& given) {
    nb::dict out;
    for (const auto& [c, n, w, u, r] : res) {
        if (r == NO_RANK) continue;
        nb::object key = given.empty() ? nb::object(nb::str(names[c].c_str())) : nb::borrow(given[c]);
        out[key] = nb::int_((long long)r);
    }
    return out;
}

nb::object IndexCore::match_tokens(u64 state, nb::handle toks_o, nb::handle K_o, u64 A, nb::handle pods_o,
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

inline size_t IndexCore::summary_locked(const u64* keys, size_t n, const std::vector<std::string>& names,
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

inline bool IndexCore::log_touches(const std::vector<u32>& path) {
    if (path.empty()) return false;
    std::lock_guard<std::mutex> g(log_mu_);
    touch_log_.insert(touch_log_.end(), path.begin(), path.end());
    return touch_log_.size() > TOUCH_LOG_MAX;
}

inline std::vector<std::string> IndexCore::candidate_names(nb::handle pods_o, std::vector<nb::handle>* given) {
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

inline void IndexCore::slots_of(const std::vector<std::string>& names, std::vector<int>& slots,
                                std::vector<std::string>& kept, std::vector<size_t>* idx) {
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

inline void IndexCore::lookup_group(const u64* gk, size_t m, u32* bis) const {
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

template <class Emit>
inline void IndexCore::walk(const u64* keys, size_t n, const std::vector<int>& cand_slot, Emit&& emit,
                            std::vector<u32>* path) {
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

// summary_walk's per-candidate state (c: a candidate's position in cand_slot).
struct IndexCore::SummaryState {
    const std::vector<int>& cand_slot;
    std::vector<size_t>& cnt;
    std::vector<u64>& uni;
    std::vector<std::vector<std::pair<u64, size_t>>>& runs;
    std::vector<uint32_t>& rid;
    std::vector<int> of_slot;     // pod slot -> c while c is live, else -1
    std::vector<size_t> stamp;    // the last block position whose holders include c
    std::vector<size_t> runn;     // blocks in c's current run
    std::vector<u64> cur, runm;   // c's mask at the block, and its current run's mask
    std::vector<size_t> live;     // the candidates still matching

    SummaryState(const std::vector<int>& cs, size_t pods, std::vector<size_t>& cn, std::vector<u64>& un,
                 std::vector<std::vector<std::pair<u64, size_t>>>& rn, std::vector<uint32_t>& rd)
        : cand_slot(cs), cnt(cn), uni(un), runs(rn), rid(rd), of_slot(pods, -1), stamp(cs.size(), ~size_t(0)),
          runn(cs.size(), 0), cur(cs.size(), 0), runm(cs.size(), 0), live(cs.size()) {
        size_t nc = cs.size();
        for (size_t c = 0; c < nc; ++c) of_slot[cand_slot[c]] = (int)c;
        for (size_t c = 0; c < nc; ++c) live[c] = c;
    }

    // c's current run into cnt, uni and runs (masks in first-seen order).
    void flush(size_t c) {
        if (!runn[c]) return;
        cnt[c] += runn[c];
        uni[c] |= runm[c];
        for (auto& e : runs[c])
            if (e.first == runm[c]) {
                e.second += runn[c];
                return;
            }
        runs[c].emplace_back(runm[c], runn[c]);
    }
};

inline void IndexCore::summary_walk(const u64* keys, size_t n, const std::vector<int>& cand_slot,
                                    std::vector<size_t>& cnt, std::vector<u64>& uni,
                                    std::vector<std::vector<std::pair<u64, size_t>>>& runs,
                                    std::vector<uint32_t>& rid, std::vector<u32>* path) {
    size_t nc = cand_slot.size();
    if (nc == 0) return;
    SummaryState s(cand_slot, pod_names_.size(), cnt, uni, runs, rid);
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
                for (size_t c : s.live) s.runn[c] += streak;
                streak = 0;
            }
            prev = &hv;
            if (!summary_block(s, hv, i)) {
                done = true;
                break;
            }
            if (path) path->push_back(bis[j]);
        }
    }
    if (streak)
        for (size_t c : s.live) s.runn[c] += streak;
    for (size_t c = 0; c < nc; ++c) s.flush(c);
}

inline bool IndexCore::summary_block(SummaryState& s, const HolderVec& hv, size_t i) {
    const Attr* av = attrs_.data();
    size_t hits = 0;
    for (const Holder& h : hv) {
        int c = s.of_slot[h.pod()];
        if (c < 0) continue;
        const Attr& at = av[h.at];
        u64 hm = at.mask;
        if (!hm) continue;
        uint32_t& r = s.rid[(size_t)c];
        if (r != at.rid) r = r == RID_NONE ? at.rid : RID_MIXED;
        if (s.stamp[(size_t)c] != i) {
            s.stamp[(size_t)c] = i;
            s.cur[(size_t)c] = hm;
            ++hits;
        } else {
            s.cur[(size_t)c] |= hm;
        }
    }
    if (hits != s.live.size()) {
        for (size_t k = 0; k < s.live.size();) {
            size_t c = s.live[k];
            if (s.stamp[c] == i) {
                ++k;
            } else {
                s.of_slot[s.cand_slot[c]] = -1;
                s.live[k] = s.live.back();
                s.live.pop_back();
            }
        }
        if (s.live.empty()) return false;
    }
    for (size_t c : s.live) {
        u64 cm = s.cur[c];
        if (cm == s.runm[c]) {
            ++s.runn[c];
        } else {
            s.flush(c);
            s.runm[c] = cm;
            s.runn[c] = 1;
        }
    }
    return true;
}

inline bool IndexCore::same_holders(const HolderVec& a, const HolderVec& b) {
    size_t n = a.size();
    if (n != b.size()) return false;
    const Holder* x = a.begin();
    const Holder* y = b.begin();
    for (size_t k = 0; k < n; ++k)
        if (x[k].pf != y[k].pf || x[k].at != y[k].at) return false;
    return true;
}

inline double IndexCore::mask_weight(u64 m, const std::vector<double>& w) {
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

}  // namespace kvnative
