// Float64 (long double) oracle for the RoPE variants of kvcache::rope_params, written from
// the published formulas in the shape of the Hugging Face rotary-embedding initialisers
// (whole-vector steps, not the library's per-pair function): default / linear / NTK-aware
// base, "llama3" wavelength bands, "yarn" correction range and linear ramp, a per-pair
// divisor table (llama.cpp rope_freqs), "longrope" short / long tables by position, and
// the magnitude attn_factor on the rotated pairs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <kvcache/model_shape.hpp>

namespace ref {

using ld = long double;
inline constexpr ld pi_ld = 3.141592653589793238462643383279502884L;

/// inv_freq[i] of every pair for a key at position p.
inline std::vector<ld> variant_inv_freq(const kvcache::rope_params& r, std::size_t dim, std::int64_t p) {
    const std::size_t n = r.n_rot == 0 ? dim : r.n_rot;
    ld base = r.freq_base;
    if (n > 2) base *= std::pow(static_cast<ld>(r.ntk_alpha), static_cast<ld>(n) / static_cast<ld>(n - 2));
    std::vector<ld> pos_freqs(n / 2), inv(n / 2);  // base^(2i/n) and 1 / that
    for (std::size_t i = 0; i < n / 2; ++i) {
        pos_freqs[i] = std::pow(base, static_cast<ld>(2 * i) / static_cast<ld>(n));
        inv[i] = 1.0L / pos_freqs[i];
    }
    const ld scale = r.freq_scale;
    using kvcache::rope_scaling;
    std::vector<ld> out(n / 2);
    if (r.scaling == rope_scaling::llama3) {
        const ld factor = r.llama3.factor, lo = r.llama3.low_freq_factor, hi = r.llama3.high_freq_factor;
        const ld old_ctx = r.n_ctx_orig;
        const ld low_wl = old_ctx / lo, high_wl = old_ctx / hi;
        for (std::size_t i = 0; i < n / 2; ++i) {
            const ld wl = 2.0L * pi_ld / inv[i];
            ld f;
            if (wl > low_wl) f = inv[i] / factor;
            else if (wl < high_wl) f = inv[i];
            else {
                const ld smooth = (old_ctx / wl - lo) / (hi - lo);
                f = (1.0L - smooth) * inv[i] / factor + smooth * inv[i];
            }
            out[i] = scale * f;
        }
        return out;
    }
    std::vector<ld> div(n / 2, 1.0L);
    if (r.scaling == rope_scaling::longrope) {
        const kvcache::rope_factors& t = p >= static_cast<std::int64_t>(r.n_ctx_orig) ? r.long_factors : r.short_factors;
        for (std::size_t i = 0; i < n / 2; ++i) div[i] = t[i];
    } else if (!r.freq_factors.empty()) {
        for (std::size_t i = 0; i < n / 2; ++i) div[i] = r.freq_factors[i];
    }
    std::vector<ld> extrap(n / 2), interp(n / 2);
    for (std::size_t i = 0; i < n / 2; ++i) {
        extrap[i] = 1.0L / (div[i] * pos_freqs[i]);
        interp[i] = scale * extrap[i];
    }
    if (r.scaling != rope_scaling::yarn) return interp;
    auto corr_dim = [&](ld rotations) {
        return static_cast<ld>(n) * std::log(static_cast<ld>(r.n_ctx_orig) / (rotations * 2.0L * pi_ld)) /
               (2.0L * std::log(base));
    };
    ld low = std::max<ld>(std::floor(corr_dim(r.yarn.beta_fast)), 0.0L);
    ld high = std::min<ld>(std::ceil(corr_dim(r.yarn.beta_slow)), static_cast<ld>(n - 1));
    if (low == high) high += 0.001L;
    for (std::size_t i = 0; i < n / 2; ++i) {
        const ld linear = std::clamp((static_cast<ld>(i) - low) / (high - low), 0.0L, 1.0L);
        const ld extrap_factor = (1.0L - linear) * static_cast<ld>(r.yarn.ext_factor);
        out[i] = interp[i] * (1.0L - extrap_factor) + extrap[i] * extrap_factor;
    }
    return out;
}

/// One head rotated to position p (magnitude attn_factor on the rotated pairs when
/// with_magnitude), or by the angle of p alone (a K-shift delta: no magnitude) with the
/// frequencies of a key at position `table_pos`.
inline std::vector<double> rope_variant_head(const std::vector<double>& x, std::int64_t p, const kvcache::rope_params& r,
                                             bool with_magnitude = true, std::int64_t table_pos = -1) {
    const std::size_t dim = x.size();
    const std::size_t n = r.n_rot == 0 ? dim : r.n_rot;
    const auto inv = variant_inv_freq(r, dim, table_pos < 0 ? p : table_pos);
    const ld m = with_magnitude ? static_cast<ld>(r.attn_factor) : 1.0L;
    std::vector<double> y = x;
    for (std::size_t i = 0; i < n / 2; ++i) {
        ld a = static_cast<ld>(p) * inv[i];
        a -= 2.0L * pi_ld * std::nearbyint(a / (2.0L * pi_ld));
        const ld c = m * std::cos(a), s = m * std::sin(a);
        const std::size_t d0 = r.type == kvcache::rope_type::normal ? 2 * i : i;
        const std::size_t d1 = r.type == kvcache::rope_type::normal ? 2 * i + 1 : i + n / 2;
        y[d0] = static_cast<double>(x[d0] * c - x[d1] * s);
        y[d1] = static_cast<double>(x[d0] * s + x[d1] * c);
    }
    return y;
}

/// M-RoPE: which of the four positions (0 t, 1 h, 2 w, 3 e) drives each of the n / 2 pairs,
/// built the other way round from the library: the section pattern is written out once
/// (contiguous: s0 zeros, s1 ones, s2 twos, s3 threes; interleaved: every slot "extra",
/// then t / h / w written at their stride-3 slots below 3 * s_k, as in llama.cpp's imrope)
/// and tiled over the pairs.
inline std::vector<int> mrope_components(const kvcache::rope_mrope_params& m, std::size_t n_pairs) {
    std::vector<int> pattern;
    const std::size_t total = std::size_t{m.sections[0]} + m.sections[1] + m.sections[2] + m.sections[3];
    if (!m.interleaved) {
        for (int k = 0; k < 4; ++k) pattern.insert(pattern.end(), m.sections[static_cast<std::size_t>(k)], k);
    } else {
        pattern.assign(total, 3);
        for (int k = 2; k >= 0; --k)  // slots k, k + 3, ... below 3 * s_k
            for (std::size_t j = static_cast<std::size_t>(k); j < total && j < 3 * std::size_t{m.sections[static_cast<std::size_t>(k)]}; j += 3)
                pattern[j] = k;
    }
    std::vector<int> out(n_pairs);
    for (std::size_t i = 0; i < n_pairs; ++i) out[i] = pattern[i % total];
    return out;
}

/// One head rotated with M-RoPE to positions p4 = {t, h, w, e} (magnitude attn_factor on the
/// rotated pairs when with_magnitude): pair i turns by p4[component i] * inv_freq[i].
inline std::vector<double> mrope_variant_head(const std::vector<double>& x, const std::int64_t (&p4)[4],
                                              const kvcache::rope_params& r, bool with_magnitude = true) {
    const std::size_t dim = x.size();
    const std::size_t n = r.n_rot == 0 ? dim : r.n_rot;
    const auto inv = variant_inv_freq(r, dim, 0);
    const auto comp = mrope_components(r.mrope, n / 2);
    const ld m = with_magnitude ? static_cast<ld>(r.attn_factor) : 1.0L;
    std::vector<double> y = x;
    for (std::size_t i = 0; i < n / 2; ++i) {
        ld a = static_cast<ld>(p4[comp[i]]) * inv[i];
        a -= 2.0L * pi_ld * std::nearbyint(a / (2.0L * pi_ld));
        const ld c = m * std::cos(a), s = m * std::sin(a);
        const std::size_t d0 = r.type == kvcache::rope_type::normal ? 2 * i : i;
        const std::size_t d1 = r.type == kvcache::rope_type::normal ? 2 * i + 1 : i + n / 2;
        y[d0] = static_cast<double>(x[d0] * c - x[d1] * s);
        y[d1] = static_cast<double>(x[d0] * s + x[d1] * c);
    }
    return y;
}

}  // namespace ref
