// demo engine: the cache kernels the engine calls (RoPE, attention, K-shift).
//
// The engine uses kvcache's own kernels (kvcache/ops/) when the library provides
// them; until then a plain implementation with the same signatures stands in.
#pragma once

#include <kvcache/kvcache.hpp>

#if __has_include(<kvcache/ops/attention.hpp>) && __has_include(<kvcache/ops/kshift.hpp>) && \
    __has_include(<kvcache/ops/rope.hpp>)
#include <kvcache/ops/attention.hpp>
#include <kvcache/ops/kshift.hpp>
#include <kvcache/ops/rope.hpp>
#define DEMO_LIBRARY_KERNELS 1

namespace demo::kv_ops {
using kvcache::ops::apply_k_shift;
using kvcache::ops::attention;
using kvcache::ops::attention_params;
using kvcache::ops::attention_workspace;
using kvcache::ops::rope_rows;
inline constexpr const char* kernels_name = "kvcache::ops";
}  // namespace demo::kv_ops

#else
#define DEMO_LIBRARY_KERNELS 0

#include <algorithm>  // std::max
#include <cmath>      // std::exp, std::cos, std::sin
#include <cstdint>    // fixed-width integers
#include <limits>     // infinity
#include <span>       // single-cell writes
#include <vector>     // scratch

namespace demo::kv_ops {

inline constexpr const char* kernels_name = "demo fallback";

using kvcache::pos_t;
using kvcache::rope_params;
using kvcache::seq_id_t;

inline void rope_rows(float* x, std::size_t n_rows, std::uint32_t n_head, std::uint32_t head_dim, const pos_t* pos,
                      const rope_params& rope) {
    const std::uint32_t n_rot = rope.n_rot == 0 ? head_dim : rope.n_rot;
    for (std::size_t r = 0; r < n_rows; ++r)
        for (std::uint32_t h = 0; h < n_head; ++h) {
            float* v = x + (r * n_head + h) * head_dim;
            for (std::uint32_t i = 0; i < n_rot / 2; ++i) {
                const double theta = static_cast<double>(pos[r]) * rope.freq_scale *
                                     std::pow(static_cast<double>(rope.freq_base), -2.0 * i / n_rot);
                const double c = std::cos(theta), s = std::sin(theta);
                const std::uint32_t a = rope.type == kvcache::rope_type::normal ? 2 * i : i;
                const std::uint32_t b = rope.type == kvcache::rope_type::normal ? 2 * i + 1 : i + n_rot / 2;
                const double x0 = v[a], x1 = v[b];
                v[a] = static_cast<float>(x0 * c - x1 * s);
                v[b] = static_cast<float>(x0 * s + x1 * c);
            }
        }
}

template <class Cache>
void apply_k_shift(Cache& cache, int = 0) {
    const auto& shape = cache.shape();
    std::vector<float> row(shape.k_row_size());
    for (std::uint32_t c : cache.cells().used_cells()) {
        const std::int32_t d = cache.cells().shift(c);
        if (d == 0) continue;
        for (std::uint32_t l = 0; l < shape.n_layer; ++l) {
            cache.read_k(l, c, row.data());
            rope_rows(row.data(), 1, shape.n_head_kv, shape.head_dim_k, &d, shape.rope);
            cache.write_k(l, std::span<const std::uint32_t>(&c, 1), row.data());
        }
    }
    cache.clear_shifts();
}

struct attention_params {
    std::uint32_t n_head = 0;
    float scale = 0.0f;
    std::int32_t window = 0;
    float softcap = 0.0f;
    int n_threads = 0;
};

class attention_workspace {
public:
    std::vector<float> k, v;
    std::vector<std::uint32_t> cells;
};

template <class Cache>
void attention(const Cache& cache, std::uint32_t layer, const float* q, const pos_t* q_pos, const seq_id_t* q_seq,
               std::uint32_t n_q, const attention_params& p, float* out, attention_workspace& ws) {
    const auto& shape = cache.shape();
    const std::uint32_t dk = shape.dim_k(), dv = shape.dim_v(), n_kv = shape.n_head_kv;
    const std::uint32_t group = p.n_head / n_kv;
    const float scale = p.scale > 0 ? p.scale : 1.0f / std::sqrt(static_cast<float>(dk));
    ws.cells.clear();
    const std::uint32_t n = cache.n_window();
    for (std::uint32_t c = 0; c < n; ++c)
        if (!cache.cells().is_free(c)) ws.cells.push_back(c);
    const std::size_t m = ws.cells.size();
    ws.k.resize(m * shape.k_row_size());
    ws.v.resize(m * shape.v_row_size());
    for (std::size_t j = 0; j < m; ++j) {
        cache.read_k(layer, ws.cells[j], ws.k.data() + j * shape.k_row_size());
        cache.read_v(layer, ws.cells[j], ws.v.data() + j * shape.v_row_size());
    }
    const auto& cells = cache.cells();
#pragma omp parallel for schedule(dynamic, 4)
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(n_q); ++i) {
        std::vector<float> score(m);
        for (std::uint32_t h = 0; h < p.n_head; ++h) {
            const float* qh = q + (static_cast<std::size_t>(i) * p.n_head + h) * dk;
            float* oh = out + (static_cast<std::size_t>(i) * p.n_head + h) * dv;
            const std::uint32_t kh = h / group;
            float mx = -std::numeric_limits<float>::infinity();
            for (std::size_t j = 0; j < m; ++j) {
                const std::uint32_t c = ws.cells[j];
                const bool visible = cells.seqs(c).test(q_seq[i]) && cells.pos(c) <= q_pos[i] &&
                                     (p.window <= 0 || cells.pos(c) > q_pos[i] - p.window);
                if (!visible) {
                    score[j] = -std::numeric_limits<float>::infinity();
                    continue;
                }
                const float* kr = ws.k.data() + j * shape.k_row_size() + kh * dk;
                float s = 0;
                for (std::uint32_t d = 0; d < dk; ++d) s += qh[d] * kr[d];
                score[j] = s * scale;
                mx = std::max(mx, score[j]);
            }
            for (std::uint32_t d = 0; d < dv; ++d) oh[d] = 0;
            if (mx == -std::numeric_limits<float>::infinity()) continue;
            float sum = 0;
            for (std::size_t j = 0; j < m; ++j) {
                if (score[j] == -std::numeric_limits<float>::infinity()) continue;
                const float e = std::exp(score[j] - mx);
                sum += e;
                const float* vr = ws.v.data() + j * shape.v_row_size() + kh * dv;
                for (std::uint32_t d = 0; d < dv; ++d) oh[d] += e * vr[d];
            }
            for (std::uint32_t d = 0; d < dv; ++d) oh[d] /= sum;
        }
    }
}

}  // namespace demo::kv_ops
#endif
