// Enum fields that C callers fill in. C lets any int sit in an enum field;
// in C++ loading a value outside the enum's range as the enum type is
// undefined behaviour (UBSan's -fsanitize=enum flags it). So the C ABI reads
// such fields as int, validates, and only then uses them as the enum.
#pragma once

#include <cstring>

namespace colibri {

template <class Enum>
int raw_enum(const Enum& field) {
  static_assert(sizeof(Enum) == sizeof(int), "C enums are int-sized here");
  int value = 0;
  std::memcpy(&value, &field, sizeof value);
  return value;
}

}  // namespace colibri
