// demo engine: Llama model configuration and weights, and a deterministic random model.
//
// The weights follow llama2.c's conventions: every matrix is row-major with one row
// per output feature (W is out x in, y = W x), RoPE pairs dimensions (2i, 2i+1) of
// each head, RMSNorm with learned scale, SwiGLU MLP (w2(silu(w1 x) * w3 x)).
// This is host-application code (the demo), not part of the kvcache library.
#pragma once

#include <cmath>      // std::sqrt
#include <cstdint>    // fixed-width integers
#include <stdexcept>  // std::runtime_error
#include <string>     // messages
#include <vector>     // weight storage

#include <kvcache/error.hpp>        // kvcache::error (rope validation)
#include <kvcache/model_shape.hpp>  // kvcache::rope_params

namespace demo {

/// Errors of the demo engine (bad model file, bad configuration).
class model_error : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

/// Llama hyper-parameters (the seven fields of a llama2.c header plus RoPE/norm constants).
/// `rope` is the library's kvcache::rope_params, passed unchanged to the cache shape
/// (cache_shape_for), so RoPE on Q and K and the K-shift use every field it has.
struct llama_config {
    int dim = 0;         ///< model width (d_model)
    int hidden_dim = 0;  ///< SwiGLU inner width
    int n_layers = 0;
    int n_heads = 0;     ///< query heads
    int n_kv_heads = 0;  ///< K/V heads (grouped-query attention: n_heads is a multiple)
    int vocab_size = 0;
    int seq_len = 0;     ///< context length the model was trained for
    bool shared_classifier = true;  ///< logits use the token embedding matrix
    /// RoPE of Q and K. llama2.c checkpoints carry none: their default is pairs (2i, 2i+1), base
    /// 10000, no scaling (llama2.c's export.py un-permutes Hugging Face's wq / wk to that pairing).
    kvcache::rope_params rope{kvcache::rope_type::normal, 10000.0f, 1.0f, 0};
    float norm_eps = 1e-5f;

    [[nodiscard]] int head_dim() const noexcept { return n_heads > 0 ? dim / n_heads : 0; }
    [[nodiscard]] int kv_dim() const noexcept { return head_dim() * n_kv_heads; }

    /// Throws model_error naming the first field that is out of range.
    void validate() const {
        auto bad = [](const char* name, long long v, const char* why) {
            throw model_error(std::string("model config: ") + name + " = " + std::to_string(v) + ": " + why);
        };
        constexpr int max_dim = 1 << 16;
        if (dim <= 0 || dim > max_dim) bad("dim", dim, "must be in [1, 65536]");
        if (hidden_dim <= 0 || hidden_dim > 4 * max_dim) bad("hidden_dim", hidden_dim, "must be in [1, 262144]");
        if (n_layers <= 0 || n_layers > 1024) bad("n_layers", n_layers, "must be in [1, 1024]");
        if (n_heads <= 0 || n_heads > dim) bad("n_heads", n_heads, "must be in [1, dim]");
        if (dim % n_heads != 0) bad("n_heads", n_heads, "must divide dim");
        if (head_dim() % 2 != 0) bad("dim / n_heads", head_dim(), "head dimension must be even (RoPE pairs)");
        if (n_kv_heads <= 0 || n_kv_heads > n_heads) bad("n_kv_heads", n_kv_heads, "must be in [1, n_heads]");
        if (n_heads % n_kv_heads != 0) bad("n_kv_heads", n_kv_heads, "must divide n_heads");
        if (vocab_size <= 0 || vocab_size > (1 << 24)) bad("vocab_size", vocab_size, "must be in [1, 2^24]");
        if (seq_len <= 0 || seq_len > (1 << 24)) bad("seq_len", seq_len, "must be in [1, 2^24]");
        // RoPE: the library's own validation of every rope_params field, against this head size.
        kvcache::model_shape s;
        s.n_layer = static_cast<std::uint32_t>(n_layers);
        s.n_head_kv = static_cast<std::uint32_t>(n_kv_heads);
        s.head_dim_k = static_cast<std::uint32_t>(head_dim());
        s.rope = rope;
        s.n_cells = 1;
        try {
            s.validate();
        } catch (const kvcache::error& e) {
            throw model_error(std::string("model config: ") + e.what());
        }
    }
};

/// Weights of one transformer block.
struct layer_weights {
    std::vector<float> rms_att;  ///< dim
    std::vector<float> wq;       ///< dim x dim
    std::vector<float> wk;       ///< kv_dim x dim
    std::vector<float> wv;       ///< kv_dim x dim
    std::vector<float> wo;       ///< dim x dim
    std::vector<float> rms_ffn;  ///< dim
    std::vector<float> w1;       ///< hidden x dim (gate)
    std::vector<float> w2;       ///< dim x hidden (down)
    std::vector<float> w3;       ///< hidden x dim (up)
};

/// A whole model. Invariant: every vector has the size its comment states for `config`.
struct llama_weights {
    llama_config config;
    std::vector<float> tok_embedding;  ///< vocab x dim
    std::vector<layer_weights> layers;
    std::vector<float> rms_final;  ///< dim
    std::vector<float> wcls;       ///< vocab x dim; empty when config.shared_classifier

