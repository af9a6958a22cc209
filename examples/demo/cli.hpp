// kvcache_demo: the command line. parse() turns argv into options or throws cli_error
// naming the argument, its value and what it must be; main prints the message and the
// usage text and exits with code 2.
#pragma once

#include <cerrno>     // errno, ERANGE
#include <cstdint>    // std::uint64_t
#include <cstdlib>    // std::strtoll, std::strtof
#include <span>       // factor tables
#include <stdexcept>  // std::invalid_argument
#include <string>     // values, messages
#include <vector>     // factor lists

#include <kvcache/model_shape.hpp>  // kvcache::rope_params (apply_rope)

namespace demo::cli {

/// RoPE scaling options (--rope-scaling and its parameters); 0 / empty: not given.
struct rope_options {
    std::string scaling;          ///< --rope-scaling none|linear|yarn|llama3|longrope ("" = the model's)
    float factor = 0.0f;          ///< --rope-factor: context extension (linear / yarn: freq_scale = 1 / F; llama3.factor)
    std::uint32_t orig_ctx = 0;   ///< --rope-orig-ctx: original_max_position_embeddings (yarn, llama3, longrope)
    float attn_factor = 0.0f;     ///< --rope-attn-factor: magnitude (default: YaRN's mscale for yarn, 1 otherwise)
    float ntk_alpha = 0.0f;       ///< --rope-ntk-alpha: NTK-aware base scaling (any scaling)
    float beta_fast = 0.0f;       ///< --yarn-beta-fast
    float beta_slow = 0.0f;       ///< --yarn-beta-slow
    float ext_factor = -1.0f;     ///< --yarn-ext-factor (-1: not given)
    float low_freq = 0.0f;        ///< --llama3-low-freq
    float high_freq = 0.0f;       ///< --llama3-high-freq
    std::vector<float> short_factors;  ///< --longrope-short F,F,...
    std::vector<float> long_factors;   ///< --longrope-long F,F,...
};

/// What to run and with which parameters (defaults: the README's demo).
struct options {
    std::string json;        ///< --json FILE: also write the rows and checks as JSON
    std::string model;       ///< --model FILE: a llama2.c checkpoint instead of the random model
    std::string tokenizer;   ///< --tokenizer FILE: llama2.c's tokenizer.bin instead of the byte tokenizer
    std::string save_model;  ///< --save-model FILE: write the model in use as a llama2.c checkpoint
    std::string cache_type = "f32";  ///< --cache-type f32|f16|bf16|q8_0|q4_0: K/V element of the TTFT runs
    std::uint64_t seed = 42;  ///< weights seed; text seeds seed+1 .. seed+3
    int base_tokens = 0;      ///< 0: sized to the model (scenarios::fit_to_model: 1000, fewer for a short context)
    int threads = 0;          ///< 0: OpenMP's default (one thread on a busy machine)
    bool ttft = true;
    bool context_shift = true;
    bool self_extend = true;
    bool timing = true;  ///< false: rows pass on their correctness checks alone (--no-timing)
    /// --strict-timing: a row whose TTFT ratio misses its target fails the run (by default
    /// it is reported OFF TARGET and the run's result rests on the correctness checks).
    bool strict_timing = false;
    bool help = false;   ///< -h / --help: print the usage and exit 0
    bool hybrid = false;  ///< --hybrid: the TTFT scenarios on a hybrid model (attention + recurrent layers)
    /// --tiers: the storage-tier scenario (tiers.hpp): TTFT of a hit from each tier given,
    /// in this process and in new processes; also run when a tier option below is given.
    bool tiers = false;
    std::string tier_dir;         ///< --tier-dir DIR: a disk tier in DIR (a run subfolder of it)
    std::string redis;            ///< --redis HOST:PORT: a Redis tier on that server (never started by the demo)
    std::string redis_host;       ///< host of --redis
    int redis_port = 0;           ///< port of --redis
    int tier_memory_mib = -1;     ///< --tier-memory-mib N: the memory tier's limit (-1: 512; 0: no memory tier)
    /// Internal (the multi-process scenario's children): --tier-role reader|restart, the run's
    /// namespace, A's cold TTFT and the file of A's cold logits.
    std::string tier_role;
    std::string tier_ns;
    double tier_cold_ms = 0;
    std::string tier_logits;
    int ctx = 256;
    int n_keep = 32;
    int n_gen = 600;
    int ga_n = 4;
    int ga_w = 128;
    float temperature = 0.8f;
    float rope_base = 0.0f;   ///< --rope-base: RoPE frequency base of the model (0: the model's, 10000 for llama2.c)
    float rope_scale = 0.0f;  ///< --rope-scale: linear position scaling (0: the model's, 1)
    rope_options rope;        ///< --rope-scaling and its parameters
};

/// A bad command line; what() names the argument, the value given and what it must be.
class cli_error : public std::invalid_argument {
public:
    using std::invalid_argument::invalid_argument;
};

/// The usage text (ends with a newline).
inline const char* usage_text() noexcept {
    return "usage: kvcache_demo [--json FILE] [--seed N] [--base-tokens N] [--threads N]\n"
           "                    [--cache-type f32|f16|bf16|q8_0|q4_0]\n"
           "                    [--model llama2c.bin] [--tokenizer tokenizer.bin] [--save-model FILE]\n"
           "                    [--context-shift] [--self-extend] [--ttft] [--no-timing] [--strict-timing] [--hybrid]\n"
           "                    [--ctx N] [--n-keep N] [--n-gen N] [--ga-n N] [--ga-w N] [--temp T]\n"
           "                    [--rope-base F] [--rope-scale F] [--rope-ntk-alpha F] [--rope-attn-factor F]\n"
           "                    [--rope-scaling none|linear|yarn|llama3|longrope] [--rope-factor F] [--rope-orig-ctx N]\n"
           "                    [--yarn-beta-fast F] [--yarn-beta-slow F] [--yarn-ext-factor F]\n"
           "                    [--llama3-low-freq F] [--llama3-high-freq F]\n"
           "                    [--longrope-short F,F,...] [--longrope-long F,F,...]\n"
           "                    [--tiers] [--tier-dir DIR] [--redis HOST:PORT] [--tier-memory-mib N]\n";
}

/// The RoPE options' cross-argument rules (see parse).
inline void check_rope(const options& o) {
    const rope_options& r = o.rope;
    const std::string& sc = r.scaling;
    const std::string named = sc.empty() ? std::string("none (no --rope-scaling)") : sc;
    auto only_for = [&](bool given, const char* arg, bool allowed, const char* which) {
        if (given && !allowed)
            throw cli_error(std::string(arg) + " applies to --rope-scaling " + which + " only, not " + named);
    };
    only_for(r.factor > 0, "--rope-factor", sc == "linear" || sc == "yarn" || sc == "llama3", "linear, yarn or llama3");
    only_for(r.orig_ctx > 0, "--rope-orig-ctx", sc == "yarn" || sc == "llama3" || sc == "longrope",
             "yarn, llama3 or longrope");
    only_for(r.beta_fast > 0, "--yarn-beta-fast", sc == "yarn", "yarn");
    only_for(r.beta_slow > 0, "--yarn-beta-slow", sc == "yarn", "yarn");
    only_for(r.ext_factor >= 0, "--yarn-ext-factor", sc == "yarn", "yarn");
    only_for(r.low_freq > 0, "--llama3-low-freq", sc == "llama3", "llama3");
    only_for(r.high_freq > 0, "--llama3-high-freq", sc == "llama3", "llama3");
    only_for(!r.short_factors.empty(), "--longrope-short", sc == "longrope", "longrope");
    only_for(!r.long_factors.empty(), "--longrope-long", sc == "longrope", "longrope");
    if ((sc == "linear" || sc == "yarn" || sc == "llama3") && !(r.factor > 0))
        throw cli_error("--rope-scaling " + sc + " needs --rope-factor F (the context extension factor)");
    if ((sc == "yarn" || sc == "llama3" || sc == "longrope") && r.orig_ctx == 0)
        throw cli_error("--rope-scaling " + sc + " needs --rope-orig-ctx N (original_max_position_embeddings)");
    if (r.factor > 0 && o.rope_scale > 0)
        throw cli_error("--rope-scale and --rope-factor both set the linear scaling; give one");
    if (sc == "llama3" && r.factor < 1.0f)
        throw cli_error("--rope-factor = " + std::to_string(r.factor) + ": must be >= 1 for llama3");
    const kvcache::rope_yarn_params yd{};
    const kvcache::rope_llama3_params ld{};
    const float bf = r.beta_fast > 0 ? r.beta_fast : yd.beta_fast, bs = r.beta_slow > 0 ? r.beta_slow : yd.beta_slow;
    if (sc == "yarn" && !(bf > bs))
        throw cli_error("--yarn-beta-fast = " + std::to_string(bf) + ": must be > --yarn-beta-slow = " + std::to_string(bs));
    const float lo = r.low_freq > 0 ? r.low_freq : ld.low_freq_factor, hi = r.high_freq > 0 ? r.high_freq : ld.high_freq_factor;
    if (sc == "llama3" && !(hi > lo))
        throw cli_error("--llama3-high-freq = " + std::to_string(hi) + ": must be > --llama3-low-freq = " + std::to_string(lo));
    if (sc == "longrope") {
        if (r.short_factors.empty() || r.long_factors.empty())
            throw cli_error("--rope-scaling longrope needs --longrope-short and --longrope-long (n_rot / 2 factors each)");
        if (r.short_factors.size() != r.long_factors.size())
            throw cli_error("--longrope-short has " + std::to_string(r.short_factors.size()) +
                            " factors but --longrope-long has " + std::to_string(r.long_factors.size()) +
                            "; both need n_rot / 2");
    }
}

/// Sets the RoPE fields the options name in `rope` (the others keep the model's): freq_base
/// (--rope-base), freq_scale (--rope-scale, or 1 / --rope-factor for linear and yarn), ntk_alpha,
/// attn_factor (default for yarn: rope_params::yarn_mscale(factor)), the scaling and its
/// parameters. The model then validates the result against its head size (kvcache's own
/// rope_params::validate, e.g. a LongRoPE table of the wrong length).
inline void apply_rope(const options& o, kvcache::rope_params& rope) {
    const rope_options& r = o.rope;
    if (o.rope_base > 0) rope.freq_base = o.rope_base;
    if (o.rope_scale > 0) rope.freq_scale = o.rope_scale;
    if (r.ntk_alpha > 0) rope.ntk_alpha = r.ntk_alpha;
    const std::string& sc = r.scaling;
    if (sc == "none" || sc == "linear") {
        rope.scaling = kvcache::rope_scaling::none;
        if (sc == "linear") rope.freq_scale = 1.0f / r.factor;
    } else if (sc == "yarn") {
        rope.scaling = kvcache::rope_scaling::yarn;
        rope.freq_scale = 1.0f / r.factor;
        rope.attn_factor = kvcache::rope_params::yarn_mscale(r.factor);
        if (r.beta_fast > 0) rope.yarn.beta_fast = r.beta_fast;
        if (r.beta_slow > 0) rope.yarn.beta_slow = r.beta_slow;
        if (r.ext_factor >= 0) rope.yarn.ext_factor = r.ext_factor;
    } else if (sc == "llama3") {
        rope.scaling = kvcache::rope_scaling::llama3;
        rope.llama3.factor = r.factor;
        if (r.low_freq > 0) rope.llama3.low_freq_factor = r.low_freq;
        if (r.high_freq > 0) rope.llama3.high_freq_factor = r.high_freq;
    } else if (sc == "longrope") {
        rope.scaling = kvcache::rope_scaling::longrope;
        rope.short_factors = kvcache::rope_factors(std::span<const float>(r.short_factors));
        rope.long_factors = kvcache::rope_factors(std::span<const float>(r.long_factors));
    }
    if (r.orig_ctx > 0) rope.n_ctx_orig = r.orig_ctx;
    if (r.attn_factor > 0) rope.attn_factor = r.attn_factor;
}

/// Parses argv. -h / --help returns at once with help set. --ttft / --context-shift / --self-extend /
/// --tiers select only the runs they name; --tier-dir, --redis or --tier-memory-mib also turn the
/// tier scenario on. Throws cli_error also for a --redis that is not HOST:PORT, a --tier-role
/// other than reader / restart or without its companions.
/// Throws cli_error on an unknown argument, a missing value, a value that is not a number
/// or out of range, --n-keep >= --ctx / 2, or --ga-w not a multiple of --ga-n; for RoPE: an
/// unknown --rope-scaling, a parameter of a scaling not selected, a missing required one
/// (--rope-factor for linear / yarn / llama3, --rope-orig-ctx for yarn / llama3 / longrope, both
/// LongRoPE tables of one length), --rope-scale with --rope-factor, and the ordering rules
/// (yarn beta_fast > beta_slow, llama3 high > low, llama3 factor >= 1).
inline options parse(int argc, const char* const* argv) {
    using std::to_string;
    options o;
    bool only = false;
    auto select = [&](bool& which) {
        if (!only) o.ttft = o.context_shift = o.self_extend = false;
        only = true;
        which = true;
    };
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) throw cli_error(a + " needs a value");
            return argv[++i];
        };
        auto number = [&](long long lo, long long hi) -> long long {
            const std::string v = value();
            char* end = nullptr;
            errno = 0;
            const long long n = std::strtoll(v.c_str(), &end, 10);
            if (v.empty() || end == v.c_str() || *end != '\0' || errno == ERANGE || n < lo || n > hi)
                throw cli_error(a + " = " + v + ": must be an integer in [" + to_string(lo) + ", " + to_string(hi) + "]");
            return n;
        };
        // A finite float, >= 0 (positive: > 0).
        auto real = [&](bool positive) -> float {
            const std::string v = value();
            char* end = nullptr;
            const float t = std::strtof(v.c_str(), &end);
            if (v.empty() || end == v.c_str() || *end != '\0' || !(t >= 0.0f) || !(t < 1e30f) ||
                (positive && !(t > 0.0f)))
                throw cli_error(a + " = " + v + (positive ? ": must be a finite number > 0" : ": must be a finite number >= 0"));
            return t;
        };
        // Comma-separated finite floats > 0.
        auto list = [&]() -> std::vector<float> {
            const std::string v = value();
            std::vector<float> out;
            std::size_t at = 0;
            while (true) {
                const std::size_t comma = v.find(',', at);
                const std::string item = v.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
                char* end = nullptr;
                const float t = std::strtof(item.c_str(), &end);
                if (item.empty() || end == item.c_str() || *end != '\0' || !(t > 0.0f) || !(t < 1e30f))
                    throw cli_error(a + " = " + v + ": item " + to_string(out.size()) + " (\"" + item +
                                    "\") must be a finite number > 0 (a comma-separated list)");
                out.push_back(t);
                if (comma == std::string::npos) break;
                at = comma + 1;
            }
            return out;
        };
        if (a == "--json") o.json = value();
        else if (a == "--cache-type") {
            o.cache_type = value();
            if (o.cache_type != "f32" && o.cache_type != "f16" && o.cache_type != "bf16" && o.cache_type != "q8_0" &&
                o.cache_type != "q4_0")
                throw cli_error("--cache-type = " + o.cache_type + ": must be f32, f16, bf16, q8_0 or q4_0");
        }
        else if (a == "--rope-scaling") {
            o.rope.scaling = value();
            if (o.rope.scaling != "none" && o.rope.scaling != "linear" && o.rope.scaling != "yarn" &&
                o.rope.scaling != "llama3" && o.rope.scaling != "longrope")
                throw cli_error("--rope-scaling = " + o.rope.scaling + ": must be none, linear, yarn, llama3 or longrope");
        }
        else if (a == "--rope-factor") o.rope.factor = real(true);
        else if (a == "--rope-orig-ctx") o.rope.orig_ctx = static_cast<std::uint32_t>(number(1, 1LL << 30));
        else if (a == "--rope-attn-factor") o.rope.attn_factor = real(true);
        else if (a == "--rope-ntk-alpha") o.rope.ntk_alpha = real(true);
        else if (a == "--yarn-beta-fast") o.rope.beta_fast = real(true);
        else if (a == "--yarn-beta-slow") o.rope.beta_slow = real(true);
        else if (a == "--yarn-ext-factor") {
            o.rope.ext_factor = real(false);
            if (o.rope.ext_factor > 1.0f)
                throw cli_error("--yarn-ext-factor = " + std::string(argv[i]) + ": must be in [0, 1]");
        }
        else if (a == "--llama3-low-freq") o.rope.low_freq = real(true);
        else if (a == "--llama3-high-freq") o.rope.high_freq = real(true);
        else if (a == "--longrope-short") o.rope.short_factors = list();
        else if (a == "--longrope-long") o.rope.long_factors = list();
        else if (a == "--model") o.model = value();
        else if (a == "--tokenizer") o.tokenizer = value();
        else if (a == "--save-model") o.save_model = value();
        else if (a == "--seed") o.seed = static_cast<std::uint64_t>(number(0, 1LL << 40));
        else if (a == "--base-tokens") o.base_tokens = static_cast<int>(number(64, 8192));
        else if (a == "--threads") o.threads = static_cast<int>(number(0, 256));
        else if (a == "--ctx") o.ctx = static_cast<int>(number(64, 1 << 20));
        else if (a == "--n-keep") o.n_keep = static_cast<int>(number(0, 1 << 20));
        else if (a == "--n-gen") o.n_gen = static_cast<int>(number(1, 1 << 20));
        else if (a == "--ga-n") o.ga_n = static_cast<int>(number(1, 64));
        else if (a == "--ga-w") o.ga_w = static_cast<int>(number(1, 1 << 20));
        else if (a == "--temp") o.temperature = real(false);
        else if (a == "--rope-base") o.rope_base = real(true);
        else if (a == "--rope-scale") o.rope_scale = real(true); else if (a == "--no-timing") o.timing = false;
        else if (a == "--strict-timing") o.strict_timing = true;
        else if (a == "--hybrid") o.hybrid = true;
        else if (a == "--tiers") select(o.tiers);
        else if (a == "--tier-dir") {
            o.tier_dir = value();
            if (o.tier_dir.empty()) throw cli_error("--tier-dir needs a directory, not an empty string");
        }
        else if (a == "--redis") {
            o.redis = value();
            const std::size_t colon = o.redis.rfind(':');
            if (colon == std::string::npos || colon == 0)
                throw cli_error("--redis = " + o.redis + ": must be HOST:PORT (e.g. 127.0.0.1:6379)");
            o.redis_host = o.redis.substr(0, colon);
            const std::string port = o.redis.substr(colon + 1);
            char* end = nullptr;
            const long p = std::strtol(port.c_str(), &end, 10);
            if (port.empty() || *end != '\0' || p < 1 || p > 65535)
                throw cli_error("--redis = " + o.redis + ": the port must be an integer in [1, 65535]");
            o.redis_port = static_cast<int>(p);
        }
        else if (a == "--tier-memory-mib") o.tier_memory_mib = static_cast<int>(number(0, 1 << 20));
        else if (a == "--tier-role") {
            o.tier_role = value();
            if (o.tier_role != "reader" && o.tier_role != "restart")
                throw cli_error("--tier-role = " + o.tier_role + ": must be reader or restart");
        }
        else if (a == "--tier-ns") o.tier_ns = value();
        else if (a == "--tier-cold-ms") o.tier_cold_ms = real(true);
        else if (a == "--tier-logits") o.tier_logits = value();
        else if (a == "--ttft") select(o.ttft);
        else if (a == "--context-shift") select(o.context_shift);
        else if (a == "--self-extend") select(o.self_extend);
        else if (a == "-h" || a == "--help") {
            o.help = true;  // as soon as it is seen: later arguments are not checked
            return o;
        }
        else throw cli_error("unknown argument " + a);
    }
    if (o.n_keep >= o.ctx / 2)
        throw cli_error("--n-keep = " + to_string(o.n_keep) + ": must be smaller than --ctx / 2 = " + to_string(o.ctx / 2));
    if (o.ga_w % o.ga_n != 0)
        throw cli_error("--ga-w = " + to_string(o.ga_w) + ": must be a multiple of --ga-n = " + to_string(o.ga_n));
    if (!o.tier_dir.empty() || !o.redis.empty() || o.tier_memory_mib >= 0) o.tiers = true;
    if (!o.tier_role.empty() && (o.tier_ns.empty() || o.tier_cold_ms <= 0 || o.tier_logits.empty()))
        throw cli_error("--tier-role " + o.tier_role + " needs --tier-ns, --tier-cold-ms and --tier-logits (set by the demo)");
    check_rope(o);
    return o;
}

}  // namespace demo::cli
