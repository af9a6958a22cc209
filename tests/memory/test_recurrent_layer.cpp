// The reference recurrent layer (examples/demo/engine/recurrent_layer.hpp, float32 over a
// recurrent_memory's state spans) against its float64 oracle (tests/reference/
// recurrent_ref.hpp): a sequence run token by token, in chunks placed as transactions
// (one of them restored and run again), and resumed from checkpoints (memory hooks) all
// match the oracle. Tolerance: every output and state float within 2e-5 * (1 + |oracle|)
// (float32 rounding over 48 tokens; the states decay, so errors do not grow).
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <cmath>
#include <numeric>
#include <vector>

#include "../../examples/demo/engine/recurrent_layer.hpp"
#include "reference/recurrent_ref.hpp"

namespace {

constexpr double reclayer_tol = 2e-5;

struct reclayer_fixture {
    static constexpr std::uint32_t n_model = 12, n_inner = 10, n_conv = 4, n_state = 6, n_tok = 48;
    std::vector<demo::recurrent_layer_weights> w;  // two layers
    std::vector<std::vector<float>> inputs;       // per token
    reclayer_fixture() {
        w.push_back(demo::recurrent_layer_weights::random(n_model, n_inner, n_conv, n_state, 11));
        w.push_back(demo::recurrent_layer_weights::random(n_model, n_inner, n_conv, n_state, 12));
        demo::splitmix64 rng(5);
        for (std::uint32_t t = 0; t < n_tok; ++t) inputs.push_back(demo::detail::random_vector(rng, n_model, 1.0));
    }
    kvcache::recurrent_shape shape(std::uint32_t n_seq) const {
        kvcache::recurrent_shape s;
        s.n_layer = 2;
        s.n_seq_max = n_seq;
        s.d_conv = n_conv;
        s.d_inner = n_inner;
        s.ssm_size = n_inner * n_state;
        return s;
    }
    /// Oracle outputs of layer 1 (layer 0's output feeds it) for every token, and the final states.
    std::vector<std::vector<double>> oracle(std::vector<ref::recurrent_state>& st) const {
        std::vector<std::vector<double>> out;
        for (const auto& u : inputs) {
            std::vector<double> x(u.begin(), u.end());
            for (std::size_t l = 0; l < w.size(); ++l) x = ref::recurrent_oracle<demo::recurrent_layer_weights>{w[l]}.step(x, st[l]);
            out.push_back(x);
        }
        return out;
    }
};

/// Runs tokens [t0, t1) of the fixture through sequence s of mem as one transaction.
std::vector<std::vector<float>> reclayer_run(const reclayer_fixture& f, kvcache::recurrent_memory& mem,
                                             demo::recurrent_layer& layer, kvcache::seq_id_t s, std::uint32_t t0,
                                             std::uint32_t t1, bool commit = true) {
    std::vector<kvcache::pos_t> pos(t1 - t0);
    std::iota(pos.begin(), pos.end(), static_cast<kvcache::pos_t>(t0));
    const std::vector<kvcache::seq_id_t> seqs(pos.size(), s);
    static_cast<void>(mem.place(pos, seqs).value());
    std::vector<std::vector<float>> out;
    for (std::uint32_t t = t0; t < t1; ++t) {
        std::vector<float> x = f.inputs[t], y(x.size());
        for (std::uint32_t l = 0; l < 2; ++l) {
            layer.step(f.w[l], x.data(), y.data(), mem.conv_state(l, s), mem.ssm_state(l, s));
            x = y;
        }
        out.push_back(x);
    }
    if (commit)
        static_cast<void>(mem.commit());
    else
        static_cast<void>(mem.restore());
    return out;
}

double reclayer_err(const std::vector<float>& got, const std::vector<double>& want) {
    REQUIRE(got.size() == want.size());
    double e = 0.0;
    for (std::size_t i = 0; i < got.size(); ++i)
        e = std::max(e, std::abs(static_cast<double>(got[i]) - want[i]) / (1.0 + std::abs(want[i])));
    return e;
}

void reclayer_check_state(const reclayer_fixture& f, const kvcache::recurrent_memory& mem, kvcache::seq_id_t s,
                          const std::vector<ref::recurrent_state>& st) {
    for (std::uint32_t l = 0; l < 2; ++l) {
        const auto c = mem.conv_state(l, s);
        const auto h = mem.ssm_state(l, s);
        CHECK(reclayer_err(std::vector<float>(c.begin(), c.end()), st[l].conv) <= reclayer_tol);
        CHECK(reclayer_err(std::vector<float>(h.begin(), h.end()), st[l].h) <= reclayer_tol);
    }
    static_cast<void>(f);
}

}  // namespace

