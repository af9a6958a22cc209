// kvcache_demo --hybrid at a small size: the hybrid model's TTFT scenarios through the
// slots with recurrent-state checkpoints. Every cached request's logits equal a cold
// computation (max |diff| <= 1e-4, same argmax), repeats and growing prompts compute only
// their new tokens, and without checkpoints the full recompute is reported with its miss
// reason. Timing is not checked here (a CI machine's timings are noise).
#include <doctest/doctest.h>

#include <sstream>
#include <string>
#include <vector>

#include "../../examples/demo/hybrid.hpp"
#include "../../examples/demo/scenarios.hpp"

TEST_CASE("demo --hybrid: cached logits equal cold ones, checkpoints used, no-checkpoint recompute reported") {
    demo::llama_config c;
    c.dim = 64;
    c.hidden_dim = 128;
    c.n_layers = 4;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.vocab_size = 259;
    c.seq_len = 512;
    const demo::hybrid::hybrid_weights w = demo::hybrid::make_hybrid_model(c, 2, 7);
    CHECK(w.rec.size() == 2);
    CHECK(w.layer_map() == std::vector<bool>{true, false, true, false});
    const demo::tokenizer tok(c.vocab_size);
    demo::scenarios::text_source text(tok, 8);
    demo::hybrid::hybrid_runner<demo::scenarios::text_source> runner(w, text, 80, false);
    const std::vector<demo::report::row> rows = runner.run();
    REQUIRE(rows.size() == 2 + 4 + 3 + 2);
    int verified = 0;
    for (const auto& x : rows) {
        CAPTURE(x.scenario);
        CAPTURE(x.round);
        CHECK(x.pass);
        REQUIRE(x.checkpoint_bytes.has_value());
        if (x.max_abs_diff >= 0) {
            ++verified;
            CHECK(x.max_abs_diff <= 1e-4);
            CHECK(x.argmax_match);
        }
    }
    CHECK(verified == 1 + 3 + 2 + 1);
    const auto& repeat = rows[1];
    CHECK(repeat.scenario == "exact repeat");
    CHECK(repeat.m.computed == 1);
    CHECK(repeat.m.checkpoint_restored);
    CHECK(*repeat.checkpoint_bytes > 0);
    for (std::size_t i = 3; i <= 5; ++i) CHECK(rows[i].m.computed == 3);  // growing prefix: only the new tokens
    CHECK(rows[7].m.computed < 40);                                     // multi-turn: reply + user message
    const auto& none = rows.back();
    CHECK(none.scenario == "no checkpoints");
    CHECK(none.m.computed == 80);
    CHECK(none.m.miss == kvcache::miss_reason::no_checkpoint);
    CHECK(*none.checkpoint_bytes == 0);
    // the JSON rows name the miss reason
    std::ostringstream js;
    demo::report::write_json(js, rows, "test", {});
    CHECK(js.str().find("\"miss_reason\": \"no_checkpoint\"") != std::string::npos);
    CHECK(js.str().find("\"checkpoint_restored\": true") != std::string::npos);
    CHECK_THROWS_AS(demo::hybrid::make_hybrid_model(c, 0, 1), demo::model_error);
}
