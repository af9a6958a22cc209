// Float64 attention oracle over a kv_cache, written for clarity (not speed; it reads the
// K and V rows of the cells a query row sees once per row, not once per head).
// For each query row i and head g: visible cells are the occupied cells c < n_window
// with q_seq[i] in seqs(c), pos(c) <= q_pos[i] and (window > 0) pos(c) > q_pos[i] - window;
// logits = scale * q.k (soft-capped), softmax in double, out = sum p * v; no visible
// cell: zeros.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include <kvcache/kvcache.hpp>

namespace ref {

template <class Cache>
std::vector<double> attention(const Cache& cache, std::uint32_t layer, const std::vector<float>& q,
                              const std::vector<kvcache::pos_t>& q_pos, const std::vector<kvcache::seq_id_t>& q_seq,
                              const kvcache::ops::attention_params& p) {
    const auto& s = cache.shape();
    const std::uint32_t dk = s.dim_k(), dv = s.dim_v(), hkv = s.n_head_kv;
    const std::uint32_t group = p.n_head / hkv;
    const double scale = p.scale > 0.0f ? p.scale : 1.0 / std::sqrt(static_cast<double>(dk));
    const std::uint32_t n = cache.n_window();
    const std::size_t n_q = q_pos.size();
    std::vector<double> out(n_q * p.n_head * dv, 0.0);
    const std::size_t kr = s.k_row_size(), vr = s.v_row_size();
    for (std::size_t i = 0; i < n_q; ++i) {
        // The cells row i sees, in cell order, with their K and V rows (every head).
        std::vector<float> ks, vs;
        std::size_t n_vis = 0;
        for (std::uint32_t c = 0; c < n; ++c) {
            const kvcache::pos_t pc = cache.cells().pos(c);
            if (pc < 0 || !cache.cells().seqs(c).test(q_seq[i]) || pc > q_pos[i]) continue;
            if (p.window > 0 && std::int64_t{pc} <= std::int64_t{q_pos[i]} - p.window) continue;
            ks.resize((n_vis + 1) * kr);
            vs.resize((n_vis + 1) * vr);
            cache.read_k(layer, c, ks.data() + n_vis * kr);
            cache.read_v(layer, c, vs.data() + n_vis * vr);
            ++n_vis;
        }
        if (n_vis == 0) continue;
        std::vector<double> logits(n_vis);
        for (std::uint32_t g = 0; g < p.n_head; ++g) {
            const std::uint32_t h = g / group;
            for (std::size_t k = 0; k < n_vis; ++k) {
                double dot = 0.0;
                for (std::uint32_t d = 0; d < dk; ++d)
                    dot += static_cast<double>(q[(i * p.n_head + g) * dk + d]) * ks[k * kr + h * dk + d];
                double l = dot * scale;
                if (p.softcap > 0.0f) l = p.softcap * std::tanh(l / p.softcap);
                logits[k] = l;
            }
            double mx = logits[0];
            for (double l : logits) mx = l > mx ? l : mx;
            double sum = 0.0;
            std::vector<double> e(n_vis);
            for (std::size_t k = 0; k < n_vis; ++k) sum += (e[k] = std::exp(logits[k] - mx));
            for (std::size_t k = 0; k < n_vis; ++k)
                for (std::uint32_t d = 0; d < dv; ++d)
                    out[(i * p.n_head + g) * dv + d] += e[k] / sum * static_cast<double>(vs[k * vr + h * dv + d]);
        }
    }
    return out;
}

}  // namespace ref
