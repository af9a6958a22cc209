// simd/tile_io.hpp helpers that the kernels' tests reach only indirectly. This folder is
// also built with -march=native, so the AVX-512 `vpbroadcastd` form of broadcast() and
// the plain xsimd form both run.
#include <doctest/doctest.h>

#include <kvcache/simd/tile_io.hpp>

#include <bit>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace {

namespace simd = kvcache::simd;

/// Every lane of v holds exactly the bits `want`.
bool all_lanes_are(const simd::fbatch& v, std::uint32_t want) {
    alignas(64) float out[simd::lanes];
    v.store_aligned(out);
    for (float x : out)
        if (std::bit_cast<std::uint32_t>(x) != want) return false;
    return true;
}

}  // namespace

TEST_CASE("broadcast puts the addressed float's exact bits in every lane") {
    using lim = std::numeric_limits<float>;
    std::vector<std::uint32_t> patterns = {
        std::bit_cast<std::uint32_t>(0.0f),          std::bit_cast<std::uint32_t>(-0.0f),
        std::bit_cast<std::uint32_t>(1.0f),          std::bit_cast<std::uint32_t>(-2.5f),
        std::bit_cast<std::uint32_t>(lim::denorm_min()), std::bit_cast<std::uint32_t>(lim::min()),
        std::bit_cast<std::uint32_t>(lim::max()),    std::bit_cast<std::uint32_t>(lim::infinity()),
        std::bit_cast<std::uint32_t>(-lim::infinity()),
        0x7fc00001u,  // quiet NaN with a payload
        0x7f800001u,  // signalling NaN pattern (must not be quieted)
        0xffffffffu};
    std::mt19937 rng(7);
    for (int i = 0; i < 200; ++i) patterns.push_back(static_cast<std::uint32_t>(rng()));

    // Neighbours differ from the addressed element, so reading the wrong one shows.
    std::vector<float> buf(patterns.size() + 2);
    for (std::size_t i = 0; i < patterns.size(); ++i) buf[i + 1] = std::bit_cast<float>(patterns[i]);
    buf.front() = 123.0f;
    buf.back() = -456.0f;
    for (std::size_t i = 0; i < patterns.size(); ++i) {
        CAPTURE(i);
        CHECK(all_lanes_are(simd::broadcast(buf.data() + i + 1), patterns[i]));
    }
}

TEST_CASE("broadcast reads memory at the call: a store in between is seen") {
    float x[3] = {1.0f, 2.0f, 3.0f};
    for (int round = 0; round < 4; ++round) {
        const simd::fbatch before = simd::broadcast(x + 1);
        CHECK(all_lanes_are(before, std::bit_cast<std::uint32_t>(x[1])));
        x[1] = x[1] * 3.0f + 1.0f;
        CHECK(all_lanes_are(simd::broadcast(x + 1), std::bit_cast<std::uint32_t>(x[1])));
    }
}
