// kvcache kernels: which implementation an op runs.
#pragma once

#include <cstdint>  // std::uint8_t

#include "../config.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace ops {

/// simd: the optimised kernels (xsimd + F16C/AVX-512 conversion, OpenMP).
/// scalar: the plain one-element-at-a-time loops the benchmarks compare against
/// (same results up to float rounding; single-threaded).
enum class kernel_path : std::uint8_t { simd = 0, scalar = 1 };

}  // namespace ops
KVCACHE_END_NAMESPACE
