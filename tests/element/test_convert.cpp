// f16 / bf16 conversion: scalar path against a double-precision oracle that picks the
// nearest representable value (ties to even) by search, and the vector path (this
// folder is also built with -march=native) against the scalar path, over special
// values, random bit patterns, sizes around the vector widths and misalignments.
#include <doctest/doctest.h>

#include <kvcache/element/bf16.hpp>
#include <kvcache/element/f16.hpp>
#include <kvcache/element/f32.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace {

using kvcache::bfloat16;
using kvcache::half;
namespace sc = kvcache::scalar;

std::uint16_t bits(half h) { return static_cast<std::uint16_t>(h); }
std::uint16_t bits(bfloat16 b) { return static_cast<std::uint16_t>(b); }

/// Value of a binary16 bit pattern, computed from its definition.
double half_value(std::uint16_t h) {
    const int sign = (h >> 15) ? -1 : 1;
    const int e = (h >> 10) & 31;
    const int m = h & 1023;
    if (e == 0) return sign * std::ldexp(m, -24);
    return sign * std::ldexp(1024 + m, e - 25);
}

/// Oracle: nearest binary16 to x (ties to even mantissa); beyond 65520 -> Inf.
std::uint16_t oracle_f16(float x) {
    if (std::isnan(x)) return 0x7e00;
    const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    const double a = std::fabs(static_cast<double>(x));
    if (a >= 65520.0) return sign | 0x7c00;
    // Positive finite halves are ordered by their bit patterns 0..0x7bff.
    std::uint16_t lo = 0, hi = 0x7bff;
    while (lo < hi) {  // largest pattern with value <= a
        const std::uint16_t mid = static_cast<std::uint16_t>((lo + hi + 1) / 2);
        if (half_value(mid) <= a)
            lo = mid;
        else
            hi = static_cast<std::uint16_t>(mid - 1);
    }
    const double below = half_value(lo);
    if (below == a || lo == 0x7bff) return sign | lo;
    const double above = half_value(static_cast<std::uint16_t>(lo + 1));
    const double dl = a - below, du = above - a;
    if (dl < du || (dl == du && (lo & 1) == 0)) return sign | lo;
    return sign | static_cast<std::uint16_t>(lo + 1);
}

/// Oracle: nearest bfloat16 to x (ties to even); rounding past the largest finite value -> Inf.
std::uint16_t oracle_bf16(float x) {
    if (std::isnan(x)) return 0;  // checked separately
    const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
    const std::uint32_t down = u & 0xffff0000u;
    const double a = std::fabs(static_cast<double>(x));
    const double below = std::fabs(static_cast<double>(std::bit_cast<float>(down)));
    if (below == a) return static_cast<std::uint16_t>(down >> 16);
    const std::uint32_t up = down + 0x10000u;
    // The value after the largest finite bf16 is 2^128 for rounding purposes.
    const double above = (up & 0x7fffffffu) == 0x7f800000u ? std::ldexp(1.0, 128)
                                                           : std::fabs(static_cast<double>(std::bit_cast<float>(up)));
    const double dl = a - below, du = above - a;
    if (dl < du || (dl == du && ((down >> 16) & 1) == 0)) return static_cast<std::uint16_t>(down >> 16);
    return static_cast<std::uint16_t>(up >> 16);
}

std::vector<float> special_values() {
    std::vector<float> v{0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65505.0f, 65519.99f, 65520.0f, -65520.0f, 1e10f,
                         std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                         std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::signaling_NaN(),
                         std::numeric_limits<float>::max(), std::numeric_limits<float>::min(),
                         std::numeric_limits<float>::denorm_min(), 6.1035156e-05f /* 2^-14 */,
                         6.0975552e-05f /* largest f16 subnormal */, 5.9604645e-08f /* 2^-24 */,
                         2.9802322e-08f /* 2^-25: tie to 0 */, 2.9802326e-08f, 8.9406967e-08f /* 1.5 * 2^-24 */,
                         1.0009766f /* 1 + 2^-10 */, 1.0004883f /* tie */, 1.0014648f /* tie, odd */};
    // Every binary16 value and the midpoints next to it.
    for (std::uint32_t h = 0; h < 0x7c00; h += 37) {
        const double x = half_value(static_cast<std::uint16_t>(h));
        v.push_back(static_cast<float>(x));
        v.push_back(static_cast<float>(-x));
        v.push_back(static_cast<float>((x + half_value(static_cast<std::uint16_t>(h + 1))) / 2));
    }
    return v;
}

std::vector<float> random_values(std::size_t n, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<float> v(n);
    for (auto& x : v) x = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
    return v;
}

}  // namespace

TEST_CASE("f16 -> f32 is exact for every binary16 pattern") {
    for (std::uint32_t h = 0; h < 65536; ++h) {
        const float f = sc::f16_to_f32(static_cast<half>(h));
        const bool is_nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0;
        if (is_nan) {
            CHECK(std::isnan(f));
            continue;
        }
        if ((h & 0x7fff) == 0x7c00) {
            CHECK(std::isinf(f));
            continue;
        }
        REQUIRE(static_cast<double>(f) == half_value(static_cast<std::uint16_t>(h)));
        REQUIRE(bits(sc::f32_to_f16(f)) == h);  // round trip
    }
}

