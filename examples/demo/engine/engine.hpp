// demo engine: a Llama-architecture forward pass on the CPU over a kvcache::kv_cache.
//
// One kvcache::transaction per eval() call; per micro-batch (at most n_ubatch tokens):
//   1. cache.place(pos, seq)                              -- cells for the new tokens
//   2. per layer: RMSNorm, Q/K/V projections (Eigen GEMM), RoPE on Q and K
//      (kvcache::ops::rope_rows), cache.write_k / write_v, grouped-query attention over
//      the cache (kvcache::ops::attention), output projection, SwiGLU MLP, residuals
// then tx.commit() once every micro-batch succeeded; the final RMSNorm and the
// classifier give the logits. A pending K-shift (after seq_add / seq_div) is applied
// first with kvcache::ops::apply_k_shift. If anything throws in the middle, the
// transaction puts the cells back: the cache holds exactly what it held before.
#pragma once

#include <Eigen/Core>

#include <algorithm>  // std::min
#include <cmath>      // std::sqrt, std::exp
#include <cstdint>    // fixed-width integers
#include <span>       // inputs
#include <string>     // messages
#include <vector>     // scratch

#include "kv_ops.hpp"
#include "model.hpp"
#include "tokenizer.hpp"

namespace demo {

using kvcache::pos_t;
using kvcache::seq_id_t;

/// The kvcache::model_shape that holds this model's K/V: n_cells cells, n_seq_max sequences.
inline kvcache::model_shape cache_shape_for(const llama_config& cfg, std::uint32_t n_cells, std::uint32_t n_seq_max) {
    kvcache::model_shape s;
    s.n_layer = static_cast<std::uint32_t>(cfg.n_layers);
    s.n_head_kv = static_cast<std::uint32_t>(cfg.n_kv_heads);
    s.head_dim_k = static_cast<std::uint32_t>(cfg.head_dim());
    s.head_dim_v = s.head_dim_k;
    s.rope = cfg.rope;  // every RoPE field of the model, unchanged
    s.n_cells = n_cells;
    s.n_seq_max = n_seq_max;
    return s;
}

/// Forward pass of a Llama model over a kv_cache of type Cache. Holds a reference to the
/// weights (they must outlive the engine) and scratch buffers reused across calls.
/// Not thread-safe (one engine per thread); the matrix products and kernels use OpenMP.
template <class Cache>
class llama_engine {
public:
    using matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    using const_map = Eigen::Map<const matrix>;

    struct options {
        std::uint32_t n_ubatch = 512;  ///< tokens per micro-batch (bounds the scratch size)
        int n_threads = 0;             ///< kernel threads; <= 0: OpenMP default
    };

    explicit llama_engine(const llama_weights& w) : llama_engine(w, options{}) {}
    llama_engine(const llama_weights& w, options opt) : w_(w), opt_(opt) {
        w.config.validate();
        if (opt_.n_ubatch == 0) throw model_error("llama_engine: n_ubatch = 0, must be >= 1");
    }

    [[nodiscard]] const llama_config& config() const noexcept { return w_.config; }
    /// The cache shape this model needs.
    [[nodiscard]] kvcache::model_shape cache_shape(std::uint32_t n_cells, std::uint32_t n_seq_max) const {
        return cache_shape_for(w_.config, n_cells, n_seq_max);
    }

