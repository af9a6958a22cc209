// demo engine: reader and writer for llama2.c checkpoints (the legacy ".bin" format).
//
// File layout (little-endian):
//   header: seven int32 = dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len
//           (vocab_size < 0 means the classifier is stored separately, |vocab_size| tokens)
//   float32 weights, each group for all layers in turn:
//     token_embedding (vocab x dim), rms_att (L x dim), wq (L x dim x dim),
//     wk (L x kv_dim x dim), wv (L x kv_dim x dim), wo (L x dim x dim), rms_ffn (L x dim),
//     w1 (L x hidden x dim), w2 (L x dim x hidden), w3 (L x hidden x dim), rms_final (dim),
//     freq_cis_real (seq_len x head_dim/2), freq_cis_imag (seq_len x head_dim/2)  -- unused here,
//     wcls (vocab x dim) only when vocab_size < 0 in the header.
// The reader checks the header and that the file holds exactly the bytes the header
// announces (truncation and trailing bytes are errors with both sizes in the message).
#pragma once

#include <array>       // header fields
#include <cmath>       // RoPE tables
#include <cstdint>     // std::int32_t
#include <cstring>     // std::memcpy
#include <filesystem>  // paths
#include <fstream>     // file I/O
#include <limits>      // size checks
#include <string>      // messages
#include <vector>      // weights

#include "model.hpp"

namespace demo {

namespace detail {
inline constexpr std::size_t llama2c_header_bytes = 7 * sizeof(std::int32_t);

/// Number of floats a llama2.c file holds after the header for `cfg`.
inline std::uint64_t llama2c_float_count(const llama_config& cfg) {
    const std::uint64_t d = static_cast<std::uint64_t>(cfg.dim);
    const std::uint64_t h = static_cast<std::uint64_t>(cfg.hidden_dim);
    const std::uint64_t L = static_cast<std::uint64_t>(cfg.n_layers);
    const std::uint64_t kv = static_cast<std::uint64_t>(cfg.kv_dim());
    const std::uint64_t v = static_cast<std::uint64_t>(cfg.vocab_size);
    const std::uint64_t hd = static_cast<std::uint64_t>(cfg.head_dim());
    const std::uint64_t s = static_cast<std::uint64_t>(cfg.seq_len);
    std::uint64_t n = v * d;                      // token embedding
    n += L * (d + d * d + 2 * kv * d + d * d + d);  // rms_att, wq, wk, wv, wo, rms_ffn
    n += L * 3 * h * d;                           // w1, w2, w3
    n += d;                                       // rms_final
    n += s * hd;                                  // freq_cis_real + freq_cis_imag (s x hd/2 each)
    if (!cfg.shared_classifier) n += v * d;
    return n;
}
}  // namespace detail

/// Reads a llama2.c checkpoint. Throws model_error with a clear message when the file
/// cannot be opened, the header is invalid, or the size does not match the header.
inline llama_weights load_llama2c(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw model_error("llama2.c checkpoint '" + path.string() + "': cannot open file");
    std::error_code ec;
    const std::uintmax_t file_size = std::filesystem::file_size(path, ec);
    if (ec) throw model_error("llama2.c checkpoint '" + path.string() + "': cannot read size: " + ec.message());
    if (file_size < detail::llama2c_header_bytes)
        throw model_error("llama2.c checkpoint '" + path.string() + "': truncated header: file has " +
                          std::to_string(file_size) + " bytes, the header needs 28");
    std::array<std::int32_t, 7> hdr{};
    in.read(reinterpret_cast<char*>(hdr.data()), detail::llama2c_header_bytes);
    if (!in) throw model_error("llama2.c checkpoint '" + path.string() + "': cannot read header");

    llama_config cfg;
    cfg.dim = hdr[0];
    cfg.hidden_dim = hdr[1];
    cfg.n_layers = hdr[2];
    cfg.n_heads = hdr[3];
    cfg.n_kv_heads = hdr[4];
    cfg.shared_classifier = hdr[5] > 0;
    cfg.vocab_size = hdr[5] == std::numeric_limits<std::int32_t>::min() ? 0 : (hdr[5] < 0 ? -hdr[5] : hdr[5]);
    cfg.seq_len = hdr[6];
    try {
        cfg.validate();
    } catch (const model_error& e) {
        throw model_error("llama2.c checkpoint '" + path.string() + "': bad header: " + e.what());
    }
    const std::uint64_t n_floats = detail::llama2c_float_count(cfg);
    const std::uint64_t expected = detail::llama2c_header_bytes + n_floats * sizeof(float);
    if (file_size < expected)
        throw model_error("llama2.c checkpoint '" + path.string() + "': truncated: the header announces " +
                          std::to_string(expected) + " bytes, the file has " + std::to_string(file_size));
    if (file_size > expected)
        throw model_error("llama2.c checkpoint '" + path.string() + "': " + std::to_string(file_size - expected) +
                          " trailing bytes: the header announces " + std::to_string(expected) +
                          " bytes, the file has " + std::to_string(file_size) +
                          " (is it a newer llama2.c export version with a magic header?)");

    const auto d = static_cast<std::size_t>(cfg.dim);
    const auto h = static_cast<std::size_t>(cfg.hidden_dim);
    const auto kv = static_cast<std::size_t>(cfg.kv_dim());
    const auto vocab = static_cast<std::size_t>(cfg.vocab_size);
    const auto L = static_cast<std::size_t>(cfg.n_layers);
    auto read = [&](std::size_t n, const char* what) {
        std::vector<float> v(n);
        in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(float)));
        if (!in) throw model_error("llama2.c checkpoint '" + path.string() + "': read failed in " + what);
        return v;
    };

    llama_weights w;
    w.config = cfg;
    w.layers.resize(L);
    w.tok_embedding = read(vocab * d, "token_embedding");
    auto per_layer = [&](std::size_t n, std::vector<float> layer_weights::*field, const char* what) {
        const std::vector<float> all = read(L * n, what);
        for (std::size_t l = 0; l < L; ++l)
            (w.layers[l].*field).assign(all.begin() + static_cast<std::ptrdiff_t>(l * n),
                                        all.begin() + static_cast<std::ptrdiff_t>((l + 1) * n));
    };
    per_layer(d, &layer_weights::rms_att, "rms_att");
    per_layer(d * d, &layer_weights::wq, "wq");
    per_layer(kv * d, &layer_weights::wk, "wk");
    per_layer(kv * d, &layer_weights::wv, "wv");
    per_layer(d * d, &layer_weights::wo, "wo");
    per_layer(d, &layer_weights::rms_ffn, "rms_ffn");
    per_layer(h * d, &layer_weights::w1, "w1");
    per_layer(d * h, &layer_weights::w2, "w2");
    per_layer(h * d, &layer_weights::w3, "w3");
    w.rms_final = read(d, "rms_final");
    static_cast<void>(read(static_cast<std::size_t>(cfg.seq_len) * static_cast<std::size_t>(cfg.head_dim()),
                           "freq_cis"));
    if (!cfg.shared_classifier) w.wcls = read(vocab * d, "wcls");
    return w;
}

