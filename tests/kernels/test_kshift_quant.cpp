// The q8_0 K-shift kernel (kernels/kshift.hpp, rotate_tile_q8_0_uniform: the uniform-delta
// path of AVX2 + FMA + F16C and AVX-512 builds; this folder is built generic, native and
// x86-64-v3, so each path runs) against the generic path (rotate_tile_converted with the
// same angles given per lane) and against a plain scalar recomputation in this file
// (dequantize, rotate with std::fma as rotate_rows, q8_0::from_float): the bytes must be
// identical. Cases: full and partial masks, partial rotary (n_rot < head dim, n_rot not a
// multiple of 32), blocks of every scale size (subnormal binary16 scales, zero blocks,
// codes -128 from foreign bytes, negative scales), non-finite stored scales (NaN, +-inf,
// in moving and in still cells), exact rounding ties, and large scales whose new scale
// overflows binary16.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace {

using kvcache::block_q8_0;
namespace kk = kvcache::kernels;

constexpr std::uint32_t qks_dim = 128, qks_units = qks_dim / 32;

/// One tile of head dim 128 (4 unit rows x 32 cells) with blocks of mixed magnitudes.
std::vector<block_q8_0> qks_tile(std::mt19937& rng) {
    std::vector<block_q8_0> tile(std::size_t{qks_units} * kvcache::k_tile);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_int_distribution<int> kind(0, 9), code(-128, 127);
    float v[32];
    for (auto& b : tile) {
        const int k = kind(rng);
        const float scale = k == 0 ? 1e-6f : k == 1 ? 3e-4f : k == 2 ? 2e4f : k == 3 ? 0.0f : 3.0f;
        for (auto& x : v) x = nd(rng) * scale;
        kvcache::q8_0::from_float(v, &b, 32);
        if (k == 4) {  // foreign bytes: any code (-128 too), a negative scale
            for (auto& q : b.qs) q = static_cast<std::int8_t>(code(rng));
            b.d = kvcache::scalar::f32_to_f16(-0.0371f);
        }
    }
    return tile;
}

/// The K-shift of one tile recomputed here: each moving cell's blocks of the rotated unit
/// rows dequantized, pairs rotated (x0 c - (x1 s) and x0 s + (x1 c), the first product
/// fused where the CPU has FMA, as rotate_rows), quantized with q8_0::from_float.
void qks_reference(block_q8_0* tile, std::uint32_t n_rot, kvcache::tile_mask mask, const float* cs, const float* sn) {
    for (std::uint32_t u = 0; u * 32 < n_rot; ++u)
        for (std::uint32_t j = 0; j < kvcache::k_tile; ++j) {
            if (!((mask >> j) & 1u)) continue;
            block_q8_0& b = tile[std::size_t{u} * kvcache::k_tile + j];
            float x[32];
            kvcache::q8_0::to_float(&b, x, 32);
            for (std::uint32_t k = 0; k < 16; ++k) {
                const std::uint32_t i = u * 16 + k;
                if (2 * i >= n_rot) break;
                const float x0 = x[2 * k], x1 = x[2 * k + 1];
#if defined(__FMA__)
                x[2 * k] = std::fma(x0, cs[i], -(x1 * sn[i]));
                x[2 * k + 1] = std::fma(x0, sn[i], x1 * cs[i]);
#else  // (no FMA: rotate_rows rounds twice, and so can nothing here be contracted)
                x[2 * k] = x0 * cs[i] - x1 * sn[i];
                x[2 * k + 1] = x0 * sn[i] + x1 * cs[i];
#endif
            }
            kvcache::q8_0::from_float(x, &b, 32);
        }
}

/// Runs the uniform path, the generic per-lane path and the reference on copies of tile.
void qks_check(const std::vector<block_q8_0>& tile, std::uint32_t n_rot, kvcache::tile_mask mask,
               const std::vector<float>& cs, const std::vector<float>& sn) {
    CAPTURE(n_rot);
    CAPTURE(mask);
    std::vector<float> lane_c(std::size_t{n_rot / 2} * kvcache::k_tile), lane_s(lane_c.size());
    for (std::uint32_t i = 0; i < n_rot / 2; ++i)
        for (std::uint32_t j = 0; j < kvcache::k_tile; ++j) {
            lane_c[std::size_t{i} * kvcache::k_tile + j] = cs[i];
            lane_s[std::size_t{i} * kvcache::k_tile + j] = sn[i];
        }
    auto fast = tile, generic = tile, ref = tile;
    kk::tile_rotation uni;
    uni.mask = mask;
    uni.uniform = true;
    kk::rotate_tile_converted<kvcache::q8_0>(fast.data(), n_rot, uni, cs.data(), sn.data());
    kk::tile_rotation lanes;
    lanes.mask = mask;
    lanes.lane_cos = lane_c.data();
    lanes.lane_sin = lane_s.data();
    kk::rotate_tile_converted<kvcache::q8_0>(generic.data(), n_rot, lanes, nullptr, nullptr);
    qks_reference(ref.data(), n_rot, mask, cs.data(), sn.data());
    std::size_t differ = 0, first = tile.size();
    for (std::size_t b = 0; b < tile.size(); ++b)
        if (!(fast[b] == ref[b]) || !(generic[b] == ref[b])) {
            ++differ;
            if (first == tile.size()) first = b;
        }
    CAPTURE(first);
    CHECK(differ == 0);
    // still cells and unit rows past n_rot keep their bytes
    for (std::uint32_t u = 0; u < qks_units; ++u)
        for (std::uint32_t j = 0; j < kvcache::k_tile; ++j) {
            const std::size_t b = std::size_t{u} * kvcache::k_tile + j;
            if (!((mask >> j) & 1u) || u * 32 >= n_rot) CHECK(std::memcmp(&fast[b], &tile[b], sizeof(block_q8_0)) == 0);
        }
}

