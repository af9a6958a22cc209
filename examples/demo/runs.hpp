// kvcache_demo's runs as functions defined in their own source files, so that the demo's
// build (once the largest unit of the README's test build: every K/V element is its own
// kv_cache type, server and tier chain) spreads over the cores instead of one translation
// unit. runs_f32.cpp, runs_16bit.cpp (f16, bf16) and runs_quant.cpp (q8_0, q4_0) instantiate
// the TTFT and tier runs of their elements (runs_element.hpp); runs_f32.cpp also defines the
// hybrid, context-shift and Self-Extend runs; kvcache_demo.cpp (main) only calls them.
#pragma once

#include <string>  // --cache-type, argv
#include <vector>  // rows

#include <kvcache/element/bf16.hpp>
#include <kvcache/element/f16.hpp>
#include <kvcache/element/f32.hpp>
#include <kvcache/element/q4_0.hpp>
#include <kvcache/element/q8_0.hpp>

#include "cli.hpp"
#include "engine/model.hpp"
#include "engine/tokenizer.hpp"
#include "report.hpp"

namespace demo::runs {

using cli::options;
using report::check_result;
using report::row;

/// The TTFT scenarios on E K/V (scenarios::basic_ttft_runner<E>).
template <class E>
std::vector<row> ttft_rows(const llama_weights& w, const tokenizer& tok, const options& o);
/// Process A's storage-tier rows on E K/V (args: its command line without the program name).
template <class E>
std::vector<row> tier_rows(const llama_weights& w, const tokenizer& tok, const options& o,
                           const std::vector<std::string>& args);
/// A child process of the tier scenario (--tier-role): its exit code.
template <class E>
int tier_child(const llama_weights& w, const tokenizer& tok, const options& o);

/// The hybrid model's TTFT rows (--hybrid; random weights of w's shape).
std::vector<row> hybrid_rows(const llama_weights& w, const tokenizer& tok, const options& o);
/// F13 and F14: generation past the context with context shift, and the Self-Extend loop.
check_result context_shift(const llama_weights& w, const tokenizer& tok, const options& o);
check_result self_extend(const llama_weights& w, const tokenizer& tok, const options& o);

/// Calls f.template operator()<E>() with the K/V element named by --cache-type (cli.hpp
/// accepts only these names).
template <class F>
auto with_element(const std::string& cache_type, F&& f) {
    if (cache_type == "f16") return f.template operator()<kvcache::f16>();
    if (cache_type == "bf16") return f.template operator()<kvcache::bf16>();
    if (cache_type == "q8_0") return f.template operator()<kvcache::q8_0>();
    if (cache_type == "q4_0") return f.template operator()<kvcache::q4_0>();
    return f.template operator()<kvcache::f32>();
}

}  // namespace demo::runs