/// Writes `w` as a llama2.c checkpoint (used by the tests and by `kvcache_demo --save-model`).
/// Throws model_error when the file cannot be written.
inline void save_llama2c(const llama_weights& w, const std::filesystem::path& path) {
    const llama_config& cfg = w.config;
    cfg.validate();
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) throw model_error("cannot write '" + path.string() + "'");
    const std::array<std::int32_t, 7> hdr{cfg.dim, cfg.hidden_dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                                          cfg.shared_classifier ? cfg.vocab_size : -cfg.vocab_size, cfg.seq_len};
    out.write(reinterpret_cast<const char*>(hdr.data()), detail::llama2c_header_bytes);
    auto put = [&](const std::vector<float>& v) {
        out.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
    };
    put(w.tok_embedding);
    for (auto field : {&layer_weights::rms_att, &layer_weights::wq, &layer_weights::wk, &layer_weights::wv,
                       &layer_weights::wo, &layer_weights::rms_ffn, &layer_weights::w1, &layer_weights::w2,
                       &layer_weights::w3})
        for (const auto& l : w.layers) put(l.*field);
    put(w.rms_final);
    // RoPE tables (llama2.c writes them; readers ignore them): cos and sin of pos * base^(-2i/hd).
    const int hd = cfg.head_dim();
    std::vector<float> re, im;
    re.reserve(static_cast<std::size_t>(cfg.seq_len) * static_cast<std::size_t>(hd / 2));
    im.reserve(re.capacity());
    for (int p = 0; p < cfg.seq_len; ++p)
        for (int i = 0; i < hd / 2; ++i) {
            const double theta = p * std::pow(static_cast<double>(cfg.rope.freq_base), -2.0 * i / hd);
            re.push_back(static_cast<float>(std::cos(theta)));
            im.push_back(static_cast<float>(std::sin(theta)));
        }
    put(re);
    put(im);
    if (!cfg.shared_classifier) put(w.wcls);
    out.flush();
    if (!out) throw model_error("write to '" + path.string() + "' failed");
}

}  // namespace demo
