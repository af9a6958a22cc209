// The q8_0 and q4_0 K-shift kernels (kernels/kshift.hpp, rotate_tile_q8_0_uniform and
// rotate_tile_q4_0_uniform: the uniform-delta path of AVX2 + FMA + F16C and AVX-512
// builds; this folder is built generic, native and x86-64-v3, so each path runs) against
// the generic path (rotate_tile_converted with the same angles given per lane) and
// against a plain scalar recomputation in this file (dequantize, rotate with std::fma as
// rotate_rows, Element::from_float): the bytes must be identical. Cases: full and
// partial masks, partial rotary (n_rot < head dim, n_rot not a multiple of 32), blocks
// of every scale size (subnormal binary16 scales, zero blocks, codes -128 from foreign
// bytes, negative scales), non-finite stored scales (NaN, +-inf, in moving and in still
// cells), exact rounding ties, and large scales whose new scale overflows binary16.
// q4_0 also: equal magnitudes of both signs (the sign of the scale follows the first in
// dimension order), new scales that round to +-0, stored -0 scales, and a float64
// recomputation of the rotation within the q4_0 error.
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
template <class E>
void qks_reference(typename E::storage_type* tile, std::uint32_t n_rot, kvcache::tile_mask mask, const float* cs,
                   const float* sn) {
    for (std::uint32_t u = 0; u * 32 < n_rot; ++u)
        for (std::uint32_t j = 0; j < kvcache::k_tile; ++j) {
            if (!((mask >> j) & 1u)) continue;
            auto& b = tile[std::size_t{u} * kvcache::k_tile + j];
            float x[32];
            E::to_float(&b, x, 32);
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
            E::from_float(x, &b, 32);
        }
}

/// Runs the uniform path, the generic per-lane path and the reference on copies of tile.
/// Returns the uniform path's output.
template <class E>
std::vector<typename E::storage_type> qks_check(const std::vector<typename E::storage_type>& tile, std::uint32_t n_rot,
                                                kvcache::tile_mask mask, const std::vector<float>& cs,
                                                const std::vector<float>& sn) {
    using B = typename E::storage_type;
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
    kk::rotate_tile_converted<E>(fast.data(), n_rot, uni, cs.data(), sn.data());
    kk::tile_rotation lanes;
    lanes.mask = mask;
    lanes.lane_cos = lane_c.data();
    lanes.lane_sin = lane_s.data();
    kk::rotate_tile_converted<E>(generic.data(), n_rot, lanes, nullptr, nullptr);
    qks_reference<E>(ref.data(), n_rot, mask, cs.data(), sn.data());
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
            if (!((mask >> j) & 1u) || u * 32 >= n_rot) CHECK(std::memcmp(&fast[b], &tile[b], sizeof(B)) == 0);
        }
    return fast;
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

/// Non-finite stored scales (NaN, +-inf, NaN payloads) in 24 blocks: moving and still
/// cells, several unit rows.
template <class Block>
void qks_poison(std::vector<Block>& tile) {
    const std::uint16_t bad[] = {0x7e00u, 0x7c00u, 0xfc00u, 0x7c01u, 0xfe00u};
    for (std::size_t k = 0; k < 24; ++k) {
        const std::size_t b = (k * 37) % tile.size();
        const std::uint16_t bits = bad[k % 5];
        std::memcpy(&tile[b].d, &bits, sizeof bits);
    }
}

/// qks_check over head dims 128 down to 2, three deltas and six masks, a fresh tile
/// make(rng) per head dim and delta; then also(tile, out, n_rot, mask, cs, sn).
template <class E, class Make, class Also>
void qks_sweep(std::uint32_t seed, Make make, Also also) {
    std::mt19937 rng(seed);
    const kvcache::tile_mask masks[] = {0xffffffffu, 0x80000001u, 0x00f0f0f0u, 0x00000100u, 0xfffe7fffu, 0x0001ffffu};
    std::vector<float> cs, sn;
    for (std::uint32_t n_rot : {128u, 96u, 66u, 40u, 32u, 2u}) {
        for (double delta : {7.0, -1.0, 123456.0}) {
            qks_angles(n_rot, delta, cs, sn);
            const auto tile = make(rng);
            for (const auto mask : masks) also(tile, qks_check<E>(tile, n_rot, mask, cs, sn), n_rot, mask, cs, sn);
        }
    }
}

