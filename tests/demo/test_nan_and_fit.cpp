// The demo's checks never take NaN for agreement (compare_logits, the cold-run verifier, the
// K-shift check, the TTFT rows end to end), and the TTFT scenarios fit the model's context
// (scenarios::fit_to_model: the base prompt sized to seq_len, or a refusal naming the limit).
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "../../examples/demo/scenarios.hpp"

namespace {

namespace sc = demo::scenarios;
constexpr float nan_f = std::numeric_limits<float>::quiet_NaN();
constexpr float inf_f = std::numeric_limits<float>::infinity();

demo::llama_config tiny_config() {
    demo::llama_config c;
    c.dim = 32;
    c.hidden_dim = 48;
    c.n_layers = 2;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.vocab_size = 259;  // the byte tokenizer's
    c.seq_len = 512;
    c.shared_classifier = false;
    return c;
}

}  // namespace

TEST_CASE("compare_logits: NaN or infinity on either side is a mismatch") {
    const std::vector<float> want{0.5f, 2.0f, -1.0f, 0.25f};
    const demo::logits_comparison same = demo::compare_logits(want.data(), want.data(), want.size());
    CHECK(same.ok(1e-4));
    CHECK(same.max_abs_diff == 0.0);
    std::vector<float> close = want;
    close[3] += 5e-5f;
    CHECK(demo::compare_logits(close.data(), want.data(), want.size()).ok(1e-4));
    close[3] += 1e-3f;
    CHECK_FALSE(demo::compare_logits(close.data(), want.data(), want.size()).ok(1e-4));

    for (std::size_t at : {0u, 1u, 3u}) {  // NaN at, and away from, the argmax
        for (float bad : {nan_f, inf_f, -inf_f}) {
            CAPTURE(at);
            CAPTURE(bad);
            std::vector<float> got = want;
            got[at] = bad;
            for (const auto& c : {demo::compare_logits(got.data(), want.data(), want.size()),
                                  demo::compare_logits(want.data(), got.data(), want.size()),
                                  demo::compare_logits(got.data(), got.data(), want.size())}) {
                CHECK_FALSE(c.ok(1e-4));
                CHECK_FALSE(c.ok(std::numeric_limits<double>::infinity()));
                CHECK_FALSE(c.finite);
                CHECK_FALSE(c.argmax_same);
                CHECK(std::isnan(c.max_abs_diff));
                CHECK(sc::logits_label(c) == "NaN/inf logits");
            }
        }
    }
    CHECK(std::isnan(demo::nan_max(1.0, std::nan(""))));
    CHECK(std::isnan(demo::nan_max(std::nan(""), 1.0)));
    CHECK(demo::nan_max(1.0, 2.0) == 2.0);
    CHECK(demo::nan_max(3.0, 2.0) == 3.0);
}

TEST_CASE("verifier: NaN in the served logits fails the cold-run check") {
    const auto w = demo::make_random_model(tiny_config(), 3);
    sc::verifier v(w, 64);
    const std::vector<demo::token_t> prompt{1, 70, 80, 90, 100};
    // The served logits: a cold run of the same prompt (agreement), then with one NaN away from the argmax.
    demo::llama_engine<sc::plain_cache> eng(w);
    sc::plain_cache cache(eng.cache_shape(64, 1));
    std::vector<float> got;
    eng.eval(cache, prompt, 0, 0, got);
    CHECK(v.compare(prompt, got).ok(sc::logits_tol));
    const auto best = static_cast<std::size_t>(demo::argmax(got.data(), got.size()));
    got[best == 0 ? 1 : 0] = nan_f;
    const demo::logits_comparison c = v.compare(prompt, got);
    CHECK_FALSE(c.ok(sc::logits_tol));
    CHECK(std::isnan(c.max_abs_diff));
    CHECK_THROWS_AS(v.compare(prompt, std::vector<float>(3, 0.0f)), demo::model_error);  // wrong size
}

