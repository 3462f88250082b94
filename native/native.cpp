// kvindex._native: the compiled core of kvindex (see kvindex/native.py).
#include <nanobind/nanobind.h>

namespace nb = nanobind;

NB_MODULE(_native, m) {
    m.doc() = "kvindex compiled core";
    m.attr("ABI_VERSION") = 1;
}
