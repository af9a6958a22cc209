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

namespace detail_rope {
/// Rotates the first n_pairs pairs of every head of one row by cs / sn.
inline void rotate_row(float* row, std::uint32_t n_head, std::uint32_t head_dim, std::uint32_t n_pairs, rope_type type,
                       const float* cs, const float* sn) noexcept {
    for (std::uint32_t h = 0; h < n_head; ++h) {
        float* v = row + std::size_t{h} * head_dim;
        if (type == rope_type::normal) {
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

inline void rope_rows_impl(const char* fn, float* x, std::size_t n_rows, std::uint32_t n_head, std::uint32_t head_dim,
                           const pos_t* pos, const mrope_pos* ext, const rope_params& rope) {
    using std::to_string;
    const std::string f(fn);
    if (n_head == 0) detail::fail(errc::invalid_argument, f + ": n_head = 0, must be >= 1");
    if (head_dim == 0) detail::fail(errc::invalid_argument, f + ": head_dim = 0, must be >= 1");
    check_params(fn, head_dim, rope);
    if (rope.mrope.on() && ext == nullptr && n_rows > 0)
        detail::fail(errc::invalid_argument, f + ": rope.mrope has sections (M-RoPE): pass each row's extra positions "
                                                 "(h, w, e) with rope_rows(x, n_rows, n_head, head_dim, pos, ext, rope)");
    if (!rope.mrope.on() && ext != nullptr)
        detail::fail(errc::invalid_argument, f + ": extra (M-RoPE) positions given but rope.mrope has no sections");
    if (n_rows == 0) return;
    if (x == nullptr) detail::fail(errc::invalid_argument, f + ": x is null with n_rows = " + to_string(n_rows));
    if (pos == nullptr) detail::fail(errc::invalid_argument, f + ": pos is null with n_rows = " + to_string(n_rows));
    const std::uint32_t n_rot = rope.n_rot == 0 ? head_dim : rope.n_rot;
    const std::uint32_t n_pairs = n_rot / 2;
    if (n_pairs == 0) return;
    const bool two_tables = rope.scaling == rope_scaling::longrope;
    std::vector<double> inv_freq(std::size_t{n_pairs} * (two_tables ? 2 : 1));  // [short | long]
    kernels::rope_inv_freqs(rope, n_rot, false, inv_freq.data());
    if (two_tables) kernels::rope_inv_freqs(rope, n_rot, true, inv_freq.data() + n_pairs);
    const double magnitude = static_cast<double>(rope.attn_factor);
    std::vector<float> cs(n_pairs), sn(n_pairs);
    std::vector<std::uint32_t> comp;  // M-RoPE: each pair's position component
    if (ext != nullptr) {
        comp.resize(n_pairs);
        for (std::uint32_t i = 0; i < n_pairs; ++i) comp[i] = rope.mrope.component(i);
    }
    for (std::size_t r = 0; r < n_rows; ++r) {
        if (ext == nullptr) {
            const double* w = inv_freq.data() + (rope.uses_long_factors(pos[r]) ? n_pairs : 0);
            kernels::rope_cos_sin(pos[r], w, n_pairs, cs.data(), sn.data(), magnitude);
        } else {  // one pair at a time, each with its own component's position (no LongRoPE here)
            const pos_t p[4] = {pos[r], ext[r].h, ext[r].w, ext[r].e};
            for (std::uint32_t i = 0; i < n_pairs; ++i)
                kernels::rope_cos_sin(p[comp[i]], inv_freq.data() + i, 1, cs.data() + i, sn.data() + i, magnitude);
        }
        rotate_row(x + r * n_head * head_dim, n_head, head_dim, n_pairs, rope.type, cs.data(), sn.data());
    }
}
}  // namespace detail_rope

/// Host RoPE: rotates n_rows rows in place. Each row is n_head heads of head_dim floats
/// (head-major); row i is at position pos[i] (any int32, accurate up to 2^31).
/// Uses every field of rope (model_shape.hpp: pairing, n_rot (0 = head_dim), linear / NTK /
/// YaRN / llama3 / factor-table / LongRoPE frequencies, and the magnitude attn_factor, which
/// multiplies the rotated pairs only); dimensions at or above n_rot are left as they are.
/// LongRoPE: rows at positions >= rope.n_ctx_orig use long_factors, the others short_factors.
/// Throws kvcache::error(invalid_argument) on bad arguments (x or pos null with n_rows > 0,
/// n_head or head_dim 0, any rope field rope_params::validate refuses, message naming it,
/// M-RoPE sections without extra positions: use the overload below) and then changes nothing.
inline void rope_rows(float* x, std::size_t n_rows, std::uint32_t n_head, std::uint32_t head_dim, const pos_t* pos,
                      const rope_params& rope) {
    detail_rope::rope_rows_impl("rope_rows", x, n_rows, n_head, head_dim, pos, nullptr, rope);
}

/// M-RoPE host RoPE: as above, row i at temporal position pos[i] with extra positions ext[i]
/// (h, w, e); pair j turns by the position of component rope.mrope.component(j). Throws
/// invalid_argument (nothing changed) also when rope.mrope has no sections or ext is null.
inline void rope_rows(float* x, std::size_t n_rows, std::uint32_t n_head, std::uint32_t head_dim, const pos_t* pos,
                      const mrope_pos* ext, const rope_params& rope) {
    if (ext == nullptr && n_rows > 0)
        detail::fail(errc::invalid_argument, "rope_rows: ext is null with n_rows = " + std::to_string(n_rows));
    detail_rope::rope_rows_impl("rope_rows", x, n_rows, n_head, head_dim, pos, ext, rope);
}

}  // namespace ops
KVCACHE_END_NAMESPACE
