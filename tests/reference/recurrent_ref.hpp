// Float64 oracle of the reference recurrent layer specified in
// examples/demo/engine/recurrent_layer.hpp (a Mamba-style selective scan with a short
// causal convolution): the same nine steps, written plainly, in double, over states the
// oracle owns. Weights are the float32 ones, converted exactly.
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

namespace ref {

/// One sequence's state of the reference recurrent layer: conv ((d_conv - 1) x d_inner,
/// row 0 the oldest input) and h (d_inner x d_state).
struct recurrent_state {
    std::vector<double> conv, h;
};

/// The layer in float64. W is demo::recurrent_layer_weights (any type with its fields).
template <class W>
struct recurrent_oracle {
    const W& w;

    [[nodiscard]] recurrent_state zero_state() const {
        return {std::vector<double>(std::size_t{w.d_conv - 1} * w.d_inner, 0.0),
                std::vector<double>(std::size_t{w.d_inner} * w.d_state, 0.0)};
    }

    /// One token: u (d_model) -> the layer's output (d_model); st updated.
    [[nodiscard]] std::vector<double> step(const std::vector<double>& u, recurrent_state& st) const {
        const std::size_t n = w.d_model, e = w.d_inner, k = w.d_conv, m = w.d_state;
        auto silu = [](double t) { return t / (1.0 + std::exp(-t)); };
        std::vector<double> x(e, 0.0), z(e, 0.0), a(e), B(m, 0.0), C(m, 0.0), y(e), out(n, 0.0);
        for (std::size_t j = 0; j < e; ++j)
            for (std::size_t i = 0; i < n; ++i) {
                x[j] += double{w.w_in[j * n + i]} * u[i];
                z[j] += double{w.w_in[(e + j) * n + i]} * u[i];
            }
        for (std::size_t j = 0; j < e; ++j) {
            double c = w.conv_b[j];
            for (std::size_t r = 0; r + 1 < k; ++r) c += double{w.conv_w[j * k + r]} * st.conv[r * e + j];
            c += double{w.conv_w[j * k + k - 1]} * x[j];
            a[j] = silu(c);
        }
        if (k > 1) {  // the window of inputs moves by one token
            std::vector<double> next(st.conv.begin() + static_cast<std::ptrdiff_t>(e), st.conv.end());
            next.insert(next.end(), x.begin(), x.end());
            st.conv = next;
        }
        for (std::size_t s = 0; s < m; ++s)
            for (std::size_t j = 0; j < e; ++j) {
                B[s] += double{w.w_b[s * e + j]} * a[j];
                C[s] += double{w.w_c[s * e + j]} * a[j];
            }
        for (std::size_t j = 0; j < e; ++j) {
            double t = w.dt_bias[j];
            for (std::size_t i = 0; i < e; ++i) t += double{w.w_dt[j * e + i]} * a[i];
            const double dt = t > 20.0 ? t : std::log1p(std::exp(t));
            double acc = 0.0;
            for (std::size_t s = 0; s < m; ++s) {
                double& h = st.h[j * m + s];
                h = std::exp(-dt * std::exp(double{w.a_log[j * m + s]})) * h + dt * B[s] * a[j];
                acc += C[s] * h;
            }
            y[j] = (acc + double{w.d_skip[j]} * a[j]) * silu(z[j]);
        }
        for (std::size_t i = 0; i < n; ++i)
            for (std::size_t j = 0; j < e; ++j) out[i] += double{w.w_out[i * e + j]} * y[j];
        return out;
    }
};

}  // namespace ref