void qks_angles(std::uint32_t n_rot, double delta, std::vector<float>& cs, std::vector<float>& sn) {
    cs.resize(n_rot / 2);
    sn.resize(n_rot / 2);
    for (std::uint32_t i = 0; i < n_rot / 2; ++i) {
        const double th = delta * std::pow(10000.0, -2.0 * i / n_rot);
        cs[i] = static_cast<float>(std::cos(th));
        sn[i] = static_cast<float>(std::sin(th));
    }
}

}  // namespace

TEST_CASE("q8_0 K-shift kernel: the uniform path writes the generic path's bytes (masks, partial rotary, scales)") {
    std::mt19937 rng(2029);
    const kvcache::tile_mask masks[] = {0xffffffffu, 0x80000001u, 0x00f0f0f0u, 0x00000100u, 0xfffe7fffu, 0x0001ffffu};
    std::vector<float> cs, sn;
    for (std::uint32_t n_rot : {128u, 96u, 66u, 40u, 32u, 2u}) {
        for (double delta : {7.0, -1.0, 123456.0}) {
            qks_angles(n_rot, delta, cs, sn);
            const auto tile = qks_tile(rng);
            for (const auto mask : masks) qks_check(tile, n_rot, mask, cs, sn);
        }
    }
}

TEST_CASE("q8_0 K-shift kernel: non-finite stored scales become from_float's NaN block, other cells unaffected") {
    std::mt19937 rng(31);
    std::vector<float> cs, sn;
    qks_angles(128, 5.0, cs, sn);
    auto tile = qks_tile(rng);
    const std::uint16_t bad[] = {0x7e00u, 0x7c00u, 0xfc00u, 0x7c01u, 0xfe00u};
    for (std::size_t k = 0; k < 24; ++k) {  // moving and still cells, several unit rows
        const std::size_t b = (k * 37) % tile.size();
        const std::uint16_t bits = bad[k % 5];
        std::memcpy(&tile[b].d, &bits, sizeof bits);
    }
    for (const kvcache::tile_mask mask : {kvcache::tile_mask{0xffffffffu}, kvcache::tile_mask{0x55555555u}}) {
        qks_check(tile, 128, mask, cs, sn);
        kk::tile_rotation uni;
        uni.mask = mask;
        uni.uniform = true;
        auto out = tile;
        kk::rotate_tile_converted<kvcache::q8_0>(out.data(), 128, uni, cs.data(), sn.data());
        std::size_t nan_blocks = 0;
        for (std::size_t b = 0; b < out.size(); ++b) {
            const float d = kvcache::scalar::f16_to_f32(out[b].d);
            if (!std::isfinite(kvcache::scalar::f16_to_f32(tile[b].d)) && ((mask >> (b % 32)) & 1u)) {
                CHECK(std::isnan(d));
                for (auto q : out[b].qs) CHECK(q == 0);
                ++nan_blocks;
            } else if (std::isfinite(kvcache::scalar::f16_to_f32(tile[b].d))) {
                CHECK(std::isfinite(d));
            }
        }
        CHECK(nan_blocks > 0);
    }
}

TEST_CASE("q8_0 K-shift kernel: exact rounding ties go away from zero; overflowing scales") {
    // angle 0 (cos 1, sin 0): a block with codes in [-2, 2] and scale 127 * 2^-10 gets the
    // new scale 254 * 2^-10 / 127 = 2^-9 exactly, so code +-1 becomes +-63.5: a tie, +-64.
    std::vector<float> cs(64, 1.0f), sn(64, 0.0f);
    std::vector<block_q8_0> tile(std::size_t{qks_units} * kvcache::k_tile);
    for (std::size_t b = 0; b < tile.size(); ++b) {
        tile[b].d = kvcache::scalar::f32_to_f16(127.0f / 1024.0f);
        for (int i = 0; i < 32; ++i) tile[b].qs[i] = static_cast<std::int8_t>((i + static_cast<int>(b)) % 5 - 2);
    }
    qks_check(tile, 128, 0xffffffffu, cs, sn);
    auto out = tile;
    kk::tile_rotation uni;
    uni.mask = 0xffffffffu;
    uni.uniform = true;
    kk::rotate_tile_converted<kvcache::q8_0>(out.data(), 128, uni, cs.data(), sn.data());
    CHECK(kvcache::scalar::f16_to_f32(out[0].d) == 1.0f / 512.0f);
    for (int i = 0; i < 32; ++i) {
        const int q = tile[0].qs[i];
        CHECK(out[0].qs[i] == (q == 0 ? 0 : q == 1 ? 64 : q == -1 ? -64 : q == 2 ? 127 : -127));
    }
    // scale 60000 (binary16 max 65504), codes +-127 at 45 degrees: |y| ~ 60000 * 127 * 1.41
    // makes the new scale overflow to inf: from_float stores inf and zero codes
    std::vector<block_q8_0> big(tile.size());
    for (auto& b : big) {
        b.d = kvcache::scalar::f32_to_f16(60000.0f);
        for (int i = 0; i < 32; ++i) b.qs[i] = static_cast<std::int8_t>(i % 2 ? 127 : -127);
    }
    std::vector<float> c45(64, static_cast<float>(std::sqrt(0.5))), s45 = c45;
    qks_check(big, 128, 0xffffffffu, c45, s45);
}
