// kvcache: f16 element policy (IEEE binary16, 2 bytes per value).
#pragma once

#include <cstddef>      // std::size_t
#include <cstdint>      // std::uint32_t
#include <string_view>  // name

#include "../concepts.hpp"
#include "../simd/convert.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Stores K/V as binary16, converted with round-to-nearest-even (F16C/AVX-512 when enabled).
/// Out of range (same bits on every path: scalar, F16C, AVX-512):
/// - |x| >= 65520 (the midpoint above the largest finite half, 65504) becomes +-inf, as
///   IEEE 754 round-to-nearest requires: `write_k` of 1e6 stores inf, and attention over
///   it then gives NaN or inf outputs (ops::attention), never a silently clamped value.
///   Scale activations before storing if they can exceed 65504.
/// - |x| < 2^-25 becomes +-0; [2^-25, 2^-14) becomes a subnormal half (rounded).
/// - inf stays inf; NaN stays NaN (quietened, payload truncated).
struct f16 {
    using policy_kind = element_tag;
    using storage_type = half;
    static constexpr std::string_view name = "f16";
    static constexpr std::uint32_t type_id = 1;
    static void to_float(const half* src, float* dst, std::size_t n) noexcept { f16_to_f32(src, dst, n); }
    static void from_float(const float* src, half* dst, std::size_t n) noexcept { f32_to_f16(src, dst, n); }
};

KVCACHE_END_NAMESPACE