TEST_CASE("K-shift check: a NaN in a moved cell's K fails it") {
    using cache_t = sc::plain_cache;
    const auto w = demo::make_random_model(tiny_config(), 4);
    demo::llama_engine<cache_t> eng(w);
    cache_t cache(eng.cache_shape(64, 1));
    std::vector<float> logits;
    const std::vector<demo::token_t> prompt{1, 10, 20, 30, 40, 50, 60, 70};
    eng.eval(cache, prompt, 0, 0, logits);
    const auto before = demo::snapshot_k(cache, 0, 0, 64);
    REQUIRE(cache.seq_add(0, 4, -1, 3).ok());
    kvcache::ops::apply_k_shift(cache);
    CHECK(demo::check_k_shift(cache, 0, before).max_error <= sc::kshift_tol);
    // One K value of one moved cell becomes NaN: the check must not pass.
    std::vector<float> k(cache.shape().k_row_size());
    const std::uint32_t cell = before.back().cell;
    cache.read_k(1, cell, k.data());
    k[2] = nan_f;
    cache.write_k(1, std::vector<std::uint32_t>{cell}, k.data());
    const demo::k_shift_report r = demo::check_k_shift(cache, 0, before);
    CHECK(std::isnan(r.max_error));
    CHECK_FALSE(r.max_error <= sc::kshift_tol);
}

TEST_CASE("TTFT rows: a model whose logits are NaN fails every logits check") {
    auto w = demo::make_random_model(tiny_config(), 5);
    w.rms_final[0] = nan_f;  // every logit NaN, in the served run and in the cold one alike
    const demo::tokenizer tok(w.config.vocab_size);
    demo::cli::options o;
    o.base_tokens = 64;
    o.timing = false;
    sc::ttft_runner runner(w, tok, o);
    const std::vector<demo::report::row> rows = runner.run();
    std::size_t verified = 0;
    for (const demo::report::row& x : rows) {
        if (x.max_abs_diff < 0) continue;  // cold rows and the control are not compared (NaN is not < 0)
        CAPTURE(x.scenario);
        CAPTURE(x.round);
        ++verified;
        CHECK_FALSE(x.check_ok);
        CHECK_FALSE(x.pass);
        CHECK(x.check.find("NaN") != std::string::npos);
    }
    CHECK(verified >= 8);
}

TEST_CASE("fit_to_model: the base prompt sized to the model's context, or a refusal naming the limit") {
    demo::llama_config cfg = tiny_config();
    demo::cli::options o;
    cfg.seq_len = 4096;
    sc::fit_to_model(o, cfg);
    CHECK(o.base_tokens == 1000);  // the README's demo
    cfg.seq_len = 512;             // stories260K
    o = {};
    sc::fit_to_model(o, cfg);
    CHECK(o.base_tokens == 512 - sc::ttft_extra_positions);
    o = {};
    o.base_tokens = 410;
    CHECK_THROWS_WITH_AS(sc::fit_to_model(o, cfg),
                         "--base-tokens = 410: the TTFT scenarios hold up to 103 positions more, the model's trained "
                         "context is 512: must be at most 409",
                         demo::cli::cli_error);
    o = {};
    o.ctx = 1024;
    CHECK_THROWS_WITH_AS(sc::fit_to_model(o, cfg), "--ctx = 1024: larger than the model's trained context 512",
                         demo::cli::cli_error);
    o.ttft = false;  // only the runs that fit
    o.context_shift = false;
    sc::fit_to_model(o, cfg);
    cfg.seq_len = 100;  // too short for the TTFT scenarios
    o = {};
    CHECK_THROWS_WITH_AS(sc::fit_to_model(o, cfg), doctest::Contains("the TTFT scenarios need at least 167"),
                         demo::cli::cli_error);
}

TEST_CASE("fit_to_model: ttft_extra_positions is what the TTFT scenarios use") {
    // A model whose context is exactly the base prompt + ttft_extra_positions: every scenario
    // runs (the runner throws std::logic_error if a request reached past seq_len).
    auto cfg = tiny_config();
    cfg.seq_len = 64 + sc::ttft_extra_positions;
    const auto w = demo::make_random_model(cfg, 6);
    const demo::tokenizer tok(cfg.vocab_size);
    demo::cli::options o;
    o.timing = false;
    o.context_shift = o.self_extend = false;  // the TTFT scenarios only (--ttft)
    sc::fit_to_model(o, cfg);
    REQUIRE(o.base_tokens == 64);
    sc::ttft_runner runner(w, tok, o);
    std::vector<demo::report::row> rows;
    CHECK_NOTHROW(rows = runner.run());
    for (const auto& x : rows) CHECK_MESSAGE(x.pass, x.scenario << " round " << x.round);
    // One position less and the runner refuses (the guard the test above relies on).
    cfg.seq_len -= 1;
    const auto w2 = demo::make_random_model(cfg, 6);
    sc::ttft_runner short_runner(w2, tok, o);
    CHECK_THROWS_AS(static_cast<void>(short_runner.run()), std::logic_error);
}
