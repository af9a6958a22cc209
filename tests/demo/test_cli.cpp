// The demo's command line (examples/demo/cli.hpp): defaults, every option, the run
// selection, and bad arguments refused with a message naming the argument and the value.
#include <doctest/doctest.h>

#include <initializer_list>
#include <string>
#include <vector>

#include "../../examples/demo/cli.hpp"

namespace {

demo::cli::options parse(std::initializer_list<const char*> args) {
    std::vector<const char*> argv{"kvcache_demo"};
    argv.insert(argv.end(), args.begin(), args.end());
    return demo::cli::parse(static_cast<int>(argv.size()), argv.data());
}

}  // namespace

TEST_CASE("cli: defaults are the README's demo") {
    const auto o = parse({});
    CHECK(o.json.empty());
    CHECK(o.model.empty());
    CHECK(o.seed == 42);
    CHECK(o.base_tokens == 0);  // sized to the model by scenarios::fit_to_model
    CHECK(o.rope_base == 0.0f);
    CHECK(o.rope_scale == 0.0f);
    CHECK(o.threads == 0);
    CHECK(o.ttft);
    CHECK(o.context_shift);
    CHECK(o.self_extend);
    CHECK(o.timing);
    CHECK_FALSE(o.help);
    CHECK(o.ctx == 256);
    CHECK(o.n_keep == 32);
    CHECK(o.n_gen == 600);
    CHECK(o.ga_n == 4);
    CHECK(o.ga_w == 128);
    CHECK(o.temperature == doctest::Approx(0.8));
}

TEST_CASE("cli: every option and the run selection") {
    const auto o = parse({"--json", "r.json", "--model", "m.bin", "--tokenizer", "t.bin", "--save-model", "s.bin",
                          "--seed", "7", "--base-tokens", "160", "--threads", "1", "--ctx", "128", "--n-keep", "16",
                          "--n-gen", "160", "--ga-n", "2", "--ga-w", "64", "--temp", "0", "--no-timing",
                          "--rope-base", "500000", "--rope-scale", "0.25"});
    CHECK(o.json == "r.json");
    CHECK(o.model == "m.bin");
    CHECK(o.tokenizer == "t.bin");
    CHECK(o.save_model == "s.bin");
    CHECK(o.seed == 7);
    CHECK(o.base_tokens == 160);
    CHECK(o.threads == 1);
    CHECK(o.ctx == 128);
    CHECK(o.n_keep == 16);
    CHECK(o.n_gen == 160);
    CHECK(o.ga_n == 2);
    CHECK(o.ga_w == 64);
    CHECK(o.temperature == 0.0f);
    CHECK(o.rope_base == 500000.0f);
    CHECK(o.rope_scale == 0.25f);
    CHECK_FALSE(o.timing);
    CHECK(o.ttft);  // no selection: everything runs

    const auto cs = parse({"--context-shift"});
    CHECK_FALSE(cs.ttft);
    CHECK(cs.context_shift);
    CHECK_FALSE(cs.self_extend);
    const auto two = parse({"--self-extend", "--ttft"});
    CHECK(two.ttft);
    CHECK_FALSE(two.context_shift);
    CHECK(two.self_extend);
    // Help stops at once: later (even bad) arguments are not looked at.
    CHECK(parse({"--help", "--bogus"}).help);
    CHECK(parse({"-h"}).help);
}

TEST_CASE("cli: bad arguments name the argument, the value and the rule") {
    using demo::cli::cli_error;
    auto refused = [](std::initializer_list<const char*> args, const char* what) {
        CAPTURE(what);
        CHECK_THROWS_WITH_AS(parse(args), doctest::Contains(what), cli_error);
    };
    refused({"--bogus"}, "unknown argument --bogus");
    refused({"--json"}, "--json needs a value");
    refused({"--seed"}, "--seed needs a value");
    refused({"--seed", "x"}, "--seed = x: must be an integer in [0, 1099511627776]");
    refused({"--seed", "-1"}, "--seed = -1: must be an integer");
    refused({"--base-tokens", "63"}, "--base-tokens = 63: must be an integer in [64, 8192]");
    refused({"--base-tokens", "12abc"}, "--base-tokens = 12abc");
    refused({"--base-tokens", ""}, "--base-tokens = : must be an integer");
    refused({"--threads", "99999999999999999999999"}, "--threads = 99999999999999999999999");
    refused({"--ctx", "10"}, "--ctx = 10: must be an integer in [64, 1048576]");
    refused({"--n-gen", "0"}, "--n-gen = 0");
    refused({"--ga-n", "65"}, "--ga-n = 65: must be an integer in [1, 64]");
    refused({"--temp", "-1"}, "--temp = -1: must be a finite number >= 0");
    refused({"--temp", "nan"}, "--temp = nan");
    refused({"--temp", "inf"}, "--temp = inf");
    refused({"--temp", "0.5x"}, "--temp = 0.5x");
    refused({"--rope-base", "0"}, "--rope-base = 0: must be a finite number > 0");
    refused({"--rope-base", "nan"}, "--rope-base = nan: must be a finite number > 0");
    refused({"--rope-scale", "-2"}, "--rope-scale = -2: must be a finite number > 0");
    refused({"--rope-scale", "1e40"}, "--rope-scale = 1e40");
    refused({"--n-keep", "128"}, "--n-keep = 128: must be smaller than --ctx / 2 = 128");
    refused({"--ctx", "64", "--n-keep", "32"}, "--n-keep = 32: must be smaller than --ctx / 2 = 32");
    refused({"--ga-n", "3"}, "--ga-w = 128: must be a multiple of --ga-n = 3");
    CHECK(std::string(demo::cli::usage_text()).find("usage: kvcache_demo") == 0);
}
