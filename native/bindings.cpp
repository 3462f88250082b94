// kvindex._native: the compiled core of kvindex.
//
// Two parts:
//  * xxh3_chain request keys (the block recurrence of kvindex/keys.py, bit-identical;
//    the scope root and per-block extras stay in Python and arrive as inputs);
//  * IndexCore: the data of the two-level KV block index (see kvindex/native.py, the
//    Python class around it, for the event semantics; they mirror kvindex/index.py).
//
// The sources: common.h, keys.h/.cpp (key inputs, xxh3_chain), tables.h (open-addressing tables),
// records.h (holders, block records, streams), index_core.h (IndexCore, declared) and its methods in
// index_write.cpp, index_apply.cpp, index_walk.cpp, index_query.cpp; picker.h/.cpp (ttft_rows).
#include "index_core.h"
#include "keys.h"
#include "picker.h"

using namespace kvnative;

NB_MODULE(_native, m) {
    m.doc() = "kvindex compiled core: xxh3_chain request keys and the index data (see kvindex.native)";
    m.attr("ABI_VERSION") = 1;
    m.def("ttft_rows", &ttft_rows, nb::arg("prefix"), nb::arg("loads"), nb::arg("pods"), nb::arg("prompt_tokens"),
          nb::arg("kv_pressure"), nb::arg("kv_stall"), nb::arg("decode_reserve"), nb::arg("tie_tokens"),
          nb::arg("row_type"),
          "scorer.picker.TTFTPicker's ranked rows for the common inputs (None: use the Python path).");

    m.def("xxh3_chain", &xxh3_chain, nb::arg("state"), nb::arg("tokens"), nb::arg("K"), nb::arg("A"),
          nb::arg("add").none() = nb::none(),
          "Request keys of the full blocks of ``tokens`` chained from ``state`` (kvindex.keys xxh3_chain):\n"
          "key_i = A * key_{i-1} + fmix64(sum_t tokens[i*bs+t] * K[t] + add[i]), bs = len(K).\n"
          "Returns the keys as native-endian uint64 bytes (numpy.frombuffer(..., numpy.uint64)).");

    nb::class_<RawBatch>(m, "RawBatch")
        .def("__len__", &RawBatch::size)
        .def_ro("resets", &RawBatch::resets)
        .def_ro("grouped", &RawBatch::grouped)
        .def("contents", [](const RawBatch& rb) {
            // for tests: per event (kind, tier bit, parent or None, block size, hashes, tokens)
            nb::list out;
            for (const RawEvent& x : rb.evs) {
                std::vector<u64> h(rb.data.begin() + x.h_off, rb.data.begin() + x.h_off + x.h_n);
                std::vector<u64> t(rb.data.begin() + x.t_off, rb.data.begin() + x.t_off + x.t_n);
                nb::object par = x.has_parent ? nb::cast(x.parent) : nb::none();
                out.append(nb::make_tuple(x.kind, x.bit, par, x.block_size, h, t));
            }
            return out;
        });
    m.def("read_raw_batch", &read_raw_batch, nb::arg("events"), nb::arg("stored_t"), nb::arg("removed_t"),
          nb::arg("cleared_t"), nb::arg("medium_bits"),
          "kvevents.fastwire's events (Raw hashes and tokens) -> RawBatch, or None when one is not of the\n"
          "plain shape it reads (the caller then decodes the reference way).");
    m.def("decode_raw_payload", &decode_raw_payload, nb::arg("payload"), nb::arg("medium_bits"),
          "A vLLM payload of the plain shape -> (ts, dp_rank or None, RawBatch), read in one pass;\n"
          "None for anything it does not read (kvevents.fastwire then decodes it with msgspec).");

    nb::class_<IndexCore>(m, "IndexCore")
        .def(nb::init<u64, bool>(), nb::arg("capacity"), nb::arg("compat"))
        .def("store_keys", &IndexCore::store_keys)
        .def("store_chain", &IndexCore::store_chain)
        .def("store_tokenless", &IndexCore::store_tokenless)
        .def("remove", &IndexCore::remove)
        .def("clear", &IndexCore::clear, nb::arg("pod"), nb::arg("rank").none(), nb::arg("model"))
        .def("apply_events", &IndexCore::apply_events)
        .def("apply_raw", &IndexCore::apply_raw)
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
        .def("stream_masks", &IndexCore::stream_masks)
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
