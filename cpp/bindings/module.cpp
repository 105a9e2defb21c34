// megamoe._C: one extension module. Each kernel family registers its own functions
// (cpp/<part>/bind_<part>.cpp); this file only says what was built.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "megamoe/sf_layout.hpp"

namespace nb = nanobind;

#ifdef MEGAMOE_HAS_COMMON
void register_common(nb::module_& m);
#endif
#ifdef MEGAMOE_HAS_SM90
void register_sm90(nb::module_& m);
#endif
#ifdef MEGAMOE_HAS_SM100
void register_sm100(nb::module_& m);
#endif

NB_MODULE(_C, m) {
  m.doc() = "megamoe compiled kernels (see megamoe/_ext.py for how they are found)";
  std::vector<std::string> parts;
#ifdef MEGAMOE_HAS_COMMON
  parts.push_back("common");
  register_common(m);
#endif
#ifdef MEGAMOE_HAS_SM90
  parts.push_back("sm90");
  register_sm90(m);
#endif
#ifdef MEGAMOE_HAS_SM100
  parts.push_back("sm100");
  register_sm100(m);
#endif
  m.attr("built_parts") = parts;
#ifdef MEGAMOE_HAS_CUDA
  m.attr("cuda_archs") = std::string(MEGAMOE_CUDA_ARCHS_STR);
#else
  m.attr("cuda_archs") = std::string("");
#endif
  // The closed form of docs/SPEC.md §2 as compiled into the kernels, so Python tests can
  // check that the C++ and Python copies of the layout agree.
  m.def("sf_offset", [](int64_t b, int64_t row, int64_t col, int64_t rows, int64_t cols) {
    return megamoe::sf_offset(b, row, col, (rows + 127) / 128, (cols + 3) / 4);
  }, nb::arg("batch"), nb::arg("row"), nb::arg("col"), nb::arg("rows"), nb::arg("cols"),
     "Byte offset of scale (row, col) of `batch` in the swizzled SF buffer (docs/SPEC.md §2).");
  m.def("sf_padded_bytes", &megamoe::sf_padded_bytes, nb::arg("rows"), nb::arg("cols"));
}
