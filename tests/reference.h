// The float64 reference (src/moe/reference.h) under the names the tests use.
#pragma once

#include "lib/float64_reference.h"

namespace colibri_test {

using colibri::load_reference_expert;
using colibri::reference_layer;
using colibri::ReferenceExpert;
using colibri::relative_l2;

}  // namespace colibri_test
