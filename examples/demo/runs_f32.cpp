// kvcache_demo's runs on f32 K/V (runs.hpp), and the runs that do not depend on
// --cache-type: the hybrid model's TTFT scenarios, context shift (F13) and Self-Extend (F14).
// They share a source because the latter run on f32 caches too: together they compile in
// about the time of the f32 runs alone.
#include <cstddef>    // std::size_t
#include <cstdio>     // std::printf
#include <stdexcept>  // std::runtime_error

#include "hybrid.hpp"
#include "runs_element.hpp"

KVCACHE_DEMO_ELEMENT_RUNS(kvcache::f32);

namespace demo::runs {

std::vector<row> hybrid_rows(const llama_weights& w, const tokenizer& tok, const options& o) {
    // A hybrid model of the same shape: attention every 4th layer, the reference recurrent
    // layer elsewhere; its own TTFT scenarios replace the attention model's runs.
    if (!o.model.empty()) throw std::runtime_error("--hybrid uses random weights; it cannot load --model");
    std::printf("\n== hybrid model: attention every 4th layer, recurrent layers elsewhere; TTFT through slots + "
                "checkpoints (base prompt %d tokens)\n", o.base_tokens);
    const hybrid::hybrid_weights hw = hybrid::make_hybrid_model(w.config, 4, o.seed);
    scenarios::text_source text(tok, o.seed + 1);
    hybrid::hybrid_runner<scenarios::text_source> runner(hw, text, static_cast<std::size_t>(o.base_tokens), o.timing,
                                                         o.strict_timing);
    return runner.run();
}

check_result context_shift(const llama_weights& w, const tokenizer& tok, const options& o) {
    return scenarios::run_context_shift(w, tok, o);
}

check_result self_extend(const llama_weights& w, const tokenizer& tok, const options& o) {
    return scenarios::run_self_extend(w, tok, o);
}

}  // namespace demo::runs