/// Tiles from make(seed) with qks_poison's scales, two masks: qks_check, then also(...);
/// the moved blocks of non-finite scale read NaN with every code byte nan_byte, and
/// (finite_stays) the blocks of finite scale keep a finite scale.
template <class E, class Make, class Also>
void qks_nonfinite(std::uint32_t seed, Make make, std::uint8_t nan_byte, bool finite_stays, Also also) {
    std::mt19937 rng(seed);
    std::vector<float> cs, sn;
    qks_angles(128, 5.0, cs, sn);
    auto tile = make(rng);
    qks_poison(tile);
    for (const kvcache::tile_mask mask : {kvcache::tile_mask{0xffffffffu}, kvcache::tile_mask{0x55555555u}}) {
        const auto out = qks_check<E>(tile, 128, mask, cs, sn);
        also(tile, out, 128, mask, cs, sn);
        std::size_t nan_blocks = 0;
        for (std::size_t b = 0; b < out.size(); ++b) {
            const float d = kvcache::scalar::f16_to_f32(out[b].d);
            if (!std::isfinite(kvcache::scalar::f16_to_f32(tile[b].d)) && ((mask >> (b % 32)) & 1u)) {
                CHECK(std::isnan(d));
                for (auto q : out[b].qs) CHECK(static_cast<std::uint8_t>(q) == nan_byte);
                ++nan_blocks;
            } else if (finite_stays && std::isfinite(kvcache::scalar::f16_to_f32(tile[b].d))) {
                CHECK(std::isfinite(d));
            }
        }
        CHECK(nan_blocks > 0);
    }
}

}  // namespace

TEST_CASE("q8_0 K-shift kernel: the uniform path writes the generic path's bytes (masks, partial rotary, scales)") {
    qks_sweep<kvcache::q8_0>(2029, qks_tile, [](const auto&...) {});
}

TEST_CASE("q8_0 K-shift kernel: non-finite stored scales become from_float's NaN block, other cells unaffected") {
    qks_nonfinite<kvcache::q8_0>(31, qks_tile, 0x00, true, [](const auto&...) {});
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
    qks_check<kvcache::q8_0>(tile, 128, 0xffffffffu, cs, sn);
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
    qks_check<kvcache::q8_0>(big, 128, 0xffffffffu, c45, s45);
}

