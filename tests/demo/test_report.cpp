// The demo's report (examples/demo/report.hpp): json_writer's escaping, layout, nulls and
// misuse, the JSON document of rows and checks, and the reuse column of the table.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../examples/demo/report.hpp"

using demo::report::json_writer;

TEST_CASE("json_writer: strings are escaped, control characters included") {
    CHECK(json_writer::quote("plain") == "\"plain\"");
    CHECK(json_writer::quote("a\"b\\c") == "\"a\\\"b\\\\c\"");
    CHECK(json_writer::quote("line\nnext\ttab\r\b\f") == "\"line\\nnext\\ttab\\r\\b\\f\"");
    CHECK(json_writer::quote(std::string("nul\0x\x1f", 6)) == "\"nul\\u0000x\\u001f\"");
    CHECK(json_writer::quote("caf\xc3\xa9") == "\"caf\xc3\xa9\"");  // UTF-8 passes through
    std::ostringstream s;
    json_writer(s).begin_object().member("k\"ey", "v\nal").end_object();
    CHECK(s.str() == "{\"k\\\"ey\": \"v\\nal\"}");
}

TEST_CASE("json_writer: numbers, booleans, nulls and layout") {
    std::ostringstream s;
    json_writer j(s);
    j.begin_object(true)
        .member("i", 3)
        .member("u", std::uint32_t{7})
        .member("d", 0.25)
        .member("nan", std::numeric_limits<double>::quiet_NaN())
        .member("inf", std::numeric_limits<double>::infinity())
        .member("none", std::optional<double>())
        .member("some", std::optional<double>(1.5))
        .member("t", true)
        .member("f", false);
    j.key("list").begin_array().value(1).value("x").null().end_array();
    j.key("rows").begin_array(true).begin_object().member("a", 1).end_object().begin_object().end_object().end_array();
    j.key("empty").begin_array(true).end_array();
    j.end_object();
    CHECK(j.done());
    CHECK(s.str() ==
          "{\n"
          "  \"i\": 3,\n  \"u\": 7,\n  \"d\": 0.25,\n  \"nan\": null,\n  \"inf\": null,\n  \"none\": null,\n"
          "  \"some\": 1.5,\n  \"t\": true,\n  \"f\": false,\n"
          "  \"list\": [1, \"x\", null],\n"
          "  \"rows\": [\n    {\"a\": 1},\n    {}\n  ],\n"
          "  \"empty\": [\n  ]\n"
          "}");
}

TEST_CASE("json_writer: misuse throws") {
    std::ostringstream s;
    {
        json_writer j(s);
        j.begin_object();
        CHECK_THROWS_AS(j.value(1), std::logic_error);  // a member without a key
        CHECK_THROWS_AS(j.end_array(), std::logic_error);
        j.key("a");
        CHECK_THROWS_AS(j.key("b"), std::logic_error);  // two keys in a row
        CHECK_THROWS_AS(j.end_object(), std::logic_error);  // a key without a value
        j.value(1).end_object();
        CHECK(j.done());
        CHECK_THROWS_AS(j.value(2), std::logic_error);  // a second document
    }
    {
        json_writer j(s);
        j.begin_array();
        CHECK_THROWS_AS(j.key("a"), std::logic_error);  // keys belong to objects
        CHECK_FALSE(j.done());
        CHECK_THROWS_AS(j.end_object(), std::logic_error);
    }
}

TEST_CASE("write_json: the demo's rows and checks, parseable field by field") {
    demo::report::row cold;
    cold.scenario = "exact \"repeat\"";
    cold.round = 1;
    cold.what = "base (cold)";
    cold.n_prompt = 1000;
    cold.m.computed = 1000;
    cold.ttft_ms = 1042.5;
    demo::report::row warm = cold;
    warm.round = 2;
    warm.cache_type = "q8_0";  // --cache-type q8_0
    warm.m.computed = 1;
    warm.m.from_slot = 999;
    warm.ratio = 0.0125;
    warm.expected_max = 0.02;
    warm.max_abs_diff = 2e-6;
    std::vector<demo::report::check_result> checks{{"context shift (F13)", "n_ctx 256\tok", true}};
    std::ostringstream s;
    demo::report::write_json(s, {cold, warm}, "2 OpenMP threads", checks);
    CHECK(s.str() ==
          "{\n  \"machine\": \"2 OpenMP threads\",\n  \"rows\": [\n"
          "    {\"scenario\": \"exact \\\"repeat\\\"\", \"cache_type\": \"f32\", \"round\": 1, \"ttft_ms\": 1042.5, \"ratio\": 1, "
          "\"expected_max_ratio\": null, \"expected_min_ratio\": null, \"pass\": true, \"off_target\": false, \"request\": \"base (cold)\", "
          "\"n_prompt\": 1000, \"computed\": 1000, \"from_slot\": 0, \"from_global\": 0, \"from_shift\": 0, "
          "\"logits_max_abs_diff\": null, \"logits_argmax_match\": true, \"logits_check_ok\": true},\n"
          "    {\"scenario\": \"exact \\\"repeat\\\"\", \"cache_type\": \"q8_0\", \"round\": 2, \"ttft_ms\": 1042.5, \"ratio\": 0.0125, "
          "\"expected_max_ratio\": 0.02, \"expected_min_ratio\": null, \"pass\": true, \"off_target\": false, \"request\": \"base (cold)\", "
          "\"n_prompt\": 1000, \"computed\": 1, \"from_slot\": 999, \"from_global\": 0, \"from_shift\": 0, "
          "\"logits_max_abs_diff\": 2e-06, \"logits_argmax_match\": true, \"logits_check_ok\": true}\n"
          "  ],\n  \"checks\": [\n"
          "    {\"name\": \"context shift (F13)\", \"summary\": \"n_ctx 256\\tok\", \"pass\": true}\n"
          "  ]\n}\n");
    std::ostringstream empty;
    demo::report::write_json(empty, {}, "m", {});
    CHECK(empty.str() == "{\n  \"machine\": \"m\",\n  \"rows\": [\n  ],\n  \"checks\": [\n  ]\n}\n");
    CHECK_FALSE(demo::report::write_json("/nonexistent-dir/x.json", {}, "m", {}));
}

