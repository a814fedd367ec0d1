// kvsim: symbols mlx-rs 0.33 links against that mlx-c 0.7.0 does not define on x86-64 Linux.
//
// * mlx-c declares the float16/bfloat16 item and data accessors only where the compiler has ARM's
//   half types (mlx/c/half.h). mlx-rs calls all four unconditionally. Here the values travel as
//   their 16-bit patterns (uint16_t), which is what the Rust side's `half` types are.
// * mlx-rs seeds its random state with `mach_approximate_time` (a macOS call, reached through
//   the `mach-sys` crate). A monotonic nanosecond clock serves the same purpose.
#include <cstdint>
#include <cstring>
#include <ctime>
#include <exception>

#include "mlx/c/error.h"
#include "mlx/c/private/mlx.h"

namespace {
template <typename T>
const uint16_t* data16(const mlx_array arr) {
  try {
    return reinterpret_cast<const uint16_t*>(mlx_array_get_(arr).data<T>());
  } catch (std::exception& e) {
    mlx_error(e.what());
    return nullptr;
  }
}
template <typename T>
int item16(uint16_t* res, const mlx_array arr) {
  try {
    T v = mlx_array_get_(arr).item<T>();
    static_assert(sizeof(T) == 2, "16-bit float expected");
    std::memcpy(res, &v, 2);
    return 0;
  } catch (std::exception& e) {
    mlx_error(e.what());
    return 1;
  }
}
}  // namespace

extern "C" const uint16_t* mlx_array_data_float16(const mlx_array arr) { return data16<mlx::core::float16_t>(arr); }
extern "C" const uint16_t* mlx_array_data_bfloat16(const mlx_array arr) { return data16<mlx::core::bfloat16_t>(arr); }
extern "C" int mlx_array_item_float16(uint16_t* res, const mlx_array arr) { return item16<mlx::core::float16_t>(res, arr); }
extern "C" int mlx_array_item_bfloat16(uint16_t* res, const mlx_array arr) { return item16<mlx::core::bfloat16_t>(res, arr); }

extern "C" uint64_t mach_approximate_time() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return uint64_t(t.tv_sec) * 1000000000ull + uint64_t(t.tv_nsec);
}