namespace {

using kvcache::block_q4_0;

/// q4_0 tile of head dim 128 with blocks of every kind the kernel must treat as
/// from_float does: random data, codes in [5, 11] (equal magnitudes of both signs: the
/// sign of the scale follows the first in dimension order), subnormal scales whose new
/// scale rounds to +-0 (m > 0: the -0 scale), zero blocks, a stored -0 scale, huge
/// scales (the new scale overflows to +-inf), foreign bytes under both signs of scale.
std::vector<block_q4_0> q4_tile(std::mt19937& rng) {
    std::vector<block_q4_0> tile(std::size_t{qks_units} * kvcache::k_tile);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_int_distribution<int> kind(0, 9), nibble(0, 15), narrow(5, 11), tiny(7, 9);
    const float scales[] = {-0.0371f, 0.25f, 6e-8f, 60000.0f, -60000.0f, 3e-3f};
    float v[32];
    for (auto& b : tile) {
        const int k = kind(rng);
        auto codes = [&](auto& dist) {
            for (auto& q : b.qs) q = static_cast<std::uint8_t>(dist(rng) | (dist(rng) << 4));
        };
        const float scale = scales[std::uniform_int_distribution<int>(0, 5)(rng)];
        if (k <= 3) {  // quantized random data of mixed magnitudes
            const float mag = k == 0 ? 1e-6f : k == 1 ? 2e4f : 3.0f;
            for (auto& x : v) x = nd(rng) * mag;
            kvcache::q4_0::from_float(v, &b, 32);
        } else if (k == 4) {  // ties of magnitude
            codes(narrow);
            b.d = kvcache::scalar::f32_to_f16(scale);
        } else if (k == 5) {  // new scale below half the smallest subnormal: +-0
            codes(tiny);
            b.d = kvcache::scalar::f32_to_f16(nibble(rng) < 8 ? 6e-8f : -6e-8f);
        } else if (k == 6) {  // zeros: a zero block, or a stored -0 scale
            codes(nibble);
            b.d = static_cast<kvcache::half>(nibble(rng) < 8 ? 0x8000u : 0u);
        } else {  // foreign bytes, huge scales included
            codes(nibble);
            b.d = kvcache::scalar::f32_to_f16(scale);
        }
    }
    return tile;
}

/// The moved blocks read back within the q4_0 error of the rotation recomputed in
/// float64 from the input: |d| (a value of the opposite sign to the block's largest
/// clamped from 8 |d| to 7 |d|) plus the binary16 rounding of d, where the new scale
/// is finite; where it is not (|y| / 8 > 65504) the block reads back NaN.
void q4_double_check(const std::vector<block_q4_0>& in, const std::vector<block_q4_0>& out, std::uint32_t n_rot,
                     kvcache::tile_mask mask, const std::vector<float>& cs, const std::vector<float>& sn) {
    std::size_t bad = 0;
    for (std::uint32_t u = 0; u * 32 < n_rot; ++u)
        for (std::uint32_t j = 0; j < kvcache::k_tile; ++j) {
            if (!((mask >> j) & 1u)) continue;
            const std::size_t b = std::size_t{u} * kvcache::k_tile + j;
            const double d_in = kvcache::scalar::f16_to_f32(in[b].d);
            if (!std::isfinite(d_in)) continue;  // (the NaN blocks: bytes checked against the generic path)
            double x[32], amax = 0.0;
            for (int i = 0; i < 32; ++i) {
                const int q = i < 16 ? in[b].qs[i] & 0x0f : in[b].qs[i - 16] >> 4;
                x[i] = (q - 8) * d_in;
            }
            for (std::uint32_t k = 0; k < 16 && 2 * (u * 16 + k) < n_rot; ++k) {
                const double c = cs[u * 16 + k], s = sn[u * 16 + k], x0 = x[2 * k], x1 = x[2 * k + 1];
                x[2 * k] = x0 * c - x1 * s;
                x[2 * k + 1] = x0 * s + x1 * c;
            }
            for (const double v : x) amax = std::max(amax, std::fabs(v));
            float got[32];
            kvcache::q4_0::to_float(&out[b], got, 32);
            if (amax / 8.0 > 65504.0 * (1.0 + 1e-6)) {
                bad += !std::isnan(got[0]);
                continue;
            }
            const double tol = 1.01 * amax / 8.0 + 8.0 * std::ldexp(1.0, -24) + 1e-30;
            for (int i = 0; i < 32; ++i) bad += !(std::fabs(got[i] - x[i]) <= tol);
        }
    CHECK(bad == 0);
}

}  // namespace

TEST_CASE("q4_0 K-shift kernel: the uniform path writes the generic path's bytes, within the float64 rotation") {
    qks_sweep<kvcache::q4_0>(2926, q4_tile, q4_double_check);
}