TEST_CASE("reuse_summary: where the reused tokens came from") {
    kvcache::request_metrics m;
    CHECK(demo::report::reuse_summary(m) == "-");
    m.from_slot = 100;
    CHECK(demo::report::reuse_summary(m) == "100 slot");
    m.from_shift = 600;
    CHECK(demo::report::reuse_summary(m) == "100 slot 600 shifted");
    m.from_global = 7;
    CHECK(demo::report::reuse_summary(m) == "100 slot 7 global 600 shifted");
    kvcache::request_metrics t;
    t.from_tier = 999;
    CHECK(demo::report::reuse_summary(t) == "999 tier");
    CHECK(demo::report::reuse_summary(t, "disk") == "999 disk");  // named by the row's tier
}

TEST_CASE("write_json: tier rows carry from_tier, tier and skipped; other rows do not") {
    demo::report::row hit;
    hit.scenario = "tiers";
    hit.round = 3;
    hit.what = "disk tier";
    hit.m.from_tier = 999;
    hit.tier = "disk";
    demo::report::row skipped = hit;
    skipped.m.from_tier = 0;
    skipped.tier.clear();
    skipped.skipped = true;
    demo::report::row other;
    other.scenario = "exact repeat";
    std::ostringstream s;
    demo::report::write_json(s, {hit, skipped, other}, "m", {});
    const std::string j = s.str();
    CHECK(j.find("\"from_tier\": 999, \"tier\": \"disk\", \"skipped\": false") != std::string::npos);
    CHECK(j.find("\"from_tier\": 0, \"tier\": null, \"skipped\": true") != std::string::npos);
    const std::size_t last = j.find("\"scenario\": \"exact repeat\"");
    REQUIRE(last != std::string::npos);
    CHECK(j.find("from_tier", last) == std::string::npos);
}

TEST_CASE("judge: correctness decides; a ratio off its target is reported, and fails only when strict") {
    demo::report::row x;
    x.expected_max = 0.05;
    x.ratio = 0.08;  // slower than its target
    demo::report::judge(x, true, false);
    CHECK(x.pass);
    CHECK(x.off_target);
    CHECK(std::string(demo::report::result_label(x)) == "OFF TARGET");
    demo::report::judge(x, true, true);  // --strict-timing
    CHECK_FALSE(x.pass);
    CHECK(std::string(demo::report::result_label(x)) == "FAIL");
    demo::report::judge(x, false, true);  // --no-timing wins: timing not judged
    CHECK(x.pass);
    CHECK_FALSE(x.off_target);

    x.ratio = 0.04;  // within target
    demo::report::judge(x, true, true);
    CHECK(x.pass);
    CHECK_FALSE(x.off_target);
    CHECK(std::string(demo::report::result_label(x)) == "PASS");

    demo::report::row control;  // must not be fast: nothing is reused
    control.expected_min = 0.8;
    control.ratio = 0.5;
    demo::report::judge(control, true, false);
    CHECK(control.off_target);
    CHECK(control.pass);

    x.check_ok = false;  // a failed logits check fails with or without timing
    for (const bool timing : {false, true})
        for (const bool strict : {false, true}) {
            demo::report::judge(x, timing, strict);
            CHECK_FALSE(x.pass);
        }
    std::ostringstream s;
    x.check_ok = true;
    x.ratio = 0.5;
    demo::report::judge(x, true, false);
    demo::report::write_json(s, {x}, "m", {});
    CHECK(s.str().find("\"pass\": true, \"off_target\": true") != std::string::npos);
}
