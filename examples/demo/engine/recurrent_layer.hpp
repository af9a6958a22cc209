// demo engine: the reference recurrent layer (issue 28), a Mamba-style selective scan
// with a short causal convolution, in float32 over a kvcache::recurrent_memory's state
// spans. tests/reference/recurrent_ref.hpp computes the same layer in float64 (the oracle).
//
// Exact specification. Sizes: d_model n, d_inner e, d_conv k (>= 1), d_state m. Per
// sequence the layer keeps
//   conv: (k - 1) rows of e floats, the inputs x of the last k - 1 tokens, row 0 the oldest
//         (kvcache::recurrent_memory::conv_state, recurrent_shape{d_conv = k, d_inner = e});
//   h:    e x m floats, h[j * m + s] (recurrent_memory::ssm_state, ssm_size = e * m).
// Both start at zero. Weights (row-major): w_in (2e x n), conv_w (e x k), conv_b (e),
// w_dt (e x e), dt_bias (e), w_b (m x e), w_c (m x e), a_log (e x m), d_skip (e), w_out (n x e).
// One token with input u (n floats) gives output o (n floats):
//   1. x_j = sum_i w_in[j][i] u_i,  z_j = sum_i w_in[e + j][i] u_i            (j < e)
//   2. c_j = conv_b_j + sum_{r < k-1} conv_w[j][r] conv[r][j] + conv_w[j][k-1] x_j
//   3. conv rows move up by one (row r = old row r + 1), the last row becomes x
//   4. a_j = silu(c_j), silu(t) = t / (1 + exp(-t))
//   5. dt_j = softplus(dt_bias_j + sum_i w_dt[j][i] a_i), softplus(t) = log(1 + exp(t))
//      (t itself for t > 20)
//   6. B_s = sum_j w_b[s][j] a_j,  C_s = sum_j w_c[s][j] a_j                     (s < m)
//   7. h[j][s] = exp(-dt_j exp(a_log[j][s])) h[j][s] + dt_j B_s a_j
//   8. y_j = (sum_s C_s h[j][s] + d_skip_j a_j) silu(z_j)
//   9. o_i = sum_j w_out[i][j] y_j
// Tokens of a sequence are processed one after the other; the order of the sums above is
// the order of their indices (the float32 and float64 versions differ only in rounding:
// tests/memory/test_recurrent_layer.cpp bounds the difference).
#pragma once

#include <cmath>    // std::exp, std::log, std::sqrt
#include <cstddef>  // std::size_t
#include <cstdint>  // fixed-width integers
#include <span>     // state spans
#include <stdexcept>  // std::invalid_argument
#include <string>   // messages
#include <vector>   // weights, scratch

#include "model.hpp"  // demo::splitmix64, detail::random_vector

namespace demo {

/// Weights of one reference recurrent layer (see the file comment).
struct recurrent_layer_weights {
    std::uint32_t d_model = 0, d_inner = 0, d_conv = 4, d_state = 0;
    std::vector<float> w_in, conv_w, conv_b, w_dt, dt_bias, w_b, w_c, a_log, d_skip, w_out;

    /// Floats of the SSM state (recurrent_shape::ssm_size).
    [[nodiscard]] std::uint32_t ssm_size() const noexcept { return d_inner * d_state; }

