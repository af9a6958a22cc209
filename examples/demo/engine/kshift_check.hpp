// demo engine: checks that the cache's K-shift did what RoPE says. RoPE is additive, so
// after a cell moved from position p to p', its K must equal RoPE(K at p, p' - p). The demo
// snapshots cells' K before seq_add / seq_div and compares afterwards, in double precision,
// with every field of the cache's rope_params: the per-pair frequencies come from the
// library's float64 angle functions (kvcache/kernels/rope_angles.hpp: linear, NTK, YaRN,
// llama3, factor tables, LongRoPE's table of the key's side, M-RoPE's temporal sections
// only), the rotation itself is done here in double.
#pragma once

#include <algorithm>  // std::max
#include <cmath>      // std::cos, std::sin
#include <cstdint>    // fixed-width integers
#include <vector>     // snapshots

#include <kvcache/kvcache.hpp>

#include "compare.hpp"

namespace demo {

/// One cell's position and K (every layer, n_layer x k_row_size floats) at snapshot time.
struct k_snapshot {
    std::uint32_t cell = 0;
    kvcache::pos_t pos = 0;
    std::vector<float> k;
    kvcache::pos_t rotated_at = 0;  ///< where K was rotated (pos minus the cell's pending K-shift)
};

/// Snapshots up to max_cells cells of sequence seq with position >= min_pos.
template <class Cache>
std::vector<k_snapshot> snapshot_k(const Cache& cache, kvcache::seq_id_t seq, kvcache::pos_t min_pos,
                                   std::size_t max_cells) {
    const auto& shape = cache.shape();
    const auto& cells = cache.cells();
    std::vector<k_snapshot> out;
    for (std::uint32_t c : cells.used_cells()) {
        if (out.size() >= max_cells) break;
        if (!cells.seqs(c).test(seq) || cells.pos(c) < min_pos) continue;
        k_snapshot s{c, cells.pos(c), std::vector<float>(shape.k_row_size() * shape.n_layer), cells.pos(c) - cells.shift(c)};
        for (std::uint32_t l = 0; l < shape.n_layer; ++l) cache.read_k(l, c, s.k.data() + l * shape.k_row_size());
        out.push_back(std::move(s));
    }
    return out;
}

/// Result of check_k_shift.
struct k_shift_report {
    double max_error = 0;       ///< max |K - RoPE(K_old, delta)| / (1 + |RoPE(K_old, delta)|); NaN if any K is NaN
    std::size_t n_cells = 0;    ///< snapshotted cells still holding seq
    std::size_t n_moved = 0;    ///< of those, cells whose position changed
};

/// Compares the snapshotted cells' K now with RoPE(old K, new pos - old pos), rotating by the
/// angle of the delta with the frequencies the key was rotated with and no magnitude
/// (attn_factor is in K once). Call after the
/// K-shift was applied (kvcache::ops::apply_k_shift or the engine's next eval). A NaN in
/// either K makes max_error NaN, which fails every `max_error <= tol` check.
template <class Cache>
k_shift_report check_k_shift(const Cache& cache, kvcache::seq_id_t seq, const std::vector<k_snapshot>& before) {
    const auto& shape = cache.shape();
    const auto& cells = cache.cells();
    const auto& rope = shape.rope;
    const std::uint32_t hd = shape.head_dim_k, n_rot = shape.n_rot();
    // The library's float64 frequencies: [short | long] (long used by LongRoPE keys past n_ctx_orig).
    std::vector<double> inv_freq(n_rot);
    kvcache::kernels::rope_inv_freqs(rope, n_rot, false, inv_freq.data());
    kvcache::kernels::rope_inv_freqs(rope, n_rot, rope.scaling == kvcache::rope_scaling::longrope,
                                     inv_freq.data() + n_rot / 2);
    kvcache::kernels::rope_temporal_only(rope, n_rot / 2, inv_freq.data());  // M-RoPE: t sections move
    kvcache::kernels::rope_temporal_only(rope, n_rot / 2, inv_freq.data() + n_rot / 2);
    k_shift_report r;
    std::vector<float> k(shape.k_row_size());
    for (const k_snapshot& s : before) {
        if (cells.is_free(s.cell) || !cells.seqs(s.cell).test(seq)) continue;
        ++r.n_cells;
        if (cells.pos(s.cell) != s.pos) ++r.n_moved;
        const std::int64_t delta = std::int64_t{cells.pos(s.cell)} - s.rotated_at;
        const double* w = inv_freq.data() + (rope.uses_long_factors(s.rotated_at) ? n_rot / 2 : 0);
        for (std::uint32_t l = 0; l < shape.n_layer; ++l) {
            cache.read_k(l, s.cell, k.data());
            const float* old = s.k.data() + l * shape.k_row_size();
            for (std::uint32_t h = 0; h < shape.n_head_kv; ++h) {
                std::vector<double> want(old + h * hd, old + (h + 1) * hd);
                for (std::uint32_t i = 0; i < n_rot / 2; ++i) {
                    const double theta = kvcache::kernels::rope_reduced_angle(delta, w[i]);
                    const std::uint32_t a = rope.type == kvcache::rope_type::normal ? 2 * i : i;
                    const std::uint32_t b = rope.type == kvcache::rope_type::normal ? 2 * i + 1 : i + n_rot / 2;
                    const double x0 = want[a], x1 = want[b];
                    want[a] = x0 * std::cos(theta) - x1 * std::sin(theta);
                    want[b] = x0 * std::sin(theta) + x1 * std::cos(theta);
                }
                for (std::uint32_t d = 0; d < hd; ++d)
                    r.max_error = nan_max(r.max_error, std::abs(k[h * hd + d] - want[d]) / (1.0 + std::abs(want[d])));
            }
        }
    }
    return r;
}

}  // namespace demo
