// kvcache kernels: RoPE angles, accurate for positions and deltas up to 2^31.
//
// theta_i(p) = p * freq_scale * freq_base^(-2i / n_rot), i in [0, n_rot / 2).
// The product is formed exactly in double (value + FMA error term) and reduced
// modulo 2*pi with a two-part constant, so the angle is right to ~1e-15 rad even
// at p = 2^31 (a float angle would be off by ~100 rad there). cos/sin are taken in
// double and rounded to float once.
#pragma once

#include <cmath>    // std::pow, std::cos, std::sin, std::fma, std::nearbyint
#include <cstddef>  // std::size_t
#include <cstdint>  // std::int64_t

#include "../config.hpp"
#include "../model_shape.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace kernels {

/// Base frequency of pair i for a rotary width n_rot: freq_scale * freq_base^(-2i / n_rot).
inline double rope_inv_freq(const rope_params& r, std::uint32_t n_rot, std::uint32_t i) noexcept {
    return static_cast<double>(r.freq_scale) *
           std::pow(static_cast<double>(r.freq_base), -2.0 * static_cast<double>(i) / static_cast<double>(n_rot));
}

/// Angle p * inv_freq reduced to about [-pi, pi], exact up to double rounding of the result.
inline double rope_reduced_angle(std::int64_t p, double inv_freq) noexcept {
    constexpr double two_pi_hi = 6.283185307179586;            // 2*pi rounded to double
    constexpr double two_pi_lo = 2.4492935982947064e-16;       // 2*pi - two_pi_hi
    constexpr double inv_two_pi = 0.15915494309189535;
    const double pd = static_cast<double>(p);                  // exact: |p| < 2^53
    const double hi = pd * inv_freq;
    const double lo = std::fma(pd, inv_freq, -hi);             // hi + lo == p * inv_freq exactly
    const double k = std::nearbyint(hi * inv_two_pi);
    double r = std::fma(-k, two_pi_hi, hi);                    // one rounding, |r| <= ~pi
    r = std::fma(-k, two_pi_lo, r);
    return r + lo;
}

/// cos/sin of every pair's angle at position (or delta) p: n_rot / 2 entries each.
inline void rope_cos_sin(std::int64_t p, const double* inv_freq, std::uint32_t n_pairs, float* cos_out,
                         float* sin_out) noexcept {
    for (std::uint32_t i = 0; i < n_pairs; ++i) {
        const double a = rope_reduced_angle(p, inv_freq[i]);
        cos_out[i] = static_cast<float>(std::cos(a));
        sin_out[i] = static_cast<float>(std::sin(a));
    }
}

}  // namespace kernels
KVCACHE_END_NAMESPACE