    /// Deterministic random weights (uniform, scaled by 1 / sqrt(fan-in)); decays
    /// exp(a_log) in [0.5, 2], dt_bias in [-2, -1]. Throws std::invalid_argument for a zero size.
    static recurrent_layer_weights random(std::uint32_t d_model, std::uint32_t d_inner, std::uint32_t d_conv,
                                          std::uint32_t d_state, std::uint64_t seed) {
        if (d_model == 0 || d_inner == 0 || d_conv == 0 || d_state == 0)
            throw std::invalid_argument("recurrent_layer_weights::random: sizes " + std::to_string(d_model) + ", " +
                                        std::to_string(d_inner) + ", " + std::to_string(d_conv) + ", " +
                                        std::to_string(d_state) + " must all be >= 1");
        splitmix64 rng(seed);
        recurrent_layer_weights w;
        w.d_model = d_model;
        w.d_inner = d_inner;
        w.d_conv = d_conv;
        w.d_state = d_state;
        const std::size_t n = d_model, e = d_inner, k = d_conv, m = d_state;
        auto sd = [](std::size_t fan_in) { return 1.0 / std::sqrt(static_cast<double>(fan_in)); };
        w.w_in = detail::random_vector(rng, 2 * e * n, sd(n));
        w.conv_w = detail::random_vector(rng, e * k, sd(k));
        w.conv_b = detail::random_vector(rng, e, 0.1);
        w.w_dt = detail::random_vector(rng, e * e, 0.5 * sd(e));
        w.dt_bias.resize(e);
        for (auto& x : w.dt_bias) x = static_cast<float>(-2.0 + rng.uniform());
        w.w_b = detail::random_vector(rng, m * e, sd(e));
        w.w_c = detail::random_vector(rng, m * e, sd(e));
        w.a_log.resize(e * m);
        for (auto& x : w.a_log) x = static_cast<float>(std::log(0.5) + rng.uniform() * std::log(4.0));
        w.d_skip = detail::random_vector(rng, e, 0.5);
        w.w_out = detail::random_vector(rng, n * e, sd(e));
        return w;
    }
};

/// The reference recurrent layer in float32 (see the file comment). Holds scratch buffers:
/// one object per thread.
class recurrent_layer {
public:
    /// Runs one token: u (d_model floats) -> out (d_model floats), updating conv
    /// ((d_conv - 1) x d_inner floats) and ssm (d_inner x d_state floats) in place. Throws
    /// std::invalid_argument when a state span has another size.
    void step(const recurrent_layer_weights& w, const float* u, float* out, std::span<float> conv,
              std::span<float> ssm) {
        const std::size_t n = w.d_model, e = w.d_inner, k = w.d_conv, m = w.d_state;
        if (conv.size() != (k - 1) * e || ssm.size() != e * m)
            throw std::invalid_argument("recurrent_layer::step: state spans of " + std::to_string(conv.size()) + " and " +
                                        std::to_string(ssm.size()) + " floats, the layer needs " +
                                        std::to_string((k - 1) * e) + " and " + std::to_string(e * m));
        x_.assign(e, 0.0f);
        z_.assign(e, 0.0f);
        for (std::size_t j = 0; j < e; ++j) {
            float sx = 0.0f, sz = 0.0f;
            for (std::size_t i = 0; i < n; ++i) {
                sx += w.w_in[j * n + i] * u[i];
                sz += w.w_in[(e + j) * n + i] * u[i];
            }
            x_[j] = sx;
            z_[j] = sz;
        }
        a_.assign(e, 0.0f);
        for (std::size_t j = 0; j < e; ++j) {
            float c = w.conv_b[j];
            for (std::size_t r = 0; r + 1 < k; ++r) c += w.conv_w[j * k + r] * conv[r * e + j];
            c += w.conv_w[j * k + k - 1] * x_[j];
            a_[j] = silu(c);
        }
        for (std::size_t r = 0; r + 2 < k; ++r)
            for (std::size_t j = 0; j < e; ++j) conv[r * e + j] = conv[(r + 1) * e + j];
        if (k > 1)
            for (std::size_t j = 0; j < e; ++j) conv[(k - 2) * e + j] = x_[j];
        b_.assign(m, 0.0f);
        c_.assign(m, 0.0f);
        for (std::size_t s = 0; s < m; ++s) {
            float sb = 0.0f, sc = 0.0f;
            for (std::size_t j = 0; j < e; ++j) {
                sb += w.w_b[s * e + j] * a_[j];
                sc += w.w_c[s * e + j] * a_[j];
            }
            b_[s] = sb;
            c_[s] = sc;
        }
        y_.assign(e, 0.0f);
        for (std::size_t j = 0; j < e; ++j) {
            float t = w.dt_bias[j];
            for (std::size_t i = 0; i < e; ++i) t += w.w_dt[j * e + i] * a_[i];
            const float dt = t > 20.0f ? t : std::log(1.0f + std::exp(t));
            float acc = 0.0f;
            for (std::size_t s = 0; s < m; ++s) {
                float& h = ssm[j * m + s];
                h = std::exp(-dt * std::exp(w.a_log[j * m + s])) * h + dt * b_[s] * a_[j];
                acc += c_[s] * h;
            }
            y_[j] = (acc + w.d_skip[j] * a_[j]) * silu(z_[j]);
        }
        for (std::size_t i = 0; i < n; ++i) {
            float o = 0.0f;
            for (std::size_t j = 0; j < e; ++j) o += w.w_out[i * e + j] * y_[j];
            out[i] = o;
        }
    }

private:
    static float silu(float t) { return t / (1.0f + std::exp(-t)); }
    std::vector<float> x_, z_, a_, b_, c_, y_;
};

}  // namespace demo
