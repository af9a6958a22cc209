// kvcache_demo: the command line. parse() turns argv into options or throws cli_error
// naming the argument, its value and what it must be; main prints the message and the
// usage text and exits with code 2.
#pragma once

#include <cerrno>     // errno, ERANGE
#include <cstdint>    // std::uint64_t
#include <cstdlib>    // std::strtoll, std::strtof
#include <stdexcept>  // std::invalid_argument
#include <string>     // values, messages

namespace demo::cli {

/// What to run and with which parameters (defaults: the README's demo).
struct options {
    std::string json;        ///< --json FILE: also write the rows and checks as JSON
    std::string model;       ///< --model FILE: a llama2.c checkpoint instead of the random model
    std::string tokenizer;   ///< --tokenizer FILE: llama2.c's tokenizer.bin instead of the byte tokenizer
    std::string save_model;  ///< --save-model FILE: write the model in use as a llama2.c checkpoint
    std::uint64_t seed = 42;  ///< weights seed; text seeds seed+1 .. seed+3
    int base_tokens = 0;      ///< 0: sized to the model (scenarios::fit_to_model: 1000, fewer for a short context)
    int threads = 0;          ///< 0: OpenMP's default (one thread on a busy machine)
    bool ttft = true;
    bool context_shift = true;
    bool self_extend = true;
    bool timing = true;  ///< false: rows pass on their correctness checks alone (--no-timing)
    bool help = false;   ///< -h / --help: print the usage and exit 0
    int ctx = 256;
    int n_keep = 32;
    int n_gen = 600;
    int ga_n = 4;
    int ga_w = 128;
    float temperature = 0.8f;
    float rope_base = 0.0f;   ///< --rope-base: RoPE frequency base of the model (0: the model's, 10000 for llama2.c)
    float rope_scale = 0.0f;  ///< --rope-scale: linear position scaling (0: the model's, 1)
};

/// A bad command line; what() names the argument, the value given and what it must be.
class cli_error : public std::invalid_argument {
public:
    using std::invalid_argument::invalid_argument;
};

/// The usage text (ends with a newline).
inline const char* usage_text() noexcept {
    return "usage: kvcache_demo [--json FILE] [--seed N] [--base-tokens N] [--threads N]\n"
           "                    [--model llama2c.bin] [--tokenizer tokenizer.bin] [--save-model FILE]\n"
           "                    [--context-shift] [--self-extend] [--ttft] [--no-timing]\n"
           "                    [--ctx N] [--n-keep N] [--n-gen N] [--ga-n N] [--ga-w N] [--temp T]\n"
           "                    [--rope-base F] [--rope-scale F]\n";
}

/// Parses argv. -h / --help returns at once with help set. --ttft / --context-shift / --self-extend select only the runs they name.
/// Throws cli_error on an unknown argument, a missing value, a value that is not a number
/// or out of range, --n-keep >= --ctx / 2, or --ga-w not a multiple of --ga-n.
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
        if (a == "--json") o.json = value();
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
    return o;
}

}  // namespace demo::cli
