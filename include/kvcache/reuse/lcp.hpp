// kvcache: the "lcp" reuse policy (F19): a request keeps the longest common
// prefix of the sequence's cached tokens and computes only the rest.
#pragma once

#include <cstdint>      // std::uint32_t
#include <string_view>  // name

#include "../concepts.hpp"
#include "../tokens/prompt_tokens.hpp"
#include "plan.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace reuse {

/// Longest-common-prefix reuse: n_past = LCP(cached, request), the rest is removed
/// with seq_rm and recomputed. Plans never move cells.
struct lcp {
    using policy_kind = reuse_tag;
    static constexpr std::string_view name = "lcp";
    static constexpr bool needs_shift = false;
    /// Whether released slot states go to a global prompt cache (F21).
    static constexpr bool global_cache = false;

    /// make_plan without chunk shifting (opt.min_chunk is ignored).
    static reuse::plan plan(const prompt_tokens& cached, const prompt_tokens& request, const plan_options& opt) {
        plan_options o = opt;
        o.min_chunk = 0;
        return make_plan(cached, request, o);
    }
};

}  // namespace reuse
KVCACHE_END_NAMESPACE
