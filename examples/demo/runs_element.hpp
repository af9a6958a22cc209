// Definitions of runs.hpp's per-element runs; runs_f32.cpp, runs_16bit.cpp and runs_quant.cpp
// include this and instantiate them for their elements with KVCACHE_DEMO_ELEMENT_RUNS.
#pragma once

#include "runs.hpp"
#include "scenarios.hpp"
#include "tiers.hpp"

namespace demo::runs {

template <class E>
std::vector<row> ttft_rows(const llama_weights& w, const tokenizer& tok, const options& o) {
    return scenarios::basic_ttft_runner<E>(w, tok, o).run();
}
template <class E>
std::vector<row> tier_rows(const llama_weights& w, const tokenizer& tok, const options& o,
                           const std::vector<std::string>& args) {
    return tiers::tier_runner<E>(w, tok, o, args).run();
}
template <class E>
int tier_child(const llama_weights& w, const tokenizer& tok, const options& o) {
    return tiers::tier_runner<E>(w, tok, o).child();
}

}  // namespace demo::runs

/// Instantiates the runs of element E (at namespace scope, once per element in the program).
#define KVCACHE_DEMO_ELEMENT_RUNS(E)                                                                           \
    template std::vector<demo::runs::row> demo::runs::ttft_rows<E>(const demo::llama_weights&,                 \
                                                                   const demo::tokenizer&, const demo::runs::options&); \
    template std::vector<demo::runs::row> demo::runs::tier_rows<E>(                                            \
        const demo::llama_weights&, const demo::tokenizer&, const demo::runs::options&,                       \
        const std::vector<std::string>&);                                                                       \
    template int demo::runs::tier_child<E>(const demo::llama_weights&, const demo::tokenizer&,                 \
                                           const demo::runs::options&)
