// kvsim: force-included into every mlx-c translation unit (`-include compat.h`).
//
// mlx-c 0.7.0 calls `std::format` in mlx/c/private/io.h, and GCC 12's libstdc++ has no <format>.
// This supplies the one shape mlx-c uses: a format string with `{}` holes filled left to right.
// Nothing here is used when the standard library already provides <format>.
#pragma once
#include <version>
#if !defined(__cpp_lib_format)
#include <sstream>
#include <string>
#include <string_view>

namespace std {
namespace kvsim_compat {
inline void fill(std::ostringstream& out, std::string_view& rest) { out << rest; rest = {}; }
template <typename T, typename... Rest>
inline void fill(std::ostringstream& out, std::string_view& rest, const T& first, const Rest&... tail) {
  auto hole = rest.find("{}");
  if (hole == std::string_view::npos) { out << rest; rest = {}; return; }
  out << rest.substr(0, hole) << first;
  rest.remove_prefix(hole + 2);
  fill(out, rest, tail...);
}
}  // namespace kvsim_compat
template <typename... Args>
inline std::string format(std::string_view fmt, const Args&... args) {
  std::ostringstream out;
  kvsim_compat::fill(out, fmt, args...);
  return out.str();
}
}  // namespace std
#endif
