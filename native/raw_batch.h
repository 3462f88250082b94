// A vLLM KV-event batch whose integer arrays (block hashes, token ids) arrive as msgspec.Raw
// slices: read here, without a Python object per token or per hash, then applied by
// IndexCore::apply_raw.  kvevents/fastwire.py parses and validates the message structure with
// msgspec; this reads only the msgpack arrays of integers, with bounds and type checks, and
// declines (None) anything else, for the caller to decode the reference way.
#pragma once

#include "common.h"

#include <memory>

namespace kvnative {

// One event of a raw batch: kind (0 stored, 1 removed, 2 cleared), tier bit, parent, and where its
// hashes and tokens are in RawBatch::data.
struct RawEvent {
    int kind = 0;
    u64 bit = 0;
    bool has_parent = false;
    u64 parent = 0;
    int64_t block_size = 0;
    size_t h_off = 0, h_n = 0, t_off = 0, t_n = 0;
};

struct RawBatch {
    std::vector<RawEvent> evs;
    std::vector<u64> data;  // every event's hashes and tokens, back to back
    bool resets = false;    // holds an AllBlocksCleared
    bool grouped = false;   // an event carries group_idx or kv_cache_spec_kind
    size_t size() const { return evs.size(); }
};

// The module function read_raw_batch: the events of a fastwire batch (msgspec structs of the three
// classes given) -> RawBatch, or None when one of them is not of the plain shape it reads.
nb::object read_raw_batch(nb::handle events, nb::handle stored_t, nb::handle removed_t, nb::handle cleared_t,
                          nb::handle medium_bits);

// Reads a msgpack array of integers from [p, end) into out (appended); hashes (`hashes`) also take
// non-empty bin digests (their last 8 bytes, big-endian) and negative ints (two's complement);
// tokens take ints in [0, 2**64) only.  False for anything else, or for bytes left over.
bool read_msgpack_u64s(const uint8_t* p, const uint8_t* end, bool hashes, std::vector<u64>& out);

// The same for the array at p followed by anything: returns the byte after it, nullptr on failure.
const uint8_t* read_msgpack_u64s_at(const uint8_t* p, const uint8_t* end, bool hashes, std::vector<u64>& out);

// The tier bit of a medium (a str, or None) from the caller's medium -> bit dict; false (no Python
// error left) when it has none or the bit is not an unsigned int.
bool tier_bit_of(PyObject* medium_bits, PyObject* medium, u64& bit);

// The module function decode_raw_payload: a whole vLLM payload of the plain shape read here (the
// subset of what kvevents.fastwire's msgspec structures take that this reader knows), as
// (ts, dp_rank or None, RawBatch); None for anything else (the caller decodes it another way).
nb::object decode_raw_payload(nb::bytes payload, nb::handle medium_bits);

}  // namespace kvnative