    /// Evaluates tokens[i] at position pos[i] for sequence seq, appending their K/V to the cache.
    /// logits receives vocab floats for the last token, or tokens.size() x vocab when all_logits.
    /// Throws model_error (bad token id, sizes, no room in the cache) or kvcache::error (bad
    /// sequence, position already held); on any throw no cell is placed: the cache holds what it
    /// held before the call (a pending K-shift may have been applied, which changes no position).
    void eval(Cache& cache, std::span<const token_t> tokens, std::span<const pos_t> pos, seq_id_t seq,
              std::vector<float>& logits, bool all_logits = false) {
        const llama_config& cfg = w_.config;
        if (tokens.size() != pos.size())
            throw model_error("eval: " + std::to_string(tokens.size()) + " tokens but " +
                              std::to_string(pos.size()) + " positions");
        if (tokens.empty()) throw model_error("eval: no tokens");
        for (std::size_t i = 0; i < tokens.size(); ++i)
            if (tokens[i] < 0 || tokens[i] >= cfg.vocab_size)
                throw model_error("eval: tokens[" + std::to_string(i) + "] = " + std::to_string(tokens[i]) +
                                  ", must be in [0, vocab_size = " + std::to_string(cfg.vocab_size) + ")");
        const auto& shape = cache.shape();
        if (shape.n_layer != static_cast<std::uint32_t>(cfg.n_layers) ||
            shape.n_head_kv != static_cast<std::uint32_t>(cfg.n_kv_heads) ||
            shape.head_dim_k != static_cast<std::uint32_t>(cfg.head_dim()) ||
            shape.dim_v() != static_cast<std::uint32_t>(cfg.head_dim()))
            throw model_error("eval: the cache shape does not match the model (use cache_shape())");
        if (cache.has_shift()) kv_ops::apply_k_shift(cache, opt_.n_threads);

        const std::size_t vocab = static_cast<std::size_t>(cfg.vocab_size);
        logits.resize(all_logits ? tokens.size() * vocab : vocab);
        // One transaction for the whole call: if micro-batch k throws, the cells of
        // micro-batches 0..k-1 go back too.
        kvcache::transaction tx(cache);
        for (std::size_t b0 = 0; b0 < tokens.size(); b0 += opt_.n_ubatch) {
            const std::size_t n = std::min<std::size_t>(opt_.n_ubatch, tokens.size() - b0);
            const bool last = b0 + n == tokens.size();
            eval_ubatch(cache, tokens.subspan(b0, n), pos.subspan(b0, n), seq);
            if (all_logits)
                classify(0, n, logits.data() + b0 * vocab);
            else if (last)
                classify(n - 1, 1, logits.data());
        }
        tx.commit();
    }

    /// Same, with positions pos0, pos0 + 1, ...
    void eval(Cache& cache, std::span<const token_t> tokens, pos_t pos0, seq_id_t seq, std::vector<float>& logits,
              bool all_logits = false) {
        std::vector<pos_t> pos(tokens.size());
        for (std::size_t i = 0; i < tokens.size(); ++i) pos[i] = pos0 + static_cast<pos_t>(i);
        eval(cache, tokens, std::span<const pos_t>(pos), seq, logits, all_logits);
    }

private:
    void rms_norm(const matrix& in, const std::vector<float>& weight, matrix& out) const {
        const auto d = in.cols();
        out.resize(in.rows(), d);
        for (Eigen::Index r = 0; r < in.rows(); ++r) {
            const float ms = in.row(r).squaredNorm() / static_cast<float>(d);
            const float inv = 1.0f / std::sqrt(ms + w_.config.norm_eps);
            for (Eigen::Index j = 0; j < d; ++j) out(r, j) = in(r, j) * inv * weight[static_cast<std::size_t>(j)];
        }
    }

    /// out = in * W^T for W (n_out x in.cols(), row-major). Many rows: one Eigen GEMM (it
    /// threads itself). A few rows (decode, short suffixes): the product is bound by reading
    /// W, which one thread does slowly, so the output features are split across threads.
    void project(const matrix& in, const float* w, Eigen::Index n_out, matrix& out) const {
        const Eigen::Index n_in = in.cols();
        out.resize(in.rows(), n_out);
        if (in.rows() > 8) {
            out.noalias() = in * const_map(w, n_out, n_in).transpose();
            return;
        }
        constexpr Eigen::Index block = 64;
        const Eigen::Index n_blocks = (n_out + block - 1) / block;
        KVCACHE_OMP(parallel for schedule(static))
        for (Eigen::Index b = 0; b < n_blocks; ++b) {
            const Eigen::Index o0 = b * block, cnt = std::min(block, n_out - o0);
            out.middleCols(o0, cnt).noalias() = in * const_map(w + o0 * n_in, cnt, n_in).transpose();
        }
    }

