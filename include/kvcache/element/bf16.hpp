// kvcache: bf16 element policy (bfloat16, 2 bytes per value, f32 exponent range).
#pragma once

#include <cstddef>      // std::size_t
#include <cstdint>      // std::uint32_t
#include <string_view>  // name

#include "../concepts.hpp"
#include "../simd/convert.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Stores K/V as bfloat16, converted with round-to-nearest-even (AVX2/AVX-512 when enabled).
/// Out of range: bf16 has f32's exponent range, so nothing finite overflows but the last
/// half ulp: |x| >= 0x1.ff0p127 (~3.3961e38, the midpoint above the largest finite bf16,
/// ~3.3895e38) rounds to +-inf (IEEE round-to-nearest). Subnormals are kept (rounded, not
/// flushed); inf stays inf; NaN stays NaN (quietened). Precision: 8 significant bits.
struct bf16 {
    using policy_kind = element_tag;
    using storage_type = bfloat16;
    static constexpr std::string_view name = "bf16";
    static constexpr std::uint32_t type_id = 2;
    static void to_float(const bfloat16* src, float* dst, std::size_t n) noexcept { bf16_to_f32(src, dst, n); }
    static void from_float(const float* src, bfloat16* dst, std::size_t n) noexcept { f32_to_bf16(src, dst, n); }
};

KVCACHE_END_NAMESPACE
