// kvcache ops: RoPE on host rows (queries and keys before they enter the cache).
#pragma once

#include <cmath>    // std::isfinite
#include <cstddef>  // std::size_t
#include <cstdint>  // fixed-width integers
#include <string>   // messages
#include <vector>   // per-call tables

#include "../config.hpp"
#include "../error.hpp"
#include "../kernels/rope_angles.hpp"
#include "../model_shape.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace ops {

namespace detail_rope {
inline void check_params(const char* fn, std::uint32_t head_dim, const rope_params& rope) {
    using std::to_string;
    const std::uint32_t n_rot = rope.n_rot == 0 ? head_dim : rope.n_rot;
    if (n_rot > head_dim)
        detail::fail(errc::invalid_argument, std::string(fn) + ": rope.n_rot = " + to_string(rope.n_rot) +
                                                 ", must not exceed head_dim = " + to_string(head_dim));
    if (n_rot % 2 != 0)
        detail::fail(errc::invalid_argument,
                     std::string(fn) + ": rope.n_rot = " + to_string(n_rot) + ", must be even (RoPE rotates pairs)");
    if (!(std::isfinite(rope.freq_base) && rope.freq_base > 0.0f))
        detail::fail(errc::invalid_argument,
                     std::string(fn) + ": rope.freq_base = " + std::to_string(rope.freq_base) + ", must be finite and > 0");
    if (!(std::isfinite(rope.freq_scale) && rope.freq_scale > 0.0f))
        detail::fail(errc::invalid_argument, std::string(fn) + ": rope.freq_scale = " +
                                                 std::to_string(rope.freq_scale) + ", must be finite and > 0");
    if (rope.type != rope_type::normal && rope.type != rope_type::neox)
        detail::fail(errc::invalid_argument,
                     std::string(fn) + ": rope.type = " + to_string(static_cast<int>(rope.type)) + ", must be normal or neox");
}
}  // namespace detail_rope

/// Host RoPE: rotates n_rows rows in place. Each row is n_head heads of head_dim floats
/// (head-major); row i is at position pos[i] (any int32, accurate up to 2^31).
/// Uses rope.type, freq_base, freq_scale and n_rot (0 = head_dim); dimensions at or above
/// n_rot are left as they are. Throws kvcache::error(invalid_argument) on bad arguments
/// (x or pos null with n_rows > 0, n_head or head_dim 0, n_rot odd or > head_dim,
/// freq_base / freq_scale not finite and positive) and then changes nothing.
inline void rope_rows(float* x, std::size_t n_rows, std::uint32_t n_head, std::uint32_t head_dim, const pos_t* pos,
                      const rope_params& rope) {
    using std::to_string;
    if (n_head == 0) detail::fail(errc::invalid_argument, "rope_rows: n_head = 0, must be >= 1");
    if (head_dim == 0) detail::fail(errc::invalid_argument, "rope_rows: head_dim = 0, must be >= 1");
    detail_rope::check_params("rope_rows", head_dim, rope);
    if (n_rows == 0) return;
    if (x == nullptr) detail::fail(errc::invalid_argument, "rope_rows: x is null with n_rows = " + to_string(n_rows));
    if (pos == nullptr) detail::fail(errc::invalid_argument, "rope_rows: pos is null with n_rows = " + to_string(n_rows));
    const std::uint32_t n_rot = rope.n_rot == 0 ? head_dim : rope.n_rot;
    const std::uint32_t n_pairs = n_rot / 2;
    if (n_pairs == 0) return;
    std::vector<double> inv_freq(n_pairs);
    for (std::uint32_t i = 0; i < n_pairs; ++i) inv_freq[i] = kernels::rope_inv_freq(rope, n_rot, i);
    std::vector<float> cs(n_pairs), sn(n_pairs);
    for (std::size_t r = 0; r < n_rows; ++r) {
        kernels::rope_cos_sin(pos[r], inv_freq.data(), n_pairs, cs.data(), sn.data());
        for (std::uint32_t h = 0; h < n_head; ++h) {
            float* v = x + (r * n_head + h) * head_dim;
            if (rope.type == rope_type::normal) {
                for (std::uint32_t i = 0; i < n_pairs; ++i) {
                    const float x0 = v[2 * i], x1 = v[2 * i + 1];
                    v[2 * i] = x0 * cs[i] - x1 * sn[i];
                    v[2 * i + 1] = x0 * sn[i] + x1 * cs[i];
                }
            } else {
                float* lo = v;
                float* hi = v + n_pairs;
                for (std::uint32_t i = 0; i < n_pairs; ++i) {
                    const float x0 = lo[i], x1 = hi[i];
                    lo[i] = x0 * cs[i] - x1 * sn[i];
                    hi[i] = x0 * sn[i] + x1 * cs[i];
                }
            }
        }
    }
}

}  // namespace ops
KVCACHE_END_NAMESPACE
