// kvcache: q4_0 element policy (llama.cpp's q4_0 block: 32 4-bit values and one f16
// scale, 18 bytes per 32 values = 4.5 bits per value).
#pragma once

#include <cmath>        // std::fabs, std::floor, std::fma, std::isfinite
#include <cstddef>      // std::size_t
#include <cstdint>      // fixed-width integers
#include <limits>       // infinity
#include <string_view>  // name

#include "../concepts.hpp"
#include "../simd/convert.hpp"
#include "q8_0.hpp"  // detail::block_scale

KVCACHE_BEGIN_NAMESPACE

/// One q4_0 block: value i = (code_i - 8) * d, code_i the low nibble of qs[i] for
/// i < 16 and the high nibble of qs[i - 16] for i >= 16 (llama.cpp's packing).
struct block_q4_0 {
    half d;                ///< scale (binary16)
    std::uint8_t qs[16];   ///< nibbles
    /// Bitwise equality (the scale's bits, then the codes).
    friend bool operator==(const block_q4_0&, const block_q4_0&) = default;
};
static_assert(sizeof(block_q4_0) == 18, "block_q4_0 is llama.cpp's 18-byte block");

/// Stores K/V as llama.cpp's q4_0 blocks: 32 values of one cell (32 consecutive
/// dimensions of one head; format/kv_view.hpp, "Block elements") share the scale
/// d = m / -8 (binary16), m the value of largest magnitude with its sign, and each value
/// is stored as min(15, floor(x * (1 / d) + 8.5)) (as llama.cpp publishes; the product and
/// the sum rounded once, std::fma, in every build): m itself maps to
/// code 0 exactly, the other side of zero reaches 7 * |d|. Error per value: at most
/// |d| / 2 = max|x| / 16 of its block (plus binary16 rounding of d), except values of
/// the opposite sign beyond 7.5 |d|, clamped to 7 |d|.
/// Out of range and bad values: as q8_0 (a NaN or +-inf in a block stores a NaN scale:
/// the block reads back NaN; |m| > 65504 * 8 makes the scale inf and the block reads back NaN).
struct q4_0 {
    using policy_kind = element_tag;
    using storage_type = block_q4_0;
    static constexpr std::string_view name = "q4_0";
    static constexpr std::uint32_t type_id = 9;
    static constexpr std::uint32_t block_size = 32;

    /// Dequantizes n / 32 blocks (n a multiple of 32).
    static void to_float(const block_q4_0* src, float* dst, std::size_t n) noexcept {
        for (std::size_t b = 0; b < n / block_size; ++b, dst += block_size) {
            const float d = scalar::f16_to_f32(src[b].d);
            for (std::uint32_t i = 0; i < 16; ++i) {
                dst[i] = static_cast<float>(static_cast<int>(src[b].qs[i] & 0x0Fu) - 8) * d;
                dst[i + 16] = static_cast<float>(static_cast<int>(src[b].qs[i] >> 4) - 8) * d;
            }
        }
    }
    /// Quantizes n values (a multiple of 32) into n / 32 blocks.
    static void from_float(const float* src, block_q4_0* dst, std::size_t n) noexcept {
        for (std::size_t b = 0; b < n / block_size; ++b, src += block_size) {
            float amax = 0.0f, m = 0.0f;
            bool finite = true;
            for (std::uint32_t i = 0; i < block_size; ++i) {
                finite = finite && std::isfinite(src[i]);
                const float a = std::fabs(src[i]);
                if (a > amax) {
                    amax = a;
                    m = src[i];
                }
            }
            half hd = detail::block_scale(finite ? amax : std::numeric_limits<float>::infinity(), 8.0f);
            if (finite && m > 0.0f) hd = static_cast<half>(static_cast<std::uint16_t>(hd) | 0x8000u);  // d = m / -8
            const float d = scalar::f16_to_f32(hd);
            const float id = d != 0.0f && std::isfinite(d) ? 1.0f / d : 0.0f;
            dst[b].d = hd;
            std::uint8_t code[32];
            for (std::uint32_t i = 0; i < block_size; ++i) {
                // one rounding (std::fma), whatever the compiler's contraction settings: the
                // K-shift kernel (kernels/kshift.hpp) computes the same fused term in SIMD
                float q = std::floor(std::fma(src[i], id, 8.5f));
                q = q > 15.0f ? 15.0f : (q < 0.0f ? 0.0f : q);  // (< 0 only through d's rounding)
                code[i] = finite ? static_cast<std::uint8_t>(q) : std::uint8_t{8};
            }
            for (std::uint32_t i = 0; i < 16; ++i)
                dst[b].qs[i] = static_cast<std::uint8_t>(code[i] | (code[i + 16] << 4));
        }
    }
};

KVCACHE_END_NAMESPACE