    /// The classifier matrix (vocab x dim).
    [[nodiscard]] const float* classifier() const noexcept {
        return config.shared_classifier ? tok_embedding.data() : wcls.data();
    }
    /// Number of float parameters (without the RoPE tables of the file format).
    [[nodiscard]] std::size_t n_params() const noexcept {
        std::size_t n = tok_embedding.size() + rms_final.size() + wcls.size();
        for (const auto& l : layers)
            n += l.rms_att.size() + l.wq.size() + l.wk.size() + l.wv.size() + l.wo.size() + l.rms_ffn.size() +
                 l.w1.size() + l.w2.size() + l.w3.size();
        return n;
    }
};

/// splitmix64: a small, fast generator whose output is the same on every platform
/// (std::normal_distribution is not), so a seed always gives the same model.
class splitmix64 {
public:
    explicit splitmix64(std::uint64_t seed) noexcept : s_(seed) {}
    std::uint64_t next() noexcept {
        std::uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    /// Uniform in [0, 1).
    double uniform() noexcept { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

private:
    std::uint64_t s_;
};

namespace detail {
/// n values uniform in [-a, a] with a = sqrt(3) * stddev (variance stddev^2).
inline std::vector<float> random_vector(splitmix64& rng, std::size_t n, double stddev) {
    std::vector<float> v(n);
    const double a = std::sqrt(3.0) * stddev;
    for (auto& x : v) x = static_cast<float>((2.0 * rng.uniform() - 1.0) * a);
    return v;
}
inline std::vector<float> norm_weights(splitmix64& rng, std::size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = static_cast<float>(0.9 + 0.2 * rng.uniform());
    return v;
}
}  // namespace detail

/// A deterministic random model of the given shape: projections with variance 1/fan_in
/// (activations keep unit scale), RMSNorm scales near 1. Same seed, same weights.
inline llama_weights make_random_model(const llama_config& cfg, std::uint64_t seed) {
    cfg.validate();
    splitmix64 rng(seed);
    const auto d = static_cast<std::size_t>(cfg.dim);
    const auto h = static_cast<std::size_t>(cfg.hidden_dim);
    const auto kv = static_cast<std::size_t>(cfg.kv_dim());
    const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
    llama_weights w;
    w.config = cfg;
    w.tok_embedding = detail::random_vector(rng, vocab * d, 1.0);
    const double sd = 1.0 / std::sqrt(static_cast<double>(d));
    const double sh = 1.0 / std::sqrt(static_cast<double>(h));
    for (int l = 0; l < cfg.n_layers; ++l) {
        layer_weights lw;
        lw.rms_att = detail::norm_weights(rng, d);
        lw.wq = detail::random_vector(rng, d * d, sd);
        lw.wk = detail::random_vector(rng, kv * d, sd);
        lw.wv = detail::random_vector(rng, kv * d, sd);
        lw.wo = detail::random_vector(rng, d * d, sd * 0.5);
        lw.rms_ffn = detail::norm_weights(rng, d);
        lw.w1 = detail::random_vector(rng, h * d, sd);
        lw.w2 = detail::random_vector(rng, d * h, sh * 0.5);
        lw.w3 = detail::random_vector(rng, h * d, sd);
        w.layers.push_back(std::move(lw));
    }
    w.rms_final = detail::norm_weights(rng, d);
    if (!cfg.shared_classifier) w.wcls = detail::random_vector(rng, vocab * d, sd);
    return w;
}

}  // namespace demo
