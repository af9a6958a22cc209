// kvcache: f32 element policy (4 bytes per value, exact).
#pragma once

#include <cstddef>      // std::size_t
#include <cstdint>      // std::uint32_t
#include <cstring>      // std::memcpy
#include <string_view>  // name

#include "../concepts.hpp"

KVCACHE_BEGIN_NAMESPACE

/// Stores K/V as IEEE binary32: every float as is (no overflow; inf and NaN kept bit for bit).
struct f32 {
    using policy_kind = element_tag;
    using storage_type = float;
    static constexpr std::string_view name = "f32";
    static constexpr std::uint32_t type_id = 0;
    static void to_float(const float* src, float* dst, std::size_t n) noexcept {
        if (n != 0) std::memcpy(dst, src, n * sizeof(float));
    }
    static void from_float(const float* src, float* dst, std::size_t n) noexcept {
        if (n != 0) std::memcpy(dst, src, n * sizeof(float));
    }
};

KVCACHE_END_NAMESPACE
