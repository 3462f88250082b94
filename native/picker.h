// scorer.picker.TTFTPicker's per-candidate pass and ranking in C++ (the module function ttft_rows).
#pragma once

#include "common.h"

namespace kvnative {

// scorer.picker.TTFTPicker.pick's per-candidate pass and ranking for the common inputs, with the
// same float operations in the same order (so every value is bit-identical).  Returns the ranked
// tuple of PodInputs, or None when an input needs the Python path's clamping or conversion (a
// load or prefix field that is not an exact float/int in range, a pod id that is not an exact
// str, kv_stall > 0, a prefix or load value that is not None and lacks a field): the caller then
// runs the Python loop, which handles (or raises for) every such input as before.
nb::object ttft_rows(nb::handle prefix_o, nb::handle loads_o, nb::handle pods_o, nb::handle n_prompt_o, double kvp,
                     double stall, double reserve, double tie, nb::handle row_type);

}  // namespace kvnative
