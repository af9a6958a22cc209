// kvcache: the "chunk_shift" reuse policy (F20): after the common prefix, runs of
// at least N matching tokens further on in the cache are moved into place with
// seq_rm + seq_add and the K-shift instead of being recomputed.
#pragma once

#include <cstdint>      // std::uint32_t
#include <string_view>  // name

#include "../concepts.hpp"
#include "../tokens/prompt_tokens.hpp"
#include "plan.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace reuse {

/// LCP reuse plus chunk shifting with threshold N (llama-server's n_cache_reuse, default 32).
/// Plans move no chunk for a request when either token list holds media or plan_options
/// forbids moves (can_shift false: a sliding-window slot manager).
template <std::uint32_t N = 32>
struct chunk_shift {
    static_assert(N >= 1, "kvcache: chunk_shift<N> needs N >= 1 (use reuse::lcp for no chunk shifting)");
    using policy_kind = reuse_tag;
    static constexpr std::string_view name = "chunk_shift";
    static constexpr bool needs_shift = true;
    static constexpr bool global_cache = false;
    /// Chunk reuse threshold.
    static constexpr std::uint32_t min_chunk = N;

    /// make_plan with chunk shifting of runs >= N (opt.min_chunk is replaced by N).
    static reuse::plan plan(const prompt_tokens& cached, const prompt_tokens& request, const plan_options& opt) {
        plan_options o = opt;
        o.min_chunk = N;
        return make_plan(cached, request, o);
    }
};

}  // namespace reuse
KVCACHE_END_NAMESPACE
