// A Llama forward pass written for clarity, in double precision and without any cache:
// every call recomputes every token from scratch. The oracle for the demo engine.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "../../examples/demo/engine/model.hpp"

namespace demo_ref {

using vec = std::vector<double>;

/// y = W x for W (rows x cols, row-major floats).
inline vec matvec(const std::vector<float>& w, std::size_t rows, std::size_t cols, const vec& x) {
    vec y(rows, 0.0);
    for (std::size_t r = 0; r < rows; ++r)
        for (std::size_t c = 0; c < cols; ++c) y[r] += static_cast<double>(w[r * cols + c]) * x[c];
    return y;
}

inline vec rms_norm(const vec& x, const std::vector<float>& weight, double eps) {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + eps);
    vec y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * weight[i];
    return y;
}

/// RoPE on one head (pairs (2i, 2i+1), theta = pos * base^(-2i / head_dim)).
inline void rope(double* head, std::size_t head_dim, double pos, double base) {
    for (std::size_t i = 0; i < head_dim / 2; ++i) {
        const double theta = pos * std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
        const double a = head[2 * i], b = head[2 * i + 1];
        head[2 * i] = a * std::cos(theta) - b * std::sin(theta);
        head[2 * i + 1] = a * std::sin(theta) + b * std::cos(theta);
    }
}

/// Logits (vocab values) after every token of `tokens`, token i at position pos[i]; token i
/// attends to every token j <= i (all tokens belong to one sequence, in order).
inline std::vector<vec> forward_all(const demo::llama_weights& w, const std::vector<int>& tokens,
                                    const std::vector<int>& pos) {
    const auto& cfg = w.config;
    const std::size_t d = static_cast<std::size_t>(cfg.dim), hdim = static_cast<std::size_t>(cfg.hidden_dim);
    const std::size_t hd = static_cast<std::size_t>(cfg.head_dim()), kv = static_cast<std::size_t>(cfg.kv_dim());
    const std::size_t n_head = static_cast<std::size_t>(cfg.n_heads);
    const std::size_t group = n_head / static_cast<std::size_t>(cfg.n_kv_heads);
    const std::size_t n = tokens.size();
    std::vector<vec> x(n, vec(d));
    for (std::size_t t = 0; t < n; ++t)
        for (std::size_t i = 0; i < d; ++i) x[t][i] = w.tok_embedding[static_cast<std::size_t>(tokens[t]) * d + i];

    for (const auto& lw : w.layers) {
        std::vector<vec> q(n), k(n), v(n);
        for (std::size_t t = 0; t < n; ++t) {
            const vec xn = rms_norm(x[t], lw.rms_att, cfg.norm_eps);
            q[t] = matvec(lw.wq, d, d, xn);
            k[t] = matvec(lw.wk, kv, d, xn);
            v[t] = matvec(lw.wv, kv, d, xn);
            for (std::size_t h = 0; h < n_head; ++h) rope(q[t].data() + h * hd, hd, pos[t], cfg.rope.freq_base);
            for (std::size_t h = 0; h < kv / hd; ++h) rope(k[t].data() + h * hd, hd, pos[t], cfg.rope.freq_base);
        }
        for (std::size_t t = 0; t < n; ++t) {
            vec att(d, 0.0);
            for (std::size_t h = 0; h < n_head; ++h) {
                const std::size_t kh = h / group;
                std::vector<double> score(t + 1);
                double mx = -1e300;
                for (std::size_t j = 0; j <= t; ++j) {
                    double s = 0;
                    for (std::size_t e = 0; e < hd; ++e) s += q[t][h * hd + e] * k[j][kh * hd + e];
                    score[j] = s / std::sqrt(static_cast<double>(hd));
                    mx = std::max(mx, score[j]);
                }
                double sum = 0;
                for (double& s : score) sum += (s = std::exp(s - mx));
                for (std::size_t j = 0; j <= t; ++j)
                    for (std::size_t e = 0; e < hd; ++e) att[h * hd + e] += score[j] / sum * v[j][kh * hd + e];
            }
            const vec o = matvec(lw.wo, d, d, att);
            for (std::size_t i = 0; i < d; ++i) x[t][i] += o[i];
            const vec xn = rms_norm(x[t], lw.rms_ffn, cfg.norm_eps);
            const vec g = matvec(lw.w1, hdim, d, xn), u = matvec(lw.w3, hdim, d, xn);
            vec act(hdim);
            for (std::size_t i = 0; i < hdim; ++i) act[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
            const vec down = matvec(lw.w2, d, hdim, act);
            for (std::size_t i = 0; i < d; ++i) x[t][i] += down[i];
        }
    }
    std::vector<vec> logits(n);
    const std::vector<float> cls(w.classifier(), w.classifier() + static_cast<std::size_t>(cfg.vocab_size) * d);
    for (std::size_t t = 0; t < n; ++t)
        logits[t] = matvec(cls, static_cast<std::size_t>(cfg.vocab_size), d, rms_norm(x[t], w.rms_final, cfg.norm_eps));
    return logits;
}

}  // namespace demo_ref
