// kvcache kernels: RoPE angles, accurate for positions and deltas up to 2^31.
//
// theta_i(p) = p * w_i, i in [0, n_rot / 2), with the per-pair angular frequency w_i of
// rope_params (model_shape.hpp: linear, NTK-aware, YaRN, llama3, factor tables, LongRoPE).
// w_i is computed in double; the product p * w_i is formed exactly (value + FMA error term)
// and reduced modulo 2*pi with a two-part constant, so the angle is right to ~1e-15 rad
// even at p = 2^31 (a float angle would be off by ~100 rad there). cos/sin are taken in
// double and rounded to float once.
//
// Every variant's angle is linear in p for a fixed table, so R(p + d) = R(d) R(p): the
// K-shift rotates by theta_i(d) with the frequencies of the table the key was rotated
// with. The magnitude (attn_factor, YaRN / LongRoPE mscale) is not a rotation and is not
// additive (m R(d) m R(p) = m^2 R(p + d)): rope_rows applies it once, the K-shift never.
#pragma once

#include <algorithm>  // std::min, std::max, std::clamp
#include <cmath>      // std::pow, std::cos, std::sin, std::fma, std::nearbyint, std::log, std::floor, std::ceil
#include <cstddef>    // std::size_t
#include <cstdint>    // std::int64_t
#include <numbers>    // std::numbers::pi

#include "../config.hpp"
#include "../model_shape.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace kernels {

/// The base after NTK-aware scaling: freq_base * ntk_alpha^(n_rot / (n_rot - 2)) (freq_base for n_rot <= 2).
inline double rope_effective_base(const rope_params& r, std::uint32_t n_rot) noexcept {
    const double b = static_cast<double>(r.freq_base);
    if (r.ntk_alpha == 1.0f || n_rot <= 2) return b;
    return b * std::pow(static_cast<double>(r.ntk_alpha), static_cast<double>(n_rot) / static_cast<double>(n_rot - 2));
}

/// YaRN's ramp bounds [lo, hi] in pairs (llama.cpp ggml_rope_yarn_corr_dims, in double):
/// the pair whose wavelength makes `beta` turns over n_ctx_orig positions, floored / ceiled
/// and clamped to [0, n_rot - 1].
inline void rope_yarn_corr_dims(const rope_params& r, std::uint32_t n_rot, double& lo, double& hi) noexcept {
    const double n = static_cast<double>(n_rot);
    const double log_base = std::log(rope_effective_base(r, n_rot));
    auto dim = [&](double beta) {
        return n * std::log(static_cast<double>(r.n_ctx_orig) / (beta * 2.0 * std::numbers::pi)) / (2.0 * log_base);
    };
    lo = std::max(0.0, std::floor(dim(static_cast<double>(r.yarn.beta_fast))));
    hi = std::min(n - 1.0, std::ceil(dim(static_cast<double>(r.yarn.beta_slow))));
}

/// Llama 3.1+ divisor of pair i whose unscaled frequency is w0: 1 for short wavelengths,
/// llama3.factor for long ones, smoothly between.
inline double rope_llama3_factor(const rope_params& r, double w0) noexcept {
    const double wavelen = 2.0 * std::numbers::pi / w0;
    const double ctx = static_cast<double>(r.n_ctx_orig);
    const double lo = static_cast<double>(r.llama3.low_freq_factor);
    const double hi = static_cast<double>(r.llama3.high_freq_factor);
    const double factor = static_cast<double>(r.llama3.factor);
    if (wavelen < ctx / hi) return 1.0;
    if (wavelen > ctx / lo) return factor;
    const double smooth = (ctx / wavelen - lo) / (hi - lo);
    return 1.0 / ((1.0 - smooth) / factor + smooth);
}

/// Angular frequency w_i of pair i (see rope_params). long_table: LongRoPE's long_factors
/// (keys at positions >= n_ctx_orig); ignored by the other scalings.
inline double rope_inv_freq(const rope_params& r, std::uint32_t n_rot, std::uint32_t i, bool long_table = false) noexcept {
    const double w0 =
        std::pow(rope_effective_base(r, n_rot), -2.0 * static_cast<double>(i) / static_cast<double>(n_rot));
    double f = 1.0;  // the pair's divisor
    switch (r.scaling) {
        case rope_scaling::llama3: f = rope_llama3_factor(r, w0); break;
        case rope_scaling::longrope:
            f = static_cast<double>(long_table ? r.long_factors[i] : r.short_factors[i]);
            break;
        default:
            if (!r.freq_factors.empty()) f = static_cast<double>(r.freq_factors[i]);
    }
    const double extrap = w0 / f;
    const double interp = static_cast<double>(r.freq_scale) * extrap;
    if (r.scaling != rope_scaling::yarn) return interp;
    double lo = 0, hi = 0;
    rope_yarn_corr_dims(r, n_rot, lo, hi);
    const double ramp = 1.0 - std::clamp((static_cast<double>(i) - lo) / std::max(0.001, hi - lo), 0.0, 1.0);
    const double mix = ramp * static_cast<double>(r.yarn.ext_factor);
    return interp * (1.0 - mix) + extrap * mix;
}

/// Every pair's w_i into out[0, n_rot / 2).
inline void rope_inv_freqs(const rope_params& r, std::uint32_t n_rot, bool long_table, double* out) noexcept {
    for (std::uint32_t i = 0; i < n_rot / 2; ++i) out[i] = rope_inv_freq(r, n_rot, i, long_table);
}

/// M-RoPE K-shift: the frequencies of the pairs driven by a non-temporal section (h, w, e)
/// set to 0, so that a rotation by a temporal delta leaves them exactly as they are
/// (cos 0 = 1, sin 0 = 0). No-op without M-RoPE.
inline void rope_temporal_only(const rope_params& r, std::uint32_t n_pairs, double* inv_freq) noexcept {
    if (!r.mrope.on()) return;
    for (std::uint32_t i = 0; i < n_pairs; ++i)
        if (r.mrope.component(i) != 0) inv_freq[i] = 0.0;
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

/// cos/sin of every pair's angle at position (or delta) p, times `magnitude` (1 for the
/// K-shift, rope.attn_factor for rope_rows): n_pairs entries each.
inline void rope_cos_sin(std::int64_t p, const double* inv_freq, std::uint32_t n_pairs, float* cos_out,
                         float* sin_out, double magnitude = 1.0) noexcept {
    for (std::uint32_t i = 0; i < n_pairs; ++i) {
        const double a = rope_reduced_angle(p, inv_freq[i]);
        cos_out[i] = static_cast<float>(magnitude * std::cos(a));
        sin_out[i] = static_cast<float>(magnitude * std::sin(a));
    }
}

}  // namespace kernels
KVCACHE_END_NAMESPACE
