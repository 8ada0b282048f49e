// Registers the multi-path control functions on the nanobind module (see control.cc).
#pragma once

#include <nanobind/nanobind.h>

namespace flexlink {
void DefineControl(nanobind::module_& m);
}  // namespace flexlink
