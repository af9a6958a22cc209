// Float64 attention oracle over a kv_cache, written for clarity (not speed).
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
    std::vector<float> krow(s.k_row_size()), vrow(s.v_row_size());
    for (std::size_t i = 0; i < n_q; ++i) {
        for (std::uint32_t g = 0; g < p.n_head; ++g) {
            const std::uint32_t h = g / group;
            std::vector<double> logits;
            std::vector<std::vector<double>> values;
            for (std::uint32_t c = 0; c < n; ++c) {
                const kvcache::pos_t pc = cache.cells().pos(c);
                if (pc < 0 || !cache.cells().seqs(c).test(q_seq[i]) || pc > q_pos[i]) continue;
                if (p.window > 0 && std::int64_t{pc} <= std::int64_t{q_pos[i]} - p.window) continue;
                cache.read_k(layer, c, krow.data());
                cache.read_v(layer, c, vrow.data());
                double dot = 0.0;
                for (std::uint32_t d = 0; d < dk; ++d)
                    dot += static_cast<double>(q[(i * p.n_head + g) * dk + d]) * krow[h * dk + d];
                double l = dot * scale;
                if (p.softcap > 0.0f) l = p.softcap * std::tanh(l / p.softcap);
                logits.push_back(l);
                values.emplace_back(vrow.begin() + h * dv, vrow.begin() + (h + 1) * dv);
            }
            if (logits.empty()) continue;
            double mx = logits[0];
            for (double l : logits) mx = l > mx ? l : mx;
            double sum = 0.0;
            for (double& l : logits) sum += (l = std::exp(l - mx));
            for (std::size_t k = 0; k < logits.size(); ++k)
                for (std::uint32_t d = 0; d < dv; ++d) out[(i * p.n_head + g) * dv + d] += logits[k] / sum * values[k][d];
        }
    }
    return out;
}

}  // namespace ref
