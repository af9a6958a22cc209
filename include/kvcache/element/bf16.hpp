// kvcache: bf16 element policy (bfloat16, 2 bytes per value, f32 exponent range).
#pragma once

#include <cstddef>      // std::size_t
#include <cstdint>      // std::uint32_t
#include <string_view>  // name

#include "../concepts.hpp"
#include "../simd/convert.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Stores K/V as bfloat16, converted with round-to-nearest-even (AVX2/AVX-512 when enabled).
struct bf16 {
    using policy_kind = element_tag;
    using storage_type = bfloat16;
    static constexpr std::string_view name = "bf16";
    static constexpr std::uint32_t type_id = 2;
    static void to_float(const bfloat16* src, float* dst, std::size_t n) noexcept { bf16_to_f32(src, dst, n); }
    static void from_float(const float* src, bfloat16* dst, std::size_t n) noexcept { f32_to_bf16(src, dst, n); }
};

KVCACHE_END_NAMESPACE
