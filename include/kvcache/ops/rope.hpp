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
    rope.validate(head_dim, errc::invalid_argument, std::string(fn) + ": rope.");
}
}  // namespace detail_rope

/// Host RoPE: rotates n_rows rows in place. Each row is n_head heads of head_dim floats
/// (head-major); row i is at position pos[i] (any int32, accurate up to 2^31).
/// Uses every field of rope (model_shape.hpp: pairing, n_rot (0 = head_dim), linear / NTK /
/// YaRN / llama3 / factor-table / LongRoPE frequencies, and the magnitude attn_factor, which
/// multiplies the rotated pairs only); dimensions at or above n_rot are left as they are.
/// LongRoPE: rows at positions >= rope.n_ctx_orig use long_factors, the others short_factors.
/// Throws kvcache::error(invalid_argument) on bad arguments (x or pos null with n_rows > 0,
/// n_head or head_dim 0, any rope field rope_params::validate refuses, message naming it)
/// and then changes nothing.
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
    const bool two_tables = rope.scaling == rope_scaling::longrope;
    std::vector<double> inv_freq(std::size_t{n_pairs} * (two_tables ? 2 : 1));  // [short | long]
    kernels::rope_inv_freqs(rope, n_rot, false, inv_freq.data());
    if (two_tables) kernels::rope_inv_freqs(rope, n_rot, true, inv_freq.data() + n_pairs);
    const double magnitude = static_cast<double>(rope.attn_factor);
    std::vector<float> cs(n_pairs), sn(n_pairs);
    for (std::size_t r = 0; r < n_rows; ++r) {
        const double* w = inv_freq.data() + (rope.uses_long_factors(pos[r]) ? n_pairs : 0);
        kernels::rope_cos_sin(pos[r], w, n_pairs, cs.data(), sn.data(), magnitude);
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
