// kvcache: the "none" reuse policy: every request recomputes its whole prompt.
#pragma once

#include <string_view>  // name

#include "../concepts.hpp"
#include "../tokens/prompt_tokens.hpp"
#include "plan.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace reuse {

/// Default reuse policy: nothing is reused across requests (cache_prompt = false).
struct none {
    using policy_kind = reuse_tag;
    static constexpr std::string_view name = "none";
    static constexpr bool needs_shift = false;
    static constexpr bool global_cache = false;

    /// Plans nothing: the whole request is computed.
    static reuse::plan plan(const prompt_tokens& /*cached*/, const prompt_tokens& request, const plan_options&) {
        reuse::plan p;
        p.n_request = static_cast<std::uint32_t>(request.size());
        return p;
    }
};

}  // namespace reuse
KVCACHE_END_NAMESPACE
