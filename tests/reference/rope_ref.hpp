// Float64 RoPE oracle, written for clarity (not speed).
// theta_i(p) = p * freq_scale * freq_base^(-2i / n_rot); normal pairs (2i, 2i+1),
// NeoX pairs (i, i + n_rot/2); dimensions >= n_rot unchanged. The angle is reduced with
// long double so that positions up to 2^31 keep ~1e-10 rad accuracy.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include <kvcache/model_shape.hpp>

namespace ref {

inline std::vector<double> rope_head(const std::vector<double>& x, std::int64_t p, const kvcache::rope_params& r) {
    const std::size_t dim = x.size();
    const std::size_t n_rot = r.n_rot == 0 ? dim : r.n_rot;
    std::vector<double> y = x;
    for (std::size_t i = 0; i < n_rot / 2; ++i) {
        const long double inv_freq = static_cast<long double>(r.freq_scale) *
                                     std::pow(static_cast<long double>(r.freq_base),
                                              -2.0L * static_cast<long double>(i) / static_cast<long double>(n_rot));
        const long double two_pi = 6.283185307179586476925286766559L;
        long double a = static_cast<long double>(p) * inv_freq;
        a = a - two_pi * std::nearbyint(a / two_pi);
        const double c = static_cast<double>(std::cos(a)), s = static_cast<double>(std::sin(a));
        const std::size_t d0 = r.type == kvcache::rope_type::normal ? 2 * i : i;
        const std::size_t d1 = r.type == kvcache::rope_type::normal ? 2 * i + 1 : i + n_rot / 2;
        y[d0] = x[d0] * c - x[d1] * s;
        y[d1] = x[d0] * s + x[d1] * c;
    }
    return y;
}

}  // namespace ref