TEST_CASE("f32 -> f16 rounds to nearest even, keeps NaN/Inf/subnormals") {
    auto vals = special_values();
    const auto rnd = random_values(200000, 7);
    vals.insert(vals.end(), rnd.begin(), rnd.end());
    for (float x : vals) {
        const std::uint16_t got = bits(sc::f32_to_f16(x));
        if (std::isnan(x)) {
            CHECK((got & 0x7c00) == 0x7c00);
            CHECK((got & 0x3ff) != 0);
            CHECK((got & 0x200) != 0);  // quiet
            continue;
        }
        INFO("x = " << x << " bits " << std::bit_cast<std::uint32_t>(x));
        REQUIRE(got == oracle_f16(x));
    }
}

TEST_CASE("bf16 conversions round to nearest even, keep NaN/Inf/subnormals") {
    auto vals = special_values();
    const auto rnd = random_values(200000, 11);
    vals.insert(vals.end(), rnd.begin(), rnd.end());
    vals.push_back(std::bit_cast<float>(0x7f7fffffu));  // rounds to Inf
    vals.push_back(std::bit_cast<float>(0x00008000u));  // subnormal tie
    vals.push_back(std::bit_cast<float>(0x00018000u));  // subnormal tie, odd
    for (float x : vals) {
        const std::uint16_t got = bits(sc::f32_to_bf16(x));
        if (std::isnan(x)) {
            CHECK(std::isnan(sc::bf16_to_f32(static_cast<bfloat16>(got))));
            CHECK((got & 0x40) != 0);
            continue;
        }
        INFO("x bits " << std::bit_cast<std::uint32_t>(x));
        REQUIRE(got == oracle_bf16(x));
        REQUIRE(std::bit_cast<std::uint32_t>(sc::bf16_to_f32(static_cast<bfloat16>(got))) ==
                static_cast<std::uint32_t>(got) << 16);
    }
}

TEST_CASE("vector conversion paths equal the scalar path (sizes, misalignment)") {
    MESSAGE("conversion path: " << std::string(kvcache::convert_path()));
    const std::vector<std::size_t> sizes{0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 130, 16 * 8 + 2};
    auto vals = special_values();
    const auto rnd = random_values(4096, 3);
    vals.insert(vals.end(), rnd.begin(), rnd.end());
    for (std::size_t n : sizes) {
        for (std::size_t off : {0, 1, 3}) {
            CAPTURE(n);
            CAPTURE(off);
            std::vector<float> src(n + off + 1), back(n + off + 1, 123.0f);
            for (std::size_t i = 0; i < n; ++i) src[off + i] = vals[(i * 131 + n) % vals.size()];
            std::vector<half> h(n + off + 1, static_cast<half>(0xabcd));
            std::vector<bfloat16> b(n + off + 1, static_cast<bfloat16>(0xabcd));
            kvcache::f32_to_f16(src.data() + off, h.data() + off, n);
            kvcache::f32_to_bf16(src.data() + off, b.data() + off, n);
            for (std::size_t i = 0; i < n; ++i) {
                const float x = src[off + i];
                if (std::isnan(x)) {
                    CHECK(std::isnan(sc::f16_to_f32(h[off + i])));
                    CHECK(std::isnan(sc::bf16_to_f32(b[off + i])));
                } else {
                    REQUIRE(bits(h[off + i]) == bits(sc::f32_to_f16(x)));
                    REQUIRE(bits(b[off + i]) == bits(sc::f32_to_bf16(x)));
                }
            }
            CHECK(bits(h[off + n]) == 0xabcd);  // nothing written past the end
            CHECK(bits(b[off + n]) == 0xabcd);
            kvcache::f16_to_f32(h.data() + off, back.data() + off, n);
            for (std::size_t i = 0; i < n; ++i) {
                const float want = sc::f16_to_f32(h[off + i]);
                if (std::isnan(want))
                    CHECK(std::isnan(back[off + i]));
                else
                    REQUIRE(std::bit_cast<std::uint32_t>(back[off + i]) == std::bit_cast<std::uint32_t>(want));
            }
            CHECK(back[off + n] == 123.0f);
            kvcache::bf16_to_f32(b.data() + off, back.data() + off, n);
            for (std::size_t i = 0; i < n; ++i)
                REQUIRE(std::bit_cast<std::uint32_t>(back[off + i]) == static_cast<std::uint32_t>(bits(b[off + i])) << 16);
        }
    }
}

TEST_CASE_TEMPLATE("element policies satisfy the concept and convert through the helper", E, kvcache::f32,
                   kvcache::f16, kvcache::bf16) {
    static_assert(kvcache::element_policy<E>);
    const std::vector<float> src{0.5f, -2.0f, 3.25f, 1024.0f};
    std::vector<typename E::storage_type> st(src.size());
    std::vector<float> back(src.size());
    E::from_float(src.data(), st.data(), src.size());
    E::to_float(st.data(), back.data(), src.size());
    CHECK(back == src);
}