TEST_CASE("reference recurrent layer: token by token, in chunks, and from checkpoints, all match the float64 oracle") {
    const reclayer_fixture f;
    std::vector<ref::recurrent_state> st;
    for (const auto& w : f.w) st.push_back(ref::recurrent_oracle<demo::recurrent_layer_weights>{w}.zero_state());
    const auto want = f.oracle(st);
    double out_norm = 0.0;
    for (const auto& o : want)
        for (double v : o) out_norm = std::max(out_norm, std::abs(v));
    CHECK(out_norm > 1e-2);  // the layer does something: a zero output could not fail the comparisons

    kvcache::recurrent_memory mem(f.shape(3));
    demo::recurrent_layer layer;
    // sequence 0: token by token
    for (std::uint32_t t = 0; t < f.n_tok; ++t) {
        const auto o = reclayer_run(f, mem, layer, 0, t, t + 1);
        CHECK(reclayer_err(o[0], want[t]) <= reclayer_tol);
    }
    reclayer_check_state(f, mem, 0, st);
    // sequence 1: chunks of 7, one chunk run, restored (a failed batch) and run again; a
    // checkpoint taken after 21 tokens
    kvcache::recurrent_checkpoint at21;
    for (std::uint32_t t = 0; t < f.n_tok; t += 7) {
        const std::uint32_t t1 = std::min(f.n_tok, t + 7);
        if (t == 14) static_cast<void>(reclayer_run(f, mem, layer, 1, t, t1, false));
        const auto o = reclayer_run(f, mem, layer, 1, t, t1);
        for (std::uint32_t i = t; i < t1; ++i) CHECK(reclayer_err(o[i - t], want[i]) <= reclayer_tol);
        if (t1 == 21) at21 = mem.take_checkpoint(1);
    }
    reclayer_check_state(f, mem, 1, st);
    // sequence 2: resumed from the checkpoint at 21 (taken on another sequence)
    mem.restore_checkpoint(2, at21);
    CHECK(mem.seq_pos_max(2) == 20);
    const auto o = reclayer_run(f, mem, layer, 2, 21, f.n_tok);
    for (std::uint32_t i = 21; i < f.n_tok; ++i) CHECK(reclayer_err(o[i - 21], want[i]) <= reclayer_tol);
    reclayer_check_state(f, mem, 2, st);
    // a sequence op the state cannot do is refused; its checkpoint serves instead
    CHECK(!mem.seq_rm(1, 21, -1));
    mem.seq_rm(1, -1, -1).value();
    mem.restore_checkpoint(1, at21);
    CHECK(reclayer_err(reclayer_run(f, mem, layer, 1, 21, 22)[0], want[21]) <= reclayer_tol);

    // wrong span sizes are refused
    std::vector<float> y(f.n_model);
    CHECK_THROWS_AS(layer.step(f.w[0], f.inputs[0].data(), y.data(), mem.ssm_state(0, 0), mem.ssm_state(0, 0)),
                    std::invalid_argument);
    CHECK_THROWS_AS(demo::recurrent_layer_weights::random(4, 0, 4, 2, 1), std::invalid_argument);
}
