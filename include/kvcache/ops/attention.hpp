// kvcache ops: attention over the cache (F16), prefill and decode.
#pragma once

#include <cmath>    // std::sqrt, std::exp, std::tanh, std::isfinite
#include <cstddef>  // std::size_t
#include <cstdint>  // fixed-width integers
#include <limits>   // infinity
#include <string>   // messages
#include <vector>   // workspace buffers

#include "../config.hpp"
#include "../error.hpp"
#include "../layout/kv_storage.hpp"
#include "../model_shape.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace ops {

/// Attention options.
struct attention_params {
    std::uint32_t n_head = 0;  ///< query heads; a multiple of the cache's n_head_kv (GQA)
    float scale = 0.0f;        ///< logit scale; 0 means 1 / sqrt(head_dim_k)
    std::int32_t window = 0;   ///< > 0: sliding window, a query at p sees positions (p - window, p]
    float softcap = 0.0f;      ///< > 0: logits = softcap * tanh(logits / softcap)
    int n_threads = 0;         ///< <= 0: the OpenMP default
};

/// Caller-owned scratch for attention(), reused across calls: it grows to the largest
/// call seen and then the hot path allocates nothing.
class attention_workspace {
public:
    attention_workspace() = default;
    /// Bytes currently reserved.
    [[nodiscard]] std::size_t bytes() const noexcept {
        return acc_.capacity() * sizeof(float);
    }

    // Internal buffers (used by ops::attention only).
    std::vector<float> acc_;  // per query row and head: running output (head_dim_v floats)
};

namespace detail_attn {
template <class Cache>
void check(const Cache& cache, std::uint32_t layer, const float* q, const pos_t* q_pos, const seq_id_t* q_seq,
           std::uint32_t n_q, const attention_params& p, float* out) {
    using std::to_string;
    const model_shape& s = cache.shape();
    if (layer >= s.n_layer)
        detail::fail(errc::invalid_argument,
                     "attention: layer = " + to_string(layer) + ", must be < n_layer = " + to_string(s.n_layer));
    if (p.n_head == 0 || p.n_head % s.n_head_kv != 0)
        detail::fail(errc::invalid_argument, "attention: n_head = " + to_string(p.n_head) +
                                                 ", must be a positive multiple of n_head_kv = " + to_string(s.n_head_kv));
    if (!std::isfinite(p.scale) || p.scale < 0.0f)
        detail::fail(errc::invalid_argument,
                     "attention: scale = " + std::to_string(p.scale) + ", must be finite and >= 0 (0: 1/sqrt(head_dim))");
    if (p.window < 0)
        detail::fail(errc::invalid_argument, "attention: window = " + to_string(p.window) + ", must be >= 0 (0: none)");
    if (!std::isfinite(p.softcap) || p.softcap < 0.0f)
        detail::fail(errc::invalid_argument,
                     "attention: softcap = " + std::to_string(p.softcap) + ", must be finite and >= 0 (0: none)");
    if (n_q == 0) return;
    if (q == nullptr) detail::fail(errc::invalid_argument, "attention: q is null with n_q = " + to_string(n_q));
    if (q_pos == nullptr) detail::fail(errc::invalid_argument, "attention: q_pos is null with n_q = " + to_string(n_q));
    if (q_seq == nullptr) detail::fail(errc::invalid_argument, "attention: q_seq is null with n_q = " + to_string(n_q));
    if (out == nullptr) detail::fail(errc::invalid_argument, "attention: out is null with n_q = " + to_string(n_q));
    for (std::uint32_t i = 0; i < n_q; ++i) {
        if (q_seq[i] < 0 || static_cast<std::uint32_t>(q_seq[i]) >= s.n_seq_max)
            detail::fail(errc::invalid_argument, "attention: q_seq[" + to_string(i) + "] = " + to_string(q_seq[i]) +
                                                     ", must be in [0, " + to_string(s.n_seq_max) + ")");
        if (q_pos[i] < 0)
            detail::fail(errc::invalid_argument,
                         "attention: q_pos[" + to_string(i) + "] = " + to_string(q_pos[i]) + ", must be >= 0");
    }
}
}  // namespace detail_attn

/// Attention of n_q query rows over layer `layer` of the cache (F16).
/// q: n_q rows of n_head x head_dim_k floats (head-major); q_pos / q_seq: position and
/// sequence of each row; out: n_q rows of n_head x head_dim_v floats. Query head g reads
/// KV head g / (n_head / n_head_kv). Cell c is visible to row i when it is occupied, used
/// by sequence q_seq[i], pos(c) <= q_pos[i] (causal) and, with a window W > 0,
/// pos(c) > q_pos[i] - W. Online softmax in f32; a row with no visible cell gets zeros.
/// Reads only cells [0, cache.n_window()) (F8). Throws kvcache::error(invalid_argument)
/// on bad arguments (before writing anything).
template <class Cache>
void attention(const Cache& cache, std::uint32_t layer, const float* q, const pos_t* q_pos, const seq_id_t* q_seq,
               std::uint32_t n_q, const attention_params& p, float* out, attention_workspace& ws) {
    detail_attn::check(cache, layer, q, q_pos, q_seq, n_q, p, out);
    if (n_q == 0) return;
    using element = typename Cache::element;
    const model_shape& s = cache.shape();
    const std::uint32_t dk = s.dim_k(), dv = s.dim_v(), hkv = s.n_head_kv, group = p.n_head / hkv;
    const float scale = p.scale > 0.0f ? p.scale : 1.0f / std::sqrt(static_cast<float>(dk));
    const auto v = cache.storage().view(layer);
    const std::uint32_t n = cache.n_window();
    const auto& cells = cache.cells();
    ws.acc_.resize(dv);
    float* acc = ws.acc_.data();
    for (std::uint32_t i = 0; i < n_q; ++i) {
        for (std::uint32_t g = 0; g < p.n_head; ++g) {
            const std::uint32_t h = g / group;
            const float* qr = q + (std::size_t{i} * p.n_head + g) * dk;
            float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
            for (std::uint32_t d = 0; d < dv; ++d) acc[d] = 0.0f;
            for (std::uint32_t c = 0; c < n; ++c) {
                const pos_t pc = cells.pos(c);
                if (pc < 0 || !cells.seqs(c).test(q_seq[i]) || pc > q_pos[i]) continue;
                if (p.window > 0 && std::int64_t{pc} <= std::int64_t{q_pos[i]} - p.window) continue;
                float sc = 0.0f;
                for (std::uint32_t d = 0; d < dk; ++d) {
                    float kf;
                    element::to_float(v.k + v.k_offset(h, c, d), &kf, 1);
                    sc += qr[d] * kf;
                }
                sc *= scale;
                if (p.softcap > 0.0f) sc = p.softcap * std::tanh(sc / p.softcap);
                const float nm = sc > m ? sc : m;
                const float alpha = std::exp(m - nm), w = std::exp(sc - nm);
                l = l * alpha + w;
                for (std::uint32_t d = 0; d < dv; ++d) {
                    float vf;
                    element::to_float(v.v + v.v_offset(h, c, d), &vf, 1);
                    acc[d] = acc[d] * alpha + w * vf;
                }
                m = nm;
            }
            float* o = out + (std::size_t{i} * p.n_head + g) * dv;
            for (std::uint32_t d = 0; d < dv; ++d) o[d] = l > 0.0f ? acc[d] / l : 0.0f;
        }
    }
}

}  // namespace ops
KVCACHE_END_NAMESPACE
