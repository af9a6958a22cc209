// demo engine: serving requests the way llama-server does, through kvcache's slots and
// global prompt cache (kvcache/prompt/slots.hpp): prepare (reuse what the slot or the
// global cache holds), compute only the remaining tokens, sample, release.
#pragma once

#include <chrono>   // TTFT
#include <cstdint>  // fixed-width integers
#include <span>     // token ranges
#include <vector>   // tokens, logits

#include <kvcache/kvcache.hpp>
#include <kvcache/prompt/slots.hpp>

#include "engine.hpp"
#include "sampler.hpp"

namespace demo {

/// What serving one request did.
struct response {
    int slot = -1;
    seq_id_t seq = -1;
    double ttft_ms = 0;                ///< request arrival to first token (prepare + compute + sample)
    double prepare_ms = 0;             ///< slots.prepare: slot choice, global-cache load, plan, K-shift
    kvcache::request_metrics metrics;  ///< where the prompt's tokens came from
    kvcache::reuse::plan plan;         ///< the reuse plan slots.prepare applied (kept prefix, moved chunks)
    std::vector<float> logits;         ///< logits after the last prompt token
    std::vector<token_t> generated;    ///< sampled tokens (the first one is the TTFT token)
};

/// A minimal llama-server: slots over one cache, requests served one at a time.
template <class Cache>
class server {
public:
    using slots_type = kvcache::slot_manager<Cache>;

    server(llama_engine<Cache>& engine, Cache& cache, const kvcache::slot_options& opt)
        : engine_(engine), cache_(cache), slots_(cache, opt) {}

    [[nodiscard]] slots_type& slots() noexcept { return slots_; }
    [[nodiscard]] Cache& cache() noexcept { return cache_; }

    /// Serves `prompt`: slots.prepare picks a slot and reuses its state, a global-cache entry or
    /// moved chunks; the engine computes the rest; n_generate tokens are sampled (each but the
    /// last evaluated and appended to the slot); the slot is released (saved to the global cache).
    /// Exceptions propagate after the slot is released; the cache stays consistent.
    response serve(const std::vector<token_t>& prompt, const kvcache::request_options& ro, int n_generate,
                   sampler& smp) {
        using clock = std::chrono::steady_clock;
        response r;
        const auto t0 = clock::now();
        const kvcache::prompt_tokens request{std::span<const token_t>(prompt)};
        // serve() runs one request at a time, so a slot is idle: value() throws only if not
        const kvcache::prepared_request p = slots_.prepare(request, ro).value();
        r.prepare_ms = std::chrono::duration<double, std::milli>(clock::now() - t0).count();
        r.slot = p.slot;
        r.seq = p.seq;
        r.metrics = p.metrics;
        try {
            const std::span<const token_t> todo = std::span<const token_t>(prompt).subspan(p.n_past);
            engine_.eval(cache_, todo, static_cast<pos_t>(p.n_past), p.seq, r.logits);
            slots_.commit_prompt(p.slot);
            token_t t = smp.sample(r.logits);
            r.ttft_ms = std::chrono::duration<double, std::milli>(clock::now() - t0).count();
            r.generated.push_back(t);
            std::vector<float> logits;
            for (int i = 1; i < n_generate; ++i) {
                const std::vector<token_t> one{t};
                engine_.eval(cache_, one, static_cast<pos_t>(slots_.tokens(p.slot).size()), p.seq, logits);
                slots_.append(p.slot, t);
                t = smp.sample(logits);
                r.generated.push_back(t);
            }
        } catch (...) {
            slots_.release(p.slot);
            throw;
        }
        slots_.release(p.slot);
        r.plan = p.plan;
        return r;
    }

private:
    llama_engine<Cache>& engine_;
    Cache& cache_;
    slots_type slots_;
};

}  // namespace demo
