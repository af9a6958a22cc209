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
    CHECK_FALSE(o.strict_timing);  // timing off target is reported, not a failure
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
    CHECK(o.cache_type == "f32");  // the default
    for (const char* t : {"f32", "f16", "bf16", "q8_0", "q4_0"}) CHECK(parse({"--cache-type", t}).cache_type == t);
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
    CHECK(parse({"--strict-timing"}).strict_timing);

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
    refused({"--cache-type", "q5_1"}, "--cache-type = q5_1: must be f32, f16, bf16, q8_0 or q4_0");
    refused({"--cache-type"}, "--cache-type needs a value");
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

TEST_CASE("cli: RoPE scaling flags set every field of kvcache::rope_params") {
    CHECK(parse({}).rope.scaling.empty());
    auto applied = [](std::initializer_list<const char*> args) {
        kvcache::rope_params r;
        demo::cli::apply_rope(parse(args), r);
        return r;
    };
    const auto none = applied({});
    CHECK(none == kvcache::rope_params{});
    const auto lin = applied({"--rope-scaling", "linear", "--rope-factor", "4", "--rope-base", "500000"});
    CHECK(lin.scaling == kvcache::rope_scaling::none);
    CHECK(lin.freq_scale == 0.25f);
    CHECK(lin.freq_base == 500000.0f);
    const auto yarn = applied({"--rope-scaling", "yarn", "--rope-factor", "4", "--rope-orig-ctx", "32768",
                               "--yarn-beta-fast", "16", "--yarn-beta-slow", "2", "--yarn-ext-factor", "0.5"});
    CHECK(yarn.scaling == kvcache::rope_scaling::yarn);
    CHECK(yarn.freq_scale == 0.25f);
    CHECK(yarn.n_ctx_orig == 32768);
    CHECK(yarn.yarn.beta_fast == 16.0f);
    CHECK(yarn.yarn.beta_slow == 2.0f);
    CHECK(yarn.yarn.ext_factor == 0.5f);
    CHECK(yarn.attn_factor == kvcache::rope_params::yarn_mscale(4.0f));  // YaRN's default magnitude
    CHECK(applied({"--rope-scaling", "yarn", "--rope-factor", "4", "--rope-orig-ctx", "8", "--rope-attn-factor", "1.5"})
              .attn_factor == 1.5f);
    const auto l3 = applied({"--rope-scaling", "llama3", "--rope-factor", "32", "--rope-orig-ctx", "8192",
                             "--llama3-low-freq", "1", "--llama3-high-freq", "4", "--rope-ntk-alpha", "2"});
    CHECK(l3.scaling == kvcache::rope_scaling::llama3);
    CHECK(l3.llama3.factor == 32.0f);
    CHECK(l3.llama3.high_freq_factor == 4.0f);
    CHECK(l3.freq_scale == 1.0f);
    CHECK(l3.ntk_alpha == 2.0f);
    const auto lr = applied({"--rope-scaling", "longrope", "--rope-orig-ctx", "4096", "--longrope-short", "1,1.5,2",
                             "--longrope-long", "2,3,4.5"});
    CHECK(lr.scaling == kvcache::rope_scaling::longrope);
    CHECK(lr.short_factors == kvcache::rope_factors{1.0f, 1.5f, 2.0f});
    CHECK(lr.long_factors == kvcache::rope_factors{2.0f, 3.0f, 4.5f});
    lr.validate(6);  // the library accepts what the flags built (3 pairs)
    CHECK_THROWS_AS(lr.validate(8), kvcache::error);  // 4 pairs: the model's own validation refuses
    CHECK(std::string(demo::cli::usage_text()).find("--rope-scaling none|linear|yarn|llama3|longrope") !=
          std::string::npos);
}

TEST_CASE("cli: bad RoPE scaling flags are refused, naming the flag and the rule") {
    using demo::cli::cli_error;
    auto refused = [](std::initializer_list<const char*> args, const char* what) {
        CAPTURE(what);
        CHECK_THROWS_WITH_AS(parse(args), doctest::Contains(what), cli_error);
    };
    refused({"--rope-scaling", "ntk"}, "--rope-scaling = ntk: must be none, linear, yarn, llama3 or longrope");
    refused({"--rope-scaling"}, "--rope-scaling needs a value");
    refused({"--rope-scaling", "linear"}, "--rope-scaling linear needs --rope-factor");
    refused({"--rope-scaling", "yarn", "--rope-factor", "4"}, "--rope-scaling yarn needs --rope-orig-ctx");
    refused({"--rope-scaling", "llama3", "--rope-orig-ctx", "8192"}, "--rope-scaling llama3 needs --rope-factor");
    refused({"--rope-scaling", "longrope", "--rope-orig-ctx", "4096"}, "needs --longrope-short and --longrope-long");
    refused({"--rope-factor", "4"}, "--rope-factor applies to --rope-scaling linear, yarn or llama3 only, not none");
    refused({"--rope-scaling", "llama3", "--rope-factor", "8", "--rope-orig-ctx", "8", "--yarn-beta-fast", "8"},
            "--yarn-beta-fast applies to --rope-scaling yarn only, not llama3");
    refused({"--rope-scaling", "linear", "--rope-factor", "2", "--rope-orig-ctx", "8"},
            "--rope-orig-ctx applies to --rope-scaling yarn, llama3 or longrope only");
    refused({"--longrope-long", "1,2"}, "--longrope-long applies to --rope-scaling longrope only");
    refused({"--rope-scaling", "linear", "--rope-factor", "2", "--rope-scale", "0.5"},
            "--rope-scale and --rope-factor both set the linear scaling");
    refused({"--rope-scaling", "yarn", "--rope-factor", "4", "--rope-orig-ctx", "8", "--yarn-beta-fast", "1"},
            "--yarn-beta-fast = 1.000000: must be > --yarn-beta-slow = 1.000000");
    refused({"--rope-scaling", "llama3", "--rope-factor", "0.5", "--rope-orig-ctx", "8"}, "must be >= 1 for llama3");
    refused({"--rope-scaling", "llama3", "--rope-factor", "8", "--rope-orig-ctx", "8", "--llama3-high-freq", "0.5"},
            "--llama3-high-freq = 0.500000: must be > --llama3-low-freq = 1.000000");
    refused({"--rope-scaling", "longrope", "--rope-orig-ctx", "8", "--longrope-short", "1,2", "--longrope-long", "1"},
            "--longrope-short has 2 factors but --longrope-long has 1");
    refused({"--longrope-short", "1,,2"}, "--longrope-short = 1,,2: item 1 (\"\") must be a finite number > 0");
    refused({"--longrope-short", "1,-2"}, "item 1 (\"-2\")");
    refused({"--rope-orig-ctx", "0"}, "--rope-orig-ctx = 0: must be an integer in [1, 1073741824]");
    refused({"--yarn-ext-factor", "2"}, "--yarn-ext-factor = 2: must be in [0, 1]");
    refused({"--rope-factor", "nan"}, "--rope-factor = nan: must be a finite number > 0");
    refused({"--rope-attn-factor", "0"}, "--rope-attn-factor = 0: must be a finite number > 0");
}
