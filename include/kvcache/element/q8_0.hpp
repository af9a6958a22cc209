// kvcache: q8_0 element policy (llama.cpp's q8_0 block: 32 int8 values and one f16
// scale, 34 bytes per 32 values = 8.5 bits per value).
#pragma once

#include <cmath>        // std::fabs, std::isfinite, std::nearbyint
#include <cstddef>      // std::size_t
#include <cstdint>      // fixed-width integers
#include <limits>       // quiet_NaN
#include <string_view>  // name

#include "../concepts.hpp"
#include "../simd/convert.hpp"

KVCACHE_BEGIN_NAMESPACE

/// One q8_0 block: value i = qs[i] * d.
struct block_q8_0 {
    half d;                ///< scale (binary16)
    std::int8_t qs[32];    ///< quantized values
    /// Bitwise equality (the scale's bits, then the codes).
    friend bool operator==(const block_q8_0&, const block_q8_0&) = default;
};
static_assert(sizeof(block_q8_0) == 34, "block_q8_0 is llama.cpp's 34-byte block");

namespace detail {
/// Binary16 scale for a block whose largest |value| is amax and largest code is qmax,
/// or NaN when the block holds a NaN or an infinity (amax not finite). The scale is
/// rounded to binary16 first and the values are then quantized with that stored scale
/// (llama.cpp quantizes with the unrounded f32 scale), so dequantization sees exactly
/// the scale the codes were chosen for.
inline half block_scale(float amax, float qmax) noexcept {
    if (!std::isfinite(amax)) return scalar::f32_to_f16(std::numeric_limits<float>::quiet_NaN());
    return scalar::f32_to_f16(amax / qmax);
}
}  // namespace detail

/// Stores K/V as llama.cpp's q8_0 blocks: 32 values of one cell (32 consecutive
/// dimensions of one head; format/kv_view.hpp, "Block elements") share the scale
/// d = max|x| / 127 (binary16), each value is round(x / d) in [-127, 127] (ties away
/// from zero). Error per value: at most d / 2 (plus the binary16 rounding of d,
/// relative 2^-11), i.e. max|x| / 254 of its block.
/// Out of range and bad values (documented behaviour, tested):
/// - a NaN or +-inf anywhere in a block stores a NaN scale: all 32 values of the block
///   read back NaN (so do the attention rows that see the cell), never a silent finite value;
/// - max|x| > 65504 * 127 (~8.3e6) makes the binary16 scale inf: the block reads back
///   NaN;
/// - an all-zero block stores d = 0 and reads back zeros; max|x| < ~7.6e-6 (d below
///   the smallest binary16 subnormal) reads back zeros.
struct q8_0 {
    using policy_kind = element_tag;
    using storage_type = block_q8_0;
    static constexpr std::string_view name = "q8_0";
    static constexpr std::uint32_t type_id = 8;
    static constexpr std::uint32_t block_size = 32;

    /// Dequantizes n / 32 blocks (n a multiple of 32).
    static void to_float(const block_q8_0* src, float* dst, std::size_t n) noexcept {
        for (std::size_t b = 0; b < n / block_size; ++b, dst += block_size) {
            const float d = scalar::f16_to_f32(src[b].d);
            for (std::uint32_t i = 0; i < block_size; ++i) dst[i] = static_cast<float>(src[b].qs[i]) * d;
        }
    }
    /// Quantizes n values (a multiple of 32) into n / 32 blocks.
    static void from_float(const float* src, block_q8_0* dst, std::size_t n) noexcept {
        for (std::size_t b = 0; b < n / block_size; ++b, src += block_size) {
            float amax = 0.0f;
            bool finite = true;
            for (std::uint32_t i = 0; i < block_size; ++i) {
                finite = finite && std::isfinite(src[i]);
                const float a = std::fabs(src[i]);
                amax = a > amax ? a : amax;
            }
            const half hd = detail::block_scale(finite ? amax : std::numeric_limits<float>::infinity(), 127.0f);
            const float d = scalar::f16_to_f32(hd);
            const float id = d != 0.0f && std::isfinite(d) ? 1.0f / d : 0.0f;
            dst[b].d = hd;
            for (std::uint32_t i = 0; i < block_size; ++i) {
                float q = std::round(src[i] * id);
                q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);  // d rounded down to binary16
                dst[b].qs[i] = static_cast<std::int8_t>(finite ? q : 0.0f);
            }
        }
    }
};

KVCACHE_END_NAMESPACE