TEST_CASE("q4_0 K-shift kernel: ties of magnitude, zero and -0 scales, quarter turns") {
    // angle 0 and a quarter turn (cos 0, sin 1 exactly): the rotated values keep their
    // magnitudes, so the blocks with codes in [5, 11] keep ties between +a and -a
    std::mt19937 rng(77);
    std::vector<float> c0(64, 1.0f), s0(64, 0.0f), c90(64, 0.0f), s90(64, 1.0f), c180(64, -1.0f);
    for (int rep = 0; rep < 4; ++rep) {
        const auto tile = q4_tile(rng);
        for (const auto mask : {kvcache::tile_mask{0xffffffffu}, kvcache::tile_mask{0x0ff00ff0u}}) {
            q4_double_check(tile, qks_check<kvcache::q4_0>(tile, 128, mask, c0, s0), 128, mask, c0, s0);
            q4_double_check(tile, qks_check<kvcache::q4_0>(tile, 128, mask, c90, s90), 128, mask, c90, s90);
            q4_double_check(tile, qks_check<kvcache::q4_0>(tile, 128, mask, c180, s0), 128, mask, c180, s0);
        }
    }
    // angle 0 on hand-made blocks: +1.5 and -1.5 (codes 11 and 5, d 0.5) at two places,
    // the rest zeros; from_float's m is the first of the two in dimension order
    std::vector<block_q4_0> tile(std::size_t{qks_units} * kvcache::k_tile);
    auto places = [](std::size_t b, int& i_pos, int& i_neg) {
        const int i = static_cast<int>(b % 32), k = (i + 1 + static_cast<int>(b % 7)) % 32;
        i_pos = (b / 32) % 2 ? i : k;
        i_neg = (b / 32) % 2 ? k : i;
    };
    for (std::size_t b = 0; b < tile.size(); ++b) {
        tile[b].d = kvcache::scalar::f32_to_f16(0.5f);
        for (auto& q : tile[b].qs) q = 0x88;  // zeros
        auto put = [&](int i, int code) {
            auto& q = tile[b].qs[i % 16];
            q = static_cast<std::uint8_t>(i < 16 ? (q & 0xf0) | code : (q & 0x0f) | (code << 4));
        };
        int i_pos, i_neg;
        places(b, i_pos, i_neg);
        put(i_pos, 11);
        put(i_neg, 5);
    }
    const auto out = qks_check<kvcache::q4_0>(tile, 128, 0xffffffffu, c0, s0);
    for (std::size_t b = 0; b < tile.size(); ++b) {
        int i_pos, i_neg;
        places(b, i_pos, i_neg);
        CAPTURE(b);
        // |m| = 1.5: d = m / -8 = -+0.1875, and m maps to code 0
        CHECK(kvcache::scalar::f16_to_f32(out[b].d) == (i_pos < i_neg ? -0.1875f : 0.1875f));
    }
    // a new scale below half the smallest binary16 subnormal: +-0 by the sign of m, codes 8
    std::vector<block_q4_0> small(tile.size());
    for (std::size_t b = 0; b < small.size(); ++b) {
        small[b].d = kvcache::scalar::f32_to_f16(6e-8f);
        for (auto& q : small[b].qs) q = 0x88;
        small[b].qs[b % 16] = b % 2 ? 0x89 : 0x87;  // one value +-d: m = +-6e-8
    }
    const auto zs = qks_check<kvcache::q4_0>(small, 128, 0xffffffffu, c0, s0);
    for (std::size_t b = 0; b < small.size(); ++b) {
        CHECK(static_cast<std::uint16_t>(zs[b].d) == (b % 2 ? 0x8000u : 0x0000u));  // code 9: m = +6e-8 > 0
        for (auto q : zs[b].qs) CHECK(q == 0x88);
    }
}

TEST_CASE("q4_0 K-shift kernel: non-finite stored scales become from_float's NaN block, other cells unaffected") {
    // (finite scales may overflow: q4_tile holds huge scales)
    qks_nonfinite<kvcache::q4_0>(41, q4_tile, 0x88, false, q4_double_check);
}