    void eval_ubatch(Cache& cache, std::span<const token_t> tokens, std::span<const pos_t> pos, seq_id_t seq) {
        const llama_config& cfg = w_.config;
        const Eigen::Index n = static_cast<Eigen::Index>(tokens.size());
        const Eigen::Index d = cfg.dim, h = cfg.hidden_dim, kv = cfg.kv_dim();
        const auto hd = static_cast<std::uint32_t>(cfg.head_dim());
        seq_buf_.assign(tokens.size(), seq);

        auto placed = cache.place(pos, std::span<const seq_id_t>(seq_buf_));
        if (!placed)
            throw model_error("eval: cannot place " + std::to_string(n) + " tokens: " + placed.message());
        const std::vector<std::uint32_t>& cells = placed.value().cells;

        x_.resize(n, d);
        for (Eigen::Index i = 0; i < n; ++i)
            x_.row(i) = const_map(w_.tok_embedding.data() + static_cast<std::size_t>(tokens[static_cast<std::size_t>(i)]) * d, 1, d);

        kv_ops::attention_params ap;
        ap.n_head = static_cast<std::uint32_t>(cfg.n_heads);
        ap.n_threads = opt_.n_threads;
        const kvcache::rope_params rope = cache.shape().rope;
        for (std::size_t l = 0; l < w_.layers.size(); ++l) {
            const layer_weights& lw = w_.layers[l];
            rms_norm(x_, lw.rms_att, xn_);
            project(xn_, lw.wq.data(), d, q_);
            project(xn_, lw.wk.data(), kv, k_);
            project(xn_, lw.wv.data(), kv, v_);
            kv_ops::rope_rows(q_.data(), static_cast<std::size_t>(n), static_cast<std::uint32_t>(cfg.n_heads), hd,
                              pos.data(), rope);
            kv_ops::rope_rows(k_.data(), static_cast<std::size_t>(n), static_cast<std::uint32_t>(cfg.n_kv_heads), hd,
                              pos.data(), rope);
            const auto layer = static_cast<std::uint32_t>(l);
            cache.write_k(layer, cells, k_.data());
            cache.write_v(layer, cells, v_.data());
            att_.resize(n, d);
            kv_ops::attention(cache, layer, q_.data(), pos.data(), seq_buf_.data(), static_cast<std::uint32_t>(n), ap,
                              att_.data(), ws_);
            project(att_, lw.wo.data(), d, tmp_);
            x_ += tmp_;

            rms_norm(x_, lw.rms_ffn, xn_);
            project(xn_, lw.w1.data(), h, g_);
            project(xn_, lw.w3.data(), h, u_);
            g_ = g_.array() / (1.0f + (-g_.array()).exp()) * u_.array();
            project(g_, lw.w2.data(), d, tmp_);
            x_ += tmp_;
        }
    }

    /// Logits of rows [r0, r0 + count) of the last micro-batch's final hidden state.
    void classify(Eigen::Index r0, Eigen::Index count, float* out) {
        const llama_config& cfg = w_.config;
        matrix rows = x_.middleRows(r0, count);
        rms_norm(rows, w_.rms_final, xn_);
        Eigen::Map<matrix> o(out, count, cfg.vocab_size);
        o.noalias() = xn_ * const_map(w_.classifier(), cfg.vocab_size, cfg.dim).transpose();
    }

    const llama_weights& w_;
    options opt_;
    // Scratch reused across calls (sizes follow the micro-batch).
    matrix x_, xn_, q_, k_, v_, att_, g_, u_, tmp_;
    std::vector<seq_id_t> seq_buf_;
    kv_ops::attention_workspace ws_;
};

}  // namespace demo
