// scorer.picker.TTFTPicker's per-candidate pass and ranking in C++ (the module function ttft_rows).
#pragma once

#include "common.h"

namespace kvnative {

nb::object ttft_rows(nb::handle prefix_o, nb::handle loads_o, nb::handle pods_o, nb::handle n_prompt_o, double kvp,
                     double stall, double reserve, double tie, nb::handle row_type);

}  // namespace kvnative
